"""Load YAML rule files into a RuleSet, reporting every problem with file:line:col.

``load_rule_files`` reads all files, collects all errors (YAML syntax, duplicate keys, schema,
detector parameters, action parameters, duplicate names, and the size, depth and alias limits
of ``agent.rules.yaml_source.YamlLimits``) and raises one ``RuleFileErrors`` that lists each,
so ``mechwatch validate`` can print them all. Warnings (a metric no built-in monitor produces)
do not stop loading; they are kept in ``RuleSet.warnings``.
"""

from __future__ import annotations

import difflib
import importlib.resources
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from agent import samples
from agent.rules.detector_catalog import DetectorCatalog, default_detector_catalog
from agent.rules.errors import RuleFileError, RuleFileErrors
from agent.rules.ruleset import Rule, RuleSet
from agent.rules.schema import SHAPE_TAGS, RuleFileSpec, describe, parse_action
from agent.rules.yaml_source import (
    LocatedDocument,
    NodePath,
    YamlSyntaxError,
    parse_located_yaml,
    read_yaml_file,
)

# Raises ValueError (unknown action) or pydantic ValidationError (bad parameters).
ActionValidator = Callable[[str, dict[str, Any]], None]

RULES_PACKAGE = "mechwatch_rules"
RULE_FILE_SUFFIXES = (".yaml", ".yml")
RULE_TEST_SUFFIXES = ("_test.yaml", "_test.yml")  # unit tests of rule files, not rule files
_KEY = "[key]"  # pydantic's marker for an error in a mapping key

# Metric names the built-in monitors produce (the str constants of agent/samples.py).
KNOWN_METRICS: frozenset[str] = frozenset(
    v for k, v in vars(samples).items() if k.isupper() and isinstance(v, str)
)


def is_rule_test_file(name: str | Path) -> bool:
    """Whether a file is a rule unit-test file (``*_test.yaml``, ``mechwatch test``), which
    sits next to the rule files it tests but is not one."""
    return Path(name).name.endswith(RULE_TEST_SUFFIXES)


def default_rule_files() -> list[Path]:
    """The shipped rule packs: ``*.yaml`` in the installed ``mechwatch_rules`` package, without
    their unit tests (``*_test.yaml``)."""
    root = importlib.resources.files(RULES_PACKAGE)
    files = [Path(str(entry)) for entry in root.iterdir() if entry.name.endswith(".yaml")]
    return sorted(f for f in files if not is_rule_test_file(f))


def load_rule_files(
    paths: Iterable[str | Path],
    action_validator: ActionValidator | None = None,
    *,
    detectors: DetectorCatalog | None = None,
) -> RuleSet:
    """Load and check rule files (a directory means its ``*.yaml``/``*.yml``, sorted, without
    the unit-test files ``*_test.yaml`` that sit next to them).

    ``action_validator(name, params)`` checks each action against the action registry; by
    default only the syntax of ``actions`` is checked. ``detectors`` defaults to the registry
    in ``agent.detectors``. Raises ``RuleFileErrors`` listing every problem.
    """
    catalog = detectors if detectors is not None else default_detector_catalog()
    files: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = [f for f in sorted(path.iterdir()) if f.suffix in RULE_FILE_SUFFIXES]
            files += [str(f) for f in found if not is_rule_test_file(f)]
        else:
            files.append(str(p))
    loader = _RuleSetLoader(catalog, action_validator)
    for name in files:
        try:
            text = read_yaml_file(name)
        except YamlSyntaxError as e:  # over the size limit
            loader.errors.append(RuleFileError(name, e.line, e.column, e.message))
            continue
        except OSError as e:
            loader.errors.append(RuleFileError(name, None, None, f"cannot read: {e.strerror or e}"))
            continue
        except UnicodeDecodeError as e:
            loader.errors.append(RuleFileError(name, None, None, f"not UTF-8 text: {e.reason}"))
            continue
        loader.add_text(text, name)
    return loader.finish(files)


