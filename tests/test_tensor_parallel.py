"""Tensor parallelism on the CPU build: ``tensor_parallel_size=2`` with vLLM's
multiprocessing executor gives the greedy output of one process without speculation.

Every rank runs the tree runner on the same scheduler output: each drafts the
same trees (the drafters are deterministic), verifies its shard of heads with
the tree mask, and samples the same tokens from the gathered logits. A
draft-model method loads its draft in every worker, sharded like the target.
The tiny model's 4 query and 2 KV heads split over two ranks. One engine per
method, stopped after its test (three processes each).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
from conftest import make_prompts
from test_lookup_tree_engine import LOOKUP, greedy, runner_stats, token_ids

ADED = {"method": "aded", "num_speculative_tokens": 3, "max_nodes": 12, "iterations": 40}
MCSD = {"method": "mcsd", "num_speculative_tokens": 4, "max_nodes": 14, "k_config": [2, 2]}
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


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return make_prompts(6)


@pytest.fixture(scope="module")
def reference(engines, prompts) -> list[list[int]]:
    """One process, no speculation."""
    return token_ids(engines.get(None).generate(prompts, greedy(MAX_TOKENS), use_tqdm=False))


#: the per-step budget (the default): each rank prunes for itself, from rank 0's cost line
LOOKUP_AUTO = {"method": "lookup_tree", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def _spec(method: str, near_draft: str) -> dict:
    return {
        "lookup_tree": LOOKUP,
        "lookup_tree-auto": LOOKUP_AUTO,
        "aded": ADED,
        "mcsd": {**MCSD, "model": near_draft},
    }[method]


@pytest.mark.parametrize("method", ["lookup_tree", "lookup_tree-auto", "aded", "mcsd"])
def test_tp2_greedy_equals_one_process_without_speculation(engines, near_draft, prompts, reference, method):
    with one_core_per_rank():
        llm = engines.get(_spec(method, near_draft), **TP)
    try:
        assert token_ids(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)) == reference
        stats = llm.collective_rpc(_read_stats)
        assert len(stats) == 2
        # both ranks verified the same trees and accepted the same drafts
        assert stats[0]["trees"] == stats[1]["trees"] > 0
        assert stats[0]["accepted"] == stats[1]["accepted"] > 0
        assert runner_stats(llm)["accepted"] == stats[0]["accepted"]
        if method == "lookup_tree-auto":  # the budget ran and chose alike on both ranks
            assert stats[0]["budget_kept"] == stats[1]["budget_kept"] > 0
            assert stats[0]["step_cost_per_row_s"] == stats[1]["step_cost_per_row_s"]
    finally:
        engines.close()  # the reference's tokens are kept by its fixture


def _read_stats(worker) -> dict[str, int]:
    return dict(worker.model_runner.tree_stats)
