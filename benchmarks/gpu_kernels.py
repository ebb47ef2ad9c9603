"""``make gpu-kernels``: the kernels-only GPU run, for a CUDA machine with only PyTorch
and Triton (no vLLM, no network, nothing installed).

    python benchmarks/gpu_kernels.py --out results/gpu-kernels            # a CUDA machine
    python benchmarks/gpu_kernels.py --out /tmp/gk --dry-run --hide-vllm  # here: CPU, Triton interpreter

Stages, each in its own process group (killed whole at its time limit), within one
global budget (``--budget``, 270 s; each stage's share below, what one leaves unused
goes to the next):

1. ``environment`` (30 s): GPU, compute capability, torch / Triton / CUDA versions,
   whether vLLM and pytest import (vLLM is expected not to).
2. ``kernel tests`` (140 s): ``tests/kernels/test_tree_attention.py`` and
   ``test_kv_move.py`` with the kernels compiled for the GPU (``TRITON_INTERPRET=0``;
   the tests' own default is the interpreter). Tests that need vLLM (found by reading
   the test files, :func:`vllm_dependent_tests`) are deselected when vLLM does not
   import; ``--confcutdir=tests/kernels`` keeps ``tests/conftest.py`` (the engine
   fixtures) out.
3. ``benchmark`` (95 s): the tree attention kernel over a paged KV cache against
   PyTorch's SDPA with the same dense boolean mask on K/V gathered into contiguous
   tensors (GQA groups expanded), and against the kernel on a chain (causal rows) of
   the same row count; CUDA events, warm-up, the median of ``--reps`` runs with L2
   flushed before each. Every shape is also a check: the kernel's and SDPA's largest
   absolute difference from SDPA in fp32. Then the fused all-layer KV move against a
   torch index copy (exact). Shapes and inputs come from ``benchmarks/bench_kernels.py``.

One report, rewritten as each stage (and each benchmark row) finishes, so a run cut
short still leaves what finished: ``DIR/report.md`` and ``DIR/report.json``, each
stage's log beside them. ``--dry-run`` does the same on the CPU under
``TRITON_INTERPRET=1`` with tiny benchmark shapes (CI runs it:
``tests/test_gpu_kernels.py``). Exit status 0 when every stage passed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.process_group import StageError, append_record, atomic_write, read_records, stop_group  # stdlib only
from benchmarks.tables import markdown_table

KERNEL_TESTS = ("tests/kernels/test_tree_attention.py", "tests/kernels/test_kv_move.py")
#: each stage's share of the 270 s default budget (scaled with ``--budget``)
STAGE_BUDGETS = {"environment": 30.0, "kernel tests": 140.0, "benchmark": 95.0}
#: kept back at the end for writing the report
RESERVE_S = 5.0
#: kernel vs fp32 SDPA, as tests/kernels/test_tree_attention.py: two bf16 ulps at 1
BF16_TOL = 1.6e-2
NO_VLLM = "raise ModuleNotFoundError(\"No module named 'vllm' (hidden by --hide-vllm)\", name='vllm')\n"


# ----------------------------------------------------------- the report
class Report:
    """``report.json`` and ``report.md``, rewritten whole at every change."""

    def __init__(self, out: Path, dry_run: bool, budget: float) -> None:
        self.out = out
        self.started = time.monotonic()
        self.data: dict[str, Any] = {
            "mode": "dry run (CPU, Triton interpreter, tiny shapes)" if dry_run else "GPU (compiled kernels)",
            "dry_run": dry_run,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "budget_s": budget,
            "elapsed_s": 0.0,
            "status": "running",
            "stages": {},
            "environment": {},
            "tests": {},
            "benchmark": {"config": {}, "attention": [], "kv_move": [], "errors": []},
        }

    def stage(self, name: str, **fields: Any) -> None:
        self.data["stages"].setdefault(name, {}).update(fields)
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        atomic_write(self.out / "report.json", json.dumps(self.data, indent=2) + "\n")
        atomic_write(self.out / "report.md", render_markdown(self.data))


ATTENTION_COLUMNS = (
    ("batch", "batch", 0),
    ("context", "context", 0),
    ("rows", "rows", 0),
    ("tree kernel ms", "tree_ms", 4),
    ("chain kernel ms", "chain_ms", 4),
    ("SDPA ms", "sdpa_ms", 4),
    ("gather+SDPA ms", "gather_sdpa_ms", 4),
    ("SDPA / tree", "sdpa_over_tree", 2),
    ("tree / chain", "tree_over_chain", 2),
    ("max abs err tree", "tree_max_abs_err", 5),
    ("max abs err SDPA", "sdpa_max_abs_err", 5),
    ("max abs err chain", "chain_max_abs_err", 5),
    ("agrees", "agrees", 0),
)
KV_MOVE_COLUMNS = (
    ("batch", "batch", 0),
    ("context", "context", 0),
    ("rows", "rows", 0),
    ("layers", "layers", 0),
    ("moves", "moves", 0),
    ("MiB moved", "mib_moved", 2),
    ("kernel ms", "kernel_ms", 4),
    ("torch index copy ms", "torch_ms", 4),
    ("torch / kernel", "torch_over_kernel", 2),
    ("exact", "exact", 0),
)


def render_markdown(data: dict) -> str:
    lines = [
        "# Kernels-only GPU run (`make gpu-kernels`)",
        "",
        f"Mode: {data['mode']}. Started {data['started']}; {data['elapsed_s']:.0f} s of the "
        f"{data['budget_s']:.0f} s budget used. Status: **{data['status']}**.",
        "",
        "| stage | status | time s | budget s | summary |",
        "|---|---|---|---|---|",
    ]
    for name, stage in data["stages"].items():
        seconds = stage.get("seconds")
        lines.append(
            f"| {name} | {stage.get('status', '')} | {'' if seconds is None else f'{seconds:.1f}'} | "
            f"{stage.get('budget_s', 0):.0f} | {stage.get('summary', '').replace('|', '/')} |"
        )
    shares = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in data["stage_shares_s"].items())
    lines += [
        "",
        f"Budget shares: {shares}, and {RESERVE_S:.0f} s for the report; a stage also gets what the"
        " ones before it left unused, and is killed (its whole process group) at its limit.",
    ]
    if data["environment"]:
        lines += ["", "## Environment", ""]
        lines += [f"- {key}: {value}" for key, value in data["environment"].items()]
    lines += _tests_section(data["tests"]) + _benchmark_section(data["benchmark"])
    return "\n".join(lines) + "\n"


def _tests_section(tests: dict) -> list[str]:
    lines: list[str] = []
    if tests:
        lines += ["", "## Kernel tests", ""]
        if "command" in tests:
            lines += [f"`{tests['command']}` (log: `kernel-tests.log`, JUnit XML: `kernel-tests.xml`)", ""]
        counts = tests.get("counts")
        if counts:
            lines.append("- " + ", ".join(f"{value} {key}" for key, value in counts.items()))
        if tests.get("deselected"):
            lines.append(f"- deselected as vLLM does not import here ({len(tests['deselected'])} tests):")
            lines += [f"  - `{test}`: {why}" for test, why in tests["deselected"].items()]
        for key, title in (("failed", "failed"), ("needed_vllm", "failed for want of vLLM (missed by the scan)")):
            if tests.get(key):
                lines.append(f"- {title}:")
                lines += [f"  - `{test}`: {message}" for test, message in tests[key].items()]
        if tests.get("slowest"):
            lines.append("- slowest: " + ", ".join(f"`{name}` {sec:.1f} s" for name, sec in tests["slowest"]))
    return lines


def _benchmark_section(bench: dict) -> list[str]:
    lines: list[str] = []
    if bench["config"] or bench["attention"] or bench["kv_move"] or bench["errors"]:
        lines += ["", "## Benchmark", ""]
        if bench["config"]:
            lines += [", ".join(f"{key} {value}" for key, value in bench["config"].items()), ""]
        if bench["attention"]:
            lines += [
                "Tree attention: `rows` query rows per request (a random tree of `rows - 1` nodes"
                " under the root) after `context` tokens. *SDPA*: `scaled_dot_product_attention`"
                " with the same boolean mask on K/V already gathered into contiguous tensors;"
                " *gather+SDPA* includes the gather out of the paged cache. *chain*: the kernel"
                " on causal rows of the same count. Errors: largest absolute difference from"
                " SDPA in fp32 (tree kernel, SDPA in the run's dtype, chain kernel).",
                "",
                markdown_table(bench["attention"], ATTENTION_COLUMNS),
            ]
        if bench["kv_move"]:
            lines += [
                "KV move: each request verified `rows` rows after `context` tokens; its accepted path"
                " (6 rows) is compacted in every layer:"
                " the kernel (one launch) against `reference.kv_move_ref` (a torch index copy"
                " per layer); `exact`: both give the same cache bits.",
                "",
                markdown_table(bench["kv_move"], KV_MOVE_COLUMNS),
            ]
        lines += [f"- error: {error}" for error in bench["errors"]]
    return lines


# ------------------------------------------------------- child processes
def run_child(
    command: list[str], log: Path, timeout: float, env: dict[str, str], on_poll=None, append: bool = False
) -> tuple[int | None, float]:
    """Run ``command`` from the repository root in its own process group, stdout and
    stderr into ``log``; past ``timeout`` seconds the whole group is killed. Returns
    (exit status or ``None`` when killed, seconds)."""
    began = time.monotonic()
    with log.open("a" if append else "w") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while True:
                try:
                    code = process.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    if on_poll:
                        on_poll()
                    if time.monotonic() - began > timeout:
                        stop_group(process, grace_s=5.0)
                        out.write(f"\n[killed after {timeout:.0f} s: the stage's time limit]\n")
                        code = None
                        break
        finally:
            if process.poll() is None:  # interrupted: leave nothing running
                stop_group(process, grace_s=5.0)
    if on_poll:
        on_poll()
    return code, time.monotonic() - began


def child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    # Set, not unset: the kernel tests default to the interpreter when it is unset.
    env["TRITON_INTERPRET"] = "1" if args.dry_run else "0"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    paths = [str(ROOT)]
    if args.hide_vllm:
        shim = args.out / ".no-vllm"
        (shim / "vllm").mkdir(parents=True, exist_ok=True)
        (shim / "vllm" / "__init__.py").write_text(NO_VLLM)
        paths.insert(0, str(shim))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return env


# ----------------------------------------------------------- the stages
#: ``python -c IMPORT_PROBE <module>``: one JSON line, its version or why it does not import
IMPORT_PROBE = """
import importlib.metadata, json, sys
name = sys.argv[1]
try:
    module = __import__(name)
    found = {"version": getattr(module, "__version__", None) or importlib.metadata.version(name)}
