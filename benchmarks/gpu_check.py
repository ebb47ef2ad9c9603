"""One command for a fresh CUDA machine: does vllm-specbeam work there?

    python3 benchmarks/gpu_check.py                 # a CUDA machine that reaches the package registry
    python3 benchmarks/gpu_check.py --cpu-dry-run   # the same stages here, tiny model and settings

Stages, in order; the first that fails stops the run, named in the report:

1. ``install``: a venv (``--venv``, default ``.venv-gpu``) with ``.[gpu,test,bench]``
   (vLLM 0.32.x or 0.33.x); the dry run checks the existing ``.venv`` instead.
2. ``environment``: the GPU, torch, CUDA and vLLM versions, and the plugin's
   start-up check of every vLLM symbol it touches on this platform.
3. ``kernels``: tests/kernels' tree-attention and KV-move tests compiled for the
   GPU (``TRITON_INTERPRET=0``, asserted on the device); the dry run interprets them.
4. ``models``: Qwen2.5-Coder-1.5B-Instruct and its 0.5B draft (benchmarks/models.py:
   the hub, else the registry); the dry run builds tests/tiny_model.py's pair.
5. ``greedy``: every plugin method (``mjsd`` in its lossless ``block`` mode) and
   vLLM's ``ngram`` / ``draft_model``, bfloat16, greedy, against no speculation.
   A divergence passes only where the float32 target's top-2 logit margin at
   the first differing token is below ``--near-tie`` (0.5): a near-tie that
   bfloat16 rounding may flip; any other fails the stage.
6. ``compare``: benchmarks/compare.py, batch 1 and 16, greedy, one repeat:
   ``lookup_tree``, ``aded``, ``mcsd``, ``dsbd``, the beam search (vLLM's and the
   speculative ``dsbd-beam``) and vLLM's
   ``draft_model`` / ``ngram`` / ``suffix`` (skipped by compare.py without arctic-inference).
7. ``serve``: one ``vllm serve`` with ``lookup_tree`` and a few completion and chat requests.

One report: ``--out`` (default ``results/gpu-check``)/report.md, each stage's
log beside it. Aimed at under 10 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    engine: dict = field(default_factory=dict)
    #: what the report carries after the stages (compare.py's table)
    tables: list[str] = field(default_factory=list)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def settings_of(args: argparse.Namespace) -> Settings:
    out = Path(args.out).resolve()
    if args.cpu_dry_run:
        return Settings(
            True,
            out,
            Path(args.venv or ROOT / ".venv").resolve(),
            dtype="float32",
            max_tokens=16,
            num_prompts=4,
            compare_max_tokens=16,
            engine={"max_model_len": 512, "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20},
        )
    return Settings(
        False,
        out,
        Path(args.venv or ROOT / ".venv-gpu").resolve(),
        engine={"max_model_len": 2048, "gpu_memory_utilization": 0.35},
    )


# ---------------------------------------------------------------- the stages
def run(
    settings: Settings, log: Path, command: list[str], env: dict[str, str] | None = None, timeout: float = 900
) -> str:
    """Run ``command`` from the repository root, its stderr into ``log``; returns its stdout
    (logged too); raises on failure."""
    with log.open("a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        done = subprocess.run(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=timeout,
        )
        out.write(done.stdout)
    if done.returncode != 0:
        raise StageError(f"`{shlex.join(command)}` exited {done.returncode}; see {log.name}")
    return done.stdout


class StageError(RuntimeError):
    """A stage's failure, said in one line."""


