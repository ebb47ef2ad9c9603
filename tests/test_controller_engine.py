"""The goodput controller inside vLLM: off steps are vLLM's plain steps, the draft resumes
exactly, and outputs stay the target's however the switch flips mid-request."""

from __future__ import annotations

import pytest
from conftest import counters_grown, greedy, runner_stats, token_ids
from specs import DSBD_CHAIN, LOOKUP_AUTO, MCSD
from test_worker_draft import ATOL, _check, _record, wide_draft  # noqa: F401 - wide_draft: a fixture

from vllm_specbeam.core.budget import StepCost, StepCostModel


class _FixedCost(StepCostModel):
    """A cost line that ignores the steps: what a machine with very dear rows would fit."""

    def __init__(self, line: StepCost) -> None:
        super().__init__()
        self.line = line

    def fitted(self) -> StepCost:
        return self.line


def _plant_cost(worker, intercept: float | None = None, slope: float = 0.0, branches: float = 0.0) -> None:
    """In the worker: fix the budget's cost lines, steps with chains alone and plain steps
    costing what the line says, steps whose trees branch ``branches`` seconds more (``None``:
    fit them all again from the steps). Plain floats travel: vLLM's RPC serialises a
    dataclass into a dict."""
    budget = worker.model_runner.budget
    line = None if intercept is None else StepCost(intercept, slope)
    tree = None if intercept is None else StepCost(intercept + branches, slope)
    budget.cost_model = StepCostModel() if tree is None else _FixedCost(tree)
    budget.chain_model = StepCostModel() if line is None else _FixedCost(line)
    budget.plain_model = StepCostModel() if line is None else _FixedCost(line)
    budget.cost, budget.chain_cost, budget.plain_cost = tree, line, line


#: mcsd with its default lookup branches (the draft fills what they leave)
MCSD_HYBRID = {**MCSD, "lookup": "global", "lookup_depth": 4, "stop_threshold": "auto"}


def _watch_steps(worker) -> None:
    """Count, in the worker, the drafter's calls, the tree steps built, the verifications, and
    the sampler's rows (vLLM's plain sampler takes one row per request)."""
    runner = worker.model_runner
    runner.watched = {"proposed": 0, "tree_steps": 0, "verified": 0, "sampler_rows": [], "requests": []}
    watched, propose, build, verify = (
        runner.watched,
        runner.tree_drafter.propose,
        runner._build_tree_step,
        runner._verify,
    )
    sampler = runner.sampler.forward

    def counted(name, method):
        def call(*args, **kwargs):
            watched[name] += 1
            return method(*args, **kwargs)

        return call

    def sample(logits, *args, **kwargs):
        watched["sampler_rows"].append(int(logits.shape[0]))
        watched["requests"].append(runner.input_batch.num_reqs)
        return sampler(logits, *args, **kwargs)

    runner.tree_drafter.propose = counted("proposed", propose)
    runner._build_tree_step, runner._verify = counted("tree_steps", build), counted("verified", verify)
    runner.sampler.forward = sample


def _watched(worker) -> dict:
    runner = worker.model_runner
    del runner.tree_drafter.propose, runner._build_tree_step, runner._verify, runner.sampler.forward
    return runner.watched


def _flip_switch(worker, on: int, off: int) -> None:
    """Plant a switch that drafts ``on`` steps, then rests ``off``, round and round."""
    switch, step = worker.model_runner.switch, [0]

    def drafts(req_ids):
        step[0] += 1
        return step[0] % (on + off) < on

    switch.drafts = drafts


def _unflip(worker) -> None:
    del worker.model_runner.switch.drafts


def _exact_while(llm, plant: tuple, undo: tuple, prompts, reference) -> dict:
    """Greedy outputs equal ``reference`` while ``plant`` holds (``collective_rpc`` arguments,
    ``undo`` after); the runner's counters' change over them."""
    llm.collective_rpc(*plant)
    before = runner_stats(llm)
    try:
        assert token_ids(llm.generate(prompts, greedy())) == reference
    finally:
        llm.collective_rpc(*undo)
    after = runner_stats(llm)
    return counters_grown(before, after)


def test_dear_rows_turn_the_batch_off_and_an_off_step_is_vllms_plain_step(engines, prompts, reference) -> None:
    """Under a planted line where a row costs a hundred steps nothing is ever kept: the batch
    rests (asking the drafter only to probe), no step builds a tree or verifies, every sample is
    vLLM's sampler over one row per request, and the outputs are the target's."""
    llm = engines.get(LOOKUP_AUTO)
    llm.collective_rpc(_plant_cost, args=(0.01, 1.0))
    llm.collective_rpc(_watch_steps)
    before = runner_stats(llm)
    try:
        assert token_ids(llm.generate(prompts, greedy())) == reference
    finally:
        watched = llm.collective_rpc(_watched)[0]
        llm.collective_rpc(_plant_cost)
    stats = {name: runner_stats(llm)[name] - before[name] for name in ("steps", "steps_off", "steps_probed", "nodes")}
    assert stats["nodes"] == 0 and stats["steps_off"] > stats["steps"] / 2 and stats["steps_probed"] > 0
    assert watched["proposed"] == stats["steps"] - stats["steps_off"]  # off steps never ask the drafter
    assert watched["tree_steps"] == 0 and watched["verified"] == 0
    assert watched["sampler_rows"] == watched["requests"]