except Exception as error:
    found = {"version": None, "error": f"{type(error).__name__}: {error}"[:200]}
print(json.dumps(found))
"""


def stage_environment(args: argparse.Namespace, report: Report, budget: float, env: dict[str, str]) -> str:
    deadline = time.monotonic() + budget - 1
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch CUDA": torch.version.cuda,
        "triton": _version("triton"),
        "numpy": _version("numpy"),
    }
    cuda = torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["GPU"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        major, minor = torch.cuda.get_device_capability(0)
        info["compute capability"] = f"sm_{major}{minor}"
        info["GPUs visible"] = torch.cuda.device_count()
    else:
        info["GPU"] = "none (torch sees no CUDA device)"
    info["TRITON_INTERPRET (children)"] = env["TRITON_INTERPRET"]
    report.data["environment"] = info
    report.save()
    if not args.dry_run and not cuda:
        raise StageError(
            f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}) sees no CUDA device: run on a "
            "machine with an NVIDIA GPU and a CUDA build of torch (check CUDA_VISIBLE_DEVICES and nvidia-smi), "
            "or pass --dry-run for the CPU interpreter run"
        )
    if _version("triton") is None:
        raise StageError("Triton is not installed: the kernels need it (it comes with CUDA builds of torch)")
    log = args.out / "environment.log"
    log.write_text("")
    found = {}
    for name in ("pytest", "vllm"):  # vLLM's import takes seconds where it is installed
        limit = deadline - time.monotonic()
        code, _ = run_child([sys.executable, "-c", IMPORT_PROBE, name], log, max(3.0, limit), env, append=True)
        if code is None:
            probe = {"version": None, "error": f"its import did not finish within {max(3.0, limit):.0f} s"}
        else:
            probe = _last_json(log) if code == 0 else {"version": None, "error": f"the probe exited {code}"}
        found[name] = probe
        report.data[f"{name}_importable"] = probe["version"] is not None
        info[f"{name} imports"] = probe["version"] or f"no ({probe.get('error')})"
        report.save()
    where = info["GPU"] if cuda else "CPU"
    return (
        f"{where}; torch {info['torch']} (CUDA {info['torch CUDA']}), Triton {info['triton']}; "
        f"vLLM {'importable' if found['vllm']['version'] else 'not importable'}"
    )


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _last_line(log: Path) -> str:
    """The last line of a log that names an exception, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return (errors or lines or [""])[-1][:300]


