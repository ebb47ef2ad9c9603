"""One command for a fresh CUDA machine: does vllm-specbeam work there?

    python3 benchmarks/gpu_check.py                 # a CUDA machine that reaches the package registry
    python3 benchmarks/gpu_check.py --passes eager  # the correctness answer alone: no compiled engine
    python3 benchmarks/gpu_check.py --cpu-dry-run   # the same stages here, tiny model and settings

Stages, in order; the first that fails stops the run, named in the report:

1. ``preflight``: the NVIDIA driver (``nvidia-smi``), its CUDA version and the GPU
   memory already in use; Python >= 3.10; ``python -m venv`` (ensurepip); the
   package registry (``pip index versions vllm``: a supported vLLM is offered);
   the venv's torch and its CUDA where the venv exists. Each failure names its fix;
   with a venv that has vLLM already, a missing registry or venv module is noted only.
2. ``install``: a venv (``--venv``, default ``.venv-gpu``) with ``.[gpu,test,bench]``
   (vLLM 0.32.x or 0.33.x); the dry run checks the existing ``.venv`` instead.
3. ``environment``: the GPU, torch, CUDA and vLLM versions, and the plugin's
   start-up check of every vLLM symbol it touches on this platform.
4. ``kernels``: tests/kernels' tree-attention and KV-move tests compiled for the
   GPU (``TRITON_INTERPRET=0``, asserted on the device); the dry run interprets them.
5. ``models``: Qwen2.5-Coder-1.5B-Instruct and its 0.5B draft (benchmarks/models.py:
   the hub, else the registry); the dry run builds tests/tiny_model.py's pair.
6. ``greedy``, once per ``--passes`` (default both): ``greedy-eager`` starts every
   engine with ``enforce_eager`` (no torch.compile, no CUDA graphs: quick starts, so
   the correctness answer comes first), ``greedy-compiled`` as vLLM starts them by
   default. Every plugin method (``mjsd`` in its lossless ``block`` mode) and vLLM's
   ``ngram`` / ``draft_model``, greedy, against no speculation, in one process. A
   divergence passes only where the float32 target's top-2 logit margin at the first
   differing token is below ``--near-tie`` (0.5): a near-tie that bfloat16 rounding
   may flip; any other fails the stage. The margins' float32 engine is always eager.
7. ``compare``: benchmarks/compare.py, batch 1 and 16, greedy, one repeat (compiled
   engines, eager with ``--passes eager``): ``lookup_tree``, ``aded``, ``mcsd``,
   ``dsbd``, the beam search (vLLM's and the speculative ``dsbd-beam``) and vLLM's
   ``draft_model`` / ``ngram`` / ``suffix`` (skipped by compare.py without arctic-inference).
8. ``serve``: one ``vllm serve`` with ``lookup_tree`` and a few completion and chat requests.

Every command runs in its own process group, stopped whole (SIGTERM, then SIGKILL
after 15 s) when its stage's time budget runs out or the check is interrupted:
killing the command alone would leave its children, vLLM's EngineCore processes,
holding the GPU's memory. The greedy stage appends each engine's outcome to
``greedy-<pass>.jsonl`` as it finishes, and compare.py leaves
``compare/logs/<engine>.result.json`` per engine, so a stage stopped on its
budget still reports the engines that finished.

One report: ``--out`` (default ``results/gpu-check``)/report.md, rewritten after
every stage, each stage's wall time next to its budget, and each stage's log beside it.

Time budgets: a stage's commands are stopped at its budget (``--budget-scale``
multiplies every one). Not under 10 minutes: the GPU run starts about 30 cold
engines, about 10 eager (greedy-eager's 9, greedy-compiled's float32 margin engine)
and about 20 compiled (greedy-compiled's 8, compare's 9 to 11, serve's 1), each a
model load and, compiled, a torch.compile and a CUDA graph capture (``max_num_seqs``
16 keeps greedy's and serve's captured sizes few). The GPU times are estimated, not
measured: no GPU run yet. The dry run's were measured (2026-11-29, both passes) on 2
CPU cores shared with other jobs, load average 4 to 7:

=================  ==========  ==========  ===============  ==========
stage              dry run     dry-run     GPU, estimated   GPU budget
                   (measured)  budget
=================  ==========  ==========  ===============  ==========
preflight          16 s        60 s        15 s             2 min
install            17 s        60 s        5-10 min         40 min
environment        24 s        2 min       30 s             5 min
kernels            24 s        5 min       2-5 min          15 min
models             6 s         1 min       1-3 min          20 min
greedy-eager       526 s       20 min      4-6 min          20 min
greedy-compiled    643 s       25 min      10-15 min        40 min
compare            787 s       30 min      15-20 min        50 min
serve              69 s        5 min       2 min            15 min
all                35 min      90 min      40-60 min        3.5 h
=================  ==========  ==========  ===============  ==========

The dry run's engines took 26-103 s each eager and 65-81 s compiled (CPU inductor).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not the repository
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_kernels import KERNEL_TESTS
from benchmarks.process_group import StageError, append_record, read_records, stop_group

PASSES = ("eager", "compiled")
PROMPTS = [
    "def fibonacci(n):\n    ",
    "def is_prime(n: int) -> bool:\n    ",
    "# Read a CSV file and print the sum of each column\nimport csv\n",
    "class Stack:\n    def __init__(self):\n        ",
    "def binary_search(items, target):\n    ",
    "def merge_sorted(a, b):\n    ",
    "import json\n\ndef load_config(path):\n    ",
    "def word_count(text: str) -> dict[str, int]:\n    ",
]
#: Seconds a finished command's group gets to end by itself (multiprocessing's resource tracker
#: tidies up after the command, ignoring SIGTERM).
SETTLE_S = 5.0


@dataclass
class Settings:
    """What the stages run on: the GPU's real pair, or the dry run's tiny one."""

    dry_run: bool
    out: Path
    venv: Path
    model: str = ""
    draft: str = ""
    dtype: str = "bfloat16"
    max_tokens: int = 64
    num_prompts: int = 8
    compare_prompts: int = 16
    compare_max_tokens: int = 64
    near_tie: float = 0.5
    passes: tuple[str, ...] = PASSES
    engine: dict = field(default_factory=dict)
    #: what the report carries after the stages (compare.py's table)
    tables: list[str] = field(default_factory=list)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def compiled(self) -> bool:
        """Whether compare and serve start compiled engines (else eager ones)."""
        return "compiled" in self.passes


#: The greedy stage batches 8 prompts and serve asks one at a time; vLLM captures CUDA graphs up
#: to max_num_seqs × (1 + k) × 2 tokens, so its default (256 or more) would capture many sizes the
#: check never runs.
MAX_NUM_SEQS = 16


def settings_of(args: argparse.Namespace) -> Settings:
    out = Path(args.out).resolve()
    passes = tuple(p for p in PASSES if p in args.passes)
    if args.cpu_dry_run:
        return Settings(
            True,
            out,
            Path(args.venv or ROOT / ".venv").resolve(),
            dtype="float32",
            max_tokens=16,
            num_prompts=4,
            compare_max_tokens=16,
            passes=passes,
            engine={"max_model_len": 512, "max_num_seqs": MAX_NUM_SEQS, "kv_cache_memory_bytes": 64 << 20},
        )
    return Settings(
        False,
        out,
        Path(args.venv or ROOT / ".venv-gpu").resolve(),
        passes=passes,
        engine={"max_model_len": 2048, "max_num_seqs": MAX_NUM_SEQS, "gpu_memory_utilization": 0.35},
    )


# ---------------------------------------------------------------- commands in their own process groups
@dataclass
class Clock:
    """A running stage's log and budget: each command it runs gets what is left of the budget."""

    stage: str
    log: Path
    budget_s: float
    began: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return max(self.began + self.budget_s - time.monotonic(), 0.0)

    def over(self, what: str) -> StageError:
        return StageError(
            f"{what} ran past the {self.stage} stage's {self.budget_s:.0f} s budget and was stopped, its process "
            f"group with it; see {self.log.name}. If it was only slow: --stages {self.stage.split('-')[0]} "
            "--budget-scale 2"
        )


