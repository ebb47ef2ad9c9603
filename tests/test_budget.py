"""The per-step node budget (``"max_nodes": "auto"``): its choice against brute
force, its step cost (flat, then rising past a knee) and what the knee buys over
a straight line, its acceptance estimates, its options, and engines whose
outputs it never changes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from conftest import greedy, runner_stats, token_ids
from specs import ADED_AUTO, LOOKUP_AUTO

from vllm_specbeam.core import budget as budget_module
from vllm_specbeam.core.budget import (
    KIND_BUCKETS,
    BatchCost,
    StepBudget,
    StepCost,
    StepCostModel,
    TreeShape,
    branches,
    choose_counts,
    choose_nodes,
    choose_trees_or_chains,
    matched_nodes,
    path_values,
)
from vllm_specbeam.core.config import AUTO, SpecbeamConfigError, parse
from vllm_specbeam.core.tree import ROOT, DraftTree


# ------------------------------------------------------------------ trees
def test_tree_shape_and_matches_worked_examples():
    tree = DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 1])
    shape = TreeShape.of(tree)
    assert shape.depths == [1, 1, 2, 2, 2]
    # sibling ranks [0, 1, 0, 1, 0]: cell = (depth - 1) x RANK_BUCKETS + rank
    assert shape.cells == [0, 1, budget_module.RANK_BUCKETS, budget_module.RANK_BUCKETS + 1, budget_module.RANK_BUCKETS]
    # Committed [5, 8]: node 0 matched, its children tried at depth 2, node 3 matched.
    trials, hits = matched_nodes(tree, shape, [5, 8])
    assert trials == [shape.cells[n] for n in (0, 1, 2, 3)]
    assert hits == [shape.cells[n] for n in (0, 3)]
    # Only one token committed: nothing deeper than 1 was tried.
    assert matched_nodes(tree, shape, [6]) == ([0, 1], [1])


def test_keep_renumbers_parents_and_refuses_orphans():
    tree = DraftTree([1, 2, 3, 4], [-1, -1, 0, 1])
    kept = tree.keep(np.array([True, True, False, True]))
    assert kept.tokens.tolist() == [1, 2, 4]
    assert kept.parents.tolist() == [-1, -1, 1]
    assert tree.keep(np.zeros(4, bool)).num_nodes == 0
    with pytest.raises(ValueError, match="parent must be kept"):
        tree.keep(np.array([False, True, True, False]))


def test_path_values_multiply_rates_along_the_path():
    tree = DraftTree([1, 2, 3, 4], [-1, -1, 0, 2])
    rates = np.full((budget_module.DEPTH_BUCKETS, budget_module.RANK_BUCKETS), 0.5)
    rates[0, 0], rates[0, 1], rates[1, 0], rates[2, 0] = 0.9, 0.3, 0.8, 0.7
    assert np.allclose(path_values(TreeShape.of(tree), rates), [0.9, 0.3, 0.72, 0.504])


# ------------------------------------------------------------------ choice
def random_tree(rng: np.random.Generator, nodes: int) -> DraftTree:
    parents = [ROOT] + [int(rng.integers(-1, i)) for i in range(1, nodes)]
    return DraftTree(rng.integers(0, 100, nodes), parents)


def closed_subsets(trees: list[DraftTree]):
    """Every choice of nodes, over all trees, in which each kept node's parent is kept."""
    flat = [(t, i) for t, tree in enumerate(trees) for i in range(tree.num_nodes)]
    for bits in itertools.product([False, True], repeat=len(flat)):
        keep = dict(zip(flat, bits))
        orphans = [
            1
            for (t, i), kept in keep.items()
            if kept and trees[t].parents[i] != ROOT and not keep[(t, trees[t].parents[i])]
        ]
        if not orphans:
            yield [np.array([keep[(t, i)] for i in range(tree.num_nodes)], bool) for t, tree in enumerate(trees)]