def load_rule_text(
    text: str,
    path: str = "<string>",
    action_validator: ActionValidator | None = None,
    *,
    detectors: DetectorCatalog | None = None,
) -> RuleSet:
    """Load rules from a YAML string (``path`` only names it in messages)."""
    catalog = detectors if detectors is not None else default_detector_catalog()
    loader = _RuleSetLoader(catalog, action_validator)
    loader.add_text(text, path)
    return loader.finish([path])


class _RuleSetLoader:
    def __init__(self, catalog: DetectorCatalog, action_validator: ActionValidator | None) -> None:
        self.catalog = catalog
        self.action_validator = action_validator
        self.errors: list[RuleFileError] = []
        self.warnings: list[RuleFileError] = []
        self.rules: list[Rule] = []
        self.groups: list[tuple[str, str]] = []
        self.rule_names: dict[str, str] = {}  # name -> "file:line:col" of its first definition

    def finish(self, files: list[str]) -> RuleSet:
        if self.errors:
            order = {name: i for i, name in enumerate(files)}
            self.errors.sort(key=lambda e: (order.get(e.path, len(order)), e.sort_key()[1:]))
            raise RuleFileErrors(self.errors)
        return RuleSet(
            rules=tuple(self.rules),
            files=tuple(files),
            detectors=self.catalog,
            warnings=tuple(self.warnings),
            groups=tuple(self.groups),
        )

    def add_text(self, text: str, path: str) -> None:
        try:
            doc = parse_located_yaml(text)
        except YamlSyntaxError as e:
            self.errors.append(RuleFileError(path, e.line, e.column, e.message))
            return
        file = _FileContext(path, doc)
        if doc.duplicate_keys:
            for dup in doc.duplicate_keys:
                first_line = dup.first_position[0]
                message = f"duplicate key (first at line {first_line})"
                self.errors.append(file.error(dup.path, message, position=dup.position))
            return  # which of the two values was meant is unknowable; stop here
        if not isinstance(doc.data, dict):
            self.errors.append(
                file.error(
                    (),
                    f"expected a mapping with a 'groups' list at the top level, "
                    f"got {describe(doc.data)}",
                )
            )
            return
        n_errors = len(self.errors)
        spec: RuleFileSpec | None = None
        try:
            spec = RuleFileSpec.model_validate(doc.data, strict=True)
        except ValidationError as e:
            self.errors += [file.pydantic_error(err, (), RuleFileSpec) for err in e.errors()]
        for rule_path, raw_rule in _raw_rules(doc.data):
            self._check_detector(file, rule_path, raw_rule)
            for signal_path, raw_signal in _raw_signals(raw_rule, rule_path):
                self._check_detector(file, signal_path, raw_signal)
            self._check_actions(file, rule_path, raw_rule)
        self._check_names(file)
        if spec is None or len(self.errors) > n_errors:
            return
        for gi, group in enumerate(spec.groups):
            self.groups.append((path, group.name))
            for ri, rule_spec in enumerate(group.rules):
                rule_path = ("groups", gi, "rules", ri)
                line = doc.position_of(rule_path)[0]
                self.rules.append(Rule.from_spec(rule_spec, group.name, path, line))
                raw_rule = doc.data["groups"][gi]["rules"][ri]
                metrics = [(rule_path + ("metric",), rule_spec.metric)] + [
                    (signal_path + ("metric",), raw_signal["metric"])
                    for signal_path, raw_signal in _raw_signals(raw_rule, rule_path)
                ]
                for metric_path, metric in metrics:
                    if metric not in KNOWN_METRICS:
                        close = difflib.get_close_matches(metric, KNOWN_METRICS, n=1)
                        hint = f"; did you mean '{close[0]}'?" if close else ""
                        self.warnings.append(
                            file.error(
                                metric_path,
                                f"metric '{metric}' is not produced by a built-in monitor"
                                f"{hint} (fine if your own code logs it)",
                            )
                        )

    def _check_detector(self, file: _FileContext, rule_path: NodePath, raw: dict) -> None:
        detector = raw.get("detector")
        if not isinstance(detector, dict) or not isinstance(detector.get("type"), str):
            return  # the schema check already reported it
        det_path = rule_path + ("detector",)
        type_name = detector["type"]
        params = {k: v for k, v in detector.items() if k != "type"}
        try:
            params_model = self.catalog.params_model(type_name)
            self.catalog.check(type_name, params)
        except ValidationError as e:
            self.errors += [
                file.pydantic_error(err, det_path, params_model, extra_fields=("type",))
                for err in e.errors()
            ]
        except ValueError as e:
            self.errors.append(file.error(det_path + ("type",), str(e)))

    def _check_actions(self, file: _FileContext, rule_path: NodePath, raw: dict) -> None:
        actions = raw.get("actions")
        if self.action_validator is None or not isinstance(actions, list):
            return
        for i, raw_action in enumerate(actions):
            try:
                action = parse_action(raw_action)
            except ValueError:
                continue  # the schema check already reported it
            action_path = rule_path + ("actions", i)
            try:
                self.action_validator(action.name, dict(action.params))
            except ValidationError as e:
                self.errors += [
                    file.pydantic_error(err, action_path + (action.name,), None)
                    for err in e.errors()
                ]
            except ValueError as e:
                self.errors.append(file.error(action_path, str(e)))

    def _check_names(self, file: _FileContext) -> None:
        groups_seen: dict[str, int] = {}
        for gi, group in enumerate(_as_list(file.doc.data.get("groups"))):
            if not isinstance(group, dict):
                continue
            name = group.get("name")
            if isinstance(name, str):
                name_path: NodePath = ("groups", gi, "name")
                if name in groups_seen:
                    self.errors.append(
                        file.error(
                            name_path,
                            f"duplicate group name '{name}'; first defined at line "
                            f"{groups_seen[name]}",
                        )
                    )
                else:
                    groups_seen[name] = file.doc.position_of(name_path)[0]
            for ri, rule in enumerate(_as_list(group.get("rules"))):
                if not isinstance(rule, dict) or not isinstance(rule.get("name"), str):
                    continue
                rule_name = rule["name"]
                name_path = ("groups", gi, "rules", ri, "name")
                if rule_name in self.rule_names:
                    self.errors.append(
                        file.error(
                            name_path,
                            f"duplicate rule name '{rule_name}'; first defined at "
                            f"{self.rule_names[rule_name]}",
                        )
                    )
                else:
                    line, column = file.doc.position_of(name_path)
                    self.rule_names[rule_name] = f"{file.path}:{line}:{column}"


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _raw_rules(data: dict) -> Iterable[tuple[NodePath, dict]]:
    for gi, group in enumerate(_as_list(data.get("groups"))):
        if isinstance(group, dict):
            for ri, rule in enumerate(_as_list(group.get("rules"))):
                if isinstance(rule, dict):
                    yield ("groups", gi, "rules", ri), rule


