"""The drafting half of an engine step: whether the batch drafts, the drafter's trees, the budget's cut.

The runner's ``propose_draft_token_ids`` hands this the batch after a step
(:class:`~vllm_specbeam.adapter.step_selection.BatchRequest`); what it proposes
goes to the scheduler as draft tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_specbeam.adapter.step_selection import (
    BatchRequest,
    DraftAsk,
    automatic_trees,
    budget_gain,
    clip_to_room,
    request_args,
    requests_to_draft,
    tokens_left,
)
from vllm_specbeam.adapter.step_timing import StepTimer
from vllm_specbeam.adapter.tree_counts import TreeCounts
from vllm_specbeam.core.budget import StepBudget, StepCost
from vllm_specbeam.core.config import METHODS, SpecbeamConfig
from vllm_specbeam.core.controller import StepPrices, Switch, overhead, utility
from vllm_specbeam.core.drafter import TreeDrafter
from vllm_specbeam.core.drain import Arrivals, Pace, token_worth
from vllm_specbeam.core.tree import DraftTree

if TYPE_CHECKING:
    from vllm import SamplingParams


@dataclass
class Proposal:
    """What one drafting step proposes."""

    #: each batch row's draft tokens (empty: none)
    drafts: list[list[int]]
    #: the trees behind them, by request
    trees: dict[str, DraftTree]
    #: the drafter's seconds (its forwards and the host work around them)
    draft_seconds: float = 0.0


class TreeDrafting:
    """Asks the drafter for the next trees, cut by the step budget under ``"max_nodes": "auto"``
    and switched off for the whole batch by the goodput controller when drafting does not pay."""

    def __init__(
        self,
        config: SpecbeamConfig,
        drafter: TreeDrafter,
        counts: TreeCounts,
        same_on_every_rank: Callable[[float], float] | None = None,
    ) -> None:
        self.config, self.drafter, self.counts = config, drafter, counts
        #: rank 0's drafting seconds on every tensor-parallel rank (``None``: one rank): the switch
        #: judges a step by them, and every rank must rest the same steps
        self.same_on_every_rank = same_on_every_rank
        method = METHODS[config.method]
        #: each step's nodes for ``"max_nodes": "auto"`` requests (methods whose trees may be cut), and
        #: the step cost for drafters that cut their own trees by it (lookup branches of draft-model methods)
        self.budget = StepBudget() if method.prunable or drafter.cuts_to_step_cost else None
        self.timer = None if self.budget is None else StepTimer(self.budget)
        #: whether the batch drafts at all (options that keep the target's output: lossy ones draft
        #: what their output means)
        self.switch = Switch() if self.budget is not None and drafter.keeps_target_output(config.options) else None
        #: this step follows the batch's rest: drafts that do not pay are probed
        self.probing = False
        #: whether requests still join the batch (once they stop, tokens are worth what they save)
        self.arrivals = Arrivals()
        #: a drafted request's committed tokens a step, for the drain worth of draft-model drafters only
        #: (drafting for a batch's laggards alone pays the draft forward's intercept for a few requests; a
        #: lookup's trees for a few cost no such forward), and the requests the last proposal drafted for
        self.pace = Pace() if drafter.cuts_to_step_cost else None
        self._drafted: frozenset[str] = frozenset()

    def observe_committed(
        self, req_ids: Sequence[str], sampled_token_ids: list[list[int]], num_tokens: np.ndarray
    ) -> None:
        """Tell the budget each request's committed tokens (``num_tokens``: each batch row's length
        after them), from which it learns its acceptance; read from vLLM's arrays, so a step that
        drafts nothing builds no per-request records."""
        if self.budget is None:
            return
        for index, (req_id, sampled) in enumerate(zip(req_ids, sampled_token_ids)):
            if sampled:
                self.budget.observe_committed(req_id, sampled, int(num_tokens[index]))
        if self.pace is not None:
            drafted, self._drafted = self._drafted, frozenset()
            self.pace.observe([len(s) for r, s in zip(req_ids, sampled_token_ids) if r in drafted and s])

    def drafts_this_step(self, req_ids: Sequence[str], params: Sequence[SamplingParams | None]) -> bool:
        """Whether this step asks the drafter at all (:class:`~vllm_specbeam.core.controller.Switch`),
        ``params`` the requests' own. A step that does not is vLLM's plain decode step: no drafts go
        to the scheduler, so the next forward builds no tree and samples with vLLM's sampler, and
        the draft model feeds nothing (it catches up at its next sync)."""
        counts, switch = self.counts, self.switch
        counts.steps += 1
        if self.budget is not None:  # a draining batch's tokens are valued by what they save
            self.arrivals.observe(req_ids)
            counts.steps_draining += self.arrivals.draining
        self.probing = False
        if switch is None or not self._all_keep_target_output(params):
            return True
        assert self.timer is not None and self.budget is not None  # a switch runs only with a budget
        if self.timer.plain_step_due():
            switch.rest()  # the plain step's own time is due again (it may have drifted)
        drafts = switch.drafts(req_ids)
        counts.steps_off += not drafts
        self.probing = drafts and switch.probing
        if self.probing:  # every request drafts, none sitting out
            counts.steps_probed += 1
            self.budget.wake()
        return drafts

    def _all_keep_target_output(self, params: Sequence[SamplingParams | None]) -> bool:
        """Whether no request overrides the engine's options into lossy ones (``dsbd`` beams on an
        engine of chains): resting such a batch would change what that request's output means."""
        return all(
            self.drafter.keeps_target_output(self.config.with_overrides(request_args(p).overrides))
            for p in params
            if p is not None and p.extra_args
        )

    def propose(self, batch: Sequence[BatchRequest], max_model_len: int, draft_cost: StepCost | None) -> Proposal:
        """The drafter's trees for the requests that draft this step, cut to what pays and fits."""
        budget = self.budget
        asked = requests_to_draft(batch, self.config, None if budget is None else budget.draft_cap, max_model_len)
        worth = {} if budget is None else self._worth(batch, max_model_len)
        prices = StepPrices(
            len(batch),
            None if budget is None else budget.cost,
            draft_cost,
            None if budget is None else budget.plain_cost,
            None if budget is None else budget.chain_cost,
            probe=self.probing,
            worth=worth,
        )
        start = time.perf_counter()
        if budget is not None and self.drafter.cuts_to_step_cost:
            self.drafter.plan_step(prices)
        trees = self.drafter.propose(asked.requests)
        elapsed = time.perf_counter() - start
        self.counts.draft_seconds += elapsed
        if self.timer is not None:
            self.timer.add_draft_seconds(elapsed)
        self.counts.budget_idle += asked.sitting_out
        offered = asked.sitting_out > 0 or any(tree.num_nodes for tree in trees)
        if any(asked.automatic):
            trees = self._keep_what_pays(asked, trees, len(batch), worth)
        proposal = _clipped(asked, trees, len(batch), max_model_len)
        proposal.draft_seconds = elapsed
        if self.pace is not None:
            self._drafted = frozenset(r.req_id for r in batch if proposal.drafts[r.batch_index])
        if self.switch is not None:
            if self.same_on_every_rank is not None:  # host sync (a broadcast) under tensor parallelism
                elapsed = self.same_on_every_rank(elapsed)
            self._judge_step(prices, asked.automatic, offered, proposal.drafts, elapsed)
        if self.timer is not None:
            self.timer.log_budget(self.counts)
        return proposal

    def _worth(self, batch: Sequence[BatchRequest], max_model_len: int) -> dict[str, float]:
        """Each request's committed token against a step's average: 1 while requests join the
        batch, what it saves of the batch's remaining steps once it drains (:func:`token_worth`)."""
        assert self.budget is not None
        if not self.arrivals.draining:
            return {}
        pace = 1.0 if self.pace is None else self.pace.tokens
        worth = token_worth([tokens_left(r, max_model_len) for r in batch], self.budget.plain_cost, pace)
        return {r.req_id: w for r, w in zip(batch, worth.tolist())}

    def _keep_what_pays(
        self, asked: DraftAsk, trees: list[DraftTree], batch_size: int, worth: dict[str, float]
    ) -> list[DraftTree]:
        """``trees`` with the ``"max_nodes": "auto"`` requests' ones cut by the step budget, each
        request's nodes valued by its ``worth`` (1 if absent)."""
        assert self.budget is not None
        automatic = automatic_trees(trees, asked.automatic)
        req_ids = [asked.requests[k].req_id for k in automatic.chosen]
        kept = self.budget.prune(
            req_ids,
            [trees[k] for k in automatic.chosen],
            [asked.requests[k].token_ids.size for k in automatic.chosen],
            batch_size=batch_size,
            other_rows=automatic.fixed_rows,
            worth=[worth.get(req_id, 1.0) for req_id in req_ids],
        )
        trees = list(trees)
        for k, tree in zip(automatic.chosen, kept):
            self.counts.budget_asked += 1
            self.counts.budget_drafted += trees[k].num_nodes
            self.counts.budget_kept += tree.num_nodes
            trees[k] = tree
        return trees

    def _judge_step(
        self, prices: StepPrices, automatic: list[bool], offered: bool, drafts: list[list[int]], seconds: float
    ) -> None:
        """Tell the switch what this drafting step was worth: its :func:`utility`, and whether it was
        priced out (drafts were there to verify, or a drafter that prices its own drafts was asked,
        and the controller kept none: the batch then rests whatever the utility); a step of a
        draft's probe alone waits for the next step's judgement."""
        assert self.switch is not None and self.budget is not None  # a switch runs only with a budget
        prices_own = self.drafter.cuts_to_step_cost
        gain = self.drafter.expected_gain if prices_own else budget_gain(automatic, self.budget.kept_value)
        rows = sum(map(len, drafts))
        offered = offered or (gain is not None and prices_own and bool(automatic))
        branched = prices_own or self.budget.kept_branches
        step_overhead = overhead(prices, rows, seconds, branched)
        if self.drafter.probed:
            self.switch.probed(step_overhead)
            return
        spent = max(seconds - self.drafter.invested_seconds, 0.0)  # a catch-up is judged by its share
        judged = None if gain is None else utility(prices, gain, rows, spent, branched)
        self.switch.after(judged, offered and rows == 0, step_overhead)