def _last_json(log: Path) -> dict | None:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        with contextlib.suppress(ValueError):
            found = json.loads(line)
            if isinstance(found, dict):
                return found
    return None


def stage_tests(args: argparse.Namespace, report: Report, budget: float, env: dict[str, str]) -> str:
    tests = report.data["tests"]
    if not report.data.get("pytest_importable"):
        tests["skipped"] = "pytest does not import here"
        raise StageSkipped("pytest does not import in this Python: the kernel tests did not run")
    deselected: dict[str, str] = {}
    if not report.data.get("vllm_importable"):
        for path in KERNEL_TESTS:
            for name, why in vllm_dependent_tests(ROOT / path).items():
                deselected[f"{path}::{name}" if name else path] = why
    tests["deselected"] = deselected
    xml = args.out / "kernel-tests.xml"
    command = [
        *("-m", "pytest", *KERNEL_TESTS, "-v", "-rfE", "-p", "no:cacheprovider"),
        *("--confcutdir", "tests/kernels", "--junitxml", str(xml), "--durations=5"),
        *(f"--deselect={test}" for test in deselected),
    ]
    tests["command"] = " ".join(["python", *command])
    report.save()
    code, _ = run_child([sys.executable, *command], args.out / "kernel-tests.log", budget, env=env)
    log = (args.out / "kernel-tests.log").read_text(errors="replace")
    if not xml.exists():
        why = "killed at the stage's time limit" if code is None else f"pytest exited {code}"
        ran = re.findall(r"^\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED)", log, re.MULTILINE)
        done = ", ".join(f"{ran.count(outcome)} {outcome.lower()}" for outcome in sorted(set(ran))) or "none"
        last = "" if code is None else f" ({_last_line(args.out / 'kernel-tests.log')})"
        raise StageError(f"{why}{last} before writing its results (tests finished: {done}); see kernel-tests.log")
    results = junit_results(xml)
    found = re.search(r"(\d+) deselected", log)
    results["counts"]["deselected"] = int(found.group(1)) if found else 0
    tests.update(results)
    report.save()
    counts = results["counts"]
    said = ", ".join(f"{value} {key}" for key, value in counts.items())
    where = "interpreter" if args.dry_run else "compiled for the GPU"
    if code is None:
        raise StageError(f"killed at the time limit ({where}): {said}")
    if counts["failed"] or counts["errors"] or not counts["passed"]:
        raise StageError(f"{where}: {said}")
    return f"{where}: {said}"


