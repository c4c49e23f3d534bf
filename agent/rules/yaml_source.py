"""Read a YAML rule file into plain Python values plus the line/column of every node.

The loader follows the YAML 1.2 core schema for plain scalars, not PyYAML's YAML 1.1 default,
because the 1.1 rules surprise people who write rule files:

- numbers: ``1e-4``, ``1E5``, ``.5``, ``-2e-3`` are floats (1.1 reads ``1e-4`` as a string);
  ``017`` is the integer 17 (not octal 15), ``0o17``/``0x1f`` are octal/hex; ``1:30`` is a string.
- booleans: only ``true``/``false`` in any case; ``on/off/yes/no/y/n`` stay strings.
- dates such as ``2024-01-01`` stay strings; ``null``, ``~`` and an empty value are None.

Duplicate keys in a mapping are errors naming both lines. Line and column numbers are 1-based.

Hostile or runaway input is refused early with a located ``YamlLimitError`` (see ``YamlLimits``):
a file over ``max_bytes`` is not read past the limit; nesting beyond ``max_depth`` and
documents that would hold more than ``max_nodes`` keys, values and list items once every alias
is expanded (the "billion laughs" bomb: a few hundred bytes that expand to hundreds of millions
of values) are refused while the document is composed, before anything is built, so the cost
stays proportional to the size of the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
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


@dataclass(frozen=True)
class YamlLimits:
    """Bounds on one YAML document; far above any real rule file or agent config."""

    max_bytes: int = 1 << 20  # size of the file, in bytes of UTF-8 (1 MiB)
    max_depth: int = 64  # lists and mappings nested in one another, aliases expanded
    max_nodes: int = 100_000  # keys, values and list items, counting each alias use in full


YAML_LIMITS = YamlLimits()


class YamlSyntaxError(Exception):
    """The text is not valid YAML (or is empty / not one document)."""

    def __init__(self, line: int, column: int, message: str) -> None:
        super().__init__(f"{line}:{column}: {message}")
        self.line = line
        self.column = column
        self.message = message


class YamlLimitError(YamlSyntaxError):
    """The text exceeds one of the ``YamlLimits``: ``limit`` names the field, ``value`` is its
    value."""

    def __init__(self, line: int, column: int, message: str, limit: str, value: int) -> None:
        super().__init__(line, column, f"{message} (limit {limit}={value})")
        self.limit = limit
        self.value = value


@dataclass(frozen=True)
class _Shape:
    """What a composed node expands to: its node count and its nesting height."""

    nodes: int  # the node itself and everything below it, aliases expanded
    height: int  # lists and mappings on the longest path down (0 for a scalar)


class RuleYamlLoader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema for plain scalars (see the module docstring)
    that enforces ``YamlLimits`` while it composes the document."""

    # Start from an empty resolver table instead of PyYAML's YAML 1.1 one.
    yaml_implicit_resolvers: dict[str, list[tuple[str, re.Pattern[str]]]] = {}

    def __init__(self, stream: str, limits: YamlLimits = YAML_LIMITS) -> None:
        super().__init__(stream)
        self.limits = limits
        self._depth = 0  # lists and mappings open around the node being composed
        self._deepest = 0  # the deepest nesting reached inside the node being composed
        self._nodes = 0  # nodes of the document so far, aliases expanded
        self._shapes: dict[int, _Shape] = {}  # id(anchored node) -> its expansion

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        mark = event.start_mark
        if isinstance(event, yaml.AliasEvent):
            anchored = self.anchors.get(event.anchor)
            # None: an undefined alias (PyYAML reports it) or one inside its own anchor
            # (a recursive alias, reported when the document is converted).
            shape = self._shapes.get(id(anchored)) if anchored is not None else None
            if shape is not None:
                self._count(shape.nodes, mark, event.anchor)
                self._reach(self._depth + shape.height, mark)
            return super().compose_node(parent, index)
        start_depth, outer_deepest, nodes_before = self._depth, self._deepest, self._nodes
        if isinstance(event, yaml.CollectionStartEvent):
            self._depth += 1
        self._deepest = self._depth
        self._reach(self._depth, mark)
        self._count(1, mark, None)
        node = super().compose_node(parent, index)
        if event.anchor is not None:
            self._shapes[id(node)] = _Shape(self._nodes - nodes_before, self._deepest - start_depth)
        self._depth, self._deepest = start_depth, max(outer_deepest, self._deepest)
        return node

    def _count(self, nodes: int, mark: yaml.Mark, alias: str | None) -> None:
        self._nodes += nodes
        limit = self.limits.max_nodes
        if self._nodes > limit:
            items = f"{limit} keys, values and list items"
            if alias is None:
                message = f"too many values: the document holds more than {items}"
            else:
                message = f"too many values: alias *{alias} repeats {nodes} values, which takes "
                message += f"the document past {items}"
            raise YamlLimitError(*_position(mark), message, "max_nodes", limit)

    def _reach(self, depth: int, mark: yaml.Mark) -> None:
        self._deepest = max(self._deepest, depth)
        limit = self.limits.max_depth
        if depth > limit:
            raise YamlLimitError(
                *_position(mark),
                f"nested too deeply: more than {limit} levels of lists and mappings "
                "(aliases expanded)",
                "max_depth",
                limit,
            )

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


def read_yaml_file(path: str | Path, limits: YamlLimits = YAML_LIMITS) -> str:
    """The text of ``path``, read no further than ``limits.max_bytes`` (a larger file is a
    YamlLimitError located at the first byte past the limit). OSError and UnicodeDecodeError
    pass through."""
    with open(path, "rb") as f:
        data = f.read(limits.max_bytes + 1)
    _check_size(data, limits)
    return data.decode("utf-8")


def _check_size(data: bytes, limits: YamlLimits) -> None:
    limit = limits.max_bytes
    if len(data) <= limit:
        return
    head = data[:limit]
    line_start = head.rfind(b"\n") + 1
    column = len(head[line_start:].decode("utf-8", errors="ignore")) + 1
    raise YamlLimitError(
        head.count(b"\n") + 1,
        column,
        f"file too large: more than {limit} bytes",
        "max_bytes",
        limit,
    )


def parse_located_yaml(text: str, limits: YamlLimits = YAML_LIMITS) -> LocatedDocument:
    """Parse one YAML document. Raises YamlSyntaxError for invalid, empty or multi-doc text,
    and its subclass YamlLimitError for text beyond ``limits``."""
    if len(text) > limits.max_bytes // 4:  # else it cannot be over the limit in UTF-8
        _check_size(text.encode("utf-8", errors="surrogatepass"), limits)
    loader = RuleYamlLoader(text, limits)
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
