"""``agent.lazy_exports``: a package's names imported from their submodules on first access."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from agent.lazy_exports import lazy_exports


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A throw-away package ``lazypkg`` whose ``__init__`` uses lazy_exports."""
    root = tmp_path / "lazypkg"
    root.mkdir()
    (root / "__init__.py").write_text(
        "from agent.lazy_exports import lazy_exports\n"
        "__all__, __getattr__ = lazy_exports(__name__, "
        "{'Heavy': '.heavy', 'light': '.light', 'dumps': 'json'})\n"
    )
    (root / "heavy.py").write_text("class Heavy:\n    pass\n")
    (root / "light.py").write_text("light = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("lazypkg")
    for name in [m for m in sys.modules if m == "lazypkg" or m.startswith("lazypkg.")]:
        del sys.modules[name]


def test_names_import_their_submodule_only_when_accessed(package) -> None:
    assert package.__all__ == ["Heavy", "dumps", "light"]  # sorted
    assert "lazypkg.heavy" not in sys.modules
    assert package.light == 42 and "lazypkg.heavy" not in sys.modules
    assert package.Heavy.__module__ == "lazypkg.heavy"
    from lazypkg import Heavy  # the from-import form goes through __getattr__ too

    assert Heavy is sys.modules["lazypkg.heavy"].Heavy


def test_unknown_names_are_attribute_errors(package) -> None:
    with pytest.raises(AttributeError, match="module 'lazypkg' has no attribute 'nope'"):
        package.nope  # noqa: B018
    assert not hasattr(package, "nope")


def test_a_module_path_without_a_dot_is_absolute(package) -> None:
    import json

    assert package.dumps is json.dumps


def test_the_real_packages_export_what_they_list() -> None:
    import agent.discovery
    import agent.notify
    import remediations

    for module in (agent.discovery, agent.notify, remediations):
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert getattr(module, name) is not None
    assert remediations.scaled_dot_product_attention.__module__ == "remediations.fp32_attention"
    assert lazy_exports("p", {"b": ".x", "a": ".y"})[0] == ["a", "b"]
