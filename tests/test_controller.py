"""The goodput controller (core/controller.py) and the priced ``mcsd`` and ``dsbd``-chain drafters, without an engine.

The maths against its worked examples and brute force; the drafter on the fake
runtime of ``test_mcsd`` under planted prices: free rows and forwards keep the
whole tree, dear ones switch the draft off but for its back-off probes.
"""

from __future__ import annotations

import functools
from itertools import combinations

import numpy as np
import pytest
from conftest import checked_options
from test_hybrid_lookup import DeferringRuntime
from test_mcsd import drafter, request

from vllm_specbeam.core.budget import BatchCost, StepCost, choose_nodes
from vllm_specbeam.core.controller import (
    CATCH_UP_STEPS,
    LONGEST_REST,
    MAX_OFF_STEPS,
    PROBE_SHARE,
    REST_BELOW,
    DraftGate,
    StepLedger,
    StepPrices,
    Switch,
    catch_up_rows,
    load_bucket,
    overhead,
    paying_share,
    utility,
)
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.methods.dsbd.drafter import DsbdDrafter

#: 38 ms + 0.5 ms a row: C(4) = 40 ms, C(8) = 42 ms (the module docstring's example)
TARGET = StepCost(0.038, 0.0005)
FREE = StepCost(0.0, 0.0)
#: a row or a draft forward that costs a hundred steps
DEAR = StepCost(1.0, 1.0)


def test_the_module_example() -> None:
    ledger = StepLedger.of(StepPrices(4, TARGET, StepCost(0.002, 0.001)))  # D(4) = 6 ms
    assert ledger is not None and ledger.seconds == pytest.approx(0.040)
    assert ledger.pays(2.4, 4, [4])  # 6.4 / 48 ms > 4 / 40 ms
    slow = StepLedger.of(StepPrices(4, TARGET, StepCost(0.036, 0.001)))  # D(4) = 40 ms
    assert slow is not None and not slow.pays(2.4, 4, [4])  # 6.4 / 82 ms
    assert StepLedger.of(StepPrices(4, None)) is None  # nothing timed yet: no price


def test_take_adds_only_what_pays() -> None:
    ledger = StepLedger.of(StepPrices(4, TARGET, StepCost(0.002, 0.001)))
    assert ledger is not None
    assert ledger.take(2.4, 4, [4]) and ledger.tokens == 6.4 and ledger.rows == 8
    assert ledger.seconds == pytest.approx(0.048)
    assert not ledger.take(0.0, 1) and ledger.rows == 8  # nothing to gain: never taken
    assert ledger.draft_price([0]) == 0.0  # a forward of no rows is no forward


def test_the_paying_share_example() -> None:
    knee = StepCost(0.040, 0.0, knee=4, bend=0.0005)
    ledger = StepLedger.of(StepPrices(4, knee, StepCost(0.006, 0.001)))
    assert ledger is not None
    assert paying_share(ledger, [0.1, 0.9, 0.8], [1, 1, 1], [1, 1, 1]) == [1, 2]
    assert ledger.tokens == 4.0  # choosing adds nothing
    # the most valuable candidate sat out 40 steps: its catch-up leaves the second to join alone
    assert paying_share(ledger, [0.1, 0.9, 0.8], [1, 1, 1], [1, 41, 1]) == [2]


def goodput(ledger: StepLedger, gains, rows, fed, chosen) -> float:
    more = [sum(fed[k] for k in chosen)] if chosen else []
    return (ledger.tokens + sum(gains[k] for k in chosen)) / (
        ledger.seconds + ledger.price(sum(rows[k] for k in chosen), more)
    )


def assert_best_of_every_subset(ledger: StepLedger, gains, rows, fed) -> None:
    chosen = paying_share(ledger, gains, rows, fed)
    best = max(
        goodput(ledger, gains, rows, fed, list(subset))
        for size in range(len(gains) + 1)
        for subset in combinations(range(len(gains)), size)
    )
    assert goodput(ledger, gains, rows, fed, chosen) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(20))
