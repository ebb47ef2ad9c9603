"""Trees in real batches: chunked prefill next to tree decodes, preemption
under KV-cache pressure, and aborted requests (prefix-cache hits are checked
in ``test_lookup_tree_engine.py``).

One engine with a small KV cache (six 128-token blocks for ten requests of
up to 400 tokens) and at most 64 tokens a step, so long prompts are
prefilled in chunks beside other requests' tree steps and requests get
preempted and resumed. ``aded`` (tri-gram overlays, and the per-step node budget's
acceptance counts: it runs with ``"max_nodes": "auto"``) and ``dsbd``
(draft-model KV caches) keep per-request state, which must be freed whatever
way a request leaves; ``dsbd`` at width 1 is greedy-exact, so both are checked
for exact output too.
"""

from __future__ import annotations

import pytest
from conftest import greedy, make_prompts, rpc_after_finished, runner_stats, token_ids
from specs import ADED_AUTO

from vllm_specbeam.core.controller import LONGEST_REST

TIGHT = {
    "kv_cache_memory_bytes": 6 * 128 * 1024,
    "max_model_len": 512,
    "max_num_batched_tokens": 64,
    "enable_prefix_caching": True,
}
MAX_TOKENS = 96


def _kv_usage(llm) -> float:
    """The scheduler's share of KV blocks in use (freed prefix-cache blocks count as free)."""
    return next(m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc")


def _live_state(worker) -> dict[str, int]:
    runner = worker.model_runner
    budget = 0 if runner.budget is None else len(runner.budget.requests)
    return {"proposed": len(runner._proposed), "drafter": runner.tree_drafter.live_requests, "budget": budget}


@pytest.fixture(scope="module", params=["aded", "dsbd"])
def tight(request, engines, near_draft):
    if request.param == "aded":
        return engines.get(ADED_AUTO, **TIGHT)
    # The same six blocks: each holds the draft's K/V too (same shape as the target's), in vLLM's cache.
    return engines.get(
        {"method": "dsbd", "model": near_draft, "num_speculative_tokens": 3, "max_nodes": 12, "max_width": 1},
        **{**TIGHT, "kv_cache_memory_bytes": 2 * TIGHT["kv_cache_memory_bytes"]},
    )


def test_preemption_and_chunked_prefill_keep_greedy_exact(engines, tight):
    prompts = make_prompts(10)
    reference = token_ids(engines.get(None).generate(prompts, greedy(MAX_TOKENS)))
    before = runner_stats(tight)
    assert token_ids(tight.generate(prompts, greedy(MAX_TOKENS))) == reference
    assert runner_stats(tight)["preempted"] > before["preempted"]
    assert runner_stats(tight)["accepted"] > before["accepted"]
    assert rpc_after_finished(tight, _live_state) == {"proposed": 0, "drafter": 0, "budget": 0}
    assert _kv_usage(tight) == 0.0  # every block back, the draft's K/V in them too


def test_aborted_requests_free_drafter_state(tight):
    engine = tight.llm_engine
    prompts = make_prompts(6)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, greedy(max_tokens=12 + LONGEST_REST + 24))
    # The engine's switch remembers the last test's verdict at this load: a rest there runs on
    # (up to LONGEST_REST steps) before a probe drafts and the drafter holds state to free.
    for _ in range(12 + LONGEST_REST):
        engine.step()
        if tight.collective_rpc(_live_state)[0]["drafter"] > 0:
            break
    assert tight.collective_rpc(_live_state)[0]["drafter"] > 0
    engine.abort_request([f"abort-{i}" for i in range(0, 6, 2)])
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == {f"abort-{i}" for i in range(1, 6, 2)}
    engine.step()  # one more step delivers the last finished ids to the worker
    assert tight.collective_rpc(_live_state)[0] == {"proposed": 0, "drafter": 0, "budget": 0}
    assert _kv_usage(tight) == 0.0