class _FileContext:
    """Turns a node path in one file into a located RuleFileError."""

    def __init__(self, path: str, doc: LocatedDocument) -> None:
        self.path = path
        self.doc = doc

    def error(
        self,
        node_path: NodePath,
        message: str,
        *,
        key: bool = False,
        position: tuple[int, int] | None = None,
    ) -> RuleFileError:
        line, column = position or self.doc.position_of(node_path, key=key)
        group, rule, field = self._context(node_path)
        return RuleFileError(self.path, line, column, message, group=group, rule=rule, field=field)

    def _context(self, node_path: NodePath) -> tuple[str | None, str | None, str | None]:
        group = rule = None
        base = 0
        data = self.doc.data
        if len(node_path) >= 2 and node_path[0] == "groups" and isinstance(node_path[1], int):
            raw_group = _item(data.get("groups") if isinstance(data, dict) else None, node_path[1])
            if isinstance(raw_group, dict) and _is_name(raw_group.get("name")):
                group, base = raw_group["name"], 2
            if len(node_path) >= 4 and node_path[2] == "rules" and isinstance(node_path[3], int):
                raw_rules = raw_group.get("rules") if isinstance(raw_group, dict) else None
                raw_rule = _item(raw_rules, node_path[3])
                if isinstance(raw_rule, dict) and _is_name(raw_rule.get("name")):
                    rule, base = raw_rule["name"], 4
        return group, rule, _field_path(data, node_path, base) or None

    def pydantic_error(
        self,
        err: Mapping[str, Any],
        prefix: NodePath,
        model: type[BaseModel] | None,
        *,
        extra_fields: tuple[str, ...] = (),
    ) -> RuleFileError:
        loc = tuple(part for part in err["loc"] if part not in SHAPE_TAGS)
        is_key = _KEY in loc
        node_path = prefix + tuple(part for part in loc if part != _KEY)
        kind = err["type"]
        if kind == "extra_forbidden":
            valid = [*extra_fields, *fields_at(model, loc[:-1])]
            message = unknown_field_message(str(loc[-1]), valid)
            return self.error(node_path, message, key=True)
        if kind == "missing":
            return self.error(node_path, "missing required field")
        if kind == "model_type" and node_path == ():
            got = describe(err.get("input"))
            message = f"expected a mapping with a 'groups' list at the top level, got {got}"
            return self.error(node_path, message)
        return self.error(node_path, pydantic_message(err), key=is_key)


