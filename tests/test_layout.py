"""The architecture's one boundary: only ``vllm_specbeam/adapter`` knows vLLM.

The core (tree type, options, verifiers), every method's algorithm code, the
draft runtime and the kernels must run without vLLM, so they can be tested,
reused and ported alone, and a vLLM upgrade touches the adapter only. Checked
two ways: statically (every ``import`` statement, module level or inside a
function, in the source) and at run time (importing every such module with
vLLM made unimportable).
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


def vllm_free_files(root: Path = PACKAGE) -> list[Path]:
    return sorted(path for folder in VLLM_FREE for path in (root / folder).rglob("*.py"))


def forbidden_imports(path: Path) -> list[str]:
    """``file:line: module`` for every import of vLLM or of the adapter in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name == "vllm" or name.startswith(("vllm.", "vllm_specbeam.adapter")):
                found.append(f"{'/'.join(path.parts[-3:])}:{node.lineno}: {name}")
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
    hits = [hit for path in vllm_free_files(planted) for hit in forbidden_imports(path)]
    assert hits == ["methods/demo/drafter.py:5: vllm.v1.outputs"]


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
