"""Serving benchmark: the OpenAI-compatible server with each method, under a load ramp.

For every method the offline comparison would run (no speculation, ``ngram``,
``draft_model`` with ``--draft``, every available plugin method; at their
default settings), starts ``vllm-specbeam serve MODEL --speculative-config
'{...}'`` on 127.0.0.1 (the plugin's command: the CPU build's ``vllm`` command
fails at start-up), then sends streamed ``/v1/completions`` requests at each
``--concurrency`` level in turn (the ramp; a level may repeat one before it, as the
last ``1`` below: back to one request at a time after the load) and measures output
throughput, time to first token (TTFT) and inter-token latency (ITL: gaps between
streamed chunks; a chunk carries several tokens when drafts are accepted, so TPOT,
(latency - TTFT) / (tokens - 1), is reported as well). Every level sends the same
requests (``--num-requests``, at least the highest concurrency: request ``i`` the
``i``-th prompt, cycled), so the levels compare; each level is bounded by
``--time-limit``. Before each level (the first after a warm-up request) the server gets a
fresh start over HTTP (dev mode on for every server): vLLM's prefix cache is emptied
(``/reset_prefix_cache``; a failure stops that server's ramp) and a plugin server's drafter
forgets the requests it has seen (``/collective_rpc`` ``specbeam_forget_finished``), so no
level reuses an earlier level's KV blocks or drafts from its identical answers. vLLM's
``suffix`` keeps what earlier levels taught it (no ``/collective_rpc`` method empties its
cache), so its later levels are favoured; ``serve.md`` says so under the ratio table.
Spec-decode counters come from the server's ``/metrics``, a plugin server's runner counters
from ``specbeam_stats`` after the ramp.

    python benchmarks/serve_bench.py                                   # SmolLM2-135M, concurrency 1 4 16
    python benchmarks/serve_bench.py --concurrency 1 2 4 8 16 1 --methods none ngram suffix lookup_tree aded
    python benchmarks/serve_bench.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct \\
        --draft Qwen/Qwen2.5-Coder-0.5B-Instruct --methods none draft_model mcsd --concurrency 1 2 4 8 16 1

(``python -m benchmarks.serve_bench`` from the repository runs the same.)
Outputs ``OUT/serve.json``, ``OUT/serve.md`` (every level of every server; each
method's throughput over no speculation's at the same level; the plugin servers'
runner counters), ``OUT/serve-ramp.png`` (throughput per level, one line per server)
and ``OUT/logs/serve-<method>.log``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the package from the repository
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import asyncio
import json
import math
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from benchmarks import models, plots, report, tables
from benchmarks.figures import ratio
from benchmarks.host import add_dtype_option, choose_dtype, environment
from benchmarks.plan import PlanOptions, plan
from benchmarks.processes import add_intel_openmp_option, set_engine_environment
from benchmarks.prompts import BUILTIN, load_prompts
from benchmarks.serve_client import KEEPS_MEMORY, SERVE_COLUMNS, bench_server, requests_per_level

if TYPE_CHECKING:
    from benchmarks.host import DtypeChoice
    from benchmarks.plan import EngineSpec, MethodStatus

RAMP_PNG = "serve-ramp.png"
#: the server every other is divided by, level for level
BASELINE = "none"


@dataclass(frozen=True)
class Level:
    """One step of the ramp. Its position, not its concurrency, is its identity: the ramp
    may come back to a concurrency (``1 2 4 8 16 1``), and "1 after the load" must not be
    compared with, or overwritten by, the first 1."""

    index: int
    concurrency: int

    @property
    def key(self) -> str:
        """Its column title in ``serve.md`` and key in ``serve.json``: ``L5 c=1``."""
        return f"L{self.index} c={self.concurrency}"


def ramp(concurrency: Sequence[int]) -> list[Level]:
    """The levels of ``--concurrency``, in the order they run."""
    return [Level(index, c) for index, c in enumerate(concurrency)]


@dataclass(frozen=True)
class StatColumn:
    """A runner counter (``specbeam_stats`` key) shown per plugin server, times ``scale``."""

    key: str
    title: str
    digits: int = 0
    scale: float = 1.0


#: What the plugin's runner says about the ramp; a key the runner does not report shows as a dash
#: (``steps_off``, ``steps_probed``, ``draft_cost_per_row_s``: the controller's, not in every version).
STAT_COLUMNS = (
    StatColumn("trees", "trees"),
    StatColumn("accepted", "accepted"),
    StatColumn("steps_off", "steps off"),
    StatColumn("steps_probed", "steps probed"),
    StatColumn("draft_cost_per_row_s", "draft cost/row µs", 1, 1e6),
    StatColumn("step_cost_per_row_s", "step cost/row µs", 1, 1e6),
)


@dataclass
class ServerRun:
    """One server's ramp, as ``serve.json`` keeps it: ``levels`` are
    :func:`~benchmarks.serve_client.load_level`'s figures with their ``level`` (position);
    ``plugin_stats`` the runner's counters after the ramp, warm-up included (plugin servers
    that answered; None otherwise)."""

    method: str
    kind: str
    speculative_config: dict[str, Any] | None
    status: str = "ok"
    reason: str | None = None
    start_s: float | None = None
    peak_rss_mib: float | None = None
    levels: list[dict[str, Any]] = field(default_factory=list)
    plugin_stats: dict[str, Any] | None = None

    def throughput(self, index: int) -> float | None:
        """Output tokens/s at the level in position ``index`` (None: that level did not run)."""
        return next((row["output_tokens_per_s"] for row in self.levels if row["level"] == index), None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_engine_environment(args.intel_openmp)
    from tqdm import tqdm

    model, draft = models.resolve_option(args.model), models.resolve_option(args.draft)
    assert model is not None
    dtype = choose_dtype(args.dtype)
    status, engines = serving_engines(args.methods, draft)
    prompts = [p.text for p in load_prompts(args.prompts, args.num_prompts)]
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    runs: dict[str, ServerRun] = {}
    for engine in tqdm(engines, desc="servers", unit="server"):
        runs[engine.id] = run = run_server(engine, model, prompts, args, dtype, out / "logs")
        if run.status != "ok":
            status[engine.method].status, status[engine.method].reason = run.status, run.reason
            tqdm.write(f"server {engine.id} failed: {run.reason}")
    levels = ramp(args.concurrency)
    add_speedups(runs)
    relative = relative_throughput(runs, levels)
    result = {
        "schema_version": report.SCHEMA_VERSION,
        "config": {**vars(args), "engine_dtype": dtype.engine, "dtype_fallback": dtype.fallback},
        "environment": environment(model, draft),
        "methods": {name: vars(s) for name, s in status.items()},
        "ramp": ramp_json(levels, relative, requests_per_level(args)),
        "servers": {name: asdict(run) for name, run in runs.items()},
    }
    (out / "serve.json").write_text(json.dumps(result, indent=1))  # first: a failing plot must not lose it
    text = ramp_markdown(runs, levels, relative)
    (out / "serve.md").write_text(text)
    plot_ramp(runs, levels, out / RAMP_PNG, f"{model}: {requests_per_level(args)} requests per level")
    print(text + "".join(f"- {name}: {s.status}: {s.reason}\n" for name, s in status.items() if s.status != "ok"))
    print(f"wrote {out / 'serve.json'}, {out / 'serve.md'}, {out / RAMP_PNG}")
    return 0


def serving_engines(methods: Sequence[str], draft: str | None) -> tuple[dict[str, MethodStatus], list[EngineSpec]]:
    """The offline comparison's engines at their defaults, without beam search (the server's
    beam search is not a speculative method), the baseline first: a late failure keeps it."""
    try:
        status, engines = plan(PlanOptions(methods=tuple(methods), sweep="none", draft=draft))
    except ValueError as error:  # bad --methods: the CLI's message, not a traceback
        raise SystemExit(str(error)) from None
    engines = [e for e in engines if e.kind != "beam"]
    status.pop("beam_search", None)
    engines.sort(key=lambda e: e.kind != "baseline")
    return status, engines


def run_server(
    engine: EngineSpec, model: str, prompts: list[str], args: argparse.Namespace, dtype: DtypeChoice, logs: Path
) -> ServerRun:
    """``engine``'s server through the ramp; a failed one (reason kept) must not lose the others' numbers."""
    log = logs / f"serve-{engine.id}.log"
    run = ServerRun(engine.method, engine.kind, engine.speculative_config)
    try:
        figures = asyncio.run(bench_server(engine, model, prompts, args, dtype, log))
    except Exception as error:
        run.status, run.reason = "failed", f"{type(error).__name__}: {error} (see {log})"
        return run
    run.start_s, run.peak_rss_mib = figures["start_s"], figures["peak_rss_mib"]
    run.levels, run.plugin_stats = figures["levels"], figures["plugin_stats"]
    return run


# ------------------------------------------------------------------ the report
def speedup(runs: Mapping[str, ServerRun], name: str, index: int) -> float | None:
    """``name``'s output tokens/s at the level in position ``index`` over :data:`BASELINE`'s at
    the same position (never at the same concurrency: a ramp may repeat one); None where
    either did not run it."""
    baseline = runs.get(BASELINE)
    return ratio(runs[name].throughput(index), baseline.throughput(index) if baseline else None)


def relative_throughput(runs: Mapping[str, ServerRun], levels: Sequence[Level]) -> dict[str, list[float | None]]:
    """Each server but :data:`BASELINE`: its :func:`speedup` at every level, in ramp order."""
    return {name: [speedup(runs, name, level.index) for level in levels] for name in runs if name != BASELINE}


def add_speedups(runs: Mapping[str, ServerRun]) -> None:
    """Each level's ``speedup`` (:func:`speedup`), for ``serve.json`` and the per-level table."""
    for name, run in runs.items():
        for row in run.levels:
            row["speedup"] = speedup(runs, name, row["level"])