def test_paying_share_equals_brute_force(seed: int) -> None:
    """With equal rows and fed rows per candidate the best share of size k is the k most valuable:
    the share chosen is as good as the best of every subset."""
    rng = np.random.default_rng(seed)
    target = StepCost(rng.uniform(0.01, 0.05), rng.uniform(0, 0.003), knee=int(rng.integers(2, 12)), bend=0.002)
    ledger = StepLedger.of(StepPrices(int(rng.integers(1, 9)), target, StepCost(rng.uniform(0, 0.02), 0.001)))
    assert ledger is not None
    count, width = int(rng.integers(1, 7)), int(rng.integers(1, 4))
    gains, rows, fed = rng.uniform(0, 1.5, count).tolist(), [width] * count, [1] * count
    assert_best_of_every_subset(ledger, gains, rows, fed)


@pytest.mark.parametrize("seed", range(20))
def test_paying_share_of_unequal_candidates_equals_brute_force_on_straight_lines(seed: int) -> None:
    """Candidates of their own rows and fed rows (requests that sat out steps feed their catch-up):
    on straight lines the share chosen, by each candidate's own rate, is the best of every subset."""
    rng = np.random.default_rng(100 + seed)
    target = StepCost(rng.uniform(0.01, 0.05), rng.uniform(0, 0.003))
    ledger = StepLedger.of(StepPrices(int(rng.integers(1, 9)), target, StepCost(rng.uniform(0, 0.02), 0.001)))
    assert ledger is not None
    count = int(rng.integers(1, 7))
    gains = rng.uniform(0, 1.5, count).tolist()
    rows, fed = rng.integers(1, 4, count).tolist(), rng.integers(1, 40, count).tolist()
    assert_best_of_every_subset(ledger, gains, rows, fed)


def test_the_utility_example() -> None:
    line = StepCost(0.040, 0.0005)
    assert utility(StepPrices(8, line), 2.0, 8, 0.003) == pytest.approx((10 / 0.051) / (8 / 0.044))
    assert utility(StepPrices(8, line), 2.0, 8, 0.003) > 1 > utility(StepPrices(8, line), 2.0, 8, 0.009)
    assert utility(StepPrices(8, None), 2.0, 8, 0.003) is None


def test_a_batch_first_node_pays_what_a_tree_step_costs_over_a_plain_one() -> None:
    """The :class:`BatchCost` example: nodes that pay against the tree line's own seconds at one
    row a request do not pay against a plain step that costs less."""
    line = StepCost(0.020, 0.001)
    step = BatchCost.of(line, 8, StepCost(0.025, 0.0))
    assert step.seconds(8) == pytest.approx(0.025) and step.seconds(9) == pytest.approx(0.029)
    assert step.seconds(np.array([8, 10])) == pytest.approx([0.025, 0.030])
    assert BatchCost.of(line, 8, None).seconds(8) == pytest.approx(0.028)  # no plain step timed yet
    no_tree_step = BatchCost.of(None, 8, line)  # the plain line stands in: nodes cost its rows
    assert no_tree_step is not None and no_tree_step.seconds(np.array([8, 9])) == pytest.approx([0.028, 0.029])
    assert BatchCost.of(None, 8, None) is None  # nothing timed
    tree, values = DraftTree.chain(list(range(6))), [[0.3] * 6]
    assert choose_nodes([tree], values, 8, 8, BatchCost.of(line, 8, None))[0].all()  # 0.3 tokens a ms
    assert not choose_nodes([tree], values, 8, 8, step)[0].any()  # 8 / 25 ms beats (8 + 0.3 n) / (28 + n) ms
    assert choose_nodes([tree], values, 8, 9, step)[0].all()  # another row drafted: a tree step anyway
    # the switch weighs a drafting step against the plain one
    assert (
        utility(StepPrices(8, line), 1.8, 6, 0.0)
        > 1
        > utility(StepPrices(8, line, plain=StepCost(0.025, 0.0)), 1.8, 6, 0.0)
    )
    ledger = StepLedger.of(StepPrices(8, line, FREE, StepCost(0.025, 0.0)))
    assert ledger.seconds == pytest.approx(0.025) and ledger.price(1) == pytest.approx(0.004)
    assert not ledger.pays(0.4, 1) and ledger.take(1.5, 1) and ledger.pays(0.4, 1)  # the second node: 1 ms


