"""The architecture's one boundary: only ``vllm_specbeam/adapter`` knows vLLM.

The core (tree type, options, verifiers), every method's algorithm code, the
draft runtime and the kernels must run without vLLM, so they can be tested,
reused and ported alone, and a vLLM upgrade touches the adapter only. Checked
two ways: statically (every ``import`` statement, module level or inside a
function, in the source) and at run time (importing every such module with
vLLM made unimportable).

The package's floors, ``core < draft_runtime < methods < adapter``, never import
upward (a method may import another method): checked statically, the same way.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_specbeam"
#: Folders that must not import vLLM (or the adapter, which does).
VLLM_FREE = ("core", "methods", "draft_runtime", "kernels")
#: The floors, lowest first: each imports only from its own floor and those below.
FLOORS = ("core", "draft_runtime", "methods", "adapter")


def vllm_free_files(root: Path = PACKAGE) -> list[Path]:
    return sorted(path for folder in VLLM_FREE for path in (root / folder).rglob("*.py"))


def imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """``(line, module)`` for every import statement in ``path`` (a file under ``root``), module
    level or inside a function. A relative import is resolved against ``path``'s package, and
    ``from vllm_specbeam import x`` reads as ``vllm_specbeam.x``."""
    package = path.relative_to(root.parent).parent.parts  # e.g. ("vllm_specbeam", "methods", "mcsd")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            modules = [f"{module}.{alias.name}" for alias in node.names] if module == root.name else [module]
            found += [(node.lineno, name) for name in modules]
    return found


def where(path: Path, root: Path, line: int, module: str) -> str:
    return f"{path.relative_to(root).as_posix()}:{line}: {module}"


def forbidden_imports(path: Path, root: Path = PACKAGE) -> list[str]:
    """``file:line: module`` for every import of vLLM or of the adapter in ``path``."""
    return [
        where(path, root, line, name)
        for line, name in imports(path, root)
        if name == "vllm" or name.startswith(("vllm.", f"{root.name}.adapter"))
    ]


def floor(module: str, package: str = PACKAGE.name) -> int | None:
    """The floor (index in :data:`FLOORS`) of a dotted module name; ``None`` outside the floors."""
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[0] == package and parts[1] in FLOORS else None


def upward_imports(root: Path = PACKAGE) -> list[str]:
    """``file:line: module`` for every import of a higher floor than the importing file's (the
    top floor has none above it)."""
    found = []
    for own, folder in enumerate(FLOORS[:-1]):
        for path in sorted((root / folder).rglob("*.py")):
            for line, name in imports(path, root):
                above = floor(name, root.name)
                if above is not None and above > own:
                    found.append(where(path, root, line, name))
    return found


def test_the_vllm_free_folders_exist_and_hold_code():
    files = vllm_free_files()
    for folder in VLLM_FREE:
        assert any(path.is_relative_to(PACKAGE / folder) for path in files), f"{folder}/ has no Python file"
    assert (PACKAGE / "adapter" / "plugin.py").is_file()


def test_no_vllm_import_outside_the_adapter():
    offenders = [hit for path in vllm_free_files() for hit in forbidden_imports(path)]
    assert not offenders, "only vllm_specbeam/adapter may import vLLM:\n" + "\n".join(offenders)


def test_the_check_catches_a_planted_import(tmp_path):
    """The static check is not vacuous: a lazy import inside a function is found."""
    planted = tmp_path / "vllm_specbeam"
    (planted / "methods" / "demo").mkdir(parents=True)
    (planted / "methods" / "demo" / "drafter.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def propose():
                from vllm.v1.outputs import DraftTokenIds
                return DraftTokenIds
            """
        )
    )
    hits = [hit for path in vllm_free_files(planted) for hit in forbidden_imports(path, planted)]
    assert hits == ["methods/demo/drafter.py:5: vllm.v1.outputs"]


def test_no_floor_imports_a_higher_one():
    offenders = upward_imports()
    assert not offenders, f"floors import only downward ({' < '.join(FLOORS)}):\n" + "\n".join(offenders)


def test_the_floor_check_catches_planted_imports(tmp_path):
    """The floor check is not vacuous: absolute, relative and lazy upward imports are found, and
    downward imports, imports within a floor and a method importing another method are not."""
    planted = tmp_path / "vllm_specbeam"
    sources = {
        "core/budget.py": "from vllm_specbeam.core.tree import DraftTree\nfrom ..methods import mcsd\n",
        "draft_runtime/lookup.py": (
            "from vllm_specbeam.core import tree\n\n"
            "def propose():\n"
            "    from vllm_specbeam.methods.lookup_tree.drafter import LookupTreeDrafter\n"
            "    return LookupTreeDrafter\n"
        ),
        "methods/mcsd/drafter.py": (
            "from vllm_specbeam.draft_runtime.base import DraftRuntime\n"
            "from vllm_specbeam.methods.lookup_tree import branches\n"
            "from . import stopping\n"
            "from vllm_specbeam import adapter\n"
        ),
    }
    for name, source in sources.items():
        (planted / name).parent.mkdir(parents=True, exist_ok=True)
        (planted / name).write_text(source)
    assert upward_imports(planted) == [
        "core/budget.py:2: vllm_specbeam.methods",
        "draft_runtime/lookup.py:4: vllm_specbeam.methods.lookup_tree.drafter",
        "methods/mcsd/drafter.py:4: vllm_specbeam.adapter",
    ]


def test_vllm_free_modules_import_with_vllm_unimportable():
    """Importing every vLLM-free module in a process where vLLM cannot be
    imported: a module-level vLLM import anywhere in them fails here."""
    modules = [
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for path in vllm_free_files()
    ]
    script = textwrap.dedent(
        f"""
        import importlib, sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm" + "."):
                    raise ImportError("vLLM is blocked in this test: " + name)

        sys.meta_path.insert(0, Block())
        for module in {modules!r}:
            importlib.import_module(module)
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
        print(len({modules!r}))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.strip()) == len(modules)
