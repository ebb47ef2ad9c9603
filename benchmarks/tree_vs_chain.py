"""Target step time against what it verifies: a tree against a chain.

A tree of N draft nodes against a chain of N tokens. Both shapes put N + 1
rows per request through the target; the tree also pays for the plugin's
topology-aware attention and KV bookkeeping. (A pass's cost against its rows
alone: benchmarks/row_cost.py.)

To time the verification step alone, a benchmark-only drafter proposes drafts
of a fixed shape made of tokens the target will not pick, so every step
commits exactly one token and ``steps = generated tokens``.

    python benchmarks/tree_vs_chain.py --model ~/.cache/specbeam-models/qwen-coder-0.5b --out results/tree_vs_chain.json

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto", help="vLLM's: auto (the default: the checkpoint's), bfloat16, ...")
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 16], help="shapes: draft nodes (4 8 16)")
    parser.add_argument("--tree-depth", type=int, default=2, help="depth of each branch of the tree shape (2)")
    parser.add_argument("--batch", type=int, default=1, help="requests (1)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens, approximately (512)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens a generation (24)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/tree_vs_chain.json"))
    args = parser.parse_args()

    METHODS["bench_shape"] = Method("__main__:ShapeDrafter")
    prompt = " ".join(["def f(x): return x + 1"] * (args.context // 8))
    results = {
        "model": args.model,
        "dtype_requested": args.dtype,
        "context_tokens_approx": args.context,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        **shapes(args, prompt),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    main()