def test_the_switch_example() -> None:
    """Utilities 0.5 at steps 0 and 2, a probe at 5 of 1.2, then 0.4: off at 1, 3-4, 7-8."""
    switch, batch, off, probes = Switch(), ["a", "b"], [], []
    for step in range(10):
        if not switch.drafts(batch):
            off.append(step)
            continue
        probes += [step] if switch.probing else []
        switch.after({5: 1.2, 6: 0.4}.get(step, 0.5) if step < 9 else 1.2)
    assert off == [1, 3, 4, 7, 8] and probes == [2, 5, 9]


def test_the_switch_averages_utilities_and_counts_the_unknown_as_paying() -> None:
    """Drafting that pays well now and then keeps the batch on through the steps that find nothing."""
    switch, batch = Switch(), ["a"]
    for utility_now in [1.5, 0.98, 0.98, 1.5, 0.98, 0.98, 0.98]:
        assert switch.drafts(batch)
        switch.after(utility_now)
    for _ in range(5):
        assert switch.drafts(batch)
        switch.after(None)
    switch.after(0.9)  # the average: 1.04, above REST_BELOW
    assert not switch.off and REST_BELOW > 0.9
    switch.after(0.3)  # the average: 0.82
    assert switch.off


def test_a_rest_asked_for_rests_one_step_and_probes_after() -> None:
    switch, batch = Switch(), ["a"]
    assert switch.drafts(batch)
    switch.after(2.0)
    switch.rest()
    assert not switch.drafts(batch)
    assert switch.drafts(batch) and switch.probing


def test_a_step_whose_drafts_were_all_priced_out_rests_the_batch() -> None:
    """Dear rows: the drafter's time is nothing beside the step (utility 1), yet nothing pays."""
    switch = Switch()
    switch.after(1.0, priced_out=True)
    assert switch.off
    switch = Switch()
    switch.after(1.0)  # nothing found to draft (new text): not the controller's cut
    assert not switch.off


def test_the_switch_rests_at_most_max_off_steps_and_probes_when_the_batch_changes() -> None:
    switch, batch, drafted = Switch(), ["a"], []
    for step in range(200):
        if switch.drafts(batch):
            drafted.append(step)
            switch.after(0.5)
    assert max(np.diff(drafted)) == MAX_OFF_STEPS + 1  # rests grow to MAX_OFF_STEPS, then stay
    assert not switch.drafts(batch) and switch.off
    assert switch.drafts(["a", "b"])  # a request came: the load it was judged at is gone


@pytest.mark.parametrize("draft_probe", [False, True])
@pytest.mark.parametrize("probe_overhead", [0.1, 0.58, 5.0])
def test_long_rests_space_the_probes_so_they_cost_at_most_probe_share(probe_overhead: float, draft_probe: bool) -> None:
    """A probe costing ``probe_overhead`` of a plain step (a draft's catch-up at batch 8; a draft's
    probe is priced at the step that judges it): once the rests reached MAX_OFF_STEPS, they
    stretch until the probes cost PROBE_SHARE of the time, up to LONGEST_REST; a cheap probe
    keeps MAX_OFF_STEPS."""
    switch, batch, drafted = Switch(), ["a"] * 8, []
    for step in range(1000):
        if switch.drafts(batch):
            drafted.append(step)
            if draft_probe:
                switch.probed(probe_overhead)
            switch.after(None, priced_out=True, overhead=0.0 if draft_probe else probe_overhead)
    gaps = np.diff(drafted)
    assert gaps[:4].tolist() == [2, 3, 5, 9]  # rests 1, 2, 4, 8 whatever the price
    steady = max(MAX_OFF_STEPS, min(int(np.ceil(probe_overhead / PROBE_SHARE)), LONGEST_REST))
    assert gaps[-1] == steady + 1 and max(gaps) == steady + 1
    if steady < LONGEST_REST:
        assert probe_overhead / (gaps[-1] - 1 + probe_overhead) <= PROBE_SHARE * 1.001


def test_the_overhead_example() -> None:
    prices = StepPrices(8, StepCost(0.040, 0.0005))
    assert overhead(prices, 1, 0.013) == pytest.approx(57.5 / 44 - 1)
    assert overhead(StepPrices(8, None), 1, 0.013) is None


