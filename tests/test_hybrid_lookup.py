"""Lookup branches in a draft-model method's trees (``"lookup"``, issue #48), without an engine.

The mixed tree's sampling law is proved by exact enumeration (test_verifiers_sampling's
composition of the rejection rule's own tables): lookup nodes are deterministic drafts,
the draft's nodes samples of ``q`` without the lookup's first-level tokens. The drafter
is driven on test_mcsd's fake runtime: how the budget splits, when the draft does not run.
"""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
import torch
from test_mcsd import FakeRuntime, options, path_logits
from test_verifiers_sampling import (
    ATOL,
    ToyModel,
    assert_exact,
    draft_rows,
    mixture,
    next_tokens_error,
    path_tokens,
    rejection_commits,
    sibling_draws,
)

from vllm_specbeam.core.budget import (
    DEPTH_BUCKETS,
    FILL_KIND,
    KIND_BUCKETS,
    RANK_BUCKETS,
    BackOff,
    StepCost,
)
from vllm_specbeam.core.config import AUTO, METHODS, SpecbeamConfigError, parse
from vllm_specbeam.core.controller import StepPrices
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.methods.lookup_tree.branches import (
    EXPLORE_MAX_LAG,
    NEW_TEXT_STEPS,
    fill_paid,
    lookup_first,
    mixed_tree,
    root_tokens,
)
from vllm_specbeam.methods.mcsd.drafter import UNPRICED_THRESHOLD, McsdDrafter, _Growth

# ---------------------------------------------------------------- the mixed tree's law, enumerated
LOOKUPS = {
    "chain": DraftTree(np.array([1, 3]), np.array([ROOT, 0]), kinds=np.array([0, 0])),
    "tree": DraftTree(np.array([1, 2, 4]), np.array([ROOT, ROOT, 0]), kinds=np.array([2, 2, 2])),
}


def masked(row: np.ndarray, tokens: list[int]) -> np.ndarray:
    out = row.copy()
    out[tokens] = 0.0
    return out / out.sum()


def mixed_trees(lookup: DraftTree, q: ToyModel, planted: bool = False) -> list[tuple[DraftTree, float]]:
    """Every mixed tree the drafter can build below ``lookup``, with its probability: two
    first-level draws without replacement from ``q`` without the lookup's first-level
    tokens, one draw from ``q`` below each. ``planted``: the bug of taking the lookup's
    nodes for samples of the draft (their rows ``q`` at their parent, not a point mass)."""
    first = masked(q(()), root_tokens(lookup))
    out = []
    for (a, b), w_first in sibling_draws(first, 2, "without"):
        for c, d in product(range(q.vocab), repeat=2):
            weight = w_first * q((a,))[c] * q((b,))[d]
            if weight == 0:
                continue
            draft = DraftTree(np.array([a, b, c, d]), np.array([ROOT, ROOT, 0, 1]))
            rows = draft_rows(draft, q, conditional=False)
            rows[:2] = first  # the law the first level was drawn from
            tree = mixed_tree(lookup, DraftTree(draft.tokens, draft.parents, rows))
            if planted:
                probs = np.array(tree.draft_probs)
                for node in range(lookup.num_nodes):
                    probs[node] = q(path_tokens(tree, int(tree.parents[node])))
                tree = DraftTree(tree.tokens, tree.parents, probs, kinds=tree.kinds)
            out.append((tree, weight))
    return out


@pytest.mark.parametrize("shape", list(LOOKUPS))
def test_a_mixed_tree_keeps_the_target_distribution(shape: str) -> None:
    lookup = LOOKUPS[shape]
    p, q = ToyModel(21, 5, zeros=0), ToyModel(121, 5)
    trees = mixed_trees(lookup, q)
    assert all(t.kinds is not None and t.kinds[lookup.num_nodes :].tolist() == [FILL_KIND] * 4 for t, _ in trees)
    commits = mixture(trees, lambda t: rejection_commits(t, p, True))
    assert_exact(commits, p, 3)
    # both sources are accepted with positive probability: the check is not vacuous
    via_lookup = sum(w for seq, w in commits.items() if seq[0] in root_tokens(lookup) and len(seq) > 1)
    via_draft = sum(w for seq, w in commits.items() if seq[0] not in root_tokens(lookup) and len(seq) > 1)
    assert via_lookup > 0.05 and via_draft > 0.05


