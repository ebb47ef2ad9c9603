"""The engine's own decode steps, timed for the step budget's cost lines (:mod:`vllm_specbeam.core.budget`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from vllm_specbeam.adapter.tree_counts import TreeCounts
from vllm_specbeam.core.budget import StepBudget, StepCost, StepCostModel

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

#: one cost line or a tuple of them, as :func:`same_on_every_rank` broadcasts them
LinesT = TypeVar("LinesT")

#: the step budget refits its cost line (and shares it across tensor-parallel ranks) every this many timed steps
BUDGET_REFIT_STEPS = 16
#: a batch that drafted this many timed steps in a row rests one, to time a plain step again
#: (the controller weighs drafting against it; costs drift on a shared machine)
PLAIN_REFRESH_STEPS = 64
#: seconds between two log lines of the step budget
BUDGET_LOG_SECONDS = 60.0


@dataclass
class TimedStep:
    """A decode step being timed, from its ``execute_model`` to the next one's."""

    rows: int
    start: float
    #: it verifies no node: vLLM's plain decode step, timed apart from steps that verify trees
    plain: bool
    #: some tree in it branches (rows off a first branch: on CPU recomputed with the tree mask),
    #: timed apart from steps whose trees are all chains
    branched: bool = False
    #: the drafter's time within it (drafting is not a cost of the rows)
    draft_seconds: float = 0.0


def decode_step(scheduler_output: SchedulerOutput, now: float) -> TimedStep | None:
    """The step ``scheduler_output`` schedules, to time from ``now``, if it decodes only
    (prompt rows cost differently): one row per request, plus drafts."""
    rows = scheduler_output.total_num_scheduled_tokens
    drafts = sum(len(d) for d in scheduler_output.scheduled_spec_decode_tokens.values())
    requests = len(scheduler_output.num_scheduled_tokens)
    decoding = not scheduler_output.scheduled_new_reqs and rows == requests + drafts
    return TimedStep(rows, now, plain=drafts == 0) if decoding and rows > 0 else None


def same_on_every_rank(lines: LinesT) -> LinesT:
    """Rank 0's cost lines (the target's or the draft's) or drafting seconds on every
    tensor-parallel rank, in one broadcast: each rank drafts, prunes and rests for itself, and
    they must keep the same nodes.
    (vLLM 0.32.0 vllm/distributed/parallel_state.py: ``get_tp_group``,
    ``GroupCoordinator.broadcast_object``.)"""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return lines if group.world_size == 1 else group.broadcast_object(lines, src=0)


def fitted_lines(budget: StepBudget | None, draft_cost: StepCost | None) -> dict[str, StepCost | None]:
    """The fitted lines by stats prefix: the target's steps with trees, with chains alone and its
    plain steps (the budget's), the draft's forwards."""
    return {
        "step_cost": None if budget is None else budget.cost,
        "chain_cost": None if budget is None else budget.chain_cost,
        "plain_cost": None if budget is None else budget.plain_cost,
        "draft_cost": draft_cost,
    }


@dataclass
class DraftForwards:
    """The in-worker draft's forwards, fitted by rows, each priced with its share of the drafting
    around it: a draft-model drafter spends host work on every level besides the forward (the
    logits over the vocabulary, scoring them, a host sync). Priced at the forward alone, a level
    looked a third cheaper than it is (Qwen pair, batch 8, Xeon: 40.0 ms + 0.49 ms a row fitted so,
    66.6 ms + 0.54 ms with the host work; docs/results/qwen-batch8-catch-up and -priced), and the
    controller drafted deeper than its rows paid for.

    Example: a drafting step of 160 ms with forwards of 8, 8 and 8 rows taking 40 ms each: each
    is observed at 40 + (160 - 120) / 3 = 53.3 ms. Forwards outside a drafting step (the syncs
    after a step) are observed as they are."""

    model: StepCostModel = field(default_factory=StepCostModel)
    #: the forwards of the drafting step under way (``None``: none is)
    _step: list[tuple[int, float]] | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if self._step is None:
            self.model.observe(rows, seconds)
        else:
            self._step.append((rows, seconds))

    def drafting(self) -> None:
        """A drafting step starts: its forwards wait for :meth:`drafted`."""
        self._step = []

    def drafted(self, seconds: float) -> None:
        """The drafting step took ``seconds``: its forwards observed with equal shares of the rest."""
        forwards, self._step = self._step or [], None
        share = max(seconds - sum(s for _, s in forwards), 0.0) / max(len(forwards), 1)
        for rows, forward_seconds in forwards:
            self.model.observe(rows, forward_seconds + share)


