"""``mcsd`` with lookup branches (``"lookup": "global"``, issue #48) inside vLLM.

Greedy output equals vLLM's without speculation; both sources' nodes are verified
and accepted; steps whose lookup branches fill the budget run no draft forward, and
the draft's next logits (its K/V caught up on the tokens committed meanwhile) equal
transformers' on the same tokens, as a draft that ran every step would give.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import greedy, make_prompts, runner_stats, token_ids
from specs import MCSD
from test_controller_engine import _FixedCost, _plant_cost
from test_sampling_engine import ALPHA, prefix_homogeneity, sample_sequences, target_samples
from test_worker_draft import ATOL, _check, _counter, _record

from vllm_specbeam.core.budget import StepCost, StepCostModel

HYBRID = {**MCSD, "lookup": "global", "lookup_depth": 8}


@pytest.fixture(scope="module")
def hybrid(engines, near_draft):
    return engines.get({**HYBRID, "model": near_draft})


def test_greedy_equals_no_speculation(hybrid, prompts, reference) -> None:
    assert_greedy_exact_with_both_sources(hybrid, prompts, reference)


def assert_greedy_exact_with_both_sources(llm, prompts: list[str], reference: list[list[int]]) -> dict[str, int]:
    """Greedy equals the reference batched, then the longest prompts one at a time (their
    answers in the global index by then); both sources drafted and accepted, some steps
    without a draft forward. The runner's counters grown meanwhile."""
    before = runner_stats(llm)
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == reference
    again = [token_ids(llm.generate([p], greedy(), use_tqdm=False))[0] for p in prompts[7:]]
    assert again == reference[7:]
    after = runner_stats(llm)
    grown = {key: after[key] - before[key] for key in before if not isinstance(before[key], list)}  # counters
    assert grown["nodes_lookup"] > 0 and grown["nodes_fill"] > 0, grown
    assert grown["accepted_lookup"] > 0 and grown["accepted_fill"] > 0, grown
    assert grown["nodes_lookup"] + grown["nodes_fill"] == grown["nodes"]
    assert grown["accepted_lookup"] + grown["accepted_fill"] == grown["accepted"]
    assert grown["draft_deferred"] > 0 and grown["steps_without_draft_forward"] > 0, grown
    assert "step_cost_per_row_s" in after  # steps are timed: the lookup branches are cut to what pays
    return grown


def test_sampling_matches_the_target(engines, hybrid, prompts) -> None:
    """test_sampling_engine's per-position statistic against the session's samples without speculation.
    Rows and draft forwards are planted free, so both sources draft however busy the machine is."""
    prompt = prompts[6]
    hybrid.collective_rpc(_plant_free_steps, args=(True,))
    try:
        before = runner_stats(hybrid)
        ours = sample_sequences(hybrid, prompt, 1.0)
        after = runner_stats(hybrid)
    finally:
        hybrid.collective_rpc(_plant_free_steps, args=(False,))
    assert after["accepted_lookup"] > before["accepted_lookup"] and after["accepted_fill"] > before["accepted_fill"]
    assert prefix_homogeneity(ours, target_samples(engines, prompt, 1.0)) > ALPHA


def _plant_free_steps(worker, free: bool) -> None:
    """In the worker: every line planted flat (``free``: rows and draft forwards cost nothing
    over a step), or fitted from the steps again."""
    _plant_cost(worker, 0.01 if free else None)
    runner = worker.model_runner
    runner.draft_forwards.model = _FixedCost(StepCost(0.0, 0.0)) if free else StepCostModel()
    runner.draft_cost = runner.draft_forwards.model.fitted()


def _record_deferrals(worker) -> None:
    """Log the draft runtime's ``defer`` calls among its syncs and extends (after ``_record``)."""
    runtime = worker.model_runner.draft_runtime
    defer = runtime.defer

    def logged(req_ids) -> None:
        req_ids = list(req_ids)
        runtime.calls += [("defer", r, [], None, None) for r in req_ids]
        defer(req_ids)

    runtime.defer = logged