def junit_results(xml: Path) -> dict[str, Any]:
    """Counts, failures (with the first line of their message) and the slowest tests."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed: dict[str, str] = {}
    needed_vllm: dict[str, str] = {}
    durations = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        durations.append((name, float(case.get("time") or 0.0)))
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
            continue
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}[outcome.tag]
        counts[key] += 1
        if key != "skipped":
            message = (outcome.get("message") or outcome.text or "").strip().splitlines()
            first = message[0][:300] if message else ""
            (needed_vllm if "No module named 'vllm" in (outcome.text or first) else failed)[name] = first
    durations.sort(key=lambda item: -item[1])
    return {"counts": counts, "failed": failed, "needed_vllm": needed_vllm, "slowest": durations[:5]}


def stage_benchmark(args: argparse.Namespace, report: Report, budget: float, env: dict[str, str]) -> str:
    rows = args.out / "benchmark.jsonl"
    rows.write_text("")
    bench = report.data["benchmark"]
    seen = [0]

    def collect() -> None:
        records = read_records(rows)
        for row in records[seen[0] :]:
            kind = row.pop("kind")
            if kind == "config":
                bench["config"] = row
            else:
                bench["errors" if kind == "error" else kind].append(row["message"] if kind == "error" else row)
        if len(records) > seen[0]:
            seen[0] = len(records)
            report.save()

    command = [sys.executable, str(Path(__file__).resolve()), "--benchmark-child", "--out", str(args.out)]
    command += ["--reps", str(args.reps), "--soft-limit", str(max(1.0, 0.85 * budget))]
    code, _ = run_child(
        [*command, *(["--dry-run"] if args.dry_run else [])], args.out / "benchmark.log", budget, env, collect
    )
    attention, moves = bench["attention"], bench["kv_move"]
    bad = [r for r in attention if not r["agrees"]] + [r for r in moves if not r["exact"]]
    said = f"{len(attention)} attention shapes, {len(moves)} KV-move shapes"
    if attention:
        said += f"; SDPA time / tree kernel time {min(r['sdpa_over_tree'] for r in attention):.2f}"
        said += f"-{max(r['sdpa_over_tree'] for r in attention):.2f}"
    if code is None:
        raise StageError(f"killed at the time limit after {said}")
    if code != 0 or bench["errors"] or bad or not attention or not moves:
        last = _last_line(args.out / "benchmark.log") if code else ""
        raise StageError(
            f"{said}; {len(bad)} disagree, {len(bench['errors'])} errors, exit {code}"
            + (f" ({last})" if last else "")
            + "; see benchmark.log"
        )
    return said + "; every shape agrees with SDPA (fp32), every move exact"


class StageSkipped(RuntimeError):
    """A stage that could not run here, said in one line."""


# ----------------------------------- which kernel tests need vLLM (static)
def _vllm_import(node: ast.AST) -> str | None:
    """The vLLM module an import statement imports, if any (``vllm_specbeam`` is not vLLM)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    else:
        return None
    return next((name for name in names if name == "vllm" or name.startswith("vllm.")), None)