def test_requests_coming_and_going_at_one_load_do_not_wake_a_resting_batch() -> None:
    """A served batch changes nearly every step; only a load half or twice as large probes at once."""
    switch, drafted = Switch(), []
    for step in range(100):  # 10-14 requests, a different set every step
        batch = [f"r{step + i}" for i in range(10 + step % 5)]
        if switch.drafts(batch):
            drafted.append(step)
            switch.after(0.5)
    assert len(drafted) < 15 and max(np.diff(drafted)) == MAX_OFF_STEPS + 1
    assert switch.off and switch.drafts([f"s{i}" for i in range(16)])  # 16 requests: another load
    assert [load_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 200)] == [0, 1, 2, 2, 3, 3, 4, 8]


def test_each_load_keeps_its_own_verdict_across_a_detour() -> None:
    """8 requests rest; a closed batch's tail (7 requests, another load) probes at once, and back
    at 8 the rest goes on where it stopped: 8 requests' decisions are those of a batch that never
    left. One request, judged paying before, still pays after its detour: its average holds."""

    def decisions_at_eight(detour_at: int | None) -> list[bool]:
        switch, decisions = Switch(), []
        for step in range(120):
            if step == detour_at:
                assert switch.off and switch.drafts(["a"] * 7) and switch.probing  # never judged
                switch.after(0.5)
                assert not switch.drafts(["a"] * 7)
            drafts = switch.drafts(["a"] * 8)
            decisions.append(drafts)
            if drafts:
                switch.after(0.5)
        return decisions

    never_left = decisions_at_eight(None)
    assert never_left[50] is False  # resting there
    assert decisions_at_eight(50) == never_left
    switch = Switch()
    assert switch.drafts(["a"])
    switch.after(2.0)
    assert switch.drafts(["a"] * 8)
    switch.after(0.5)
    assert switch.off and switch.drafts(["a"])
    switch.after(0.5)  # averaged with 2.0: it still pays (a fresh verdict of 0.5 would rest)
    assert not switch.off


def test_the_gate_probes_the_best_request_alone_on_a_back_off() -> None:
    gate, probes = DraftGate(), []
    for step in range(30):
        ledger = StepLedger.of(StepPrices(2, TARGET, DEAR))
        assert ledger is not None
        chosen = gate.choose(ledger, [0.2, 0.7], [1, 1], [1, 1])
        if chosen:
            assert chosen == [1] and ledger.probing
            probes.append(step)
    assert probes == [0, 2, 5, 10, 19, 28]
    ledger = StepLedger.of(StepPrices(2, TARGET, FREE))
    assert ledger is not None
    assert gate.choose(ledger, [0.2, 0.7], [1, 1], [1, 1]) == [0, 1] and not ledger.probing
    assert ledger.draft_seconds == 0.0 and ledger.rows == 2  # the forward is charged, the levels are not


def test_the_gate_probes_every_request_at_every_step_after_the_batch_rest() -> None:
    """The switch spaces its own probes; a gate resting on its back-off would multiply the rests.
    The batch's probe drafts a node for every request, priced at the rows each feeds: one
    request's trial alone would leave the others valued by the engine's prior, which may never
    pay (a cold batch of 8 never drafted so, at 0.45 against the 0.85 its draft is accepted)."""
    gate = DraftGate()
    for _step in range(6):
        ledger = StepLedger.of(StepPrices(2, TARGET, DEAR, probe=True))
        assert ledger is not None
        assert gate.choose(ledger, [0.2, 0.7], [1, 1], [1, 3]) == [0, 1] and ledger.probing
        assert ledger.invested_seconds == 0.0 and ledger.draft_seconds == pytest.approx(float(DEAR.seconds(4)))
    ledger = StepLedger.of(StepPrices(2, TARGET, DEAR))
    assert ledger is not None and gate.choose(ledger, [0.2, 0.7], [1, 1], [1, 1]) == []  # its back-off rests


