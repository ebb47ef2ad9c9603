"""The cross-request index inside vLLM keeps tenants apart by ``cache_salt`` (issue #60).

A request drafts only from, and feeds only, finished requests with its salt; requests
without one share one partition. Shown, for ``lookup_tree``'s global scope and ``mcsd``'s
global lookup, by the runner's per-source counters (``nodes_from_index``,
``accepted_from_index``: tree nodes that continue other requests' text), with greedy
output equal to vLLM's without speculation throughout. The index's own rules (partitions,
eviction): test_lookup_index.py; a salt sent to the server: test_server.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import MAX_TOKENS, greedy, make_prompts, read_stats, rpc_after_finished, runner_stats, token_ids
from specs import LOOKUP_GLOBAL
from test_hybrid_lookup_engine import HYBRID

#: the runner's counters these tests read
COUNTERS = ("nodes_from_index", "accepted_from_index")
#: requests per wave: the session's shortest prompts, one salt each unless a test says otherwise
WAVE = 4


@pytest.fixture(scope="module", params=["lookup_tree", "mcsd"])
def llm(request, engines, near_draft):
    """An engine with a cross-request index partitioned by salt (the default), emptied."""
    llm = engines.get(LOOKUP_GLOBAL if request.param == "lookup_tree" else {**HYBRID, "model": near_draft})
    llm.collective_rpc("specbeam_forget_finished")
    return llm


@dataclass(frozen=True)
class Wave:
    """Greedy outputs of one ``generate`` call, and how much the runner's counters grew."""

    outputs: list[list[int]]
    grown: dict[str, int]


def wave(llm, prompts: list[str], salts: list[str | None], max_tokens: int = MAX_TOKENS) -> Wave:
    """``prompts`` in one call, each with its salt (``None``: unsalted), as vLLM takes it offline."""
    before = runner_stats(llm)
    inputs = [
        prompt if salt is None else {"prompt": prompt, "cache_salt": salt} for prompt, salt in zip(prompts, salts)
    ]
    outputs = token_ids(llm.generate(inputs, greedy(max_tokens), use_tqdm=False))
    after = runner_stats(llm)
    return Wave(outputs, {key: after[key] - before[key] for key in COUNTERS})


def test_another_salt_drafts_nothing_from_a_salts_text(llm, prompts, reference) -> None:
    """Tenant A's requests, then tenant B's with identical text: A's text is indexed (a partition
    per salt), B drafts none of it, and B's output is vLLM's without speculation."""
    a = wave(llm, prompts[:WAVE], [f"tenant-a{k}" for k in range(WAVE)])
    assert a.outputs == reference[:WAVE]
    partitions = rpc_after_finished(llm, read_stats)["index_partitions"]
    assert partitions >= WAVE
    b = wave(llm, prompts[:WAVE], [f"tenant-b{k}" for k in range(WAVE)])
    assert b.outputs == reference[:WAVE]
    assert b.grown["nodes_from_index"] == b.grown["accepted_from_index"] == 0, b.grown
    assert rpc_after_finished(llm, read_stats)["index_partitions"] == partitions + WAVE  # B's text, apart


def test_the_same_salt_drafts_from_its_earlier_requests(llm, prompts, reference) -> None:
    """The same prompts under the same salts again, in one batch: three quarters of the repeat's
    tokens are drafted from the first wave's outputs (at most 41 of 48 can be, at depth 8: each step
    commits one token of the target's own), and the output is unchanged."""
    salts = [f"tenant-s{k}" for k in range(WAVE)]
    wave(llm, prompts[:WAVE], salts)
    again = wave(llm, prompts[:WAVE], salts)
    assert again.outputs == reference[:WAVE]
    assert again.grown["accepted_from_index"] >= 3 * WAVE * MAX_TOKENS // 4, again.grown


def test_requests_without_a_salt_share_one_partition(llm, prompts, reference) -> None:
    """Unsalted requests draft from each other as before salts; a salted request reads none of them."""
    wave(llm, prompts[:WAVE], [None] * WAVE)
    again = wave(llm, prompts[:WAVE], [None] * WAVE)
    assert again.outputs == reference[:WAVE]
    assert again.grown["accepted_from_index"] >= 3 * WAVE * MAX_TOKENS // 4, again.grown
    salted = wave(llm, prompts[:WAVE], [f"tenant-u{k}" for k in range(WAVE)])
    assert salted.outputs == reference[:WAVE] and salted.grown["nodes_from_index"] == 0, salted.grown


def test_a_mixed_load_of_salts_stays_within_index_tokens(engines) -> None:
    """Ten prompts (about 1,400 tokens with their answers) under three salts and none, into an
    index of 1,000 tokens: the runner's stats show the partitions held, their tokens (all of
    them: at most four partitions) within the cap, and the evictions it took."""
    from vllm_specbeam.adapter.tree_counts import STATE_BYTES

    spec = {**LOOKUP_GLOBAL, "index_tokens": 1000}
    llm = engines.get(spec)
    prompts = make_prompts(10, seed=11)
    wave(llm, prompts, [[None, "a", "b", "c"][k % 4] for k in range(len(prompts))], max_tokens=16)
    stats = rpc_after_finished(llm, read_stats)
    assert 1 < stats["index_partitions"] == len(stats["index_largest_partition_tokens"]) <= 4, stats
    held = sum(stats["index_largest_partition_tokens"])
    assert held <= 1000 and stats["index_evicted_sequences"] > 0, stats
    # 8 bytes a token and a separator, 12 an occurrence (a third more while evicted ones wait)
    assert 20 * held < stats[STATE_BYTES] <= 8 * (1000 + len(prompts)) + 16 * 1000
    engines.stop(spec)