def test_the_planted_lookup_as_a_sample_bug_is_caught() -> None:
    """Taking a lookup node for a sample of the draft (its ``q`` row the draft's) biases the output."""
    p, q = ToyModel(21, 5, zeros=0), ToyModel(121, 5)
    commits = mixture(mixed_trees(LOOKUPS["chain"], q, planted=True), lambda t: rejection_commits(t, p, True))
    assert max(next_tokens_error(commits, p, n) for n in (1, 2)) > 100 * ATOL


def test_the_first_level_is_drawn_without_the_lookups_tokens() -> None:
    """The law the drafter records for its first level is the law it draws from: ``q`` without the lookup's tokens."""
    logits = torch.log(torch.tensor(ToyModel(121, 5)(()), dtype=torch.float32))  # [V]
    request = DraftRequest("r", np.array([0]), options(k_config=[2]), temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    counts = np.zeros(5)
    for _ in range(400):
        growth = _Growth(request, [1], logits, exclude=[1, 3])
        tokens, _ = growth.grow(generator)
        counts[tokens] += 1
        expected = masked(torch.softmax(logits, -1).numpy(), [1, 3])
        assert np.allclose(growth.probs[0][0].numpy(), expected, atol=1e-6)
    assert counts[[1, 3]].sum() == 0 and counts.sum() == 400
    greedy = _Growth(DraftRequest("r", np.array([0]), request.options), [2], logits, exclude=[int(logits.argmax())])
    assert int(logits.argmax()) not in greedy.grow(generator)[0]


def test_a_cap_ends_the_draft_mid_level() -> None:
    request = DraftRequest("r", np.array([0]), options(k_config=[3, 2]))
    growth = _Growth(request, [3, 2, 1], path_logits((), 99), cap=5)
    growth.grow(torch.Generator())
    growth.rows = torch.stack([path_logits((t,), 99) for t in growth.tokens])
    _, parents = growth.grow(torch.Generator())
    assert growth.done and len(growth.tokens) == 5 and parents == [0, 0]


# ---------------------------------------------------------------- how the budget splits
def rates(lookup: float, fill: float) -> np.ndarray:
    table = np.full((KIND_BUCKETS, DEPTH_BUCKETS, RANK_BUCKETS), lookup)
    table[FILL_KIND] = fill
    return table


def test_lookup_first_keeps_the_most_valuable_nodes() -> None:
    chain = LOOKUPS["chain"]
    fill = DraftTree(np.zeros(2, np.int64), np.array([ROOT, 0]))
    share = lookup_first(chain, fill, 3, rates(0.9, 0.6), 0.0)
    assert share.lookup.num_nodes == 2 and share.fill_nodes == 1  # 0.9, 0.81 from the lookup, then the fill's 0.6
    assert np.allclose(share.values, [0.9, 0.81])
    assert lookup_first(chain, fill, 3, rates(0.9, 0.6), 0.7).fill_nodes == 0  # the fill is worth too little
    share = lookup_first(chain, fill, 2, rates(0.5, 0.9), 0.0)
    assert share.lookup.num_nodes == 0 and share.fill_nodes == 2  # the fill's 0.9 and 0.81 beat 0.5 and 0.25
    assert share.values == []
    share = lookup_first(chain, fill, 3, rates(0.85, 0.9), 0.0)
    assert share.lookup.num_nodes == 1 and share.fill_nodes == 2  # 0.9, 0.85, 0.81 (fill, lookup, fill) beat 0.7225
    share = lookup_first(chain, fill, 1, rates(0.9, 0.9), 0.0)
    assert share.lookup.num_nodes == 1 and share.fill_nodes == 0  # ties go to the lookup
    share = lookup_first(chain, fill, 4, rates(0.9, 0.6), 0.5)
    # the threshold judges the fill's first level only (0.6, not 0.36)
    assert share.lookup.num_nodes == 2 and share.fill_nodes == 2
    siblings = DraftTree(np.zeros(3, np.int64), np.array([ROOT, ROOT, 1]))
    table = rates(0.9, 0.6)
    table[FILL_KIND, 0, 2:] = 0.4  # the second candidate (third below the root) is below the threshold: its child too
    assert lookup_first(chain, siblings, 8, table, 0.5).fill_nodes == 1


class DeferringRuntime(FakeRuntime):
    """test_mcsd's fake runtime, also recording which requests it was told ran no draft forward."""

    def __init__(self) -> None:
        super().__init__()
        self.synced: list[str] = []
        self.deferred: list[str] = []

    def sync_many(self, requests):
        self.synced += [r for r, _, _ in requests]
        return super().sync_many(requests)

    def defer(self, req_ids):
        self.deferred += list(req_ids)


def hybrid(runtime: DeferringRuntime, **overrides) -> McsdDrafter:
    drafter = McsdDrafter(options(lookup="request", **overrides))
    drafter.use_runtime(runtime)
    return drafter


#: lookup: a long chain after "7 8"; short enough (26 tokens) for the draft to catch up on it at once
REPEATS = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18] * 2 + [7, 8]