def module_vllm_needs(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, list[str]]:
    """Module-level names of a test module (functions, classes, fixtures, names imported
    from sibling modules) whose use imports vLLM, each with the chain of calls that gets
    there (``["helper (file.py)", "imports vllm.x"]``); ``{"*": [why]}`` when the module
    itself does (at import, or through an autouse fixture)."""
    tree = ast.parse(path.read_text())
    needs: dict[str, list[str]] = {}
    label: dict[str, str] = {}
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        module = _vllm_import(node)
        if module:
            return {"*": [f"{path.name} imports {module}"]}
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            sibling = path.parent.joinpath(*node.module.split(".")).with_suffix(".py")
            if sibling.exists() and sibling not in _seen:
                inner = module_vllm_needs(sibling, (*_seen, path))
                for alias in node.names:
                    chain = inner.get("*") or inner.get(alias.name)
                    if chain:
                        needs[alias.asname or alias.name] = chain
                        label[alias.asname or alias.name] = f"{alias.name} ({sibling.name})"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
    for name, node in defs.items():
        module = next(filter(None, map(_vllm_import, ast.walk(node))), None)
        if module:
            needs[name] = [f"imports {module}"]
    changed = True
    while changed:  # what calls (or takes as a fixture) something that needs vLLM
        changed = False
        for name, node in defs.items():
            if name in needs:
                continue
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            used |= {a.arg for n in ast.walk(node) if isinstance(n, ast.arguments) for a in n.args}
            hit = next((other for other in sorted(used) if other in needs and other != name), None)
            if hit:
                needs[name] = [label.get(hit, hit), *needs[hit]]
                changed = True
    for name, node in defs.items():
        decorators = getattr(node, "decorator_list", [])
        if name in needs and any("autouse=True" in ast.unparse(d) for d in decorators):
            return {"*": [f"autouse fixture {name}", *needs[name]]}
    return needs


