"""``make gpu-kernels``' CPU dry run (``benchmarks/gpu_kernels.py --dry-run``), run as
the GPU box runs it: vLLM hidden (a ``vllm`` package first on ``PYTHONPATH`` whose
import fails), so the kernel tests that need vLLM must be found and deselected, and
``tests/conftest.py`` must stay out of the way. No engine: the fast tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.gpu_kernels import append_record, read_records, vllm_dependent_tests

ROOT = Path(__file__).resolve().parent.parent
HIDDEN_VLLM = "raise ModuleNotFoundError(\"No module named 'vllm' (hidden by the test)\", name='vllm')\n"


def without_vllm(tmp_path: Path) -> dict[str, str]:
    """The environment of a Python that cannot import vLLM."""
    shim = tmp_path / "no-vllm"
    (shim / "vllm").mkdir(parents=True)
    (shim / "vllm" / "__init__.py").write_text(HIDDEN_VLLM)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    return env


def test_dry_run_without_vllm(tmp_path):
    out = tmp_path / "report"
    command = [sys.executable, "benchmarks/gpu_kernels.py", "--dry-run", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=without_vllm(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + (out / "report.md").read_text()[-3000:]
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    assert report["status"] == "ok" and "Status: **ok**" in markdown
    assert [stage["status"] for stage in report["stages"].values()] == ["ok", "ok", "ok"]
    assert report["vllm_importable"] is False, "the shim did not hide vLLM"

    tests = report["tests"]
    assert tests["counts"]["passed"] > 0
    assert tests["counts"]["failed"] == tests["counts"]["errors"] == 0
    assert not tests["needed_vllm"], "a test needed vLLM and was not deselected"
    # the tests that call vLLM's kernels (tests/kernels/vllm_kernels.py) are left out, and only those
    assert tests["deselected"] and all("vllm" in why for why in tests["deselected"].values())
    assert tests["counts"]["deselected"] >= len(tests["deselected"])
    assert all(
        test.startswith(("tests/kernels/test_tree_attention.py", "tests/kernels/test_kv_move.py"))
        for test in tests["deselected"]
    )

    bench = report["benchmark"]
    assert bench["attention"] and bench["kv_move"] and not bench["errors"]
    for row in bench["attention"]:
        assert row["agrees"] and row["tree_max_abs_err"] <= 1.6e-2 and row["tree_ms"] > 0
    assert all(row["exact"] for row in bench["kv_move"])
    assert "| batch | context | rows | tree kernel ms" in markdown


def test_without_cuda_and_without_dry_run_says_what_to_do(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "report"
    command = [sys.executable, "benchmarks/gpu_kernels.py", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=without_vllm(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "--dry-run" in proc.stdout and "CUDA" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["stages"]["environment"]["status"] == "FAILED"
    assert report["stages"]["kernel tests"]["status"] == "not run"


def test_vllm_dependent_tests_are_found_by_reading_the_files(tmp_path):
    (tmp_path / "helpers.py").write_text(
        textwrap.dedent(
            """
            def uses_vllm():
                import vllm.v1.attention.ops as ops
                return ops

            def plain():
                return 1
            """
        )
    )
    (tmp_path / "test_mod.py").write_text(
        textwrap.dedent(
            """
            import pytest
            from helpers import plain, uses_vllm as vllm_op
            from vllm_specbeam.kernels import reference  # the plugin is not vLLM

            def _indirect():
                return vllm_op()

            @pytest.fixture
            def engine():
                from vllm import LLM
                return LLM

            def test_direct():
                vllm_op()

            def test_through_a_helper():
                _indirect()

            def test_fixture(engine):
                pass

            @pytest.mark.parametrize("x", [1, 2])
            def test_plain(x):
                plain(); reference.allowed_keys

            class TestGroup:
                def test_method(self):
                    _indirect()
            """
        )
    )
    found = vllm_dependent_tests(tmp_path / "test_mod.py")
    assert set(found) == {"test_direct", "test_through_a_helper", "test_fixture", "TestGroup"}
    assert (
        found["test_through_a_helper"]
        == "calls _indirect -> uses_vllm (helpers.py), which imports vllm.v1.attention.ops"
    )
    (tmp_path / "test_top.py").write_text("from vllm.config import VllmConfig\n\ndef test_x():\n    pass\n")
    assert vllm_dependent_tests(tmp_path / "test_top.py") == {"": "test_top.py imports vllm.config"}
    (tmp_path / "test_autouse.py").write_text(
        "import pytest\n\n@pytest.fixture(autouse=True)\ndef _f():\n    import vllm\n\ndef test_x():\n    pass\n"
    )
    assert list(vllm_dependent_tests(tmp_path / "test_autouse.py")) == [""]


def test_records_skip_a_line_cut_short(tmp_path):
    """What a stopped writer left reads (the greedy stage's engines, the benchmark's rows)."""
    path = tmp_path / "greedy-eager.jsonl"
    append_record(path, {"engine": "none", "diverged": None, "seconds": 1})
    with path.open("a") as out:
        out.write('{"engine": "ad')
    assert read_records(path) == [{"engine": "none", "diverged": None, "seconds": 1}]
    assert read_records(tmp_path / "absent.jsonl") == []