def learnt(d: McsdDrafter, lookup: float, fill: float) -> McsdDrafter:
    """``d`` after many judged nodes: the engine's rates ``lookup`` (long matches) and ``fill``."""
    engine = d.lookup.values.engine
    engine.trials[:] = 1000.0
    engine.hits[:] = 1000.0 * rates(lookup, fill).ravel()
    return d


def test_a_lookup_that_fills_the_budget_runs_no_draft() -> None:
    runtime = DeferringRuntime()
    d = learnt(hybrid(runtime, max_nodes=8, k_config=[1], stop_threshold=0.0), 0.95, 0.5)
    tree = d.propose([DraftRequest("r", np.array(REPEATS), d.options)])[0]
    assert tree.tokens.tolist() == [9, 10, 11, 12, 13, 14, 15, 16] and set(tree.kinds.tolist()) == {0}
    assert runtime.synced == [] and runtime.fed == [] and runtime.deferred == ["r"]


#: 10 ms a step up to 3 rows, 5 ms more for each row past them
DEAR_ROWS = StepCost(intercept=0.010, slope=0.0, knee=3, bend=0.005)


def test_the_step_cost_cuts_the_lookup_to_the_nodes_that_pay() -> None:
    """As ``lookup_tree``'s ``"max_nodes": "auto"``: the chain's values are 0.95, 0.9025, 0.857...;
    at batch 1 under :data:`DEAR_ROWS` two nodes give 2.85 tokens in 10 ms, three 3.71 in 15 ms.
    The cut nodes are judged all the same (so their value can rise again)."""
    runtime = DeferringRuntime()
    d = learnt(hybrid(runtime, max_nodes=8, k_config=[1], stop_threshold=0.0), 0.95, 0.5)
    assert d.cuts_to_step_cost
    request = DraftRequest("r", np.array(REPEATS), d.options)
    d.plan_step(StepPrices(1, DEAR_ROWS))
    tree = d.propose([request])[0]
    assert tree.tokens.tolist() == [9, 10] and runtime.synced == [] and runtime.deferred == ["r"]
    d.propose([DraftRequest("r", np.array([*REPEATS, 9, 10, 11, 12, 99]), d.options)])
    counts = d.lookup.values.requests["r"].counts  # judged: the 8-node chain against 5 committed tokens
    assert counts.trials.sum() == 5 and counts.hits.sum() == 4
    d.plan_step(StepPrices(1, StepCost(intercept=0.010, slope=0.0)))  # rows free: the whole chain
    assert d.propose([request])[0].num_nodes == 8
    d.plan_step(StepPrices(8, DEAR_ROWS))  # 8 requests' own rows already past the knee: no node pays
    assert d.propose([request])[0].num_nodes == 0


def test_the_draft_fills_what_the_lookup_leaves_below_the_root() -> None:
    runtime = DeferringRuntime()
    d = learnt(hybrid(runtime, max_nodes=16, lookup_depth=3, k_config=[2], stop_threshold=0.0), 0.95, 0.5)
    tree = d.propose([DraftRequest("r", np.array(REPEATS), d.options)])[0]
    assert tree.tokens[:3].tolist() == [9, 10, 11] and tree.kinds[:3].tolist() == [0, 0, 0]
    fill = tree.kinds == FILL_KIND
    assert fill.sum() == 8 and runtime.synced == ["r"] and runtime.deferred == []  # 2 + 2 + 2 + 2: depth 4
    first = [int(t) for t, parent, is_fill in zip(tree.tokens, tree.parents, fill) if is_fill and parent == ROOT]
    best = torch.topk(path_logits((), 99).index_fill(0, torch.tensor([9]), float("-inf")), 2).indices.tolist()
    assert first == best and 9 not in first  # the draft's best tokens other than the lookup's


