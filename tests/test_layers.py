"""The library (`shared/sessionlog`) never imports the services: the layer that wires them (the `sessionlog`
command line's `serve`, `up` and `demo`, the process stack) sits above both, in `services/`."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import sessionlog

LIBRARY = Path(sessionlog.__file__).parent
# A module path written as a string for a lazy import: "services.gateway.run:start".
_IMPORT_TARGET = re.compile(r"^services(\.\w+)+(:\w+)?$")


def _services_references(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _IMPORT_TARGET.match(node.value):
            names = [node.value]
        found += [f"{path.relative_to(LIBRARY.parent)}:{node.lineno}: {name}" for name in names
                  if name == "services" or name.startswith("services.")]  # fmt: skip
    return found


def test_no_module_of_the_library_names_a_service_module() -> None:
    modules = sorted(LIBRARY.rglob("*.py"))
    assert len(modules) > 30  # the walk found the library
    assert [ref for path in modules for ref in _services_references(path)] == []


def test_every_module_of_the_library_imports_with_the_services_unimportable() -> None:
    script = """
import importlib, pkgutil, sys
import importlib.abc

class NoServices(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "services" or name.startswith("services."):
            raise ImportError(f"the library imported {name}")
        return None

sys.meta_path.insert(0, NoServices())
import sessionlog
names = [m.name for m in pkgutil.walk_packages(sessionlog.__path__, "sessionlog.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
assert not [m for m in sys.modules if m == "services" or m.startswith("services.")]
print(len(names))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 30


def test_the_blocker_would_catch_a_library_module_that_imports_a_service() -> None:
    """The check above can fail: the same finder refuses `services` when a module asks for it."""
    script = """
import sys, importlib.abc
class NoServices(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "services" or name.startswith("services."):
            raise ImportError(f"the library imported {name}")
        return None
sys.meta_path.insert(0, NoServices())
import services.gateway
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and "the library imported services" in done.stderr


def test_the_command_line_still_offers_every_command_through_python_m_sessionlog() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sessionlog", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    for command in ("check", "import", "serve", "repair-session", "up", "demo", "audit", "quarantine"):
        assert re.search(rf"^\s+{command}\s", done.stdout, re.M), (command, done.stdout)


REPO = Path(__file__).resolve().parents[1]
ROOTS = {"shared/sessionlog/": REPO / "shared" / "sessionlog", "services/": REPO / "services"}


def _layer_map() -> set[str]:
    """The modules `docs/architecture.md`'s layer map lists, as repository paths."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    listed, root = set(), None
    for line in block.splitlines():
        if not line.strip():
            continue
        token = line.split()[0]
        if not line.startswith(" "):
            assert token in ROOTS, f"the layer map names an unknown root {token!r}"
            root = token
        elif token.endswith(".py"):
            assert root is not None, f"{token} is listed before a root"
            listed.add(root + token)
    return listed


def test_the_layer_map_lists_every_module_and_no_other() -> None:
    modules = {
        root + path.relative_to(folder).as_posix()
        for root, folder in ROOTS.items()
        for path in folder.rglob("*.py")
        if path.name != "__init__.py"
    }
    listed = _layer_map()
    assert sorted(modules - listed) == [], "modules missing from docs/architecture.md's layer map"
    assert sorted(listed - modules) == [], "the layer map names modules that do not exist"