@pytest.mark.parametrize("seed", range(12))
def test_choice_equals_brute_force(seed):
    """The budget's nodes give the best tokens per second of every subset of
    nodes that still hangs from the roots, under the fitted cost."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, int(rng.integers(1, 6))) for _ in range(2)]
    shape = (budget_module.DEPTH_BUCKETS, budget_module.RANK_BUCKETS)
    rates = np.minimum.accumulate(rng.uniform(0.05, 0.95, shape), axis=1)
    values = [np.array(path_values(TreeShape.of(tree), rates)) for tree in trees]
    cost = StepCost(
        intercept=float(rng.uniform(0.005, 0.05)),
        slope=float(rng.uniform(0.0005, 0.02)),
        knee=float(rng.integers(1, 8)),  # flat, then rising: the budget's choice holds for any cost of the rows
        bend=float(rng.choice([0.0, rng.uniform(0.0005, 0.05)])),
    )
    batch = 2

    def speed(masks: list[np.ndarray]) -> float:
        tokens = batch + sum(float(v[m].sum()) for v, m in zip(values, masks))
        return tokens / float(cost.seconds(batch + sum(int(m.sum()) for m in masks)))

    chosen = choose_nodes(trees, values, batch, batch, cost)
    for tree, mask in zip(trees, chosen):
        tree.keep(mask)  # still a tree: raises otherwise
    best = max(speed(masks) for masks in closed_subsets(trees))
    assert speed(chosen) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_trees_or_chains_equal_brute_force_under_two_lines(seed):
    """Where a step whose trees branch costs more than one verifying chains alone (the CPU
    recomputes the rows off a first branch), the choice is the best tokens per second of every
    subset hanging from the roots, each priced by its own line."""
    rng = np.random.default_rng(100 + seed)
    trees = [random_tree(rng, int(rng.integers(1, 6))) for _ in range(2)]
    shape = (budget_module.DEPTH_BUCKETS, budget_module.RANK_BUCKETS)
    rates = np.minimum.accumulate(rng.uniform(0.05, 0.95, shape), axis=1)
    values = [np.array(path_values(TreeShape.of(tree), rates)) for tree in trees]
    chain_line = StepCost(float(rng.uniform(0.005, 0.05)), float(rng.uniform(0.0005, 0.02)))
    tree_line = StepCost(chain_line.intercept + float(rng.choice([0.0, rng.uniform(0.001, 0.03)])), chain_line.slope)
    batch = 2
    costs = {
        branched: BatchCost.of(line, batch, chain_line) for branched, line in ((True, tree_line), (False, chain_line))
    }

    def speed(masks: list[np.ndarray]) -> float:
        tokens = batch + sum(float(v[m].sum()) for v, m in zip(values, masks))
        return tokens / float(costs[branches(trees, masks)].seconds(batch + sum(int(m.sum()) for m in masks)))

    chosen, branched = choose_trees_or_chains(trees, values, batch, 0, costs[True], costs[False])
    assert branched == branches(trees, chosen)
    assert speed(chosen) == pytest.approx(max(speed(masks) for masks in closed_subsets(trees)), rel=1e-12)


def test_a_branch_is_kept_only_where_it_pays_for_the_step_it_makes_dearer():
    """The worked example of :func:`choose_trees_or_chains`: a chain worth 0.9 (node 0) and a
    sibling worth 0.5 (node 1), a 20 ms step and 1 ms a row."""
    tree, values = DraftTree([1, 2], [ROOT, ROOT]), [[0.9, 0.5]]
    chain = BatchCost.of(StepCost(0.020, 0.001), 1, None)
    dear, cheap = (BatchCost.of(StepCost(0.020 + extra, 0.001), 1, StepCost(0.020, 0.001)) for extra in (0.010, 0.001))
    assert chain is not None and dear is not None and cheap is not None
    masks, branched = choose_trees_or_chains([tree], values, 1, 0, dear, chain)
    assert masks[0].tolist() == [True, False] and not branched
    masks, branched = choose_trees_or_chains([tree], values, 1, 0, cheap, chain)
    assert masks[0].tolist() == [True, True] and branched
    # rows of trees it does not choose may branch: the trees' line alone
    assert choose_trees_or_chains([tree], values, 1, 2, cheap, chain)[1]


def test_expensive_rows_keep_nothing_cheap_rows_keep_everything():
    tree = DraftTree([1, 2, 3], [-1, 0, 1])
    values = [np.array([0.6, 0.3, 0.1])]
    assert choose_nodes([tree], values, 1, 1, StepCost(0.01, 1.0))[0].sum() == 0
    assert choose_nodes([tree], values, 1, 1, StepCost(0.01, 0.0))[0].sum() == 3
    # The worked example of the module docstring: C(R) = 10 + 0.5R + 3 max(0, R - 3) ms keeps
    # two of [0.9, 0.45, 0.2]; without the knee (0.5 ms a row throughout) it keeps all three.
    values = [np.array([0.9, 0.45, 0.2])]
    assert choose_nodes([tree], values, 1, 1, StepCost(0.010, 0.0005, 3, 0.003))[0].tolist() == [True, True, False]
    assert choose_nodes([tree], values, 1, 1, StepCost(0.010, 0.0005))[0].tolist() == [True, True, True]


# ------------------------------------------------------------------ step cost
def test_cost_model_recovers_a_known_line():
    rng = np.random.default_rng(0)
    model = StepCostModel()
    for _ in range(400):
        rows = int(rng.integers(8, 60))
        model.observe(rows, 0.020 + 0.0005 * rows + rng.normal(0, 0.001))
    line = model.fit()
    assert line.intercept == pytest.approx(0.020, rel=0.1)
    assert line.slope == pytest.approx(0.0005, rel=0.1)


def test_cost_model_follows_a_change_of_machine_load():
    model = StepCostModel()
    for step in range(300):
        rows = 8 + step % 40
        model.observe(rows, 0.010 + 0.0002 * rows)
    for step in range(300):
        rows = 8 + step % 40
        model.observe(rows, 0.030 + 0.0010 * rows)
    assert model.fit().slope == pytest.approx(0.0010, rel=0.05)


#: A target pass over a cached context, R rows against 1 (Qwen2.5-Coder-1.5B, bfloat16, a Xeon with
#: AMX): flat up to 16 rows, then rising; past 64 rows it goes on as from 32 to 64.
MEASURED_ROWS, MEASURED_RATIOS = [1, 8, 16, 32, 64], [1.0, 1.02, 1.04, 1.19, 1.48]


def measured_seconds(rows: np.ndarray | float) -> np.ndarray:
    rows = np.asarray(rows, float)
    past = MEASURED_RATIOS[-1] + (rows - 64) * (MEASURED_RATIOS[-1] - MEASURED_RATIOS[-2]) / 32
    return 0.030 * np.where(rows <= 64, np.interp(rows, MEASURED_ROWS, MEASURED_RATIOS), past)


def observed_steps(seconds, rng: np.random.Generator, steps: int = 300, most_rows: int = 96):
    """Steps of 1 to ``most_rows`` rows timed with 1% noise: the rows and their seconds."""
    rows = rng.integers(1, most_rows + 1, steps)
    return rows, seconds(rows) * (1 + rng.normal(0, 0.01, steps))


def hinge_fit(rows: np.ndarray, seconds: np.ndarray) -> StepCost:
    model = StepCostModel()
    for r, s in zip(rows, seconds):
        model.observe(int(r), float(s))
    return model.fit()


def test_cost_model_finds_the_knee_of_flat_then_rising_steps():
    rng = np.random.default_rng(1)
    planted = StepCost(0.030, 0.00005, knee=20, bend=0.0008)
    fitted = hinge_fit(*observed_steps(planted.seconds, rng, most_rows=72))
    assert 16 <= fitted.knee <= 24
    assert fitted.slope == pytest.approx(0.00005, abs=0.00005)
    assert fitted.bend == pytest.approx(0.0008, rel=0.1)
    grid = np.arange(1, 73)
    assert np.allclose(fitted.seconds(grid), planted.seconds(grid), rtol=0.01)
    # The measured pass: its knee lies where its rows stop being free, past which a row costs
    # well over one before it.
    measured = hinge_fit(*observed_steps(measured_seconds, rng))
    assert 12 <= measured.knee <= 24 and measured.bend > measured.slope / 2
    assert np.allclose(measured.seconds(grid), measured_seconds(grid), rtol=0.02)


@pytest.mark.parametrize(
    ("batch", "acceptance", "depth", "hinge_keeps"),
    [(1, 0.7, 12, "more"), (8, 0.6, 6, "fewer")],
    ids=["rows-free-below-the-knee", "rows-dear-past-the-knee"],
)
def test_knee_keeps_free_rows_and_drops_dear_ones(batch, acceptance, depth, hinge_keeps):
    """Fitted to the same steps of the measured pass, the hinge keeps the nodes the
    true cost would; a straight line charges the rows below the knee too much (a
    request alone keeps fewer nodes than pay) and the rows past it too little (a
    batch keeps more), and its steps yield fewer tokens a second."""
    rows, seconds = observed_steps(measured_seconds, np.random.default_rng(2))
    hinge = hinge_fit(rows, seconds)
    slope, intercept = np.polyfit(rows, seconds, 1)
    line = StepCost(float(intercept), float(slope))
    values = np.tile(acceptance ** np.arange(1, depth + 1), batch)  # [batch x depth]: each request a chain

    def tokens_per_second(kept: int) -> float:
        tokens = batch + np.sort(values)[::-1][:kept].sum()
        return float(tokens / measured_seconds(batch + kept))

    best = max(range(values.size + 1), key=tokens_per_second)
    by_hinge, by_line = (choose_counts(values, batch, batch, cost) for cost in (hinge, line))
    assert by_hinge == best
    assert (by_hinge > by_line) if hinge_keeps == "more" else (by_hinge < by_line)
    assert tokens_per_second(by_hinge) > tokens_per_second(by_line)


def test_constant_rows_still_give_a_line():
    model = StepCostModel()
    for _ in range(50):
        model.observe(10, 0.02)
    line = model.fit()
    assert line.slope > 0 and line.bend == 0 and float(line.seconds(10)) == pytest.approx(0.02, rel=0.01)


# ------------------------------------------------------------------ the budget over steps
def run_steps(budget: StepBudget, accept: bool, steps: int, cap: int = 8) -> list[int]:
    """One request drafting a chain ``[1, 2, ..., cap]`` each step; the target
    commits the chain's first 4 tokens when ``accept`` (greedy-style matching), else
    a token no draft holds. Returns the nodes kept per step (-1: sat the step out)."""
    kept, length = [], 100
    for _ in range(steps):
        ask = budget.draft_cap("r", cap)
        if ask == 0:
            kept.append(-1)
            budget.observe_committed("r", [999], length + 1)
            length += 1
            continue
        tree = DraftTree.chain(list(range(1, ask + 1)))
        kept.append(budget.prune(["r"], [tree], [length], batch_size=1)[0].num_nodes)
        committed = [1, 2, 3, 4, 5][: min(4, ask) + 1] if accept else [999]
        budget.observe_committed("r", committed, length + len(committed))
        length += len(committed)
    return kept


def test_budget_drops_to_no_draft_when_drafts_are_never_accepted():
    budget = StepBudget()
    budget.cost = StepCost(0.020, 0.001)  # one row costs 5% of a step
    kept = run_steps(budget, accept=False, steps=40)
    assert kept[0] > 0  # new engine, no history: the prior says drafts may pay
    assert all(k <= 0 for k in kept[-20:])
    assert kept[-20:].count(-1) >= 14  # mostly sitting out, drafting now and then to check


def test_budget_keeps_nodes_that_are_accepted():
    budget = StepBudget()
    budget.cost = StepCost(0.020, 0.001)
    kept = run_steps(budget, accept=True, steps=40)
    assert all(k >= 4 for k in kept[-20:])
    assert budget.rates("r")[0, 0, 0] > 0.9


def test_new_request_starts_from_the_engine_rates():
    budget = StepBudget()
    budget.cost = StepCost(0.020, 0.001)
    run_steps(budget, accept=False, steps=30)
    fresh = budget.draft_cap("new", 8)
    assert fresh == 8
    assert budget.rates("new")[0, 0, 0] < 0.2  # learnt from "r": the engine's drafts do not pay


def test_dear_rows_keep_no_node_and_free_rows_bring_the_drafts_back():
    """Under a planted line where a row costs a hundred steps, the budget keeps no node however
    well the drafts are accepted, and the request sits out 1, 3, then 7 steps between tries (-1);
    once rows are free and the batch woken mid-rest, it drafts at once and keeps what it asks
    for, asking for more each step (2, 6, then the cap)."""
    budget = StepBudget()
    budget.cost = budget.chain_cost = budget.plain_cost = StepCost(0.01, 1.0)
    assert run_steps(budget, accept=True, steps=18) == [0, -1, 0, -1, -1, -1, 0, *[-1] * 7, 0, -1, -1, -1]
    assert budget.kept_value == 0.0 and budget.rates("r")[0, 0, 0] > 0.9
    budget.cost = budget.chain_cost = budget.plain_cost = StepCost(0.01, 0.0)
    budget.wake()
    assert run_steps(budget, accept=True, steps=4) == [2, 6, 8, 8]


def test_before_a_tree_step_is_timed_the_plain_line_prices_the_nodes():
    """A fresh engine has timed plain steps only (a warm-up): a burst of 200 requests, each
    drafting a chain of 4 at the prior's rates, keeps no node where a row costs 1.8 ms of a
    0.38 s step (each would have to be accepted 95 % of the time), while one request keeps
    its chain's first nodes. Without a stand-in for the tree line, every node would be kept."""
    budget = StepBudget()
    budget.plain_cost = StepCost(0.020, 0.0018)
    ids = [f"r{i}" for i in range(200)]
    burst = budget.prune(ids, [DraftTree.chain([1, 2, 3, 4])] * 200, [100] * 200, batch_size=200)
    assert sum(tree.num_nodes for tree in burst) == 0
    alone = budget.prune(["one"], [DraftTree.chain([1, 2, 3, 4])], [100], batch_size=1)[0]
    assert alone.num_nodes > 0