def test_the_gate_charges_each_requests_catch_up_and_probes_the_cheapest() -> None:
    """A request whose draft lags 400 tokens (a long prompt it never read) is refused where its
    caught-up peers draft, even spread over its steps; the forward is charged at the rows fed.
    When none pays, the probe is the request of the most tokens per second of its own, not the
    most valuable one dragging a catch-up."""
    draft = StepCost(0.006, 0.001)
    ledger = StepLedger.of(StepPrices(4, TARGET, draft))
    assert ledger is not None
    assert DraftGate().choose(ledger, [0.6] * 4, [1] * 4, [1, 1, 1, 401]) == [0, 1, 2]
    assert ledger.draft_seconds == pytest.approx(float(draft.seconds(3)))
    ledger = StepLedger.of(StepPrices(4, TARGET, StepCost(0.2, 0.001)))  # no share pays
    assert ledger is not None
    assert DraftGate().choose(ledger, [0.9, 0.6], [1, 1], [401, 1]) == [1] and ledger.probing


def test_a_batch_whose_draft_sat_out_catches_up_where_drafting_in_step_pays() -> None:
    """8 requests whose draft lags 41 tokens each (a prompt, a rest), a first level worth 0.7 a request: fed
    whole, the catch-up (328 rows) outweighs a step's gain, so a draft that once sat out would never
    run again; spread over :data:`CATCH_UP_STEPS` steps it pays, and the forward is charged at its
    share, the rest invested. A draft not worth running in step stays off whatever the lag."""
    target, draft = StepCost(0.140, 0.002), StepCost(0.046, 0.0004)  # a 1.5B target, a 0.5B draft, on CPU
    ledger = StepLedger.of(StepPrices(8, target, draft))
    assert ledger is not None
    assert DraftGate().choose(ledger, [0.7] * 8, [1] * 8, [41] * 8) == list(range(8))
    share = 8 * catch_up_rows(41)
    assert share == 8 * (1 + 40 / CATCH_UP_STEPS) and catch_up_rows(41, tokens_left=4) == 11
    assert ledger.draft_seconds == pytest.approx(float(draft.seconds(share)))
    assert ledger.invested_seconds == pytest.approx(float(draft.seconds(8 * 41)) - float(draft.seconds(share)))
    whole = StepLedger.of(StepPrices(8, target, draft))
    assert whole is not None and paying_share(whole, [0.7] * 8, [1] * 8, [41] * 8) == []  # priced whole: none
    ledger = StepLedger.of(StepPrices(8, target, draft))
    assert ledger is not None and paying_share(ledger, [0.1] * 8, [1] * 8, [1] * 8) == []
    assert DraftGate().choose(ledger, [0.1] * 8, [1] * 8, [41] * 8) == [0] and ledger.probing  # its probe
    assert ledger.invested_seconds == 0.0 and ledger.draft_seconds == pytest.approx(float(draft.seconds(41)))


# ---------------------------------------------------------------- the priced mcsd drafter
def priced(prices: StepPrices, **overrides):
    runtime = DeferringRuntime()
    d = drafter(runtime, **overrides)
    d.plan_step(prices)
    return d, runtime


@pytest.mark.parametrize("k_config", [[1], [2, 2]])
def test_free_rows_and_forwards_keep_the_whole_tree(k_config: list[int]) -> None:
    """Nothing to pay: every level pays, however unsure the draft (rows flat past depth 1), as
    with no threshold at all; a planted price on either rows or forwards cuts the tree."""
    d, runtime = priced(StepPrices(1, FREE, FREE), k_config=k_config)
    tree = d.propose([request(d, [5, 6])])[0]
    unpriced, _ = priced(StepPrices(1, None), k_config=k_config, stop_threshold=0.0)
    assert tree.tokens.tolist() == unpriced.propose([request(unpriced, [5, 6])])[0].tokens.tolist()
    assert tree.max_depth == 4 and runtime.deferred == []
    for prices in (StepPrices(1, TARGET, StepCost(0.2, 0.0)), StepPrices(1, StepCost(0.01, 0.05), FREE)):
        d, _ = priced(prices, k_config=k_config)
        assert 0 < d.propose([request(d, [5, 6])])[0].num_nodes < tree.num_nodes


def test_depth_follows_the_price_of_a_draft_forward() -> None:
    """The draft is sure (top-1 ~ 0.99) at every depth: each level is worth almost a token, so the
    deeper the cheaper its forwards; the target's rows cost 0.5 ms on a 40 ms step."""
    depths = []
    for forward in (0.0, 0.010, 0.040, 0.200):
        d, _ = priced(StepPrices(1, TARGET, StepCost(forward, 0.0)), num_speculative_tokens=8, max_nodes=64)
        depths.append(d.propose([request(d, [5, 6])])[0].max_depth)
    assert depths[0] == 8 and depths == sorted(depths, reverse=True) and depths[-1] < depths[0]