def test_speculation_comes_back_when_rows_are_free_again(engines, prompts, reference) -> None:
    llm = engines.get(LOOKUP_AUTO)
    llm.collective_rpc(_plant_cost, args=(0.01, 1.0))
    llm.generate(prompts[:4], greedy())
    change = _exact_while(llm, (_plant_cost, None, (0.01, 0.0)), (_plant_cost,), prompts, reference)
    assert change["nodes"] > 0 and change["accepted"] > 0


def test_dear_branches_leave_chains_and_free_branches_bring_trees_back(engines, prompts, reference) -> None:
    """Under a planted line where a step whose trees branch costs a second more than one that
    verifies chains alone, the budget verifies chains (no step branches) and outputs stay the
    target's; with branches free, trees branch again."""
    llm = engines.get(LOOKUP_AUTO)
    dear = _exact_while(llm, (_plant_cost, None, (0.01, 0.0, 1.0)), (_plant_cost,), prompts, reference)
    assert dear["nodes"] > 0 and dear["accepted"] > 0 and dear["steps_branched"] == 0
    free = _exact_while(llm, (_plant_cost, None, (0.01, 0.0, 0.0)), (_plant_cost,), prompts, reference)
    assert free["steps_branched"] > 0


@pytest.mark.parametrize("spec", [LOOKUP_AUTO, MCSD_HYBRID, DSBD_CHAIN], ids=["lookup_tree", "mcsd", "dsbd-chain"])
def test_greedy_exact_with_the_switch_flipping_mid_request(
    engines, tiny_draft, near_draft, prompts, reference, spec
) -> None:
    # the draft alone (dsbd's chain) needs one close to the target for its drafts to be accepted
    draft = {"lookup_tree": None, "mcsd": tiny_draft, "dsbd": near_draft}[spec["method"]]
    spec = spec if draft is None else {**spec, "model": draft}
    change = _exact_while(engines.get(spec), (_flip_switch, None, (2, 3)), (_unflip,), prompts, reference)
    assert change["steps_off"] > 20 and change["accepted"] > 0


def test_a_draft_resumed_after_a_pause_gives_the_logits_of_one_that_never_paused(engines, wide_draft) -> None:  # noqa: F811
    """While the batch rests the draft feeds nothing; when it drafts again it catches up on what it
    missed. Every logit row it then gives equals transformers' on the plain sequence, as a draft
    that never paused gives (so greedy drafts, and what the target accepts of them, are the same)."""
    from conftest import make_prompts

    spec = {**MCSD, "model": wide_draft}
    llm = engines.get(spec)
    llm.collective_rpc(_record)
    llm.collective_rpc(_flip_switch, args=(2, 5))
    before = runner_stats(llm)
    try:
        llm.generate(make_prompts(4, seed=3), greedy(24))
    finally:
        llm.collective_rpc(_unflip)
    result = llm.collective_rpc(_check_catch_up, args=(wide_draft,))[0]
    engines.stop(spec)  # its runtime logs every call
    stats = result["stats"]
    assert stats["steps_off"] - before["steps_off"] > 10 and stats["trees"] > before["trees"]
    # a sync after a pause feeds more than one step can commit (the tree's depth and the target's token)
    assert result["catch_up"] > MCSD["num_speculative_tokens"] + 1
    assert result["counts"]["sync"] > 10 and result["worst"]["sync"] < ATOL and result["worst"]["extend"] < ATOL


def _check_catch_up(worker, draft: str) -> dict:
    """:func:`_check`, and the most committed tokens one sync of a request fed after its last."""
    calls = worker.model_runner.draft_runtime.calls
    last: dict[str, int] = {}
    catch_up = 0
    for kind, req_id, tokens, _, _ in calls:
        if kind == "sync":
            catch_up = max(catch_up, len(tokens) - last.get(req_id, len(tokens)))
            last[req_id] = len(tokens)
    return {**_check(worker, draft), "catch_up": catch_up}


def _watch_syncs(worker) -> None:
    """Record, in the worker, each step's batch, the requests its drafter was asked for, and
    those whose draft K/V the step's closing sync (``sync_step``) fed."""
    runner = worker.model_runner
    drafting, runtime = runner.drafting, runner.draft_runtime
    propose, sync = drafting.propose, runtime.sync_step
    runner.syncs, asked = [], set()

    def proposed(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        asked.update(proposal.trees)
        return proposal

    def synced():
        before = {req_id: request.kv_len for req_id, request in runtime._requests.items()}
        sync()
        fed = {req_id for req_id, request in runtime._requests.items() if request.kv_len > before.get(req_id, 0)}
        runner.syncs.append((set(runner.input_batch.req_ids), set(asked), fed))
        asked.clear()

    drafting.propose, runtime.sync_step = proposed, synced


def _watched_syncs(worker) -> list:
    runner = worker.model_runner
    del runner.drafting.propose, runner.draft_runtime.sync_step
    return runner.syncs


def test_a_request_the_drafter_was_not_asked_for_feeds_the_draft_nothing(engines, near_draft, prompts, reference):
    """A request with no token left to draft, or a prompt's chunk, waits for a step that drafts
    it: fed at the step's end, a closed batch's last step fed the draft every context it had
    never drafted (a thousand rows, 0.85 s, on the Qwen pair at batch 8: docs/results.md)."""
    llm = engines.get({**MCSD, "model": near_draft})
    llm.collective_rpc(_watch_syncs)
    try:
        assert token_ids(llm.generate(prompts, greedy())) == reference
    finally:
        syncs = llm.collective_rpc(_watched_syncs)[0]
    assert any(batch - asked for batch, asked, _ in syncs if asked)  # some request sat out a drafting step
    assert all(fed <= asked for _, asked, fed in syncs)
