"""Serving benchmark: the OpenAI-compatible server with each method.

For every method the offline comparison would run (no speculation, ``ngram``,
``draft_model`` with ``--draft``, every available plugin method; at their
default settings), starts ``vllm-specbeam serve MODEL --speculative-config
'{...}'`` on 127.0.0.1 (the plugin's command: the CPU build's ``vllm`` command
fails at start-up), then sends streamed ``/v1/completions`` requests at each
concurrency level and measures output throughput, time to first token (TTFT)
and inter-token latency (ITL: gaps between streamed chunks; a chunk carries
several tokens when drafts are accepted, so TPOT, (latency - TTFT) / (tokens
- 1), is reported as well). Spec-decode counters come from the server's
``/metrics``. Each level is bounded by ``--num-requests`` and ``--time-limit``.

    python benchmarks/serve_bench.py                                   # SmolLM2-135M, concurrency 1 4 16
    python benchmarks/serve_bench.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct \\
        --draft Qwen/Qwen2.5-Coder-0.5B-Instruct --methods none draft_model

(``python -m benchmarks.serve_bench`` from the repository runs the same.)
Outputs ``OUT/serve.json``, ``OUT/serve.md`` and ``OUT/logs/serve-<method>.log``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the package from the repository
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import asyncio
import json
import time
from typing import Any

from benchmarks import models, report
from benchmarks.host import add_dtype_option, choose_dtype, environment
from benchmarks.plan import PlanOptions, plan
from benchmarks.processes import add_intel_openmp_option, set_engine_environment
from benchmarks.prompts import BUILTIN, load_prompts
from benchmarks.serve_client import SERVE_COLUMNS, bench_server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_engine_environment(args.intel_openmp)
    from tqdm import tqdm

    model, draft = models.resolve_option(args.model), models.resolve_option(args.draft)
    assert model is not None
    dtype = choose_dtype(args.dtype)
    status, engines = plan(PlanOptions(methods=tuple(args.methods), sweep="none", draft=draft))  # at their defaults
    engines = [e for e in engines if e.kind != "beam"]  # the server's beam search is not a speculative method
    status.pop("beam_search", None)
    engines.sort(key=lambda e: e.kind != "baseline")  # baseline first: later servers are compared with it
    prompts = [p.text for p in load_prompts(args.prompts, args.num_prompts)]
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    servers: dict[str, Any] = {}
    for engine in tqdm(engines, desc="servers", unit="server"):
        log = out / "logs" / f"serve-{engine.id}.log"
        try:
            servers[engine.id] = {
                "method": engine.method,
                "speculative_config": engine.speculative_config,
                "status": "ok",
                **asyncio.run(bench_server(engine, model, prompts, args, dtype, log)),
            }
        except Exception as error:  # one failing server must not lose the others' numbers
            reason = f"{type(error).__name__}: {error} (see {log})"
            servers[engine.id] = {
                "method": engine.method,
                "speculative_config": engine.speculative_config,
                "status": "failed",
                "reason": reason,
                "levels": [],
            }
            status[engine.method].status, status[engine.method].reason = "failed", reason
            tqdm.write(f"server {engine.id} failed: {reason}")
    baseline = {
        level["concurrency"]: level["output_tokens_per_s"] for level in servers.get("none", {}).get("levels", [])
    }
    rows = [level for server in servers.values() for level in server["levels"]]
    for row in rows:
        row["speedup"] = report.ratio(row["output_tokens_per_s"], baseline.get(row["concurrency"]))
    rows.sort(key=lambda r: (r["concurrency"], r["method"] != "none", r["method"]))
    result = {
        "schema_version": report.SCHEMA_VERSION,
        "config": {**vars(args), "engine_dtype": dtype.engine, "dtype_fallback": dtype.fallback},
        "environment": environment(model, draft),
        "methods": {name: vars(s) for name, s in status.items()},
        "servers": servers,
    }
    table = report.markdown_table(rows, SERVE_COLUMNS)
    (out / "serve.json").write_text(json.dumps(result, indent=1))
    (out / "serve.md").write_text(table)
    print(table)
    for name, s in status.items():
        if s.status != "ok":
            print(f"- {name}: {s.status}: {s.reason}")
    print(f"wrote {out / 'serve.json'}, {out / 'serve.md'}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="target: path or hub name (default %(default)s)")
    parser.add_argument("--draft", default=None, help="draft model for draft_model and plugin methods that need one")
    parser.add_argument("--methods", nargs="+", default=["all"], help="as in compare.py; 'none' always runs")
    parser.add_argument("--prompts", default="humaneval", help=f"{' | '.join(BUILTIN)} | path to JSONL with 'prompt'")
    parser.add_argument("--num-prompts", type=int, default=16, help="distinct prompts, cycled over the requests")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--num-requests", type=int, default=16, help="requests per concurrency level (at least the level)"
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
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