def test_kinds_are_calibrated_apart():
    """A drafter's kinds tell nodes at the same depth and rank apart: one kind always
    accepted, the other never, alternating step by step. Pooled (no kinds) each is worth
    one half, which does not pay at this cost; told apart, the good kind is kept."""

    def kept_after_training(kinds: tuple[int, int]) -> list[int]:
        budget = StepBudget()
        # (1 + p) / (5 + 2 x 15 ms) against 1 / (5 + 15 ms): a node pays when p > 0.75
        budget.cost = StepCost(0.005, 0.015)
        length, kept = 10, []
        for step in range(40):
            good = step % 2 == 0
            tree = DraftTree.chain([7]).with_kinds(kinds[0] if good else kinds[1])
            kept.append(budget.prune(["r"], [tree], [length], batch_size=1)[0].num_nodes)
            committed = [7, 8] if good else [9]
            length += len(committed)
            budget.observe_committed("r", committed, length)
        return kept[-10:]

    assert kept_after_training((0, 2)) == [1, 0] * 5
    assert kept_after_training((0, 0)) == [0] * 10
    past_the_last = DraftTree([5, 6], [-1, 0], kinds=[0, 9])  # kinds past the last bucket share it
    assert TreeShape.of(past_the_last).cells == [0, (KIND_BUCKETS - 1) * 32 + 4]