def test_without_a_match_the_draft_drafts_alone_and_learns() -> None:
    runtime = DeferringRuntime()
    d = hybrid(runtime, max_nodes=8, k_config=[1], stop_threshold=0.0)
    tree = d.propose([DraftRequest("r", np.array([1, 2, 3]), d.options)])[0]
    assert tree.num_nodes == 4 and set(tree.kinds.tolist()) == {FILL_KIND}  # the chain, at depth 4
    d.propose([DraftRequest("r", np.array([1, 2, 3, *tree.tokens[:2].tolist(), 5]), d.options)])
    state = d.lookup.values.requests["r"]  # the first tree was judged: 2 hits of 3 trials
    assert state.counts.trials.sum() == 3 and state.counts.hits.sum() == 2
    d.remove_requests(["r"])
    assert "r" not in d.lookup.values.requests


FIRST_FILL = int(path_logits((), 99).argmax())  # the fake draft's first token below a root alone
CYCLE = [t for t in range(12) if t != FIRST_FILL]  # a text the lookup predicts once it has gone round once


def drive(d: McsdDrafter, runtime: DeferringRuntime, tokens: list[int], commits) -> list[int]:
    """Steps of ``d`` on one request: ``commits(step, tree)`` are the tokens the target commits
    after the step's tree. Returns the steps whose trees held draft (fill) nodes; checks that
    the others ran no draft forward."""
    filled = []
    for step, commit in enumerate(commits):
        synced = len(runtime.synced)
        tree = d.propose([DraftRequest("r", np.array(tokens), d.options)])[0]
        if tree.kinds is not None and (tree.kinds == FILL_KIND).any():
            filled.append(step)
        else:
            assert len(runtime.synced) == synced and runtime.deferred[-1] == "r"
        tokens += commit(step, tree)
    return filled


def novel(step: int, tree: DraftTree) -> list[int]:
    """New text, no token of which the draft guesses: the lookup finds nothing, the fill misses."""
    return [1000 + step]


def test_a_fill_left_out_by_the_threshold_is_tried_again_on_a_back_off() -> None:
    """One missed fill node valued the fill below ``stop_threshold`` (its prior is the threshold),
    and a fill never drafted is never judged: no draft again, however new the text (issue #48's
    absorbing state). A fill left out retries after 1, 2, 4, 8 steps without it."""
    runtime = DeferringRuntime()
    d = hybrid(runtime, max_nodes=8, k_config=[1])
    assert d.options["stop_threshold"] == AUTO and UNPRICED_THRESHOLD == 0.5  # unpriced: the threshold
    assert drive(d, runtime, [1, 2, 3], [novel] * 30) == [0, 2, 5, 10, 19, 28]


def test_a_try_the_threshold_left_out_probes_with_one_node() -> None:
    """The back-off's tries learn the fill's value at the cost of one draft forward."""
    runtime = DeferringRuntime()
    d = hybrid(runtime, max_nodes=8, k_config=[1])
    tokens, fills = [1, 2, 3], []
    for step in range(30):
        tree = d.propose([DraftRequest("r", np.array(tokens), d.options)])[0]
        fills.append(0 if tree.kinds is None else int((tree.kinds == FILL_KIND).sum()))
        tokens += novel(step, tree)
    tried = [n for n in fills if n]
    # the first at its prior (the threshold itself): the whole chain, the draft's stopping rule judging
    # below the first level; then the back-off's (left to that rule alone, these drafted 4 nodes each)
    assert tried == [4, 1, 1, 1, 1, 1], fills


def test_a_probe_that_pays_brings_back_the_whole_chain() -> None:
    """On new text the draft guesses, one paid probe lifts the fill's first level over the threshold,
    and the next step drafts the chain the draft's stopping rule allows, not another single node
    (issue #48: on HumanEval the hybrid committed 1.4 tokens a step against mcsd's 3.3)."""
    runtime = DeferringRuntime()
    d = learnt(hybrid(runtime, max_nodes=8, k_config=[1]), 0.9, 0.3)  # the fill learnt poor (editing)
    tokens, fills = [1, 2, 3], []
    for _ in range(6):
        tree = d.propose([DraftRequest("r", np.array(tokens), d.options)])[0]
        fills.append(0 if tree.kinds is None else int((tree.kinds == FILL_KIND).sum()))
        tokens += [*tree.tokens.tolist(), 1000 + len(tokens)]  # the target accepts every draft node
    assert fills[0] == 1 and max(fills) == 4, fills  # a probe, then whole chains once it paid


