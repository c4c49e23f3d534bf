"""The package list in pyproject.toml names every package folder (it is explicit because
``mechwatch_rules`` maps to a folder of another name; a folder left out would be missing from
a built wheel while an editable install still finds it)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_and_every_listed_package_exists():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    folders = {name: ROOT / path for name, path in project["package-dir"].items()}
    found = set()
    for top, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            found.add(".".join((top, *relative)))
    assert found == listed, (sorted(found - listed), sorted(listed - found))
    data = project["package-data"]["mechwatch_rules"]
    assert data == ["*.yaml"] and list((ROOT / "rules").glob("*.yaml"))