def test_a_request_whose_draft_lags_is_left_to_wait_while_its_peers_draft() -> None:
    """Four requests under a draft forward that pays at one row each; one of them sat out 400 steps
    (a planted lag): its catch-up does not pay, even spread over the steps it buys, so it defers
    and the others draft."""
    prices = StepPrices(4, TARGET, StepCost(0.004, 0.002))
    d, runtime = priced(prices)
    runtime.lags["d"] = 400
    requests = [DraftRequest(req_id, np.asarray([5, 6]), d.options, 0.0) for req_id in "abcd"]
    trees = d.propose(requests)
    assert [t.num_nodes > 0 for t in trees] == [True, True, True, False]
    assert runtime.deferred == ["d"] and sorted(runtime.synced) == ["a", "b", "c"]
    runtime.lags.clear()  # caught up, it drafts too
    d.plan_step(prices)
    assert all(t.num_nodes for t in d.propose(requests))


def test_a_draining_batch_drafts_for_the_request_it_waits_for_alone() -> None:
    """Four requests under a draft forward that pays at one row each (the test above): all draft
    while their tokens are worth alike; once the batch drains and waits for ``a`` alone
    (:attr:`StepPrices.worth`: ``a``'s tokens worth twice the average, the others' a twentieth,
    rows past the knee), only ``a`` drafts, the others' drafts deferred; ``dsbd``'s chains and
    ``mcsd`` behind lookup branches (nothing to look up here) alike."""
    worth = {"a": 2.0, "b": 0.05, "c": 0.05, "d": 0.05}
    for make in (priced, dsbd, functools.partial(priced, lookup="request")):
        drafted = {}
        for label, prices in (
            ("alike", StepPrices(4, TARGET, StepCost(0.004, 0.002))),
            ("draining", StepPrices(4, TARGET, StepCost(0.004, 0.002), worth=worth)),
        ):
            d, runtime = make(prices)
            requests = [DraftRequest(req_id, np.asarray([5, 6]), d.options, 0.0) for req_id in "abcd"]
            drafted[label] = [tree.num_nodes > 0 for tree in d.propose(requests)]
            if label == "draining":
                assert runtime.deferred == ["b", "c", "d"], make
        assert drafted == {"alike": [True] * 4, "draining": [True, False, False, False]}, make


def test_dear_forwards_switch_the_draft_off_but_for_probes() -> None:
    """No draft forward pays: the draft syncs only on the gate's back-off, one node each."""
    d, runtime = priced(StepPrices(1, TARGET, DEAR), k_config=[2])
    tokens, drafted = [5, 6], []
    for step in range(30):
        d.plan_step(StepPrices(1, TARGET, DEAR))
        tree = d.propose([request(d, tokens)])[0]
        if tree.num_nodes:
            assert tree.num_nodes == 1 and d.expected_gain == 0.0  # a probe is valued at nothing
            drafted.append(step)
        tokens.append(1000 + step)
    assert drafted == [0, 2, 5, 10, 19, 28] and len(runtime.synced) == len(drafted)
    assert len(runtime.deferred) == 30 - len(drafted)


# ---------------------------------------------------------------- the priced dsbd chain
def dsbd(prices: StepPrices | None, **overrides) -> tuple[DsbdDrafter, DeferringRuntime]:
    """``dsbd`` at ``max_width: 1`` (a draft chain) on the fake runtime, priced by ``prices``."""
    values = {"draft_model": "draft", "num_speculative_tokens": 4, "max_nodes": 16, "lookup": "off", "max_width": 1}
    d, runtime = DsbdDrafter(checked_options(DsbdDrafter, **{**values, **overrides})), DeferringRuntime()
    d.use_runtime(runtime)
    if prices is not None:
        d.plan_step(prices)
    return d, runtime