def ramp_json(levels: Sequence[Level], relative: Mapping[str, list[float | None]], requests: int) -> dict[str, Any]:
    """``serve.json``'s ``ramp``: the levels in order and each server's throughput ratios, keyed by level."""
    return {
        "levels": [{"level": level.index, "concurrency": level.concurrency, "key": level.key} for level in levels],
        "requests_per_level": requests,
        "throughput_vs_none": {
            name: {level.key: value for level, value in zip(levels, ratios)} for name, ratios in relative.items()
        },
    }


def ratio_table(relative: Mapping[str, list[float | None]], levels: Sequence[Level]) -> str:
    """One row per server, one column per level: output tokens/s over no speculation's."""
    rows = [
        {"method": name, **{level.key: value for level, value in zip(levels, ratios)}}
        for name, ratios in relative.items()
    ]
    columns = [("method", "method", 0), *((level.key, level.key, 2) for level in levels)]
    return tables.markdown_table(rows, columns)


def memory_footnote(runs: Mapping[str, ServerRun]) -> str:
    """A line under the ratio table for each server whose cross-request memory the fresh start
    before each level could not empty (:data:`~benchmarks.serve_client.KEEPS_MEMORY`): its later
    levels draft from the earlier levels' identical answers, so they are favoured."""
    kept = [name for name, run in runs.items() if run.method in KEEPS_MEMORY]
    return "".join(
        f"\n*`{name}`: its cache of responses is not emptied between levels (no HTTP route reaches it), "
        "so it drafts from the earlier levels' identical answers and its later levels are favoured.*\n"
        for name in kept
    )