def run(clock: Clock, command: list[str], env: dict[str, str] | None = None) -> str:
    """Run ``command`` from the repository root in its own process group, its stderr into the stage's
    log; returns its stdout (logged too). Raises on failure and when the stage's budget runs out;
    either way nothing of the command's process group outlives the call."""
    with clock.log.open("a") as log, tempfile.TemporaryFile("w+") as stdout:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=stdout, stderr=log, env={**os.environ, **(env or {})}, start_new_session=True
        )
        try:
            code = process.wait(timeout=clock.left())
        except subprocess.TimeoutExpired:
            raise clock.over(f"`{shown(command)}`") from None
        finally:
            left = stop_group(process, settle_s=SETTLE_S if process.returncode is not None else 0.0)
            if left:
                log.write(f"(stopped what was left of `{shown(command)}`'s process group: {left})\n")
        stdout.seek(0)
        said = stdout.read()
        log.write(said)
    if code != 0:
        raise StageError(f"`{shown(command)}` exited {code}; see {clock.log.name}")
    return said


def shown(command: list[str]) -> str:
    """A command's first words, for one-line messages (the log has it whole)."""
    words = [" ".join(word.split()) for word in command[:3]]
    return shlex.join(w if len(w) <= 60 else w[:57] + "..." for w in words) + (" …" if len(command) > 3 else "")