def cycle(step: int, tree: DraftTree) -> list[int]:
    """The target goes round :data:`CYCLE`: the lookup's chain, then one more."""
    tokens = tree.tokens[tree.kinds != FILL_KIND].tolist()
    return [*tokens, CYCLE[(CYCLE.index(tokens[-1]) + 1) % len(CYCLE)]]


def test_the_fill_is_tried_behind_a_lookup_and_used_again_where_the_lookup_stops_matching() -> None:
    runtime = DeferringRuntime()
    d = hybrid(runtime, max_nodes=16, lookup_depth=4, k_config=[1])

    def drafts(step: int, tree: DraftTree) -> list[int]:  # new text the draft guesses the first token of
        return [FIRST_FILL, 2000 + step]

    tokens = [500, 501, 502]
    assert drive(d, runtime, tokens, [novel] * 3) == [0, 2]  # the fill (below the root alone) missed twice
    tokens += CYCLE + CYCLE[:2]
    filled = drive(d, runtime, tokens, [cycle] * 20)  # the lookup's chain, the fill behind it, missing
    # tried after 2 (the rest carries over) and 4 lookup-only steps; 8 steps later the draft lags
    # 45 tokens (5 a step), past EXPLORE_MAX_LAG: no try the threshold left out catches up that far
    assert filled == [2, 7]
    # the draft lags far: not at the first step without a lookup branch (an edit in copied text buys one
    # node for the prompt's catch-up), but at the second (new text; the rest passed), then every step
    assert drive(d, runtime, tokens, [drafts] * 10) == list(range(NEW_TEXT_STEPS, 10))


def test_a_request_the_lookup_serves_from_its_first_step_never_feeds_its_prompt_to_the_draft() -> None:
    """A try the threshold left out first feeds the draft what it lags: never a whole prompt
    (issue #48's editing prompts paid each prompt's prefill into the draft for nothing)."""
    runtime = DeferringRuntime()
    d = hybrid(runtime, max_nodes=16, lookup_depth=4, k_config=[1])
    # a short request: the fill behind the lookup is tried (at its prior), misses, and is tried again
    assert drive(d, runtime, [500, *CYCLE, *CYCLE[:2]], [cycle] * 4) == [0, 2]
    d.remove_requests(["r"])
    synced = len(runtime.synced)
    long_prompt = [*range(600, 600 + EXPLORE_MAX_LAG), *CYCLE, *CYCLE[:2]]
    assert drive(d, runtime, long_prompt, [cycle] * 12) == [] and len(runtime.synced) == synced


def test_a_draft_worth_running_does_not_catch_up_on_a_long_prompt_the_lookup_serves() -> None:
    """The threshold asks for the draft (its value learnt high), but the draft would first feed
    the whole prompt: not while the lookup has branches; at the second step without one, it does."""
    runtime = DeferringRuntime()
    d = learnt(hybrid(runtime, max_nodes=16, lookup_depth=4, k_config=[1]), 0.9, 0.9)
    tokens = [*range(600, 600 + EXPLORE_MAX_LAG), *CYCLE, *CYCLE[:2]]
    assert drive(d, runtime, tokens, [cycle] * 6) == [] and runtime.synced == []
    # new text: the first step still ends in the cycle's n-gram (a branch), then NEW_TEXT_STEPS without one
    assert drive(d, runtime, tokens, [novel] * 4) == [NEW_TEXT_STEPS, 3] and runtime.synced == ["r", "r"]


def test_the_back_off_is_engine_wide_so_short_requests_do_not_each_start_over() -> None:
    """Many short copying requests (issue #48's editing prompts): fruitless fills behind the
    lookup lengthen the rest for the requests after them, not only within one request."""
    runtime = DeferringRuntime()
    d = hybrid(runtime, max_nodes=16, lookup_depth=4, k_config=[1])
    filled = []
    for request in range(4):  # each request: 4 steps of the lookup's chain, the fill behind it missing
        filled.append(drive(d, runtime, [500 + request, *CYCLE, *CYCLE[:2]], [cycle] * 4))
        d.remove_requests(["r"])
    assert filled == [[0, 2], [1], [2], []]  # rests 1, 2, 4, 8 across requests; per request: [0, 2] each