def test_kinds_survive_pruning_and_truncation():
    tree = DraftTree([1, 2, 3, 4], [-1, -1, 0, 1]).with_kinds([0, 1, 2, 3])
    assert tree.keep(np.array([True, True, False, True])).kinds.tolist() == [0, 1, 3]
    assert tree.truncate(2).kinds.tolist() == [0, 1]
    assert tree.with_tokens(np.array([9, 9, 9])).kinds.tolist() == [0, 1, 2]
    assert DraftTree.chain([1, 2]).with_kinds(2).kinds.tolist() == [2, 2]
    with pytest.raises(ValueError, match="kinds"):
        DraftTree([1], [-1], kinds=[-1])


def test_a_stale_tree_is_not_judged():
    budget = StepBudget()
    budget.draft_cap("r", 4)
    budget.prune(["r"], [DraftTree.chain([1, 2])], [10], batch_size=1)
    budget.observe_committed("r", [1, 2, 3], 20)  # the request moved on elsewhere (preempted, resumed)
    assert budget.requests["r"].counts.trials.sum() == 0
    # and the same tree judged at the right length counts
    budget.prune(["r"], [DraftTree.chain([1, 2])], [10], batch_size=1)
    budget.observe_committed("r", [1, 2, 3], 13)
    assert budget.requests["r"].counts.trials.sum() == 2 and budget.requests["r"].counts.hits.sum() == 2