# ---------------------------------------------------------------- preflight
#: a probe run by the venv's python: what it has of vLLM and torch, and whether torch sees CUDA
VENV_PROBE = (
    "import importlib.util as u, json\n"
    "found = {'vllm': u.find_spec('vllm') is not None, 'torch': None, 'cuda': None, 'available': False}\n"
    "if u.find_spec('torch'):\n"
    "    import torch\n"
    "    found.update(torch=torch.__version__, cuda=torch.version.cuda, available=torch.cuda.is_available())\n"
    "print(json.dumps(found))\n"
)


@dataclass
class Gpu:
    """What nvidia-smi says of the first GPU."""

    name: str
    driver: str
    cuda: str
    total_mib: float
    used_mib: float

    @classmethod
    def parse(cls, query: str, banner: str) -> Gpu:
        """From ``--query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader,nounits``
        and the plain banner, which alone gives the driver's CUDA version."""
        name, driver, total, used = (part.strip() for part in query.strip().splitlines()[0].split(","))
        cuda = re.search(r"CUDA Version:\s*([\d.]+)", banner)
        return cls(name, driver, cuda.group(1) if cuda else "unknown", float(total), float(used))


def stage_preflight(s: Settings, clock: Clock) -> str:
    gpu = None if s.dry_run else _gpu(clock)
    if sys.version_info < (3, 10):  # noqa: UP036  (the check runs under the machine's python3, maybe an old one)
        raise StageError(f"Python {platform.python_version()} runs this check; vLLM needs >= 3.10: run it with one")
    probe = _probe_venv(s, clock)
    needed = not probe["vllm"]  # the install stage has work to do
    with tempfile.TemporaryDirectory() as tmp:
        venv = _venv_works(clock, Path(tmp) / "venv", needed)
        registry = _registry(clock, venv or s.python, needed)
    return "; ".join(
        [
            f"{gpu.name}, driver {gpu.driver} (CUDA {gpu.cuda}), {gpu.used_mib:.0f} of {gpu.total_mib:.0f} MiB in use"
            if gpu
            else "no GPU, dry run",
            f"Python {platform.python_version()}",
            "python -m venv works" if venv else "python -m venv fails (not needed: the venv has vLLM)",
            registry,
            _torch_cuda(s, probe, gpu),
        ]
    )


def _gpu(clock: Clock) -> Gpu:
    if shutil.which("nvidia-smi") is None:
        raise StageError(
            "nvidia-smi not found: install the NVIDIA driver (in a container, start it with the GPUs: "
            "`docker run --gpus all`)"
        )
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv,noheader,nounits"]
    try:
        gpu = Gpu.parse(run(clock, query), run(clock, ["nvidia-smi"]))
    except StageError as error:
        raise StageError(f"{error}: nvidia-smi cannot reach the driver; load or reinstall the NVIDIA driver") from None
    if gpu.used_mib > 0.05 * gpu.total_mib:
        raise StageError(
            f"{gpu.used_mib:.0f} of the GPU's {gpu.total_mib:.0f} MiB are in use already (a previous run's "
            "EngineCore?): stop those processes (`nvidia-smi` lists them); compare.py's engines take 90% of it"
        )
    return gpu


def _probe_venv(s: Settings, clock: Clock) -> dict[str, Any]:
    if not s.python.exists():
        return {"vllm": False, "torch": None}
    return json.loads(run(clock, [str(s.python), "-c", VENV_PROBE]).strip().splitlines()[-1])