class StepTimer:
    """Feeds the budget's cost lines: a decode step lasts from its ``execute_model`` to the
    next one's, less its drafting."""

    def __init__(self, budget: StepBudget) -> None:
        self.budget = budget
        self.timed: TimedStep | None = None
        self.timed_steps = 0
        #: timed tree steps since the last timed plain one (one is rested for when it is overdue)
        self.steps_since_plain = 0
        self._logged = time.monotonic()

    def time_step(self, scheduler_output: SchedulerOutput) -> bool:
        """End the step being timed and start timing the one ``scheduler_output`` schedules;
        whether the budget's lines were refitted (the caller refits the draft's then).

        Only steps of decoding requests count, and only when requests carried on into the next
        step (else the engine may have sat idle in between). Plain steps (no node) and tree steps
        are fitted apart. The lines the budget decides with are refitted every
        ``BUDGET_REFIT_STEPS`` timed steps, and at once when a kind of step is timed for the first
        time (until then another kind's line stands for it: :func:`~.budget.step_line`), the same
        steps on every rank.
        """
        now, timed, budget = time.perf_counter(), self.timed, self.budget
        refit = False
        if timed is not None and scheduler_output.scheduled_cached_reqs.req_ids:
            model = budget.plain_model if timed.plain else budget.cost_model if timed.branched else budget.chain_model
            first_of_its_kind = not model.observed
            model.observe(timed.rows, now - timed.start - timed.draft_seconds)
            self.steps_since_plain = 0 if timed.plain else self.steps_since_plain + 1
            self.timed_steps += 1
            refit = first_of_its_kind or self.timed_steps % BUDGET_REFIT_STEPS == 1
            if refit:
                fitted = (budget.cost_model.fitted(), budget.chain_model.fitted(), budget.plain_model.fitted())
                budget.cost, budget.chain_cost, budget.plain_cost = same_on_every_rank(fitted)
        self.timed = decode_step(scheduler_output, now)
        return refit

    def add_draft_seconds(self, seconds: float) -> None:
        """Drafting within the timed step: the draft's time, not the target's rows'."""
        if self.timed is not None:
            self.timed.draft_seconds += seconds

    def mark_branched(self, branched: bool) -> None:
        if self.timed is not None:
            self.timed.branched = branched

    def plain_step_due(self) -> bool:
        """Whether the plain step's own time is due again (it may have drifted); the count restarts."""
        if self.steps_since_plain < PLAIN_REFRESH_STEPS:
            return False
        self.steps_since_plain = 0
        return True

    def log_budget(self, counts: TreeCounts) -> None:
        now = time.monotonic()
        cost = self.budget.cost
        if now - self._logged < BUDGET_LOG_SECONDS or cost is None:
            return
        self._logged = now
        kept = (
            ""
            if counts.budget_asked == 0  # a drafter that cuts its own trees (no "auto" request)
            else f"{counts.budget_kept / counts.budget_asked:.2f} of {counts.budget_drafted / counts.budget_asked:.2f} "
            f"drafted nodes kept per asked request, {counts.budget_idle} idle; "
        )
        logger.info(
            "vllm-specbeam step budget: %sstep cost %.1f ms + %.3f ms per row, %.3f ms more per row past %d rows",
            kept,
            1e3 * cost.intercept,
            1e3 * cost.slope,
            1e3 * cost.bend,
            cost.knee,
        )
