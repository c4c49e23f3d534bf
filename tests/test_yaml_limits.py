"""Size, depth and alias-expansion limits of the YAML reader used for rule files and the agent
config: hostile files are refused fast with a located error; ordinary anchors still work."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.config_file import load_agent_config
from agent.rules import RuleFileErrors, load_rule_files, load_rule_text, validate
from agent.rules.yaml_source import (
    YAML_LIMITS,
    YamlLimitError,
    YamlLimits,
    parse_located_yaml,
)

MIB = 1 << 20


def alias_bomb() -> str:
    """'Billion laughs': 303 bytes whose aliases expand to 9^9 (387 million) scalars."""
    lines = ["a: &a [x,x,x,x,x,x,x,x,x]"]
    for prev, name in zip("abcdefg", "bcdefgh", strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    lines.append("i: [" + ",".join(["*h"] * 9) + "]")
    return "\n".join(lines) + "\n"


# a..d and their keys hold 8,302 nodes; the first *e (line 6, column 8) adds 66,430 more and
# the second would pass 100,000.
BOMB_ERROR = (
    "6:8: too many values: alias *e repeats 66430 values, which takes the document past "
    "100000 keys, values and list items (limit max_nodes=100000)"
)
DEEP_ERROR = (
    "1:67: nested too deeply: more than 64 levels of lists and mappings (aliases expanded) "
    "(limit max_depth=64)"
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def messages(exc: pytest.ExceptionInfo[RuleFileErrors]) -> list[str]:
    return [str(e) for e in exc.value.errors]


def test_defaults():
    assert YAML_LIMITS == YamlLimits(max_bytes=MIB, max_depth=64, max_nodes=100_000)


def test_alias_bomb_is_refused_fast_by_the_rule_loader(tmp_path: Path):
    path = write(tmp_path, "bomb.yaml", alias_bomb())
    assert path.stat().st_size == 303
    start = time.perf_counter()
    with pytest.raises(RuleFileErrors) as exc:
        load_rule_files([path])
    elapsed = time.perf_counter() - start
    assert messages(exc) == [f"{path}:{BOMB_ERROR}"]
    error = exc.value.errors[0]
    assert (error.line, error.column) == (6, 8)
    assert elapsed < 2.0, f"the alias bomb took {elapsed:.2f} s"


def test_alias_bomb_is_refused_fast_by_mechwatch_validate(tmp_path: Path, capsys):
    path = write(tmp_path, "bomb.yaml", alias_bomb())
    start = time.perf_counter()
    assert validate.cli_validate([str(path)]) == 1
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"{path}:{BOMB_ERROR}\n")
    assert elapsed < 2.0, f"mechwatch validate took {elapsed:.2f} s"


def test_alias_bomb_is_refused_fast_in_the_agent_config(tmp_path: Path):
    path = write(tmp_path, "mechwatch.yaml", alias_bomb())
    start = time.perf_counter()
    with pytest.raises(RuleFileErrors) as exc:
        load_agent_config(path)
    assert time.perf_counter() - start < 2.0
    assert messages(exc) == [f"{path}:{BOMB_ERROR}"]


def test_merge_key_bomb_is_refused_before_merging():
    lines = ["a: &a {" + ", ".join(f"k{i}: {i}" for i in range(9)) + "}"]
    for prev, name in zip("abcdefg", "bcdefgh", strict=True):
        lines.append(f"{name}: &{name} {{<<: [" + ", ".join([f"*{prev}"] * 9) + "]}")
    start = time.perf_counter()
    with pytest.raises(YamlLimitError, match=r"alias \*d repeats 14124 values") as exc:
        parse_located_yaml("\n".join(lines))
    assert time.perf_counter() - start < 2.0
    assert (exc.value.line, exc.value.limit, exc.value.value) == (5, "max_nodes", 100_000)


def test_nodes_are_counted_with_every_alias_use_in_full():
    # root, key a, [1, 2, 3] (4 nodes), key b, the list of b: 8; each *a adds 4.
    text = "a: &a [1, 2, 3]\nb: [*a, *a]\n"
    assert parse_located_yaml(text, YamlLimits(max_nodes=16)).data["b"] == [[1, 2, 3]] * 2
    with pytest.raises(YamlLimitError) as exc:
        parse_located_yaml(text, YamlLimits(max_nodes=15))
    assert str(exc.value) == (
        "2:9: too many values: alias *a repeats 4 values, which takes the document past 15 "
        "keys, values and list items (limit max_nodes=15)"
    )
    with pytest.raises(YamlLimitError) as exc:
        parse_located_yaml(text, YamlLimits(max_nodes=5))
    assert exc.value.message == (
        "too many values: the document holds more than 5 keys, values and list items "
        "(limit max_nodes=5)"
    )
    assert (exc.value.line, exc.value.column) == (1, 14)  # the 6th node: the scalar 3


def test_over_deep_files_are_refused_with_a_located_error(tmp_path: Path):
    deep = "a: " + "[" * 65 + "]" * 65 + "\n"  # the mapping and 65 lists; the 64th is too deep
    path = write(tmp_path, "deep.yaml", deep)
    with pytest.raises(RuleFileErrors) as exc:
        load_rule_files([path])
    assert messages(exc) == [f"{path}:{DEEP_ERROR}"]
    with pytest.raises(RuleFileErrors) as exc:
        load_agent_config(path)
    assert messages(exc) == [f"{path}:{DEEP_ERROR}"]
    # 64 levels load (and fail on the schema only).
    assert parse_located_yaml("a: " + "[" * 63 + "]" * 63).data["a"] is not None
    # Thousands of levels: refused at level 65, not a RecursionError.
    with pytest.raises(YamlLimitError, match="max_depth=64"):
        parse_located_yaml("[" * 100_000 + "]" * 100_000)


def test_depth_counts_through_aliases():
    # Each anchor nests 10 lists and holds the previous one: 7 anchors are 70 levels deep,
    # though no line of the file nests more than 11.
    lines = ["a0: &a0 " + "[" * 10 + "1" + "]" * 10]
    for i in range(1, 7):
        lines.append(f"a{i}: &a{i} " + "[" * 10 + f"*a{i - 1}" + "]" * 10)
    with pytest.raises(YamlLimitError) as exc:
        parse_located_yaml("\n".join(lines))
    assert (exc.value.line, exc.value.column, exc.value.limit) == (7, 19, "max_depth")


def test_oversize_files_are_refused_with_a_located_error(tmp_path: Path):
    # A valid rule file padded by a comment to just over 1 MiB: refused at the byte past it.
    head = "groups: []\n"
    path = write(tmp_path, "big.yaml", head + "# " + "é" * (MIB // 2) + "\n")
    assert path.stat().st_size > MIB
    column = (MIB - len(head) - 2) // 2 + 3  # 2-byte characters; the last one is cut
    expected = f"{path}:2:{column}: file too large: more than {MIB} bytes (limit max_bytes={MIB})"
    with pytest.raises(RuleFileErrors) as exc:
        load_rule_files([path])
    assert messages(exc) == [expected]
    with pytest.raises(RuleFileErrors) as exc:
        load_agent_config(path)
    assert messages(exc) == [expected]
    # Text given as a string is held to the same limit.
    with pytest.raises(RuleFileErrors, match=r"<string>:2:\d+: file too large"):
        load_rule_text(head + "# " + "x" * MIB)
    # At the limit exactly, it loads.
    exact = write(tmp_path, "exact.yaml", head + "#" * (MIB - len(head) - 1) + "\n")
    assert exact.stat().st_size == MIB
    assert len(load_rule_files([exact])) == 0


RULES_WITH_ALIASES = """\
groups:
  - name: g
    rules:
      - name: loss_high
        metric: loss
        detector: &above {type: threshold, above: 10.0}
        severity: &sev critical
        family: &fam symptom
        actions: &acts [page]
      - name: grad_high
        metric: grad_norm
        detector: *above
        severity: *sev
        family: *fam
        actions: *acts
      - &quiet
        name: loss_low
        metric: loss
        detector: {type: threshold, below: 0.0}
        severity: info
        family: *fam
      - <<: *quiet
        name: grad_low
        metric: grad_norm
"""


def test_ordinary_anchors_and_aliases_still_work():
    ruleset = load_rule_text(RULES_WITH_ALIASES)
    rows = [
        (r.name, r.metric, r.detector.type, r.severity, r.family, [str(a) for a in r.actions])
        for r in ruleset
    ]
    assert rows == [
        ("loss_high", "loss", "threshold", "critical", "symptom", ["page"]),
        ("grad_high", "grad_norm", "threshold", "critical", "symptom", ["page"]),
        ("loss_low", "loss", "threshold", "info", "symptom", []),
        ("grad_low", "grad_norm", "threshold", "info", "symptom", []),
    ]
    assert ruleset.get("grad_high").detector.params == {"above": 10.0}