def stats_table(runs: Mapping[str, ServerRun]) -> str:
    """One row per plugin server: :data:`STAT_COLUMNS` of its runner (a dash where it has none);
    empty without a plugin server."""
    rows = []
    for name, run in runs.items():
        if run.kind != "plugin":
            continue
        stats = run.plugin_stats or {}
        values = {c.title: stats[c.key] * c.scale if stats.get(c.key) is not None else None for c in STAT_COLUMNS}
        rows.append({"method": name, **values})
    columns = [("method", "method", 0), *((c.title, c.title, c.digits) for c in STAT_COLUMNS)]
    return tables.markdown_table(rows, columns) if rows else ""


def ramp_markdown(
    runs: Mapping[str, ServerRun], levels: Sequence[Level], relative: Mapping[str, list[float | None]]
) -> str:
    """``serve.md``: every server's levels (their speedups: :func:`add_speedups`), the ratio
    table (with :func:`memory_footnote`), the plugin servers' runner counters."""
    rows = [row for run in runs.values() for row in run.levels]
    rows.sort(key=lambda r: (r["level"], r["method"] != BASELINE, r["method"]))
    parts = [
        "Each level (`level`: its position in the ramp; a concurrency may come back), each after a fresh "
        "start (prefix cache emptied; a plugin drafter's cross-request memory too):\n\n"
        + tables.markdown_table(rows, SERVE_COLUMNS),
        f"Output tokens/s over `{BASELINE}`'s at the same level (`L<position> c=<concurrency>`):\n\n"
        + ratio_table(relative, levels)
        + memory_footnote(runs),
    ]
    counters = stats_table(runs)
    if counters:
        parts.append("Plugin runner counters after the ramp (warm-up included; a dash: not reported):\n\n" + counters)
    parts.append(f"![output tokens/s per level]({RAMP_PNG})\n")
    return "\n".join(parts)


def plot_ramp(runs: Mapping[str, ServerRun], levels: Sequence[Level], path: Path, title: str) -> None:
    """Output tokens/s per level, one line per server. The x axis is the level's position,
    labelled by its concurrency, so a concurrency that comes back is a point of its own."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 0.8 * len(levels)), 4.5))
    positions = [level.index for level in levels]
    for name, run in runs.items():
        if not run.levels:
            continue
        values = [run.throughput(i) for i in positions]
        style = {"color": "black", "ls": "--"} if name == BASELINE else {}
        ax.plot(positions, [math.nan if v is None else v for v in values], marker="o", label=name, **style)
    ax.set_xticks(positions, [str(level.concurrency) for level in levels])
    ax.set_xlabel("concurrency (levels in the order they ran)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="target: path or hub name (default %(default)s)")
    parser.add_argument("--draft", default=None, help="draft model for draft_model and plugin methods that need one")
    parser.add_argument("--methods", nargs="+", default=["all"], help="as in compare.py; 'none' always runs")
    parser.add_argument("--prompts", default="humaneval", help=f"{' | '.join(BUILTIN)} | path to JSONL with 'prompt'")
    parser.add_argument("--num-prompts", type=int, default=16, help="distinct prompts, cycled over the requests")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 16], help="the ramp's levels in order; may repeat"
    )
    parser.add_argument(
        "--num-requests", type=int, default=16, help="requests per level (at least the highest concurrency)"
    )
    parser.add_argument(
        "--time-limit", type=float, default=120.0, help="seconds per level after which no request starts"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    add_dtype_option(parser)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=f"results/serve-{time.strftime('%Y%m%d-%H%M%S')}")
    add_intel_openmp_option(parser)
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1:
        parser.error("--concurrency: every level needs at least 1 request in flight")
    return args


if __name__ == "__main__":
    sys.exit(main())
