"""Every package directory is listed in pyproject.toml and maps to where it lives.

An editable install finds unlisted packages anyway; the wheel silently drops them.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from tangram.node_agent.exec_server import SOURCES

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("scheduler", "operator", "node-agent")


def _pyproject() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _package_dirs() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top in SOURCE_ROOTS:
        base = ROOT / top
        for init in base.glob("tangram/**/__init__.py"):
            pkg = init.parent
            found[".".join(pkg.relative_to(base).parts)] = pkg
    return found


def _resolve(name: str, package_dir: dict[str, str]) -> Path:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / Path(*parts[cut:])
    raise AssertionError(f"{name} has no package-dir entry")


def test_every_package_is_listed() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]  # type: ignore[index]
    listed = set(setuptools["packages"])
    assert set(_package_dirs()) == listed


def test_listed_packages_map_to_their_directories() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]  # type: ignore[index]
    for name, path in _package_dirs().items():
        assert _resolve(name, setuptools["package-dir"]) == path, name


def test_namespace_root_has_no_init() -> None:
    # `tangram` spans several folders; an __init__.py in one would hide the others.
    for top in SOURCE_ROOTS:
        assert not (ROOT / top / "tangram" / "__init__.py").exists()


def test_the_exec_servers_sources_ship_in_the_wheel() -> None:
    """The agent compiles the exec server from its sources where it runs: a source left
    out of the package data is a build that fails only after installing."""
    setuptools = _pyproject()["tool"]["setuptools"]  # type: ignore[index]
    shipped = set(setuptools["package-data"]["tangram.node_agent"])
    assert {source.name for source in SOURCES} <= shipped
