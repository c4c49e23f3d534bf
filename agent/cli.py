"""The ``mechwatch`` command: one sub-command per concern, each implemented where it lives."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# sub-command -> ("module:function", one-line help). Each function takes argv and returns an
# exit code; modules are imported only when their command runs (keeps `mechwatch --help` fast).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("agent.demo:cli_demo", "watch the agent catch, attribute and fix a fault"),
    "validate": ("agent.cli:validate", "check rule files; print every error"),
    "rules": ("agent.cli:list_rules", "list the loaded rules"),
    "test": ("agent.cli:test_rules", "run rule unit tests (*_test.yaml)"),
    "explain": ("agent.cli:explain_rule", "say in words what a rule watches and does"),
    "replay": ("agent.replay:cli_replay", "replay a recorded run through rule files"),
    "report": ("agent.report.build:cli_report", "an HTML report of a run from its event log"),
    "slack-test": ("agent.notify.slack_test:cli_slack_test", "send a test page"),
    "testbed": ("agent.testbed.cli:cli_testbed", "run one fault-injection scenario"),
}


def validate(argv: list[str]) -> int:
    """``mechwatch validate``: rule files checked against the action registry too."""
    from agent.rules.validate import cli_validate
    from remediations.registry import validate_action

    return cli_validate(argv, action_validator=validate_action)


def list_rules(argv: list[str]) -> int:
    from agent.rules.validate import cli_list
    from remediations.registry import validate_action

    return cli_list(argv, action_validator=validate_action)


def test_rules(argv: list[str]) -> int:
    """``mechwatch test``: the rules' actions checked and paced as the agent does."""
    from agent.rules.unit_tests import cli_test
    from remediations.base import ActionContext
    from remediations.registry import validate_action
    from remediations.runner import ActionRunner

    runner = ActionRunner(lambda: ActionContext(step=0))  # only asked for pacing limits
    return cli_test(argv, limits_of=runner.limits_of, action_validator=validate_action)


def explain_rule(argv: list[str]) -> int:
    """``mechwatch explain``: each action's pacing and the first line of its docstring."""
    from agent.rules.explain import cli_explain
    from remediations.base import ActionContext
    from remediations.registry import action_class, validate_action
    from remediations.runner import ActionRunner

    def action_doc(name: str) -> str:
        doc = (action_class(name).__doc__ or "").strip().splitlines()
        return doc[0].replace("``", "") if doc else ""

    runner = ActionRunner(lambda: ActionContext(step=0))  # only asked for pacing limits
    return cli_explain(
        argv, limits_of=runner.limits_of, action_doc=action_doc, action_validator=validate_action
    )


def _resolve(target: str) -> Callable[[list[str]], int]:
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: mechwatch COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `mechwatch COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"mechwatch: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return int(_resolve(COMMANDS[command][0])(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