def test_free_rows_and_forwards_keep_the_whole_dsbd_chain() -> None:
    """Nothing to pay: the priced chain is the unpriced one, valued at its nodes' draft
    probabilities; a dear draft forward cuts it, and a dear one of 200 ms leaves its first node."""
    d, _ = dsbd(StepPrices(1, FREE, FREE))
    tree = d.propose([request(d, [5, 6])])[0]
    unpriced, _ = dsbd(None)
    assert tree.tokens.tolist() == unpriced.propose([request(unpriced, [5, 6])])[0].tokens.tolist()
    assert tree.max_depth == 4 and unpriced.expected_gain is None
    assert 3.5 < d.expected_gain <= 4.0  # four nodes the draft is sure of (top-1 ~ 0.99)
    depths = []
    for forward in (0.0, 0.004, 0.040, 0.200):
        d, _ = dsbd(StepPrices(1, TARGET, StepCost(forward, 0.0)), num_speculative_tokens=8)
        depths.append(d.propose([request(d, [5, 6])])[0].max_depth)
    assert depths[0] == 8 and depths == sorted(depths, reverse=True) and depths[-1] < depths[1]


def test_a_dsbd_chain_the_draft_is_unsure_of_stops_where_its_rows_stop_paying() -> None:
    """Past depth 2 the draft is flat (1/16 a node): those nodes are not worth their forward."""
    d, runtime = dsbd(StepPrices(1, TARGET, StepCost(0.004, 0.0)))
    runtime.confident_below = 2
    tree = d.propose([request(d, [5, 6])])[0]
    assert 2 <= tree.max_depth < 4


def test_dear_forwards_rest_a_dsbd_chain_but_for_probes() -> None:
    """No draft forward pays: the chain's draft syncs only on the gate's back-off, one node each."""
    d, runtime = dsbd(StepPrices(1, TARGET, DEAR))
    tokens, drafted = [5, 6], []
    for step in range(30):
        d.plan_step(StepPrices(1, TARGET, DEAR))
        tree = d.propose([request(d, tokens)])[0]
        if tree.num_nodes:
            assert tree.num_nodes == 1
            drafted.append(step)
        tokens.append(1000 + step)
    assert drafted == [0, 2, 5, 10, 19, 28] and len(runtime.deferred) == 30 - len(drafted)


def test_dsbd_beams_are_drafted_whatever_they_cost_and_left_unvalued() -> None:
    """A request of 2 beams a depth (lossy: its drafts are what its output means) on the chain
    engine: drafted in full under dear prices, the step's value unknown to the switch."""
    d, runtime = dsbd(StepPrices(1, TARGET, DEAR))
    tree = d.propose([request(d, [5, 6], max_width=2, prune_ratio=0.0)])[0]
    assert tree.max_depth == 4 and tree.num_nodes == 8 and runtime.deferred == []
    assert d.expected_gain is None


def test_a_request_asking_for_beams_keeps_a_resting_chain_engine_drafting() -> None:
    """Only options that keep the target's output may rest: ``dsbd`` chains do, beams do not, so
    a batch holding a request of beams drafts every step, even while the switch would rest it."""
    from vllm import SamplingParams

    from vllm_specbeam.adapter.drafting import TreeDrafting
    from vllm_specbeam.adapter.tree_counts import TreeCounts
    from vllm_specbeam.core.config import SpecbeamConfig

    assert DsbdDrafter.keeps_target_output({"max_width": 1}) and not DsbdDrafter.keeps_target_output({"max_width": 2})
    d, _ = dsbd(None)
    drafting = TreeDrafting(SpecbeamConfig("dsbd", d.options), d, TreeCounts())
    assert drafting.switch is not None
    plain, beams = SamplingParams(), SamplingParams(extra_args={"max_width": 3})
    assert drafting.drafts_this_step(["a", "b"], [plain, plain])  # the switch learns the load
    drafting.switch.rest()
    assert drafting.drafts_this_step(["a", "b"], [plain, beams])
    assert not drafting.drafts_this_step(["a", "b"], [plain, plain])
    wide, _ = dsbd(None, max_width=4)
    assert TreeDrafting(SpecbeamConfig("dsbd", wide.options), wide, TreeCounts()).switch is None