def _raw_signals(raw_rule: dict, rule_path: NodePath) -> list[tuple[NodePath, dict]]:
    """The mappings of a raw rule's ``requires`` and ``unless`` (each one mapping or a list of
    them), with their paths in the file."""
    out: list[tuple[NodePath, dict]] = []
    for key in ("requires", "unless"):
        raw, path = raw_rule.get(key), rule_path + (key,)
        if isinstance(raw, dict):
            out.append((path, raw))
        elif isinstance(raw, list):
            out += [(path + (i,), item) for i, item in enumerate(raw) if isinstance(item, dict)]
    return out


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _field_path(data: Any, node_path: NodePath, start: int) -> str:
    """The part of ``node_path`` from ``start`` as text; an int is shown as ``[i]`` when it
    indexes a list and as ``.i`` when it is a mapping key."""
    out = ""
    node = data
    for depth, part in enumerate(node_path):
        is_index = isinstance(part, int) and isinstance(node, list)
        if depth >= start:
            if is_index:
                out += f"[{part}]"
            else:
                out += f".{part}" if out else str(part)
        if is_index:
            node = _item(node, part)
        else:
            node = node.get(part) if isinstance(node, dict) else None
    return out


def _item(container: Any, index: int) -> Any:
    if isinstance(container, list) and 0 <= index < len(container):
        return container[index]
    return None


_TYPE_WORDS = {
    "float_type": "a number",
    "float_parsing": "a number",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dataclass_type": "a mapping",
}
_BOUNDS = {
    "greater_than_equal": ">=",
    "greater_than": ">",
    "less_than_equal": "<=",
    "less_than": "<",
}


def pydantic_message(err: Mapping[str, Any]) -> str:
    """A short message for one pydantic error: 'expected a number, got 'abc''."""
    kind = err["type"]
    got = describe(err.get("input"))
    ctx = err.get("ctx") or {}
    if kind == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {got}"
    if kind in ("literal_error", "enum"):
        return f"expected {ctx.get('expected')}, got {got}"
    for bound_kind, symbol in _BOUNDS.items():
        if kind == bound_kind:
            limit = next(iter(ctx.values()), "?")
            return f"must be {symbol} {limit}, got {got}"
    if kind == "finite_number":
        return f"must be a finite number, got {got}"
    if kind == "string_too_short":
        return "must not be empty"
    return f"{err['msg']}, got {got}"


def unknown_field_message(key: str, valid: list[str]) -> str:
    if not valid:
        return "unknown field"
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        return f"unknown field; did you mean '{close[0]}'?"
    return f"unknown field; valid fields: {', '.join(valid)}"


def fields_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str]:
    """Field names (aliases) of the model found by following ``loc`` from ``model``."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or part == _KEY:
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        fields = {(f.alias or n): f for n, f in current.model_fields.items()}
        if part not in fields:
            return []
        current = _inner_model(fields[part].annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [(f.alias or n) for n, f in current.model_fields.items()]
    return []


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found = _inner_model(arg)
            if found is not None:
                return found
    return None