# ------------------------------------------------------------------ options
def test_auto_is_the_default_of_prunable_methods_only():
    assert parse({"method": "lookup_tree"}).options["max_nodes"] == AUTO
    assert parse({"method": "lookup_tree"}).max_nodes == 16
    assert parse({"method": "lookup_tree", "scope": "global"}).max_nodes == 48
    assert parse({"method": "aded", "auto_max_nodes": 24}).max_nodes == 24
    assert parse({"method": "lookup_tree", "max_nodes": 8}).max_nodes == 8  # a number: a fixed budget
    with pytest.raises(SpecbeamConfigError, match="'max_nodes' cannot be 'auto' for this method"):
        parse({"method": "dsbd", "model": "some/draft", "max_nodes": "auto"})
    with pytest.raises(SpecbeamConfigError, match="auto_max_nodes=3 cannot hold one branch of depth"):
        parse({"method": "lookup_tree", "auto_max_nodes": 3})


def test_per_request_budget_overrides():
    auto = parse({"method": "lookup_tree"})
    assert auto.with_overrides({"max_nodes": 4})["max_nodes"] == 4
    with pytest.raises(SpecbeamConfigError, match=r"max_nodes=auto \(auto_max_nodes=32\) exceeds the engine's"):
        auto.with_overrides({"auto_max_nodes": 32})
    fixed = parse({"method": "lookup_tree", "max_nodes": 8})
    assert fixed.with_overrides({"max_nodes": AUTO, "auto_max_nodes": 8})["max_nodes"] == AUTO
    with pytest.raises(SpecbeamConfigError, match="exceeds the engine's max_nodes=8"):
        fixed.with_overrides({"max_nodes": AUTO})  # auto up to 16 on an engine of 8