def _why(chain: list[str]) -> str:
    """``["a (f.py)", "b", "imports vllm.x"]`` -> ``calls a (f.py) -> b, which imports vllm.x``."""
    *calls, last = chain
    return f"calls {' -> '.join(calls)}, which {last}" if calls else last


def vllm_dependent_tests(path: Path) -> dict[str, str]:
    """The tests of ``path`` (pytest node names, without parameters) that import vLLM
    when they run, each with why; a module that imports vLLM itself gives ``{"": why}``."""
    needs = module_vllm_needs(path)
    if "*" in needs:
        return {"": _why(needs["*"])}
    tests = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            if node.name in needs:
                tests[node.name] = _why(needs[node.name])
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test") and node.name in needs:
            tests[node.name] = _why(needs[node.name])
    return tests


# ------------------------------------------------ the benchmark (a child)
def benchmark_child(args: argparse.Namespace) -> int:
    """Stage 3, in its own process (TRITON_INTERPRET is read when Triton is imported):
    one JSON line per row into ``benchmark.jsonl``, flushed as each finishes."""
    import numpy as np
    import torch

    forbid_torch_references()
    began = time.monotonic()

    def emit(kind: str, **row: Any) -> None:
        append_record(args.out / "benchmark.jsonl", {"kind": kind, **row})

    gpu = not args.dry_run
    if gpu:
        # Qwen2.5-1.5B's attention: 12 query heads, 2 KV heads of 128, 28 layers
        shape = dict(num_heads=12, num_kv_heads=2, head_size=128, num_layers=28)
        grid = [(b, c, r) for b in (1, 8) for c in (512, 4096) for r in (16, 64)]
        move_case = dict(context=1000, rows=64)
        warmup, reps = 5, args.reps
    else:
        shape = dict(num_heads=4, num_kv_heads=2, head_size=32, num_layers=2)
        grid = [(1, 24, 4), (2, 40, 8)]
        move_case = dict(context=24, rows=8)
        warmup, reps = 1, 2
    config = argparse.Namespace(block_size=16, dtype="bfloat16", **shape)
    emit(
        "config",
        device=torch.cuda.get_device_name() if gpu else "cpu (interpreter)",
        dtype=config.dtype,
        heads=f"{config.num_heads} q / {config.num_kv_heads} kv x {config.head_size}",
        block_size=config.block_size,
        timing=f"median of {reps} after {warmup} warm-up" + (", CUDA events, L2 flushed" if gpu else ", wall clock"),
    )
    timer = _cuda_timer(torch) if gpu else _cpu_timer
    timing = Timing(timer, warmup, reps)
    for batch, context, rows in grid:
        if time.monotonic() - began > args.soft_limit:
            emit("error", message=f"stopped before batch {batch} context {context} rows {rows}: time limit")
            return 1
        try:
            emit("attention", **_attention_row(batch, context, rows, config, timing, on_gpu=gpu))
        except Exception as error:  # one shape's failure (e.g. a compile error) is reported, the rest still run
            emit(
                "error",
                message=f"attention batch {batch} context {context} rows {rows}: {type(error).__name__}: {error}"[:500],
            )
    rng = np.random.default_rng(1)
    for batch in (1, 8) if gpu else (2,):
        try:
            emit("kv_move", **_kv_move_row(batch, config, rng, move_case, timing))
        except Exception as error:
            emit("error", message=f"KV move batch {batch}: {type(error).__name__}: {error}"[:500])
    return 0


