"""Tensor parallelism on the CPU build: ``tensor_parallel_size=2`` with vLLM's
multiprocessing executor gives the greedy output of one process without speculation.

Every rank runs the tree runner on the same scheduler output: each drafts the
same trees (the drafters are deterministic), verifies its shard of heads with
the tree mask, and samples the same tokens from the gathered logits. A
draft-model method loads its draft in every worker, sharded like the target.
The tiny model's 4 query and 2 KV heads split over two ranks. One engine per
method, stopped after its test (three processes each). The matrix: the
lookup drafter with the step budget (its cost line shared across ranks; the
plain lookup_tree case ran the same drafter without it), aded, and a
draft-model method (mcsd).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
from conftest import greedy, read_stats, token_ids
from specs import ADED, LOOKUP_AUTO, MCSD

TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
MAX_TOKENS = 32


@contextlib.contextmanager
def one_core_per_rank() -> Iterator[None]:
    """While an engine starts its workers: vLLM's CPU workers bind OpenMP threads per
    rank, and "auto" wants a NUMA node per rank, so two allowed cores are named (binding
    is skipped on a one-core machine). Only then: a one-rank engine refuses two lists."""
    cores = sorted(os.sched_getaffinity(0))
    previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}|{cores[1]}" if len(cores) >= 2 else "nobind"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = previous


#: counters both ranks must agree on: each verifies the same trees and accepts the same nodes
SAME_ON_EVERY_RANK = ("trees", "nodes", "depth_sum", "accepted", "accepted_off_first_branch", "kv_moves")


def _spec(method: str, near_draft: str) -> dict:
    return {
        "lookup_tree-auto": LOOKUP_AUTO,  # the per-step budget: each rank prunes for itself, from rank 0's cost line
        "aded": ADED,
        "mcsd": {**MCSD, "model": near_draft},
    }[method]


@pytest.mark.parametrize("method", ["lookup_tree-auto", "aded", "mcsd"])
def test_tp2_greedy_equals_one_process_without_speculation(engines, near_draft, prompts, reference, method):
    """The first 6 prompts, 32 tokens (a prefix of the session's greedy reference)."""
    spec = _spec(method, near_draft)
    with one_core_per_rank():
        llm = engines.get(spec, own_process=True, **TP)  # its stop must not touch this process
    try:
        before = llm.collective_rpc(read_stats)
        outputs = token_ids(llm.generate(prompts[:6], greedy(MAX_TOKENS), use_tqdm=False))
        after = llm.collective_rpc(read_stats)
        assert outputs == [r[:MAX_TOKENS] for r in reference[:6]]
        assert len(after) == 2
        rank0, rank1 = ({name: a[name] - b[name] for name in SAME_ON_EVERY_RANK} for a, b in zip(after, before))
        # rank 1's own counters: it verified the same trees and accepted the same drafts as rank 0
        assert rank1 == rank0 and rank1["trees"] > 0 and rank1["accepted"] > 0
        if method == "lookup_tree-auto":  # the budget ran and chose alike on both ranks
            kept = [a["budget_kept"] - b["budget_kept"] for a, b in zip(after, before)]
            assert kept[1] == kept[0] > 0
            assert after[0]["step_cost_per_row_s"] == after[1]["step_cost_per_row_s"]
    finally:
        engines.stop(spec, own_process=True, **TP)  # three processes: not kept for later modules