# ------------------------------------------------------------------ engines
@pytest.mark.parametrize("config", [LOOKUP_AUTO, ADED_AUTO], ids=["lookup_tree", "aded"])
def test_auto_budget_greedy_equals_no_speculation(engines, prompts, reference, config):
    llm = engines.get(config)
    before = runner_stats(llm)
    assert token_ids(llm.generate(prompts, greedy())) == reference
    for prompt, expected in zip(prompts[:3], reference[:3]):
        assert token_ids(llm.generate([prompt], greedy())) == [expected]
    after = runner_stats(llm)
    # The budget ran: it timed steps, fitted a line, was asked, kept and pruned nodes.
    assert after["budget_asked"] > before["budget_asked"]
    # a fitted line pricing a one-row step above nothing (its intercept is clipped at 0, where a
    # loaded machine's noisy steps can put it)
    assert math.isfinite(after["step_cost_per_row_s"]) and after["step_cost_intercept_s"] >= 0
    assert after["step_cost_intercept_s"] + after["step_cost_per_row_s"] > 0
    assert after["accepted"] > before["accepted"]
    assert 0 < after["budget_kept"] - before["budget_kept"] <= after["budget_drafted"] - before["budget_drafted"]
    assert after["nodes"] - before["nodes"] <= after["budget_kept"] - before["budget_kept"]


def test_hopeful_rates_are_one_standard_error_up_and_near_the_rate_once_measured():
    """The docstring's figures: with nothing but the engine's prior, a draft's first level is
    valued 0.25 higher (4 tries' weight at 0.5); 40 tries later, by their standard error only."""
    budget = StepBudget()
    cold = budget.rates("r", hopeful=True)
    assert budget.rates("r") == pytest.approx(np.full_like(cold, 0.5)) and cold == pytest.approx(0.75)
    budget.requests["r"].counts.add([0] * 40, [0] * 34, decay=1.0)  # 34 of 40 tries at cell 0
    rate, hopeful = budget.rates("r")[0, 0, 0], budget.rates("r", hopeful=True)[0, 0, 0]
    assert rate == pytest.approx((34 + 2) / 44)
    assert hopeful == pytest.approx(rate + math.sqrt(rate * (1 - rate) / 44)) and hopeful < rate + 0.06
