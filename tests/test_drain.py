"""A draining batch's token worth (``core/drain.py``) and the budget's choice under it."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_specbeam.core.budget import StepBudget, StepCost
from vllm_specbeam.core.drain import PACE_MEMORY, Arrivals, Pace, token_worth
from vllm_specbeam.core.tree import DraftTree

#: flat to 6 rows, then 0.7 ms a row: SmolLM2's plain steps on the 2-core EPYC, about
HINGE = StepCost(0.020, 0.0, knee=6, bend=0.0007)


def test_arrivals_drain_after_four_usual_gaps_without_a_join():
    """The docstring's example: joins at steps 0, 2, 4, 6 (every other step a new request)."""
    arrivals, draining = Arrivals(), []
    for step in range(20):
        members = [f"r{k}" for k in range(step // 2 + 1)] if step <= 6 else [f"r{k}" for k in range(4)]
        arrivals.observe(members)
        draining.append(arrivals.draining)
    assert draining.index(True) == 15 and all(draining[15:])
    arrivals.observe(["r0", "new"])
    assert not arrivals.draining


def test_a_server_whose_requests_come_and_go_never_drains():
    """A request leaves and another joins every 6 steps: a gap of 6, never 4 gaps without a join."""
    arrivals, draining = Arrivals(), []
    for step in range(200):
        arrivals.observe([f"r{k}" for k in range(step // 6, step // 6 + 4)])
        draining.append(arrivals.draining)
    assert not any(draining[30:])


def test_a_token_ending_the_batch_saves_its_share_of_the_last_step_the_others_their_row():
    """200 requests, 5 with the most tokens left: theirs are worth ``P(5) / 5``, the others'
    ``P'(200)`` (the bend past the knee), each over the average ``P(200) / 200``."""
    left = [48] * 5 + [20] * 195
    average = float(HINGE.seconds(200)) / 200
    worth = token_worth(left, HINGE)
    assert worth[:5] == pytest.approx(float(HINGE.seconds(5)) / 5 / average)
    assert worth[5:] == pytest.approx(0.0007 / average)
    assert token_worth([40, 38, 10], HINGE).tolist() == pytest.approx([1.5, 1.5, 0.0])


def test_at_the_batchs_pace_a_request_ends_it_if_undrafted_it_would_end_after_the_last():
    """The docstring's example: at 4 tokens a step, 10 tokens left undrafted take as long as 40
    drafted, so all three end the batch; at 1 token a step (no drafting), the first two."""
    assert token_worth([40, 38, 10], HINGE, pace=4.0).tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert token_worth([40, 38, 10], HINGE, pace=1.0).tolist() == pytest.approx([1.5, 1.5, 0.0])
    assert token_worth([40, 38, 10], HINGE, pace=0.5).tolist() == pytest.approx([1.5, 1.5, 0.0])


def test_the_pace_averages_the_drafted_requests_committed_tokens_and_starts_at_one():
    pace = Pace()
    assert pace.tokens == 1.0
    pace.observe([])  # a step that verified no draft
    assert pace.tokens == 1.0
    pace.observe([3, 5])
    assert pace.tokens == pytest.approx(PACE_MEMORY + (1 - PACE_MEMORY) * 4)


@pytest.mark.parametrize(
    "left",
    [[64] * 8, [5], [40, None, 3], [-2]],
    ids=["equal requests: the average", "one request: its whole step", "a limit unknown", "one past its limit"],
)
def test_every_token_is_worth_the_average_where_no_request_ends_the_batch_alone(left):
    assert token_worth(left, HINGE).tolist() == [1.0] * len(left)
    assert token_worth(left, None).tolist() == [1.0] * len(left)


def test_a_draining_batch_drafts_for_the_request_it_waits_for():
    """8 requests on a line flat to 6 rows: the one with the most tokens left keeps its chain and
    the 7 that will end sooner keep nothing (their rows past the knee save no step); valued
    alike (a batch requests still join), the leaders keep nodes too."""
    chains = [DraftTree.chain([1, 2, 3, 4])] * 8
    ids = [f"r{k}" for k in range(8)]
    worth = token_worth([40] + [12] * 7, HINGE)

    def kept(worth: np.ndarray | None) -> list[int]:
        budget = StepBudget()
        budget.cost = budget.chain_cost = budget.plain_cost = HINGE
        return [tree.num_nodes for tree in budget.prune(ids, chains, [100] * 8, batch_size=8, worth=worth)]

    draining = kept(worth)
    assert draining[0] == 4 and draining[1:] == [0] * 7
    assert sum(kept(None)[1:]) > 0


def test_a_second_burst_after_a_drain_drains_as_soon_as_the_first():
    """Two bursts of 4 requests over 4 steps, each then run 50 steps: the second joins a batch
    that had emptied, the 50 steps are no gap between arrivals, and it drains as soon."""
    arrivals, starts = Arrivals(), []
    for burst in range(2):
        for step in range(54):
            arrivals.observe([f"b{burst}r{k}" for k in range(min(step, 3) + 1)])
            if arrivals.draining and len(starts) == burst:
                starts.append(step)
    assert starts == [8, 8]


def test_the_drafting_step_values_tokens_by_what_they_save_once_the_batch_drains():
    """``lookup_tree`` over 8 requests of repeating text, started together, one allowed 60 tokens
    and the others 20: while they join, every request keeps nodes; once the batch drains
    (5 steps without a join), only the one the batch waits for does."""
    from vllm import SamplingParams

    from vllm_specbeam.adapter.drafting import TreeDrafting
    from vllm_specbeam.adapter.step_selection import BatchRequest
    from vllm_specbeam.adapter.tree_counts import TreeCounts
    from vllm_specbeam.core.config import METHODS, parse

    config = parse({"method": "lookup_tree", "num_speculative_tokens": 4})
    drafting = TreeDrafting(config, METHODS["lookup_tree"].drafter_class()(config.options), TreeCounts())
    assert drafting.budget is not None
    drafting.budget.cost = drafting.budget.chain_cost = drafting.budget.plain_cost = HINGE
    ids = [f"r{k}" for k in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=60 if k == 0 else 20) for k in range(8)]
    kept = []
    for step in range(8):
        assert drafting.drafts_this_step(ids, params)
        tokens = np.asarray([7, 8, 9, 10] * 6 + [7], np.int64)  # [25]: the text repeats
        batch = [BatchRequest(r, k, params[k], step, tokens, True) for k, r in enumerate(ids)]
        proposal = drafting.propose(batch, 4096, None)
        kept.append([len(proposal.drafts[k]) > 0 for k in range(8)])
        drafting.budget.wake()  # every request asked every step
    assert all(kept[0]) and drafting.counts.steps_draining == 3
    assert kept[-1] == [True] + [False] * 7


def test_a_drafter_that_prices_its_own_drafts_gets_each_requests_worth_once_the_batch_drains():
    """The same batch as above, handed to a drafter that cuts its trees by the step's prices
    (``mcsd``, ``dsbd`` chains, the hybrid lookup): its prices carry no worth while requests join
    and :func:`token_worth` by request once the batch drains (the one with 60 tokens to go the
    batch's last)."""
    from vllm import SamplingParams

    from vllm_specbeam.adapter.drafting import TreeDrafting
    from vllm_specbeam.adapter.step_selection import BatchRequest
    from vllm_specbeam.adapter.tree_counts import TreeCounts
    from vllm_specbeam.core.config import METHODS, parse

    class PricingDrafter(METHODS["lookup_tree"].drafter_class()):  # type: ignore[misc]
        cuts_to_step_cost = True

        def plan_step(self, prices):
            worths.append(dict(prices.worth))

    worths: list[dict[str, float]] = []
    config = parse({"method": "lookup_tree", "num_speculative_tokens": 4})
    drafting = TreeDrafting(config, PricingDrafter(config.options), TreeCounts())
    assert drafting.budget is not None
    drafting.budget.cost = drafting.budget.chain_cost = drafting.budget.plain_cost = HINGE
    ids = [f"r{k}" for k in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=60 if k == 0 else 20) for k in range(8)]
    tokens = np.asarray([7, 8, 9, 10] * 6 + [7], np.int64)  # [25]
    for step in range(8):
        drafting.drafts_this_step(ids, params)
        drafting.propose([BatchRequest(r, k, params[k], step, tokens, True) for k, r in enumerate(ids)], 4096, None)
    assert worths[0] == {} and len(worths) == 8
    expected = token_worth([60 - 7] + [20 - 7] * 7, HINGE)
    assert worths[-1] == pytest.approx(dict(zip(ids, expected.tolist())))
    assert worths[-1]["r0"] > 1 > worths[-1]["r1"]


def test_the_drafting_step_paces_only_the_requests_it_drafted_for():
    """A request drafted for commits 3 tokens, one without a draft 1: the pace counts the first
    only, and a step after one that proposed nothing leaves it as it was. A drafter that prices no
    draft forward keeps no pace."""
    from vllm import SamplingParams

    from vllm_specbeam.adapter.drafting import TreeDrafting
    from vllm_specbeam.adapter.step_selection import BatchRequest
    from vllm_specbeam.adapter.tree_counts import TreeCounts
    from vllm_specbeam.core.config import METHODS, parse

    class PricingDrafter(METHODS["lookup_tree"].drafter_class()):  # type: ignore[misc]
        cuts_to_step_cost = True  # a draft-model drafter's pricing: the pace is theirs

    config = parse({"method": "lookup_tree", "num_speculative_tokens": 4})
    assert TreeDrafting(config, METHODS["lookup_tree"].drafter_class()(config.options), TreeCounts()).pace is None
    drafting = TreeDrafting(config, PricingDrafter(config.options), TreeCounts())
    assert drafting.budget is not None and drafting.pace is not None
    drafting.budget.cost = drafting.budget.chain_cost = drafting.budget.plain_cost = HINGE
    ids, params = ["r0", "r1"], SamplingParams(temperature=0.0, max_tokens=60)
    repeating, new = np.asarray([7, 8, 9, 10] * 6 + [7], np.int64), np.arange(100, 125, dtype=np.int64)  # [25] each
    assert drafting.drafts_this_step(ids, [params, params])
    batch = [BatchRequest("r0", 0, params, 0, repeating, True), BatchRequest("r1", 1, params, 0, new, True)]
    proposal = drafting.propose(batch, 4096, None)
    assert proposal.drafts[0] and not proposal.drafts[1]
    drafting.observe_committed(ids, [[8, 9, 10], [5]], np.asarray([28, 26]))
    paced = PACE_MEMORY + (1 - PACE_MEMORY) * 3
    assert drafting.pace.tokens == pytest.approx(paced)
    drafting.observe_committed(ids, [[7], [5]], np.asarray([29, 27]))
    assert drafting.pace.tokens == pytest.approx(paced)
