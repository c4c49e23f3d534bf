"""Read a YAML rule file into plain Python values plus the line/column of every node.

The loader follows the YAML 1.2 core schema for plain scalars, not PyYAML's YAML 1.1 default,
because the 1.1 rules surprise people who write rule files:

- numbers: ``1e-4``, ``1E5``, ``.5``, ``-2e-3`` are floats (1.1 reads ``1e-4`` as a string);
  ``017`` is the integer 17 (not octal 15), ``0o17``/``0x1f`` are octal/hex; ``1:30`` is a string.
- booleans: only ``true``/``false`` in any case; ``on/off/yes/no/y/n`` stay strings.
- dates such as ``2024-01-01`` stay strings; ``null``, ``~`` and an empty value are None.

Duplicate keys in a mapping are errors naming both lines. Line and column numbers are 1-based.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

# A path to a node: mapping keys and list indices from the document root.
NodePath = tuple[Any, ...]
Position = tuple[int, int]  # (line, column), both 1-based

_BOOL = re.compile(r"^(?:true|false)$", re.IGNORECASE)
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)
_MERGE = re.compile(r"^(?:<<)$")


class RuleYamlLoader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema for plain scalars (see the module docstring)."""

    # Start from an empty resolver table instead of PyYAML's YAML 1.1 one.
    yaml_implicit_resolvers: dict[str, list[tuple[str, re.Pattern[str]]]] = {}

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:  # type: ignore[override]
        text = str(self.construct_scalar(node)).replace("_", "")
        sign = -1 if text.startswith("-") else 1
        digits = text.lstrip("+-")
        bases = {"0x": 16, "0X": 16, "0o": 8, "0O": 8, "0b": 2, "0B": 2}
        try:
            base = bases.get(digits[:2], 10)
            return sign * int(digits[2:] if base != 10 else digits, base)
        except ValueError as e:
            raise yaml.constructor.ConstructorError(
                None, None, f"invalid integer {text!r}", node.start_mark
            ) from e

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:  # type: ignore[override]
        text = str(self.construct_scalar(node)).replace("_", "")
        lowered = text.lower()
        if lowered.lstrip("+-") == ".inf":
            return float("-inf") if lowered.startswith("-") else float("inf")
        if lowered == ".nan":
            return float("nan")
        try:
            return float(text)
        except ValueError as e:
            raise yaml.constructor.ConstructorError(
                None, None, f"invalid number {text!r}", node.start_mark
            ) from e


RuleYamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))
RuleYamlLoader.add_implicit_resolver("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""])
RuleYamlLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
RuleYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
RuleYamlLoader.add_implicit_resolver("tag:yaml.org,2002:merge", _MERGE, ["<"])
RuleYamlLoader.add_constructor("tag:yaml.org,2002:int", RuleYamlLoader.construct_yaml_int)
RuleYamlLoader.add_constructor("tag:yaml.org,2002:float", RuleYamlLoader.construct_yaml_float)


class YamlSyntaxError(Exception):
    """The text is not valid YAML (or is empty / not one document)."""

    def __init__(self, line: int, column: int, message: str) -> None:
        super().__init__(f"{line}:{column}: {message}")
        self.line = line
        self.column = column
        self.message = message


@dataclass
class DuplicateKey:
    """A key that appears twice in one mapping."""

    path: NodePath  # path of the repeated key
    position: Position  # where it is repeated
    first_position: Position  # where it first appeared


@dataclass
class LocatedDocument:
    """A parsed YAML document: the data and the position of every value and mapping key."""

    data: Any
    value_positions: dict[NodePath, Position] = field(default_factory=dict)
    key_positions: dict[NodePath, Position] = field(default_factory=dict)
    duplicate_keys: list[DuplicateKey] = field(default_factory=list)

    def position_of(self, path: NodePath, *, key: bool = False) -> Position:
        """Where the node at ``path`` is (its key if ``key``); falls back to the nearest parent."""
        table = self.key_positions if key else self.value_positions
        if path in table:
            return table[path]
        for end in range(len(path) - 1, -1, -1):
            if path[:end] in self.value_positions:
                return self.value_positions[path[:end]]
        return (1, 1)


def _position(mark: yaml.Mark) -> Position:
    return (mark.line + 1, mark.column + 1)


def _syntax_error(error: yaml.YAMLError) -> YamlSyntaxError:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        line, column = _position(error.problem_mark)
        problem = error.problem or str(error)
        if problem.startswith("but ") and error.context:
            problem = f"{error.context}, {problem}"  # e.g. "expected a single document ..."
        if "'\\t'" in problem:
            return YamlSyntaxError(
                line, column, "invalid YAML: tab character; indent with spaces, not tabs"
            )
        context_mark = error.context_mark
        if problem.startswith(str(error.context)):
            pass  # the context is already part of the problem text
        elif error.context and context_mark is not None and context_mark != error.problem_mark:
            where = f"line {context_mark.line + 1}, column {context_mark.column + 1}"
            problem += f" ({error.context} at {where})"
        return YamlSyntaxError(line, column, f"invalid YAML: {problem}")
    return YamlSyntaxError(1, 1, f"invalid YAML: {error}")


def parse_located_yaml(text: str) -> LocatedDocument:
    """Parse one YAML document. Raises YamlSyntaxError for invalid, empty or multi-doc text."""
    loader = RuleYamlLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise YamlSyntaxError(1, 1, "file is empty; expected a mapping with a 'groups' list")
        doc = LocatedDocument(data=None)
        doc.data = _convert(loader, root, (), doc, set())
        return doc
    except yaml.YAMLError as e:
        raise _syntax_error(e) from None
    finally:
        loader.dispose()


def _convert(
    loader: RuleYamlLoader, node: yaml.Node, path: NodePath, doc: LocatedDocument, active: set[int]
) -> Any:
    doc.value_positions[path] = _position(node.start_mark)
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_object(node, deep=True)
    if id(node) in active:
        raise YamlSyntaxError(*_position(node.start_mark), "invalid YAML: recursive alias")
    active.add(id(node))
    try:
        if isinstance(node, yaml.SequenceNode):
            return [
                _convert(loader, item, path + (i,), doc, active)
                for i, item in enumerate(node.value)
            ]
        assert isinstance(node, yaml.MappingNode), type(node)
        own_pairs = sum(1 for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge")
        loader.flatten_mapping(node)  # resolves `<<: *anchor` merge keys, merged pairs first
        merged_pairs = len(node.value) - own_pairs
        result: dict[Any, Any] = {}
        first_seen: dict[Any, tuple[int, Position]] = {}
        for index, (key_node, value_node) in enumerate(node.value):
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlSyntaxError(
                    *_position(key_node.start_mark), "invalid YAML: a mapping key must be a scalar"
                )
            key = loader.construct_object(key_node, deep=True)
            key_position = _position(key_node.start_mark)
            if key in first_seen and first_seen[key][0] >= merged_pairs:
                # Keys repeated inside the mapping itself; a key that overrides a merged one is ok.
                doc.duplicate_keys.append(
                    DuplicateKey(path + (key,), key_position, first_seen[key][1])
                )
                continue
            first_seen[key] = (index, key_position)
            doc.key_positions[path + (key,)] = key_position
            result[key] = _convert(loader, value_node, path + (key,), doc, active)
        return result
    finally:
        active.discard(id(node))
