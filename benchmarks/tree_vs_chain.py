"""Target step time against what it verifies: a tree against a chain, or rows.

``--mode shapes`` (the default): a tree of N draft nodes against a chain of
N tokens. Both shapes put N + 1 rows per request through the target; the
tree also pays for the plugin's topology-aware attention and KV bookkeeping.

``--mode rows``: one pass's cost against the rows R it computes (R in 1, 8,
16, 32, 64 by default), batch 1, over a cached context of about 256 tokens.
The request drafts R - 1 nodes a step (R = 1: none, through the same runner);
a pass costs the time of a generation of ``--max-tokens`` tokens less that of a
short one (the prefill and the engine's overheads cancel), per pass between
them. The ratio to 1 row is the
shape the ``"max_nodes": "auto"`` step budget fits (``core/budget.py``): flat
while the matrix units have room, then rising past a knee. One engine serves
every R (a request's ``draft_nodes``), so each R sees the same compiled model.

To time the verification step alone, a benchmark-only drafter proposes drafts
of a fixed shape made of tokens the target will not pick, so every step
commits exactly one token and ``steps = generated tokens`` (``rows`` mode
counts its passes, and records the accepted nodes and the rows each pass
verified, to check).

    python benchmarks/tree_vs_chain.py --model ~/.cache/specbeam-models/qwen-coder-0.5b --out results/tree_vs_chain.json
    python benchmarks/tree_vs_chain.py --mode rows --model "$(python benchmarks/models.py path qwen-coder-1.5b)" \\
        --out results/pass_vs_rows.json

``--dtype`` is vLLM's: ``auto`` (vLLM's default) is the checkpoint's dtype,
a float32 one downcast to the platform's preferred (bfloat16 on CPU); the JSON
records the dtype vLLM resolved. Each configuration runs in this process one
after another (engines started in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
repeated; medians and ratios are what to read, absolute times on a shared CPU
are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from vllm_specbeam.core.config import METHODS, Method, Option
from vllm_specbeam.core.drafter import DraftRequest, TreeDrafter
from vllm_specbeam.core.tree import ROOT, DraftTree

if TYPE_CHECKING:
    from vllm import LLM

DEFAULT_MODEL = os.path.expanduser("~/.cache/specbeam-models/qwen-coder-0.5b")  # Qwen/Qwen2.5-Coder-0.5B-Instruct
#: approximate prompt tokens per mode
DEFAULT_CONTEXT = {"shapes": 512, "rows": 256}


class ShapeDrafter(TreeDrafter):
    """Drafts a chain, or a tree as wide as it is deep, of ``max_nodes`` nodes
    (or a request's ``draft_nodes``); every token is the same rarely chosen
    id, so nothing is accepted."""

    OPTIONS: ClassVar[dict] = {
        "draft_nodes": Option(-1, "nodes to draft, at most max_nodes (-1: max_nodes; 0: none)", -1, 128),
    }

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        trees = []
        for request in requests:
            # the request's options: the engine caps the depth near max_tokens
            depth, most, wanted = (request.options[k] for k in ("num_speculative_tokens", "max_nodes", "draft_nodes"))
            trees.append(self.shape(most if wanted < 0 else min(wanted, most), depth))
        return trees

    @staticmethod
    def shape(nodes: int, depth: int) -> DraftTree:
        """``depth`` = nodes gives a chain; otherwise chains of ``depth`` below the root."""
        if nodes == 0:
            return DraftTree.empty()
        parents = [ROOT if i % depth == 0 else i - 1 for i in range(nodes)]
        tokens = np.arange(nodes) + 17  # distinct siblings, never the argmax in practice
        return DraftTree(tokens, np.asarray(parents))


def start_engine(model: str, spec: dict | None, dtype: str) -> LLM:
    from vllm import LLM

    return LLM(
        model=model,
        dtype=dtype,
        max_model_len=2048,
        speculative_config=spec,
        seed=0,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
    )


def resolved_dtype(llm: LLM) -> str:
    """The dtype vLLM runs the target in (``auto`` resolved), e.g. ``bfloat16``."""
    return str(llm.model_config.dtype).removeprefix("torch.")


def stop_engine(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


def step_seconds(llm: LLM, prompts: list[str], max_tokens: int, repeats: int) -> list[float]:
    """Seconds a step, prefill included, over ``repeats`` generations of ``max_tokens``."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps = max(len(o.outputs[0].token_ids) for o in outputs)
        times.append(elapsed / steps)
    return times


def pass_seconds(llm: LLM, prompt: str, draft_nodes: int, tokens: tuple[int, int], repeats: int) -> list[float]:
    """Seconds of one decode pass of a request drafting ``draft_nodes`` nodes a
    step: a generation of ``tokens[1]`` tokens less one of ``tokens[0]``, per
    pass between them. Both pay the prefill, the engine's per-call overhead and
    the last step (which drafts nothing) alike, so the difference is full
    passes only; their count is the trees verified (an accepted node would
    save a pass), or the tokens when nothing is drafted."""
    from vllm import SamplingParams

    def generation(count: int) -> tuple[float, int]:
        params = SamplingParams(
            temperature=0.0, max_tokens=count, ignore_eos=True, extra_args={"draft_nodes": draft_nodes}
        )
        trees = llm.collective_rpc("specbeam_stats")[0]["trees"]
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        passes = llm.collective_rpc("specbeam_stats")[0]["trees"] - trees if draft_nodes else count
        return seconds, passes

    short, long = tokens
    generation(long)  # warm-up
    times = []
    for _ in range(repeats):
        (long_s, long_passes), (short_s, short_passes) = generation(long), generation(short)
        times.append((long_s - short_s) / (long_passes - short_passes))
    return times


def shapes(args: argparse.Namespace, prompt: str) -> dict[str, Any]:
    """Chain against tree per node count, each configuration its own engine."""
    prompts = [prompt] * args.batch
    results: dict[str, Any] = {"batch": args.batch, "rows": []}

    def median_step(spec: dict | None) -> float:
        llm = start_engine(args.model, spec, args.dtype)
        results["dtype"] = resolved_dtype(llm)
        times = step_seconds(llm, prompts, args.max_tokens, args.repeats)
        stop_engine(llm)
        return statistics.median(times)

    baseline = median_step(None)
    results["no_speculation_step_s"] = baseline
    for nodes in args.nodes:
        row: dict[str, Any] = {"nodes": nodes}
        for name, depth in (("chain", nodes), ("tree", min(args.tree_depth, nodes))):
            spec = {"method": "bench_shape", "num_speculative_tokens": depth, "max_nodes": nodes}
            row[f"{name}_step_s"] = median_step(spec)
        row["tree_over_chain"] = row["tree_step_s"] / row["chain_step_s"]
        row["chain_over_no_spec"] = row["chain_step_s"] / baseline
        results["rows"].append(row)
        print(json.dumps(row))
    print("| nodes | chain / no spec | tree / chain |\n|---|---|---|")
    for row in results["rows"]:
        print(f"| {row['nodes']} | {row['chain_over_no_spec']:.2f} | {row['tree_over_chain']:.2f} |")
    return results


def rows(args: argparse.Namespace, prompt: str) -> dict[str, Any]:
    """A pass's seconds against its rows, batch 1, one engine for every row count."""
    most = max(args.rows) - 1
    depth = min(args.tree_depth, most)
    spec = {"method": "bench_shape", "num_speculative_tokens": depth, "max_nodes": most}
    llm = start_engine(args.model, spec, args.dtype)
    tokens = (depth + 1, args.max_tokens)  # the shorter generation still ends as the longer one does
    results: dict[str, Any] = {"batch": 1, "dtype": resolved_dtype(llm), "tree_depth": depth, "tokens": tokens}
    measured = []
    for count in args.rows:
        before = llm.collective_rpc("specbeam_stats")[0]
        times = pass_seconds(llm, prompt, count - 1, tokens, args.repeats)
        after = llm.collective_rpc("specbeam_stats")[0]
        trees, nodes, accepted = (after[key] - before[key] for key in ("trees", "nodes", "accepted"))
        # to check: the rows each pass verified, and the nodes accepted (their passes were saved)
        verified = {"verified_rows": 1 + nodes / max(trees, 1), "accepted": accepted}
        measured.append({"rows": count, "pass_s": statistics.median(times), "pass_s_all": times, **verified})
    stop_engine(llm)
    one_row = next((m["pass_s"] for m in measured if m["rows"] == 1), measured[0]["pass_s"])
    for row in measured:
        row["ratio_to_1_row"] = row["pass_s"] / one_row
        print(json.dumps({key: value for key, value in row.items() if key != "pass_s_all"}))
    print(f"dtype {results['dtype']}\n| rows | pass ms | / 1 row |\n|---|---|---|")
    for row in measured:
        print(f"| {row['rows']} | {1e3 * row['pass_s']:.2f} | {row['ratio_to_1_row']:.2f} |")
    results["rows"] = measured
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("shapes", "rows"), default="shapes", help="what to time (default: shapes)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto", help="vLLM's: auto (the default: the checkpoint's), bfloat16, ...")
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 16], help="shapes: draft nodes (4 8 16)")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64], help="rows: a pass's rows (1 8 16 32 64)"
    )
    parser.add_argument("--tree-depth", type=int, default=2, help="depth of each branch of the tree shape (2)")
    parser.add_argument("--batch", type=int, default=1, help="shapes: requests (1; rows: always 1)")
    parser.add_argument("--context", type=int, help="prompt tokens, approximately (shapes: 512, rows: 256)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens a generation (24)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/tree_vs_chain.json"))
    args = parser.parse_args()
    if args.mode == "rows" and not (min(args.rows) >= 1 and 2 <= max(args.rows) <= 129):
        parser.error("--mode rows: rows in 1..129, at least one above 1")
    if args.mode == "rows" and args.max_tokens <= args.tree_depth + 1:
        parser.error("--mode rows: --max-tokens must exceed --tree-depth + 1")

    METHODS["bench_shape"] = Method("__main__:ShapeDrafter")
    context = args.context or DEFAULT_CONTEXT[args.mode]
    prompt = " ".join(["def f(x): return x + 1"] * (context // 8))
    results = {
        "mode": args.mode,
        "model": args.model,
        "dtype_requested": args.dtype,
        "context_tokens_approx": context,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        **(shapes if args.mode == "shapes" else rows)(args, prompt),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    main()