def test_a_paid_try_halves_the_rest_rather_than_starting_it_over() -> None:
    """BackOff's docstring example: fruitless tries at steps 0, 2, 5 (rests 1, 2, 4), a paid
    try at 10, then a fruitless one at 11 rests 4 steps (12-15), not 1."""
    back_off, tried = BackOff(), []
    for step in range(20):
        if back_off.allows():
            tried.append(step)
            back_off.after(paid=step == 10)
    assert tried == [0, 2, 5, 10, 11, 16]


def test_a_fill_pays_when_the_committed_tokens_walk_through_its_nodes() -> None:
    # lookup a -> b; fill c below the root, d below it
    tree = DraftTree(np.array([5, 6, 7, 8]), np.array([ROOT, 0, ROOT, 2]), kinds=np.array([1, 1, FILL_KIND, FILL_KIND]))
    assert fill_paid(tree, [7, 1]) and fill_paid(tree, [7, 8, 9])
    assert not fill_paid(tree, [5, 6, 8]) and not fill_paid(tree, [6, 7]) and not fill_paid(tree, [])


def test_off_drafts_exactly_as_before() -> None:
    """``"lookup": "off"`` is today's drafter: the same trees from the same generator."""
    plain, off = McsdDrafter(options(k_config=[2, 2])), McsdDrafter(options(k_config=[2, 2], lookup="off"))
    for d in (plain, off):
        d.use_runtime(FakeRuntime())
    for temperature in (0.0, 1.0):
        ours, theirs = (
            d.propose([DraftRequest("r", np.array(REPEATS), d.options, temperature)])[0] for d in (off, plain)
        )
        assert ours.tokens.tolist() == theirs.tokens.tolist() and ours.kinds is None
        assert (ours.draft_probs is None) == (temperature == 0.0)


# ---------------------------------------------------------------- the option
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"lookup": "on"}, r"option 'lookup' must be one of \['off', 'request', 'global'\], got 'on'"),
        ({"lookup": True}, "option 'lookup' must be a str"),
        ({"lookup_depth": 0}, r"option 'lookup_depth' must be in \[1, 64\]"),
    ],
)
def test_a_bad_lookup_is_refused_at_start_up(config: dict, message: str) -> None:
    with pytest.raises(SpecbeamConfigError, match=message):
        parse({"method": "mcsd", "model": "draft", **config})


def test_forgetting_finished_requests_empties_the_global_lookup_index() -> None:
    d = McsdDrafter(options(lookup="global"))
    d.finished([DraftRequest("a", np.arange(40), d.options)])
    assert d.learns_across_requests and d.lookup.drafter.index.num_tokens == 40
    d.forget_finished()  # what the benchmarks do before every timed run
    assert d.lookup.drafter.index.num_tokens == 0


def test_the_global_lookup_indexes_each_salt_apart_unless_told_not_to() -> None:
    """A finished request's text goes into its cache_salt's partition (``"index_isolation": "salt"``,
    the default), or into the one shared partition (``"none"``)."""
    for isolation, key in (("salt", "tenant-a"), ("none", None)):
        d = McsdDrafter(options(lookup="global", index_isolation=isolation))
        assert McsdDrafter.salted_index(d.options) == (isolation == "salt")
        d.finished([DraftRequest("a", np.arange(40), d.options, cache_salt="tenant-a")])
        assert d.lookup.drafter.index.partition(key).num_tokens == 40
        assert d.index_stats["index_partitions"] == 1


def test_lookup_is_global_by_default_and_engine_wide() -> None:
    config = parse({"method": "mcsd", "model": "draft"})
    assert config.options["lookup"] == "global" and config.options["lookup_depth"] == 24
    # lookup on gives the lookup's trees room unless max_nodes is set; off keeps mcsd's own default
    assert config.options["max_nodes"] == 48
    assert parse({"method": "mcsd", "model": "draft", "lookup": "request"}).options["max_nodes"] == 48
    assert parse({"method": "mcsd", "model": "draft", "max_nodes": 8}).options["max_nodes"] == 8
    assert parse({"method": "mcsd", "model": "draft", "lookup": "off"}).options["max_nodes"] == 16
    assert METHODS["dsbd"].options()["lookup"].default == "off"  # not measured to pay on dsbd's beams
    with pytest.raises(SpecbeamConfigError, match=r"'lookup' is engine-wide.*set it in the engine's speculative"):
        config.with_overrides({"lookup": "off"})
    assert config.with_overrides({"lookup_depth": 4})["lookup_depth"] == 4
    assert "lookup" in METHODS["dsbd"].options() and "lookup" not in METHODS["mjsd"].options()