def stage_install(s: Settings, log: Path) -> str:
    if s.dry_run:
        run(s, log, [str(s.python), "-c", "import vllm, vllm_specbeam, pytest"])
        return f"dry run: uses {s.venv} as it is (nothing installed)"
    if not s.python.exists():
        run(s, log, [sys.executable, "-m", "venv", str(s.venv)])
    run(s, log, [str(s.python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    run(s, log, [str(s.python), "-m", "pip", "install", "--quiet", "-e", ".[gpu,test,bench]"], timeout=1800)
    return f"installed .[gpu,test,bench] into {s.venv}"


def stage_environment(s: Settings, log: Path) -> str:
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
    found = json.loads(run(s, log, [str(s.python), "-c", code]).strip().splitlines()[-1])
    if found["problems"]:
        raise StageError(f"the plugin's start-up check failed: {found['problems']}")
    if not s.dry_run and found["device"] == "cpu":
        raise StageError("torch sees no CUDA device")
    return ", ".join(f"{k} {v}" for k, v in found.items() if k != "problems") + "; every target found"


def stage_kernels(s: Settings, log: Path) -> str:
    tests = ["tests/kernels/test_tree_attention.py", "tests/kernels/test_kv_move.py"]
    interpret = "1" if s.dry_run else "0"
    device = "cpu" if s.dry_run else "cuda"
    check = f"import test_tree_attention as t; assert t.DEVICE == {device!r}, t.DEVICE"
    env = {"TRITON_INTERPRET": interpret, "PYTHONPATH": str(ROOT / "tests" / "kernels")}
    run(s, log, [str(s.python), "-c", check], env=env)
    tail = run(s, log, [str(s.python), "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider"], env=env)
    where = "Triton interpreter (dry run)" if s.dry_run else "compiled for the GPU"
    return f"{where}: {tail.strip().splitlines()[-1]}"


def stage_models(s: Settings, log: Path) -> str:
    if s.dry_run:
        code = (
            "import sys; sys.path.insert(0, 'tests')\n"
            "from pathlib import Path; from tiny_model import build_tiny_model\n"
            f"print(build_tiny_model(Path({str(s.out / 'tiny-target')!r})))\n"
            f"print(build_tiny_model(Path({str(s.out / 'tiny-draft')!r}), seed=1))\n"
        )
        s.model, s.draft = run(s, log, [str(s.python), "-c", code]).strip().splitlines()[-2:]
    else:
        fetch = [str(s.python), "benchmarks/models.py", "fetch", "qwen-coder-1.5b", "qwen-coder-0.5b"]
        s.model, s.draft = run(s, log, fetch, timeout=1800).strip().splitlines()[-2:]
    return f"target {s.model}, draft {s.draft}"


def stage_greedy(s: Settings, log: Path) -> str:
    result = s.out / "greedy.json"
    run(
        s,
        log,
        [str(s.python), __file__, "--worker", "greedy", "--settings", json.dumps(_plain(s)), "--result", str(result)],
    )
    report = json.loads(result.read_text())
    lines = [f"{m}: {r}" for m, r in report["methods"].items()]
    if report["clear"]:
        raise StageError("divergences at a clear margin: " + "; ".join(report["clear"]))
    return "; ".join(lines)


def stage_compare(s: Settings, log: Path) -> str:
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
        "--out", str(s.out / "compare"),
    ]  # fmt: skip
    run(s, log, command, timeout=1800)
    table = s.out / "compare" / "table.md"
    if not table.exists():
        raise StageError(f"compare.py wrote no {table}")
    s.tables.append(table.read_text())
    return f"compare.py's table below ({table.relative_to(s.out)})"


def stage_serve(s: Settings, log: Path) -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = {"method": "lookup_tree", "num_speculative_tokens": 4, "max_nodes": 16}
    # the CPU build's `vllm` command cannot start (vllm_specbeam/adapter/cli.py): the plugin's, there
    serve = [str(s.python), "-m", "vllm_specbeam.adapter.cli"] if s.dry_run else [str(s.venv / "bin" / "vllm")]
    command = [
        *serve, "serve", s.model, "--port", str(port), "--dtype", s.dtype,
        "--max-model-len", str(s.engine["max_model_len"]), "--speculative-config", json.dumps(spec),
    ]  # fmt: skip
    if s.dry_run:
        command += ["--enforce-eager", "--kv-cache-memory-bytes", str(s.engine["kv_cache_memory_bytes"])]
    else:
        command += ["--gpu-memory-utilization", str(s.engine["gpu_memory_utilization"])]
    with log.open("a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        server = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _get(base + "/health"):
            if server.poll() is not None:
                raise StageError(f"vllm serve exited {server.returncode} before it was ready; see {log.name}")
            if time.monotonic() > deadline:
                raise StageError("vllm serve was not ready within 600 s")
            time.sleep(2)
        answers = []
        for prompt in PROMPTS[:3] if not s.dry_run else ["w1 w2 w3 w1 w2 w3", "w5 w6 w7 w5 w6", "w9 w8 w9 w8"]:
            body = {"model": s.model, "prompt": prompt, "max_tokens": s.max_tokens, "temperature": 0}
            choice = _post(base + "/v1/completions", body)["choices"][0]
            answers.append(choice)
        chat = {"model": s.model, "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 8}
        answers.append(_post(base + "/v1/chat/completions", chat)["choices"][0])
        if not all(a.get("finish_reason") in ("length", "stop") for a in answers):
            raise StageError(f"unexpected answers: {answers}")
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    return f"vllm serve with lookup_tree answered {len(answers)} requests (3 completions, 1 chat)"


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


STAGES: list[tuple[str, Callable[[Settings, Path], str]]] = [
    ("install", stage_install),
    ("environment", stage_environment),
    ("kernels", stage_kernels),
    ("models", stage_models),
    ("greedy", stage_greedy),
    ("compare", stage_compare),
    ("serve", stage_serve),
]


# ---------------------------------------------------------------- the greedy worker (inside the venv)
def greedy_worker(s: Settings, result: Path) -> None:
    """Every method's greedy outputs against no speculation's, with float32 margins at divergences."""
    from vllm import LLM, SamplingParams

    prompts = PROMPTS[: s.num_prompts]
    if s.dry_run:
        prompts = [" ".join(f"w{(5 * i + j) % 100}" for j in range(10)) for i in range(s.num_prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=s.max_tokens, ignore_eos=True)
    draft = {"model": s.draft}
    methods: dict[str, dict | None] = {
        "none": None,
        "lookup_tree": {"method": "lookup_tree"},
        "aded": {"method": "aded"},
        "mcsd": {"method": "mcsd", **draft},
        "dsbd": {"method": "dsbd", **draft},
        "mjsd (block)": {"method": "mjsd", "verify": "block", **draft},
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, **draft},
    }

    def outputs(spec: dict | None, dtype: str) -> list[list[int]]:
        llm = LLM(model=s.model, speculative_config=spec, dtype=dtype, seed=0, **s.engine)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        finally:
            llm.llm_engine.engine_core.shutdown()

    reference = outputs(None, s.dtype)
    contexts: dict[str, list[tuple[int, int]]] = {}
    summary: dict[str, str] = {}
    for name, spec in list(methods.items())[1:]:
        ours = outputs(spec, s.dtype)
        diverged = [
            (p, next(i for i, (a, b) in enumerate(zip(o, r)) if a != b))
            for p, (o, r) in enumerate(zip(ours, reference))
            if o != r
        ]
        contexts[name] = diverged
        summary[name] = f"identical {len(prompts) - len(diverged)}/{len(prompts)}"
    # the dry run's float32 outputs never diverge: it scores one margin anyway, so this code runs there too
    probe = {(0, s.max_tokens // 2)} if s.dry_run else set()
    margins = _margins(s, prompts, reference, probe | {c for found in contexts.values() for c in found})
    if probe:
        summary["margin self-test"] = f"prompt 0 token {s.max_tokens // 2}: {margins[min(probe)]:.3f}"
    clear = []
    for name, found in contexts.items():
        if found:
            worst = max(margins[c] for c in found)
            summary[name] += f"; {len(found)} diverged (max float32 margin {worst:.3f})"
            clear += [
                f"{name} prompt {p} token {i} (margin {margins[(p, i)]:.3f})"
                for p, i in found
                if margins[(p, i)] >= s.near_tie
            ]
    result.write_text(json.dumps({"methods": summary, "clear": clear}, indent=1))


def _margins(
    s: Settings, prompts: list[str], reference: list[list[int]], at: set[tuple[int, int]]
) -> dict[tuple[int, int], float]:
    """The float32 target's top-2 logit margin (= logprob gap) before reference token ``i`` of prompt ``p``."""
    if not at:
        return {}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=s.model, dtype="float32", seed=0, **s.engine)
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
def main(argv: list[str] | None = None) -> int:
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
        choices=[name for name, _ in STAGES],
        default=None,
        help="run only these stages (a rerun; models runs too where a later stage needs it)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "greedy":
        raw = json.loads(args.settings)
        greedy_worker(Settings(**{**raw, "out": Path(raw["out"]), "venv": Path(raw["venv"])}), Path(args.result))
        return 0

    settings = settings_of(args)
    settings.out.mkdir(parents=True, exist_ok=True)
    report = settings.out / "report.md"
    mode = "CPU dry run (tiny model)" if settings.dry_run else "GPU"
    lines = [f"# vllm-specbeam GPU check: {mode}, {time.strftime('%Y-%m-%d %H:%M:%S')}", ""]
    start, failed = time.monotonic(), None
    wanted = set(args.stages or [name for name, _ in STAGES])
    if wanted & {"greedy", "compare", "serve"}:
        wanted.add("models")
    for name, stage in STAGES:
        if name not in wanted:
            continue
        log = settings.out / f"{name}.log"
        log.write_text("")
        began = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            said, status = stage(settings, log), "ok"
        except (StageError, subprocess.TimeoutExpired, OSError, ValueError) as error:
            said, status, failed = str(error), "FAILED", name
        lines.append(f"- **{name}** {status} ({time.monotonic() - began:.0f} s): {said}")
        print(f"   {status}: {said}", flush=True)
        report.write_text("\n".join(lines) + "\n")
        if failed:
            break
    verdict = f"FAILED at stage {failed}" if failed else "all stages passed"
    lines += ["", f"{verdict} in {time.monotonic() - start:.0f} s; logs beside this report.", "", *settings.tables]
    report.write_text("\n".join(lines) + "\n")
    print(f"== {verdict}; report: {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