def _venv_works(clock: Clock, where: Path, needed: bool) -> Path | None:
    """A throwaway venv's python, or None where ``python -m venv`` fails and the venv is not needed."""
    try:
        run(clock, [sys.executable, "-m", "venv", str(where)])
    except StageError as error:
        if needed:
            raise StageError(
                f"{error}: `python -m venv` fails (ensurepip missing?): install it (Debian/Ubuntu: "
                f"apt-get install python3.{sys.version_info.minor}-venv), or pass --venv with vLLM installed"
            ) from None
        return None
    return where / "bin" / "python"


def _registry(clock: Clock, python: Path, needed: bool) -> str:
    """Whether pip's configured index offers a vLLM that setup.py's ``gpu`` extra accepts."""
    low, high = supported_vllm()
    command = [str(python), "-m", "pip", "index", "versions", "vllm", "--timeout", "10", "--retries", "0"]
    try:
        versions = offered_versions(run(clock, command))
    except StageError as error:
        versions, problem = [], f"pip cannot reach the package registry ({error})"
    else:
        problem = f"the package registry offers no vLLM >= {low}, < {high}"
    fitting = within(versions, low, high)
    if fitting:
        return f"the package registry offers vLLM {fitting[0]}"
    if needed:
        raise StageError(
            f"{problem}: point pip at an index that has it (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL), "
            "or pass --venv with vLLM installed"
        )
    return f"{problem} (not needed: the venv has vLLM)"


def supported_vllm() -> tuple[str, str]:
    """setup.py's ``GPU_VLLM`` bounds, ``vllm>=LOW,<HIGH``."""
    found = re.search(r'GPU_VLLM = "vllm>=([\d.]+),<([\d.]+)"', (ROOT / "setup.py").read_text())
    if found is None:
        raise StageError("setup.py's GPU_VLLM is not `vllm>=LOW,<HIGH`: update gpu_check.supported_vllm")
    return found.group(1), found.group(2)


def offered_versions(said: str) -> list[str]:
    """The versions in ``pip index versions``' answer, newest first."""
    found = re.search(r"Available versions:\s*(.+)", said)
    return [v.strip() for v in found.group(1).split(",")] if found else []


def within(versions: list[str], low: str, high: str) -> list[str]:
    """The ``versions`` >= ``low`` and < ``high``."""
    return [v for v in versions if version_key(low) <= version_key(v) < version_key(high)]


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _torch_cuda(s: Settings, probe: dict[str, Any], gpu: Gpu | None) -> str:
    if probe["torch"] is None:
        return f"no torch in {s.venv} yet (the install stage installs it)"
    said = f"torch {probe['torch']} (CUDA {probe['cuda']})"
    if s.dry_run or probe["available"]:
        return f"{said}, {'sees' if probe['available'] else 'no'} CUDA device"
    driver = gpu.cuda if gpu else "unknown"
    if probe["cuda"] and driver != "unknown" and version_key(probe["cuda"]) > version_key(driver):
        fix = f"upgrade the NVIDIA driver to one for CUDA >= {probe['cuda']}, or install a torch for CUDA {driver}"
    else:
        fix = "check CUDA_VISIBLE_DEVICES, and that torch is a CUDA build (`pip install -e .[gpu]` in a new venv)"
    raise StageError(f"{said} in {s.venv} sees no CUDA device; the driver supports CUDA {driver}: {fix}")