def test_a_step_that_only_probed_the_draft_is_judged_at_the_next() -> None:
    """Dear draft forwards at batch 1: each step after a rest drafts the gate's probe (one node,
    valued at nothing), the next step refuses the draft on price and rests the batch, the rests
    doubling. Counted as paying, the probe would halve the rests; counted as refused, it would
    rest the batch before its node is judged; a gate on its own back-off would skip probes."""
    from vllm import SamplingParams

    from vllm_specbeam.adapter.drafting import TreeDrafting
    from vllm_specbeam.adapter.step_selection import BatchRequest
    from vllm_specbeam.adapter.tree_counts import TreeCounts
    from vllm_specbeam.core.config import SpecbeamConfig

    d, _ = dsbd(None)
    drafting = TreeDrafting(SpecbeamConfig("dsbd", d.options), d, TreeCounts())
    assert drafting.budget is not None
    drafting.budget.cost = StepCost(0.038, 0.005)  # a row costs 13 % of the step
    params, tokens, probes, refused = SamplingParams(temperature=0.0, max_tokens=100), [5, 6], [], []
    for step in range(60):
        if drafting.drafts_this_step(["a"], [params]):
            batch = [BatchRequest("a", 0, params, len(tokens) - 2, np.asarray(tokens), True)]
            nodes = len(drafting.propose(batch, 4096, DEAR).drafts[0])
            assert nodes in (0, 1) and (nodes == 0 or d.expected_gain == 0.0)
            (probes if nodes else refused).append(step)
        tokens.append(1000 + step)
    assert len(refused) >= len(probes) - 1  # each probe judged at the next step
    assert refused == [p + 1 for p in probes][: len(refused)]
    assert np.diff(probes).tolist() == [3, 4, 6, 10, 18, 18]  # rests 1, 2, 4, 8, 16, 16
    assert drafting.counts.steps_probed == len(probes) - 1


def test_tensor_parallel_ranks_rest_alike_whatever_their_own_drafting_took(monkeypatch) -> None:
    """Each tensor-parallel rank drafts for itself, and the switch judges a step by its drafting
    seconds: with rank 0's seconds shared, a rank whose every drafting took a second more rests
    the same steps as rank 0; with its own seconds it rests where rank 0 drafts (and the two
    would verify different trees)."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_specbeam.adapter import drafting as drafting_module
    from vllm_specbeam.adapter.step_selection import BatchRequest
    from vllm_specbeam.adapter.tree_counts import TreeCounts
    from vllm_specbeam.core.config import SpecbeamConfig

    def rank(same_on_every_rank) -> drafting_module.TreeDrafting:
        d, _ = dsbd(None)
        ranked = drafting_module.TreeDrafting(SpecbeamConfig("dsbd", d.options), d, TreeCounts(), same_on_every_rank)
        assert ranked.budget is not None
        ranked.budget.cost = ranked.budget.chain_cost = ranked.budget.plain_cost = TARGET
        return ranked

    def drafting_steps(share: bool) -> tuple[list[bool], list[bool]]:
        """Each rank's drafting steps over 40 steps of one request (rank 1's drafting 1 s a step)."""
        rank0_seconds: list[float] = []
        rank0 = rank(lambda seconds: rank0_seconds.append(seconds) or seconds)
        rank1 = rank(lambda seconds: rank0_seconds[-1] if share else seconds)
        params, tokens = SamplingParams(temperature=0.0, max_tokens=100), [5, 6]
        steps: tuple[list[bool], list[bool]] = ([], [])
        for step in range(40):
            for drafting, took, drafted in ((rank0, 0.0, steps[0]), (rank1, 1.0, steps[1])):
                clock = iter((0.0, took))  # the drafting's start and end
                monkeypatch.setattr(drafting_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
                drafted.append(drafting.drafts_this_step(["a"], [params]))
                if drafted[-1]:
                    batch = [BatchRequest("a", 0, params, len(tokens) - 2, np.asarray(tokens), True)]
                    drafting.propose(batch, 4096, FREE)
            tokens.append(1000 + step)
        return steps

    rank0, rank1 = drafting_steps(share=True)
    assert rank1 == rank0 and rank0.count(True) > 20
    rank0, rank1 = drafting_steps(share=False)  # the planted bug: each rank judges by its own seconds
    assert rank1 != rank0 and rank1.count(True) < rank0.count(True) / 2
