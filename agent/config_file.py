"""Read ``mechwatch.yaml`` into an AgentConfig; every error names the file, line, column and
field (the same YAML rules as rule files: duplicate keys are errors, ``1e-4`` is a number, only
``true``/``false`` are booleans, and the same size, depth and alias limits)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from agent.config import AgentConfig
from agent.rules.errors import RuleFileError, RuleFileErrors
from agent.rules.loader import pydantic_message
from agent.rules.yaml_source import YamlSyntaxError, parse_located_yaml, read_yaml_file


def load_agent_config(path: str | Path) -> AgentConfig:
    """Parse and validate an agent config file. Raises ``RuleFileErrors`` listing each problem.

    Relative paths inside the file (``run_dir``, ``rules``, ``checkpoints.directory``) are
    relative to the file's folder.
    """
    path = Path(path)
    try:
        doc = parse_located_yaml(read_yaml_file(path))
    except OSError as e:
        raise RuleFileErrors([RuleFileError(str(path), None, None, f"cannot read: {e}")]) from None
    except UnicodeDecodeError as e:
        message = f"not UTF-8 text: {e.reason}"
        raise RuleFileErrors([RuleFileError(str(path), None, None, message)]) from None
    except YamlSyntaxError as e:  # invalid YAML, or beyond the size, depth and alias limits
        raise RuleFileErrors([RuleFileError(str(path), e.line, e.column, e.message)]) from None
    errors = [
        RuleFileError(
            str(path),
            *dup.position,
            f"duplicate key (first at line {dup.first_position[0]})",
            field=format_field_path(dup.path),
        )
        for dup in doc.duplicate_keys
    ]
    data = doc.data
    if not isinstance(data, dict):
        errors.append(RuleFileError(str(path), 1, 1, "expected a mapping of agent settings"))
        raise RuleFileErrors(errors)
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            loc = tuple(err["loc"])
            key = err["type"] == "extra_forbidden"
            line, column = doc.position_of(loc, key=key)
            if key:
                message = "unknown field"
            elif err["type"] == "missing":
                message = "missing required field"
            elif "slack" in loc:  # never echo what was given there: it may be a secret
                message = pydantic_message({**err, "input": "<hidden>"})
            else:
                message = pydantic_message(err)
            field = format_field_path(loc)
            errors.append(RuleFileError(str(path), line, column, message, field=field))
        raise RuleFileErrors(errors) from None
    if errors:
        raise RuleFileErrors(errors)
    return _resolve_paths(config, path.parent)


def format_field_path(parts: tuple) -> str:
    """('qk', 'delta') -> 'qk.delta'; ('rules', 1) -> 'rules[1]'."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _resolve_paths(config: AgentConfig, base: Path) -> AgentConfig:
    def rel(p: Path) -> Path:
        return p if p.is_absolute() else base / p

    update: dict = {"run_dir": rel(config.run_dir)}
    if config.rules is not None:
        update["rules"] = [rel(p) for p in config.rules]
    if config.checkpoints.directory is not None:
        update["checkpoints"] = config.checkpoints.model_copy(
            update={"directory": rel(config.checkpoints.directory)}
        )
    return config.model_copy(update=update)