# ---------------------------------------------------------------- the other stages
def stage_install(s: Settings, clock: Clock) -> str:
    if s.dry_run:
        run(clock, [str(s.python), "-c", "import vllm, vllm_specbeam, pytest"])
        return f"dry run: uses {s.venv} as it is (nothing installed)"
    if not s.python.exists():
        run(clock, [sys.executable, "-m", "venv", str(s.venv)])
    run(clock, [str(s.python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    run(clock, [str(s.python), "-m", "pip", "install", "--quiet", "-e", ".[gpu,test,bench]"])
    return f"installed .[gpu,test,bench] into {s.venv}"


def stage_environment(s: Settings, clock: Clock) -> str:
    code = (
        "import torch, vllm, json\n"
        "from vllm.platforms import current_platform\n"
        "from vllm_specbeam.adapter import patches, vllm_versions\n"
        "cuda = torch.cuda.is_available()\n"
        "on = lambda t: t.platform is None or getattr(current_platform, f'is_{t.platform}')()\n"
        "targets = [t for t in patches.TARGETS if on(t)]\n"
        "print(json.dumps({'vllm': vllm.__version__, 'release': vllm_versions.installed().minor,\n"
        "  'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "  'device': torch.cuda.get_device_name(0) if cuda else 'cpu',\n"
        "  'memory_gib': round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,\n"
        "  'platform': type(current_platform).__name__, 'problems': patches.check(targets)}))\n"
    )
    found = json.loads(run(clock, [str(s.python), "-c", code]).strip().splitlines()[-1])
    if found["problems"]:
        raise StageError(f"the plugin's start-up check failed: {found['problems']}")
    if not s.dry_run and found["device"] == "cpu":
        raise StageError("torch sees no CUDA device: rerun the preflight stage, which names the fix")
    return ", ".join(f"{k} {v}" for k, v in found.items() if k != "problems") + "; every target found"


def stage_kernels(s: Settings, clock: Clock) -> str:
    interpret = "1" if s.dry_run else "0"
    device = "cpu" if s.dry_run else "cuda"
    check = f"import test_tree_attention as t; assert t.DEVICE == {device!r}, t.DEVICE"
    env = {"TRITON_INTERPRET": interpret, "PYTHONPATH": str(ROOT / "tests" / "kernels")}
    run(clock, [str(s.python), "-c", check], env=env)
    tail = run(clock, [str(s.python), "-m", "pytest", *KERNEL_TESTS, "-q", "-p", "no:cacheprovider"], env=env)
    where = "Triton interpreter (dry run)" if s.dry_run else "compiled for the GPU"
    return f"{where}: {tail.strip().splitlines()[-1]}"


def stage_models(s: Settings, clock: Clock) -> str:
    if s.dry_run:
        code = (
            "import sys; sys.path.insert(0, 'tests')\n"
            "from pathlib import Path; from tiny_model import build_tiny_model\n"
            f"print(build_tiny_model(Path({str(s.out / 'tiny-target')!r})))\n"
            f"print(build_tiny_model(Path({str(s.out / 'tiny-draft')!r}), seed=1))\n"
        )
        s.model, s.draft = run(clock, [str(s.python), "-c", code]).strip().splitlines()[-2:]
    else:
        fetch = [str(s.python), "benchmarks/models.py", "fetch", "qwen-coder-1.5b", "qwen-coder-0.5b"]
        s.model, s.draft = run(clock, fetch).strip().splitlines()[-2:]
    return f"target {s.model}, draft {s.draft}"


def stage_greedy(s: Settings, clock: Clock, pass_: str) -> str:
    results = s.out / f"greedy-{pass_}.jsonl"
    results.unlink(missing_ok=True)
    settings = s.out / "settings.json"
    settings.write_text(json.dumps(_plain(s)))
    worker = ["--worker", "greedy", "--pass", pass_, "--settings", str(settings), "--result", str(results)]
    try:
        run(clock, [str(s.python), __file__, *worker])
    except StageError as error:
        lines, _ = greedy_summary(read_records(results), s.near_tie)
        raise StageError(f"{error}. Finished before it: {'; '.join(lines) or 'no engine'}") from None
    lines, clear = greedy_summary(read_records(results), s.near_tie)
    if clear:
        raise StageError("divergences at a clear margin: " + "; ".join(clear))
    return "; ".join(lines)


def greedy_summary(records: list[dict[str, Any]], near_tie: float) -> tuple[list[str], list[str]]:
    """A line per engine the worker finished, and the divergences at a clear margin (a margin at
    least ``near_tie``): what a stopped worker wrote still reads."""
    margins = {(p, i): m for r in records for p, i, m in r.get("margins", [])}
    lines, clear = [], []
    for r in records:
        if "margins" in r:
            lines.append(f"float32 margins: {len(r['margins'])} scored ({r['seconds']:.0f} s)")
            if r["probe"]:
                p, i = r["probe"]
                lines.append(f"margin self-test: prompt {p} token {i}: {margins[(p, i)]:.3f}")
            continue
        if r["diverged"] is None:
            lines.append(f"{r['engine']}: the reference ({r['seconds']:.0f} s)")
            continue
        found = [(p, i) for p, i in r["diverged"]]
        line = f"{r['engine']}: identical {r['prompts'] - len(found)}/{r['prompts']} ({r['seconds']:.0f} s)"
        if found:
            scored = [margins[c] for c in found if c in margins]
            worst = f"max float32 margin {max(scored):.3f}" if scored else "margins not scored"
            line += f", {len(found)} diverged ({worst})"
        lines.append(line)
        clear += [
            f"{r['engine']} prompt {p} token {i} (margin {margins[(p, i)]:.3f})"
            for p, i in found
            if margins.get((p, i), 0.0) >= near_tie
        ]
    return lines, clear


def stage_compare(s: Settings, clock: Clock) -> str:
    out = s.out / "compare"
    shutil.rmtree(out, ignore_errors=True)
    prompts = ["--prompts", "humaneval"]
    if s.dry_run:
        words = s.out / "tiny-prompts.jsonl"
        words.write_text(
            "".join(
                json.dumps({"prompt": " ".join(f"w{(7 * i + j) % 100}" for j in range(12))}) + "\n" for i in range(16)
            )
        )
        prompts = ["--prompts", str(words)]
    command = [
        str(s.python), "benchmarks/compare.py", "--model", s.model, "--draft", s.draft, *prompts,
        "--num-prompts", str(s.compare_prompts), "--max-tokens", str(s.compare_max_tokens),
        "--batch-sizes", "1", "16", "--temperatures", "0", "--repeats", "1", "--sweep", "none",
        "--dtype", s.dtype, "--max-model-len", str(s.engine["max_model_len"]),
        "--methods", "none", "lookup_tree", "aded", "mcsd", "dsbd", "beam_search", "dsbd-beam", "draft_model", "ngram",
        "suffix",
        "--out", str(out),
    ]  # fmt: skip
    if not s.compiled:
        command.append("--enforce-eager")
    try:
        run(clock, command)
    except StageError as error:
        raise StageError(f"{error}. Engines finished before it: {', '.join(finished_engines(out)) or 'none'}") from None
    table = out / "table.md"
    if not table.exists():
        raise StageError(f"compare.py wrote no {table}")
    s.tables.append(table.read_text())
    divergences = json.loads((out / "result.json").read_text())["clear_margin_divergences"]
    signals = [d for d in divergences if not d["expected"]]
    mode = "compiled" if s.compiled else "eager"
    return (
        f"{len(finished_engines(out))} {mode} engines finished; clear-margin divergences of a lossless method "
        f"(bug signals, in compare/result.json): {len(signals)}; compare.py's table below ({table.relative_to(s.out)})"
    )


def finished_engines(out: Path) -> list[str]:
    """The engines of a compare.py run that finished: each worker leaves its result as it ends."""
    return sorted(path.name.removesuffix(".result.json") for path in (out / "logs").glob("*.result.json"))


def stage_serve(s: Settings, clock: Clock) -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = {"method": "lookup_tree", "num_speculative_tokens": 4, "max_nodes": 16}
    # the CPU build's `vllm` command cannot start (vllm_specbeam/adapter/cli.py): the plugin's, there
    serve = [str(s.python), "-m", "vllm_specbeam.adapter.cli"] if s.dry_run else [str(s.venv / "bin" / "vllm")]
    command = [
        *serve, "serve", s.model, "--port", str(port), "--dtype", s.dtype,
        "--max-model-len", str(s.engine["max_model_len"]), "--max-num-seqs", str(s.engine["max_num_seqs"]),
        "--speculative-config", json.dumps(spec),
    ]  # fmt: skip
    if not s.compiled:
        command.append("--enforce-eager")
    if s.dry_run:
        command += ["--kv-cache-memory-bytes", str(s.engine["kv_cache_memory_bytes"])]
    else:
        command += ["--gpu-memory-utilization", str(s.engine["gpu_memory_utilization"])]
    with clock.log.open("a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        server = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        answers = _ask(s, clock, server, f"http://127.0.0.1:{port}")
    finally:
        stop_group(server)
    mode = "compiled" if s.compiled else "eager"
    return f"vllm serve ({mode}) with lookup_tree answered {len(answers)} requests (3 completions, 1 chat)"


def _ask(s: Settings, clock: Clock, server: subprocess.Popen, base: str) -> list[dict[str, Any]]:
    """A few completions and a chat from the server, once it is ready."""
    while not _get(base + "/health"):
        if server.poll() is not None:
            raise StageError(f"vllm serve exited {server.returncode} before it was ready; see {clock.log.name}")
        if not clock.left():
            raise clock.over("`vllm serve` (not ready)")
        time.sleep(2)
    answers = []
    for prompt in PROMPTS[:3] if not s.dry_run else ["w1 w2 w3 w1 w2 w3", "w5 w6 w7 w5 w6", "w9 w8 w9 w8"]:
        body = {"model": s.model, "prompt": prompt, "max_tokens": s.max_tokens, "temperature": 0}
        answers.append(_post(base + "/v1/completions", body, clock)["choices"][0])
    chat = {"model": s.model, "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 8}
    answers.append(_post(base + "/v1/chat/completions", chat, clock)["choices"][0])
    if not all(a.get("finish_reason") in ("length", "stop") for a in answers):
        raise StageError(f"unexpected answers: {answers}")
    return answers


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _post(url: str, body: dict, clock: Clock) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=max(clock.left(), 1.0)) as response:
        return json.loads(response.read())


@dataclass(frozen=True)
class Stage:
    """One step of the check and its time budgets, in seconds: on a GPU (estimated: no GPU run
    yet) and in the dry run (at least twice its measured time: the module's table)."""

    name: str
    body: Callable[[Settings, Clock], str]
    gpu_s: float
    dry_s: float
    #: the greedy stage's pass; it runs only where ``--passes`` names it
    pass_: str = ""

    @property
    def option(self) -> str:
        """Its ``--stages`` name: the greedy passes share one."""
        return self.name.removesuffix(f"-{self.pass_}")


STAGES = [
    Stage("preflight", stage_preflight, 120, 60),
    Stage("install", stage_install, 2400, 60),
    Stage("environment", stage_environment, 300, 120),
    Stage("kernels", stage_kernels, 900, 300),
    Stage("models", stage_models, 1200, 60),
    Stage("greedy-eager", functools.partial(stage_greedy, pass_="eager"), 1200, 1200, "eager"),
    Stage("greedy-compiled", functools.partial(stage_greedy, pass_="compiled"), 2400, 1500, "compiled"),
    Stage("compare", stage_compare, 3000, 1800),
    Stage("serve", stage_serve, 900, 300),
]


# ---------------------------------------------------------------- the greedy worker (inside the venv)
def greedy_methods(draft: str) -> dict[str, dict]:
    """The greedy stage's engines besides the reference: every plugin method and vLLM's two."""
    with_draft = {"model": draft}
    return {
        "lookup_tree": {"method": "lookup_tree"},
        "aded": {"method": "aded"},
        "mcsd": {"method": "mcsd", **with_draft},
        "dsbd": {"method": "dsbd", **with_draft},
        "mjsd (block)": {"method": "mjsd", "verify": "block", **with_draft},
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, **with_draft},
    }


def greedy_worker(s: Settings, pass_: str, result: Path) -> None:
    """Every method's greedy outputs against no speculation's, one engine after the other, each
    engine's outcome appended to ``result`` as it finishes; then the float32 margins at the
    divergences (``greedy_summary`` reads them)."""
    from vllm import LLM, SamplingParams

    prompts = PROMPTS[: s.num_prompts]
    if s.dry_run:
        prompts = [" ".join(f"w{(5 * i + j) % 100}" for j in range(10)) for i in range(s.num_prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=s.max_tokens, ignore_eos=True)
    engine = {**s.engine, "enforce_eager": pass_ == "eager"}

    def outputs(spec: dict | None) -> list[list[int]]:
        llm = LLM(model=s.model, speculative_config=spec, dtype=s.dtype, seed=0, **engine)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        finally:
            llm.llm_engine.engine_core.shutdown()

    began = time.monotonic()
    reference = outputs(None)
    append_record(result, {"engine": "none", "diverged": None, "seconds": time.monotonic() - began})
    found: set[tuple[int, int]] = set()
    for name, spec in greedy_methods(s.draft).items():
        began = time.monotonic()
        diverged = first_divergences(outputs(spec), reference)
        found |= set(diverged)
        seconds = time.monotonic() - began
        append_record(result, {"engine": name, "prompts": len(prompts), "diverged": diverged, "seconds": seconds})
    # the dry run's float32 outputs never diverge: it scores one margin anyway, so this code runs there too
    probe = (0, s.max_tokens // 2) if s.dry_run else None
    began = time.monotonic()
    margins = _margins(s, prompts, reference, found | ({probe} if probe else set()))
    scored = [[p, i, m] for (p, i), m in sorted(margins.items())]
    append_record(result, {"margins": scored, "probe": probe, "seconds": time.monotonic() - began})


def first_divergences(ours: list[list[int]], reference: list[list[int]]) -> list[tuple[int, int]]:
    """(prompt, token index) where each output first leaves the reference's."""
    return [
        (p, next(i for i, (a, b) in enumerate(zip(o, r)) if a != b))
        for p, (o, r) in enumerate(zip(ours, reference))
        if o != r
    ]


def _margins(
    s: Settings, prompts: list[str], reference: list[list[int]], at: set[tuple[int, int]]
) -> dict[tuple[int, int], float]:
    """The float32 target's top-2 logit margin (= logprob gap) before reference token ``i`` of prompt
    ``p``, from an eager engine: a compiled start would only add minutes."""
    if not at:
        return {}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=s.model, dtype="float32", seed=0, **{**s.engine, "enforce_eager": True})
    try:
        tokenizer = llm.get_tokenizer()
        keys = sorted(at)
        inputs = [TokensPrompt(prompt_token_ids=tokenizer.encode(prompts[p]) + reference[p][:i]) for p, i in keys]
        scored = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False)
        margins = {}
        for key, output in zip(keys, scored):
            top = sorted((lp.logprob for lp in output.outputs[0].logprobs[0].values()), reverse=True)
            margins[key] = top[0] - top[1]
        return margins
    finally:
        llm.llm_engine.engine_core.shutdown()


def _plain(s: Settings) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(s).items()}


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="the same stages on this CPU: tiny model and settings"
    )
    parser.add_argument(
        "--venv", default=None, help="the venv to install into and run (default .venv-gpu; dry run .venv)"
    )
    parser.add_argument("--out", default=str(ROOT / "results" / "gpu-check"))
    parser.add_argument(
        "--stages",
        nargs="+",
        choices=list(dict.fromkeys(stage.option for stage in STAGES)),
        default=None,
        help="run only these stages (a rerun; models runs too where a later stage needs it)",
    )
    parser.add_argument(
        "--passes",
        nargs="+",
        choices=PASSES,
        default=list(PASSES),
        help="the greedy stage's passes, eager first: eager engines (no torch.compile, no CUDA graphs) "
        "answer correctness sooner; compare and serve run compiled unless only eager is named",
    )
    parser.add_argument(
        "--budget-scale", type=float, default=1.0, help="multiplies every stage's time budget (a slower machine)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pass", dest="pass_", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def selected(args: argparse.Namespace, settings: Settings) -> list[Stage]:
    """The stages to run: those asked for (and models where a later stage needs it), greedy's passes as given."""
    wanted = set(args.stages or [stage.option for stage in STAGES])
    if wanted & {"greedy", "compare", "serve"}:
        wanted.add("models")
    return [st for st in STAGES if st.option in wanted and (not st.pass_ or st.pass_ in settings.passes)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "greedy":
        raw = json.loads(Path(args.settings).read_text())
        settings = Settings(**{**raw, "out": Path(raw["out"]), "venv": Path(raw["venv"])})
        greedy_worker(settings, args.pass_, Path(args.result))
        return 0
    # `kill` of the check unwinds it, so the running command's process group is stopped too
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    settings = settings_of(args)
    settings.out.mkdir(parents=True, exist_ok=True)
    report = settings.out / "report.md"
    mode = "CPU dry run (tiny model)" if settings.dry_run else "GPU"
    lines = [f"# vllm-specbeam GPU check: {mode}, {time.strftime('%Y-%m-%d %H:%M:%S')}", ""]
    start, failed, budgets = time.monotonic(), None, 0.0
    for stage in selected(args, settings):
        budget = (stage.dry_s if settings.dry_run else stage.gpu_s) * args.budget_scale
        budgets += budget
        clock = Clock(stage.name, settings.out / f"{stage.name}.log", budget)
        clock.log.write_text("")
        print(f"== {stage.name} (budget {budget:.0f} s)", flush=True)
        try:
            said, status = stage.body(settings, clock), "ok"
        except (StageError, OSError, ValueError, KeyError) as error:
            said, status, failed = str(error), "FAILED", stage.name
        lines.append(f"- **{stage.name}** {status} ({time.monotonic() - clock.began:.0f} s of {budget:.0f} s): {said}")
        print(f"   {status}: {said}", flush=True)
        report.write_text("\n".join(lines) + "\n")
        if failed:
            break
    verdict = f"FAILED at stage {failed}" if failed else "all stages passed"
    took = f"{time.monotonic() - start:.0f} s of the stages' {budgets:.0f} s budget"
    lines += ["", f"{verdict} in {took}; logs beside this report.", "", *settings.tables]
    report.write_text("\n".join(lines) + "\n")
    print(f"== {verdict} in {took}; report: {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