def batch_requests(
    input_batch: Any, requests: Mapping[str, Any], sampled_token_ids: list[list[int]]
) -> list[BatchRequest]:
    """vLLM's input batch after a step (``InputBatch``, and the runner's ``CachedRequestState`` by
    request), as the drafting step reads it."""
    batch = []
    for index, req_id in enumerate(input_batch.req_ids):
        state = requests[req_id]
        num_tokens = int(input_batch.num_tokens_no_spec[index])
        token_ids = input_batch.token_ids_cpu[index, :num_tokens]  # [num_tokens]
        sampled = bool(sampled_token_ids[index])
        batch.append(
            BatchRequest(req_id, index, state.sampling_params, len(state.output_token_ids), token_ids, sampled)
        )
    return batch


def _clipped(asked: DraftAsk, trees: list[DraftTree], batch_size: int, max_model_len: int) -> Proposal:
    """The asked requests' trees, each cut to the KV slots left below ``max_model_len``."""
    proposal = Proposal([[] for _ in range(batch_size)], {})
    for index, request, tree in zip(asked.batch_indices, asked.requests, trees):
        tree = clip_to_room(tree, request.token_ids.size, max_model_len)
        proposal.trees[request.req_id] = tree
        proposal.drafts[index] = tree.tokens.tolist()
    return proposal