def forbid_torch_references() -> None:
    """A kernel that falls back to its torch reference fails, instead of timing the reference."""
    from vllm_specbeam.kernels import kv_move as km
    from vllm_specbeam.kernels import tree_attention as ta

    def fallback(*_args, **_kwargs):
        raise AssertionError("a kernel fell back to its torch reference")

    ta.tree_attention_ref = fallback
    km.kv_move_ref = fallback


@dataclass(frozen=True)
class Timing:
    """How the benchmark times a call: ``timer(fn, warmup, reps)`` gives its median in ms."""

    timer: Callable[[Callable[[], Any], int, int], float]
    warmup: int
    reps: int

    def ms(self, fn: Callable[[], Any]) -> float:
        return self.timer(fn, self.warmup, self.reps)


def _attention_row(
    batch: int, context: int, rows: int, config: argparse.Namespace, timing: Timing, on_gpu: bool
) -> dict[str, Any]:
    """Tree attention over the paged cache against SDPA with the same mask and against a chain of
    the same rows: times, and each output's largest error from fp32 SDPA."""
    import torch

    from benchmarks import bench_kernels as bk
    from vllm_specbeam.kernels import tree_attention as ta

    scale = config.head_size**-0.5
    inp = bk.make_inputs(batch, rows - 1, context, config, seed=batch * 1000 + rows)
    chain = {**inp, "tree_mask": torch.zeros_like(inp["tree_mask"])}
    dense, dense_chain = bk.dense_inputs(inp), bk.dense_inputs(chain)
    want = bk.dense_attention(dense, scale, dtype=torch.float32).float()
    want_chain = bk.dense_attention(dense_chain, scale, dtype=torch.float32).float()
    tree_out = ta.tree_attention(**inp, max_query_len=rows)
    chain_out = ta.tree_attention(**chain, max_query_len=rows)
    sdpa_out = bk.dense_attention(dense, scale)
    buf = torch.empty_like(inp["q"])
    qd, kd, vd, mask = dense["q"], dense["k"], dense["v"], dense["mask"]
    if not on_gpu:  # CPU SDPA: fp32, as bench_kernels.dense_attention
        qd, kd, vd = qd.float(), kd.float(), vd.float()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row = {
        "batch": batch,
        "context": context,
        "rows": rows,
        "tree_ms": timing.ms(lambda: ta.tree_attention(**inp, max_query_len=rows, out=buf)),
        "chain_ms": timing.ms(lambda: ta.tree_attention(**chain, max_query_len=rows, out=buf)),
        "sdpa_ms": timing.ms(lambda: sdpa(qd, kd, vd, attn_mask=mask, scale=scale)),
        "gather_sdpa_ms": timing.ms(lambda: bk.dense_masked_baseline(inp)),
        "tree_max_abs_err": float((tree_out.float() - want).abs().max()),
        "sdpa_max_abs_err": float((sdpa_out.float() - want).abs().max()),
        "chain_max_abs_err": float((chain_out.float() - want_chain).abs().max()),
    }
    row["sdpa_over_tree"] = row["sdpa_ms"] / row["tree_ms"]
    row["tree_over_chain"] = row["tree_ms"] / row["chain_ms"]
    row["agrees"] = max(row["tree_max_abs_err"], row["chain_max_abs_err"]) <= BF16_TOL
    return row


