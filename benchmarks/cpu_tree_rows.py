"""The CPU cost of a branching tree's off-branch rows: one layer's ``recompute_tree_rows``.

On vLLM's CPU build a tree's first branch is verified by vLLM's causal attention, and
the rows off it are recomputed with the tree mask in every layer
(vllm_specbeam/adapter/attention/cpu.py): what the step budget's branched line pays
over the chains' line. This times one layer's recompute on a bfloat16 cache written
through vLLM's own cache op, at a model's attention shapes (default SmolLM2-135M's:
9 query heads, 3 kv heads, head 64), for a 16-node tree with 10 off-branch rows per
request (the median the engine recomputes on the main job); the median of ``--reps``
calls, the cases in turns so a drift reaches all alike.

    python benchmarks/cpu_tree_rows.py

Run it on two checkouts to compare implementations (the engines preload Intel
OpenMP: ``LD_PRELOAD=.venv/lib/libiomp5.so`` times it as they run).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the package from the repository
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import math
import statistics
import time
from types import SimpleNamespace

import torch

from vllm_specbeam.adapter.attention.cpu import TreeStep, recompute_tree_rows
from vllm_specbeam.core.tree import ROOT, DraftTree

#: a chain of 6 with branches of 3 at the root and at nodes 1, 2 and one of 2 at node 0:
#: the 10 rows of those branches are off the first branch
TREE = DraftTree(tokens=[0] * 16, parents=[ROOT, 0, 1, 2, 3, 4, ROOT, 6, 7, 1, 9, 10, 2, 12, 0, 14])


def one_case(args: argparse.Namespace, context: int, requests: int) -> tuple[TreeStep, dict]:
    """A step of ``requests`` trees after ``context`` cached tokens each, and the call's arguments."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = torch.bfloat16
    per_request = -(-(context + TREE.num_nodes + 1) // args.block_size)
    cache = torch.randn(requests * per_request + 1, args.kv_heads, args.block_size, 2 * args.head_size).to(dtype)
    block_table = 1 + torch.arange(requests * per_request).view(requests, per_request)
    rows = TREE.num_nodes + 1
    step = TreeStep.build(list(range(requests)), [r * rows for r in range(requests)], [context] * requests,
                          [TREE] * requests)  # fmt: skip
    call = dict(
        impl=SimpleNamespace(scale=1 / math.sqrt(args.head_size), num_heads=args.heads, head_size=args.head_size),
        layer=SimpleNamespace(isa=_get_attn_isa(dtype, args.block_size, args.head_size)),
        query=torch.randn(requests * rows, args.heads, args.head_size).to(dtype),
        kv_cache=cache,
        block_table=block_table,
        output=torch.zeros(requests * rows, args.heads * args.head_size, dtype=dtype),
    )
    return step, call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's CPU block size (128)")
    parser.add_argument("--cases", nargs="+", default=["150x1", "1000x1", "150x4", "150x8"], help="CONTEXTxREQUESTS")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = [tuple(int(n) for n in case.split("x")) for case in args.cases]
    built = [one_case(args, context, requests) for context, requests in cases]
    times: list[list[float]] = [[] for _ in cases]
    for rep in range(args.reps + 20):  # 20 warm-up turns
        for (step, call), timings in zip(built, times):
            start = time.perf_counter()
            recompute_tree_rows(step=step, **call)
            if rep >= 20:
                timings.append(time.perf_counter() - start)
    print(f"| context | requests | ms a layer (median of {args.reps}) |\n|---|---|---|")
    for (context, requests), timings in zip(cases, times):
        print(f"| {context} | {requests} | {1e3 * statistics.median(timings):.3f} |")


if __name__ == "__main__":
    main()