def _check_after_deferrals(worker, draft: str) -> dict:
    """Every sync that follows a step without a draft forward for its request, against
    transformers on the same committed tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    deferred: dict[str, int] = {}
    worst, checked, longest = 0.0, 0, 0
    for kind, req_id, tokens, _, logits in worker.model_runner.draft_runtime.calls:
        if kind == "defer":
            deferred[req_id] = deferred.get(req_id, 0) + 1
            longest = max(longest, deferred[req_id])
        elif kind == "sync" and logits is not None and deferred.pop(req_id, 0):
            with torch.inference_mode():
                reference = model(torch.tensor([tokens])).logits[0, -1]
            worst = max(worst, float((logits - reference).abs().max()))
            checked += 1
        elif kind == "sync":
            deferred.pop(req_id, None)
    return {"worst": worst, "checked": checked, "longest_deferral": longest}


def test_a_step_without_a_draft_forward_leaves_the_draft_caught_up(engines, near_draft) -> None:
    # A fresh engine: an index holding the earlier tests' answers would fill every step to the end.
    engines.stop({**HYBRID, "model": near_draft})
    hybrid = engines.get({**HYBRID, "model": near_draft})
    hybrid.collective_rpc(_record)
    hybrid.collective_rpc(_record_deferrals)
    before = runner_stats(hybrid)
    # new prompts (nothing of them indexed) with repeated phrases: lookup fills some steps, not all
    outputs = token_ids(hybrid.generate(make_prompts(10, seed=3)[4:], greedy(), use_tqdm=False))
    assert all(len(o) == 48 for o in outputs)
    after = runner_stats(hybrid)
    assert after["draft_deferred"] > before["draft_deferred"]
    result = hybrid.collective_rpc(_check_after_deferrals, args=(near_draft,))[0]
    assert result["checked"] > 0 and result["longest_deferral"] >= 1, result
    assert result["worst"] < ATOL, result
    engines.stop({**HYBRID, "model": near_draft})  # this module's engine, logging every draft call


def _draft_runs(worker, runs: bool) -> None:
    """``runs=False``: every step of every request is one whose lookup leaves the draft nothing
    (``split`` caps every fill at 0), so the draft is fed none of their tokens."""
    lookup = worker.model_runner.tree_drafter.lookup
    if not runs:
        split = lookup.split
        lookup.split = lambda *args, **kwargs: [dataclasses.replace(s, fill_nodes=0) for s in split(*args, **kwargs)]
    else:
        del lookup.split  # the class's again


def test_a_prefix_hit_on_blocks_the_draft_never_fed_feeds_the_draft_first(engines, near_draft) -> None:
    """Blocks the target computed while the draft deferred hold no draft K/V: a later request
    hitting them in vLLM's prefix cache trusts only the blocks the draft fed, and its draft
    rows equal transformers' on the same tokens (trusting the whole hit reads unwritten K/V)."""
    spec = {**HYBRID, "model": near_draft}
    engines.stop(spec)
    hybrid = engines.get(spec)
    prompts = make_prompts(10, seed=5)[7:]  # 200, 260 and 300 words: past the first 128-token blocks
    hybrid.collective_rpc(_draft_runs, args=(False,))
    before = runner_stats(hybrid)
    hybrid.generate(prompts, greedy(max_tokens=4), use_tqdm=False)
    assert runner_stats(hybrid)["draft_rows"] == before["draft_rows"]  # not even the prompts
    hybrid.collective_rpc(_draft_runs, args=(True,))
    hybrid.collective_rpc(_record)
    hits = _counter(hybrid, "vllm:prefix_cache_hits")
    hybrid.generate([p + " and some more words" for p in prompts], greedy(max_tokens=16), use_tqdm=False)
    assert _counter(hybrid, "vllm:prefix_cache_hits") - hits >= 3 * 128
    result = hybrid.collective_rpc(_check, args=(near_draft,))[0]
    assert result["counts"]["sync"] >= len(prompts), result
    assert result["worst"]["sync"] < ATOL and result["worst"]["extend"] < ATOL, result
    engines.stop(spec)  # this test's own engine, logging every draft call