def _kv_move_row(
    batch: int, config: argparse.Namespace, rng: Any, move_case: dict[str, int], timing: Timing
) -> dict[str, Any]:
    """The KV-move kernel against a torch index copy: exactness first, then both timed."""
    import torch

    from benchmarks import bench_kernels as bk
    from vllm_specbeam.kernels import kv_move as km
    from vllm_specbeam.kernels.reference import kv_move_ref

    case = bk.kv_move_case(batch, config, rng, **move_case)
    layers, src, dst, cu = case["layers"], case["src"], case["dst"], case["cu"]
    expected = [layer.clone() for layer in layers]
    kv_move_ref(expected, src, dst)
    ptrs = km.layer_pointer_table(layers)
    km.kv_move(layers, src, dst, cu, ptrs)
    exact = all(torch.equal(got, want) for got, want in zip(layers, expected))
    row = {
        "batch": batch,
        **move_case,
        "layers": config.num_layers,
        "moves": int(src.numel()),
        "mib_moved": case["bytes_moved"] / 2**20,
        "kernel_ms": timing.ms(lambda: km.kv_move(layers, src, dst, cu, ptrs)),
        "torch_ms": timing.ms(lambda: kv_move_ref(layers, src, dst)),
        "exact": exact,
    }
    row["torch_over_kernel"] = row["torch_ms"] / row["kernel_ms"]
    return row


def _cuda_timer(torch):
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # larger than any L2

    def timer(fn, warmup: int, reps: int) -> float:
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for start, end in zip(starts, ends):
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(end) for start, end in zip(starts, ends))
        return times[len(times) // 2]

    return timer


def _cpu_timer(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


# ------------------------------------------------------------------ main
STAGES = (("environment", stage_environment), ("kernel tests", stage_tests), ("benchmark", stage_benchmark))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu-kernels", help="the report's folder")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: Triton interpreter, tiny shapes")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for the whole run (default 270)")
    parser.add_argument("--reps", type=int, default=30, help="timed runs per kernel and shape (GPU)")
    parser.add_argument(
        "--hide-vllm", action="store_true", help="run the children as if vLLM were not installed (as on the GPU box)"
    )
    parser.add_argument("--benchmark-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--soft-limit", type=float, default=1e9, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.benchmark_child:
        return benchmark_child(args)

    report = Report(args.out, args.dry_run, args.budget)
    env = child_env(args)
    scale = (args.budget - RESERVE_S) / (sum(STAGE_BUDGETS.values()))
    report.data["stage_shares_s"] = {name: round(share * scale, 1) for name, share in STAGE_BUDGETS.items()}
    deadline = report.started
    for name, _ in STAGES:
        report.stage(name, status="pending", budget_s=STAGE_BUDGETS[name] * scale)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: children are killed
    failed = False
    try:
        for name, stage in STAGES:
            deadline += STAGE_BUDGETS[name] * scale  # what a stage leaves unused goes to the next
            budget = deadline - time.monotonic()
            print(f"== {name} (up to {budget:.0f} s)", flush=True)
            began = time.monotonic()
            report.stage(name, status="running", budget_s=round(budget, 1))
            try:
                summary, status = stage(args, report, budget, env), "ok"
            except StageSkipped as skipped:
                summary, status, failed = str(skipped), "skipped", True
            except StageError as error:
                summary, status, failed = str(error), "FAILED", True
            except Exception as error:
                summary, status, failed = f"{type(error).__name__}: {error}", "FAILED", True
            report.stage(name, status=status, seconds=round(time.monotonic() - began, 1), summary=summary)
            print(f"   {status}: {summary}", flush=True)
            if name == "environment" and status != "ok":
                break  # nothing else can run
    finally:
        if report.data["status"] == "running":
            report.data["status"] = "FAILED" if failed else "ok"
            for stage_report in report.data["stages"].values():
                if stage_report["status"] == "running":
                    stage_report["status"] = report.data["status"] = "interrupted"
                elif stage_report["status"] == "pending":
                    stage_report["status"] = "not run"
        report.save()
    print(f"== {report.data['status']} in {report.data['elapsed_s']:.0f} s; report: {args.out / 'report.md'}")
    return 0 if report.data["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
