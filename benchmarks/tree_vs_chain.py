"""Target step time: a tree of N draft nodes against a chain of N tokens.

Both shapes put N + 1 rows per request through the target; the tree also
pays for the plugin's topology-aware attention and KV bookkeeping. To time
the verification step alone, a benchmark-only drafter proposes drafts of a
fixed shape made of tokens the target will not pick, so every step commits
exactly one token and ``steps = generated tokens``.

    python benchmarks/tree_vs_chain.py --model ~/.cache/specbeam-models/qwen-coder-0.5b --out results/tree_vs_chain.json

Each configuration runs in this process one after another (engines started
in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), repeated; medians and
ratios are what to read, absolute times on a shared CPU are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import ClassVar

import numpy as np

from vllm_specbeam.core.config import METHODS, Method
from vllm_specbeam.core.drafter import DraftRequest, TreeDrafter
from vllm_specbeam.core.tree import ROOT, DraftTree

DEFAULT_MODEL = os.path.expanduser("~/.cache/specbeam-models/qwen-coder-0.5b")  # Qwen/Qwen2.5-Coder-0.5B-Instruct


class ShapeDrafter(TreeDrafter):
    """Drafts a chain, or a tree as wide as it is deep, of ``max_nodes`` nodes;
    every token is the same rarely chosen id, so nothing is accepted."""

    OPTIONS: ClassVar[dict] = {}

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self.shape(self.options["max_nodes"], self.options["num_speculative_tokens"]) for _ in requests]

    @staticmethod
    def shape(nodes: int, depth: int) -> DraftTree:
        """``depth`` = nodes gives a chain; otherwise chains of ``depth`` below the root."""
        parents = [ROOT if i % depth == 0 else i - 1 for i in range(nodes)]
        tokens = np.arange(nodes) + 17  # distinct siblings, never the argmax in practice
        return DraftTree(tokens, np.asarray(parents))


def step_seconds(model: str, spec: dict | None, prompts: list[str], max_tokens: int, repeats: int) -> list[float]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=2048,
        speculative_config=spec,
        seed=0,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps = max(len(o.outputs[0].token_ids) for o in outputs)
        times.append(elapsed / steps)
    llm.llm_engine.engine_core.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--tree-depth", type=int, default=2, help="depth of each branch of the tree shape")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512, help="prompt length in tokens (approximately)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/tree_vs_chain.json"))
    args = parser.parse_args()

    METHODS["bench_shape"] = Method("__main__:ShapeDrafter")
    prompt = " ".join(["def f(x): return x + 1"] * (args.context // 8))
    prompts = [prompt] * args.batch
    results = {
        "model": args.model,
        "batch": args.batch,
        "context_tokens_approx": args.context,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "rows": [],
    }
    baseline = statistics.median(step_seconds(args.model, None, prompts, args.max_tokens, args.repeats))
    results["no_speculation_step_s"] = baseline
    for nodes in args.nodes:
        row = {"nodes": nodes}
        for name, depth in (("chain", nodes), ("tree", min(args.tree_depth, nodes))):
            spec = {"method": "bench_shape", "num_speculative_tokens": depth, "max_nodes": nodes}
            row[f"{name}_step_s"] = statistics.median(
                step_seconds(args.model, spec, prompts, args.max_tokens, args.repeats)
            )
        row["tree_over_chain"] = row["tree_step_s"] / row["chain_step_s"]
        row["chain_over_no_spec"] = row["chain_step_s"] / baseline
        results["rows"].append(row)
        print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print("| nodes | chain / no spec | tree / chain |\n|---|---|---|")
    for row in results["rows"]:
        print(f"| {row['nodes']} | {row['chain_over_no_spec']:.2f} | {row['tree_over_chain']:.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    main()
