"""``lookup_tree`` inside vLLM: greedy output equals vLLM without speculation.

These run real engines on a tiny random model (see ``tiny_model.py``) and
compare token ids, batched and one request at a time.
"""

from __future__ import annotations

import itertools

import pytest
from conftest import greedy, runner_stats, token_ids
from specs import ADED, LOOKUP


def metric(llm, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


@pytest.fixture(scope="module")
def lookup_with_metrics(engines, reference):
    """The ``LOOKUP`` engine, started anew: ``LLM.get_metrics`` reads the process's
    Prometheus registry, which holds the newest engine's metrics only (each engine
    unregisters the earlier ones: vLLM 0.32.0 v1/metrics/loggers.py,
    ``unregister_vllm_metrics``). The metric tests start no engine in between."""
    engines.stop(LOOKUP)
    return engines.get(LOOKUP)


def _set_kv_move(worker, enabled: bool) -> None:
    worker.model_runner.move_accepted_kv = enabled


def test_batched_greedy_equals_no_speculation(engines, prompts, reference):
    llm = engines.get(LOOKUP)
    before = runner_stats(llm)
    assert token_ids(llm.generate(prompts, greedy())) == reference
    after = runner_stats(llm)
    # The tree path was really taken: trees verified, drafts accepted, and some
    # accepted node was not the first child of its parent.
    assert after["trees"] > before["trees"]
    assert after["accepted"] > before["accepted"]
    assert after["accepted_off_first_branch"] > before["accepted_off_first_branch"]
    assert after["kv_moves"] > before["kv_moves"]


def test_one_at_a_time_greedy_equals_no_speculation(lookup_with_metrics, prompts, reference):
    """Also with prefix caching at work: the prompts run once in a batch first (whatever
    ran before this test), so every one-at-a-time request finds its prompt's blocks cached."""
    llm = lookup_with_metrics
    llm.generate(prompts, greedy(), use_tqdm=False)
    hits = metric(llm, "vllm:prefix_cache_hits")
    for prompt, expected in zip(prompts, reference):
        assert token_ids(llm.generate([prompt], greedy(), use_tqdm=False)) == [expected]
    assert metric(llm, "vllm:prefix_cache_hits") > hits


def test_kv_move_is_needed(engines, prompts, reference):
    """With the accepted path left where it was verified, later steps attend
    to the wrong keys and the output changes: the move is exercised."""
    llm = engines.get(LOOKUP)
    llm.collective_rpc(_set_kv_move, args=(False,))
    try:
        broken = token_ids(llm.generate(prompts, greedy()))
    finally:
        llm.collective_rpc(_set_kv_move, args=(True,))
    assert broken != reference
    assert token_ids(llm.generate(prompts, greedy())) == reference


def test_spec_decode_metrics_count_trees(lookup_with_metrics, prompts):
    llm = lookup_with_metrics

    def totals() -> dict[str, object]:
        return {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}

    before_stats, before = runner_stats(llm), totals()
    llm.generate(prompts, greedy())
    after_stats, after = runner_stats(llm), totals()

    def delta(name: str):
        return after[name] - before[name]

    assert delta("vllm:spec_decode_num_drafts") == after_stats["trees"] - before_stats["trees"]
    assert delta("vllm:spec_decode_num_draft_tokens") == after_stats["nodes"] - before_stats["nodes"]
    assert delta("vllm:spec_decode_num_accepted_tokens") == after_stats["accepted"] - before_stats["accepted"]
    per_depth = [
        a - b
        for a, b in zip(
            after["vllm:spec_decode_num_accepted_tokens_per_pos"],
            before["vllm:spec_decode_num_accepted_tokens_per_pos"],
        )
    ]
    # Position i counts paths that reached depth i + 1: non-increasing, summing to the total.
    assert sum(per_depth) == delta("vllm:spec_decode_num_accepted_tokens")
    assert all(a >= b for a, b in itertools.pairwise(per_depth))
    assert per_depth[LOOKUP["num_speculative_tokens"] :] == [0] * (len(per_depth) - LOOKUP["num_speculative_tokens"])


def test_per_request_override_and_bad_value(engines, prompts, reference):
    llm = engines.get(LOOKUP)
    shallow = greedy(extra_args={"num_speculative_tokens": 2, "max_nodes": 4})
    assert token_ids(llm.generate(prompts[:4], shallow)) == reference[:4]
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="max_nodes=64 exceeds the engine's max_nodes=12"):
        llm.generate(prompts[:1], greedy(extra_args={"max_nodes": 64}))
    with pytest.raises(VLLMValidationError, match="option 'prompt_lookup_min' must be an int"):
        llm.generate(prompts[:1], greedy(extra_args={"prompt_lookup_min": "2"}))
    # The engine survived the bad requests.
    assert token_ids(llm.generate(prompts[:2], greedy())) == reference[:2]


def test_aded_greedy_equals_no_speculation(engines, prompts, reference):
    """The draft-model-free tri-gram + MCTS drafter (no corpus) is exact too."""
    llm = engines.get(ADED)
    before = runner_stats(llm)
    assert token_ids(llm.generate(prompts, greedy())) == reference
    after = runner_stats(llm)
    assert after["accepted"] > before["accepted"]


def dsbd_spec(draft: str, **options: object) -> dict[str, object]:
    return {"method": "dsbd", "model": draft, "num_speculative_tokens": 3, "max_nodes": 12, **options}


def test_dsbd_width_one_greedy_equals_no_speculation(engines, near_draft, prompts, reference):
    """Greedy DSBD is beam decoding; with one beam it is greedy decoding, exactly."""
    llm = engines.get(dsbd_spec(near_draft, min_width=1, max_width=1))
    assert token_ids(llm.generate(prompts, greedy())) == reference
    stats = runner_stats(llm)
    assert stats["trees"] > 0
    # one beam per accepted depth, and the depths are the accepted tokens
    assert stats["beam_width_sum"] == stats["beam_depths"] == stats["accepted"] > 0


def test_dsbd_pruned_to_the_best_pair_is_greedy_and_drafts_deeper(engines, tiny_draft, prompts, reference):
    """``prune_ratio: 1`` keeps only each depth's best pair: a chain at ``max_width`` 4, so greedy
    decoding exactly, and as deep as ``num_speculative_tokens`` where unpruned depths of 4 pairs
    would spend ``max_nodes`` in 3."""
    llm = engines.get(dsbd_spec(tiny_draft, num_speculative_tokens=6, max_width=4, prune_ratio=1.0))
    assert token_ids(llm.generate(prompts, greedy())) == reference
    stats = runner_stats(llm)
    assert stats["trees"] > 0 and stats["nodes"] == stats["depth_sum"]  # chains: one node per depth
    assert stats["depth_sum"] > 3 * stats["trees"]
