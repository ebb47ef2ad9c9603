"""The goodput controller's maths: what a step is expected to commit against what it costs.

Every exact method speculates only where it pays. A step verifying ``R`` rows
costs ``C(R)`` seconds (:class:`~vllm_specbeam.core.budget.BatchCost`, fitted
to the engine's steps; a step with no node is timed apart) plus the draft
model's forwards, each ``D(rows)`` seconds (the same hinge, fitted to the
draft's own forwards). It commits one token per
request plus, in expectation, the values of the nodes it verifies. A part of
the step (a level of draft nodes, the draft forward that yields it) joins only
if it raises the step's tokens per second::

    (T + gain) / (S + price) > T / S    <=>    gain * S > T * price

Worked example: 4 requests, no node: ``T = 4``, ``C(4) = 40`` ms. The draft's
first level would add 4 rows (``C(8) = 42`` ms) and 2.4 expected tokens, after
one draft forward over the 4 requests (``D(4) = 6`` ms): ``6.4 / 48 = 0.133``
tokens a millisecond against ``0.100``, so it runs. With a draft forward of
40 ms, ``6.4 / 82 = 0.078``: it does not, and the step is vLLM's plain one.

:class:`StepLedger` keeps that account through one step's drafting;
:class:`Switch` turns a whole batch's drafting off after steps that chose
nothing, and probes to come back (rationale: docs/budget.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_specbeam.core.budget import BackOff, BatchCost, StepCost, step_line

#: the rests double up to this many steps (a batch probes after 1, 2, 4, ... resting steps)
MAX_OFF_STEPS = 16
#: a draft's catch-up (the committed tokens it lacks: its request's prompt, or what was committed
#: while it sat out, past the one row a step that keeps it in step feeds) is priced as spread over
#: this many steps, or the tokens its request has left if fewer: it buys the steps after it
CATCH_UP_STEPS = 32
#: at most this share of a resting batch's time goes to its probes: a probe dearer than
#: ``PROBE_SHARE * MAX_OFF_STEPS`` plain steps (a draft's catch-up at a large batch) rests longer
PROBE_SHARE = 0.02
#: the longest rest, however dear the probes
LONGEST_REST = 64
#: how much of a batch's drafting utility carries over to the next drafting step (about 3 steps' memory)
UTILITY_MEMORY = 0.7
#: a batch rests while its average utility is below this: drafting that costs a step 1 % and finds
#: nothing for a while (new text) is kept, since the text may repeat again at any step
REST_BELOW = 0.99


@dataclass(frozen=True)
class StepPrices:
    """What the runner measured, handed to a drafter before each step (``None``: not measured yet)."""

    #: requests in the step
    batch_size: int
    #: seconds of a target step verifying nodes, by rows
    target: StepCost | None
    #: seconds of one draft-model forward by rows
    draft: StepCost | None = None
    #: seconds of a plain target step (no node), by rows (``None``: the tree steps' line stands for it)
    plain: StepCost | None = None
    #: seconds of a target step whose trees are all chains, by rows (:func:`~.budget.step_line`)
    chain: StepCost | None = None
    #: the step follows the batch's rest (:class:`Switch`): a draft that does not pay is probed
    probe: bool = False
    #: a draining batch's requests' committed tokens against a step's average, by request
    #: (:func:`~vllm_specbeam.core.drain.token_worth`; absent: 1, as while requests join)
    worth: Mapping[str, float] = field(default_factory=dict)

    @property
    def step(self) -> BatchCost | None:
        """This batch's step by its rows, plain or verifying trees (which may branch)."""
        return self.step_of(branched=True)

    def step_of(self, branched: bool) -> BatchCost | None:
        """This batch's step by its rows, plain or verifying trees that branch, or chains alone."""
        return BatchCost.of(step_line(branched, self.target, self.chain), self.batch_size, self.plain)


@dataclass
class StepLedger:
    """One step's expected committed tokens and its seconds so far, as drafting adds to them."""

    target: BatchCost
    #: ``None``: draft forwards not measured yet, priced at nothing (so that they get measured)
    draft: StepCost | None
    tokens: float
    rows: int
    draft_seconds: float = 0.0
    #: the step follows the batch's rest (:attr:`StepPrices.probe`): a draft that does not pay is probed
    probe_due: bool = False
    #: the step drafts a probe (:class:`DraftGate`): its one node is drafted whatever it costs,
    #: valued at nothing (the tokens the target commits value it)
    probing: bool = False
    #: some of its nodes were drafted unpriced (a probe, a request's own threshold): ``tokens`` lacks their value
    unvalued: bool = False
    #: :attr:`StepPrices.worth`: a request's expected tokens count times its worth
    worth: Mapping[str, float] = field(default_factory=dict)
    #: seconds of catch-up this step spends for the steps after it (:func:`catch_up_rows`): in the
    #: draft's forwards, not in :attr:`draft_seconds`, which holds their share of this step
    invested_seconds: float = 0.0

    @classmethod
    def of(cls, prices: StepPrices, other_rows: int = 0) -> StepLedger | None:
        """A step of ``prices.batch_size`` requests, one row each plus ``other_rows`` drafted
        rows nobody prices; ``None`` before the target's steps were timed."""
        step = prices.step
        if step is None:
            return None
        tokens, rows = float(prices.batch_size), prices.batch_size + other_rows
        return cls(step, prices.draft, tokens, rows, probe_due=prices.probe, worth=prices.worth)

    def worth_of(self, req_id: str) -> float:
        """What a token of ``req_id`` is worth to this step, against a step's average token."""
        return self.worth.get(req_id, 1.0)

    def probed_alone(self, batch_size: int) -> bool:
        """Whether the step drafts a probe and nothing valued beside it."""
        return self.probing and self.tokens <= batch_size

    @property
    def seconds(self) -> float:
        """The step's seconds so far (a planted free step costs a nanosecond: rates stay defined)."""
        return max(float(self.target.seconds(self.rows)) + self.draft_seconds, 1e-9)

    def draft_price(self, forwards: Sequence[float]) -> float:
        """Seconds of draft forwards of these many rows each."""
        if self.draft is None:
            return 0.0
        return sum(float(self.draft.seconds(rows)) for rows in forwards if rows > 0)

    def price(self, rows: int, forwards: Sequence[float] = ()) -> float:
        """Seconds that ``rows`` more verified rows and draft forwards of ``forwards`` rows add."""
        more = float(self.target.seconds(self.rows + rows)) - float(self.target.seconds(self.rows))
        return more + self.draft_price(forwards)

    def marginal_price(self, rows: int, fed: float, fixed: int = 0) -> float:
        """Seconds a candidate's ``rows`` verified rows and ``fed`` rows of a draft forward add,
        past what the forward costs anyway (its intercept, or ``fixed`` rows fed whatever it costs)."""
        draft = 0.0 if self.draft is None else float(self.draft.seconds(fixed + fed)) - float(self.draft.seconds(fixed))
        return self.price(rows) + draft

    def pays(self, gain: float, rows: int, forwards: Sequence[int] = ()) -> bool:
        """Whether ``gain`` expected tokens for ``rows`` rows and ``forwards`` raise tokens per second."""
        return gain > 0 and gain * self.seconds > self.tokens * self.price(rows, forwards)

    def add(self, gain: float, rows: int, forwards: Sequence[int] = ()) -> None:
        self.tokens += gain
        self.draft_seconds += self.draft_price(forwards)
        self.rows += rows

    def take(self, gain: float, rows: int, forwards: Sequence[int] = ()) -> bool:
        """:meth:`add` it if it :meth:`pays`; whether it did."""
        paid = self.pays(gain, rows, forwards)
        if paid:
            self.add(gain, rows, forwards)
        return paid


def catch_up_rows(fed: int, tokens_left: int | None = None) -> float:
    """The rows a request's draft sync is priced at this step: the one row that keeps it in step,
    and the rest spread over :data:`CATCH_UP_STEPS` steps (fewer when the request has fewer
    ``tokens_left``; ``None``: no limit). Priced whole, a catch-up (a prompt the draft never
    read, or the tokens of a rest) never pays for one step's gain at a large batch, so the draft
    would never run however well it drafts.

    Example: a 129-token prompt the draft lacks: ``1 + 128 / 32 = 5`` rows; with 4 tokens left, 33."""
    steps = CATCH_UP_STEPS if tokens_left is None else max(1, min(CATCH_UP_STEPS, tokens_left))
    return 1 + max(fed - 1, 0) / steps


def own_rates(
    ledger: StepLedger, gains: Sequence[float], rows: Sequence[int], fed: Sequence[float], fixed: int = 0
) -> list[float]:
    """Each candidate's expected tokens per second of its own (:meth:`StepLedger.marginal_price`)."""
    return [g / max(ledger.marginal_price(r, f, fixed), 1e-12) for g, r, f in zip(gains, rows, fed)]


def paying_share(
    ledger: StepLedger, gains: Sequence[float], rows: Sequence[int], fed: Sequence[float], fixed: int = 0
) -> list[int]:
    """Which candidates (each ``gains`` expected tokens for ``rows`` verified rows, feeding ``fed``
    rows to one draft forward they share with ``fixed`` rows fed whatever it costs) join: the most
    tokens per second of their own first (:meth:`StepLedger.marginal_price`; with equal rows and
    fed rows, the most valuable first), as many as maximise the step's tokens per second, none if
    no share pays for its part of the forward. With straight lines that is the best of every
    subset: a share beats the step's rate only by holding every candidate whose own rate does.
    Nothing is added to ``ledger``.

    Example: ``T = 4``, ``C(R) = 40 + 0.5 max(0, R - 4)`` ms, ``D(rows) = 6 + 1 rows`` ms, gains
    ``[0.9, 0.8, 0.1]``, a row and a fed row each: one candidate gives 4.9 / 47.5, two 5.7 / 49,
    three 5.8 / 50.5: two join (0.1163 tokens a millisecond; 0.1149 with all three). Had the
    first sat out 40 steps (41 rows fed), the second would join alone: 4.8 / 47.5.
    """
    own = own_rates(ledger, gains, rows, fed, fixed)
    order = sorted(range(len(gains)), key=lambda k: -own[k])
    best, best_rate, tokens, more_rows, more_fed = 0, ledger.tokens / ledger.seconds, ledger.tokens, 0, 0.0
    for count, k in enumerate(order, 1):
        tokens, more_rows, more_fed = tokens + gains[k], more_rows + rows[k], more_fed + fed[k]
        rate = tokens / (ledger.seconds + ledger.price(more_rows, [fixed + more_fed]) - ledger.draft_price([fixed]))
        if rate > best_rate:
            best, best_rate = count, rate
    return sorted(order[:best])


def forwards_that_pay(ledger: StepLedger, guesses: Sequence[float], rows: Sequence[int], fixed: int = 0) -> list[int]:
    """Which candidates the next draft forward feeds, to draft a level of ``rows`` nodes each
    worth ``guesses`` expected tokens (:func:`paying_share`, each verified row one fed row), beside
    ``fixed`` rows fed whatever it costs; the forward is charged to ``ledger``."""
    chosen = paying_share(ledger, guesses, rows, rows, fixed)
    ledger.add(0.0, 0, [fixed + sum(rows[k] for k in chosen)])
    return chosen


class DraftGate:
    """Which requests a step's draft model drafts for (:func:`paying_share`).

    A request's share of the draft's forward is the rows its sync feeds: one
    when the draft kept the K/V of what it drafted, more after steps it sat
    out (the committed tokens the draft lacks, fed then). So a batch that
    rested catches up only where the catch-up pays; the others keep waiting.
    A draft's value is learnt only from its tries, so when no share pays, the
    request of the most tokens per second is drafted alone, with one node, on a back-off
    (after 1, 2, 4, 8 refused steps), and at each step after the batch's rest
    (:attr:`StepPrices.probe`; the switch spaces those): a value that fell below its price can
    rise again, at the price of one small forward in several steps.
    """

    def __init__(self) -> None:
        self.rest = BackOff()

    def choose(
        self,
        ledger: StepLedger,
        gains: Sequence[float],
        rows: Sequence[int],
        fed: Sequence[int],
        tokens_left: Sequence[int | None] | None = None,
    ) -> list[int]:
        """The requests that draft (``fed``: the rows each one's sync feeds the draft, priced as
        :func:`catch_up_rows` by each one's ``tokens_left``), their forward charged to ``ledger``
        (its catch-up's spread to :attr:`StepLedger.invested_seconds`); a probe (its back-off's, or
        :attr:`StepLedger.probe_due`) sets :attr:`StepLedger.probing`, and is priced at the rows it
        feeds: the batch may rest again after it, so its catch-up buys nothing."""
        priced = [catch_up_rows(f, None if tokens_left is None else tokens_left[k]) for k, f in enumerate(fed)]
        chosen = paying_share(ledger, gains, rows, priced)
        if chosen:
            self.rest.after(paid=True)
        elif gains and ledger.probe_due:  # the batch's probe after its rest: every request, one node each
            self.rest.after(paid=False)
            chosen, ledger.probing, priced = list(range(len(gains))), True, list(fed)
        elif gains and self.rest.allows():  # the gate's probe: the most tokens per second of its own
            self.rest.after(paid=False)
            own = own_rates(ledger, gains, rows, fed)
            chosen, ledger.probing, priced = [max(range(len(gains)), key=lambda k: own[k])], True, list(fed)
        share = ledger.draft_price([sum(priced[k] for k in chosen)])
        ledger.invested_seconds += ledger.draft_price([sum(fed[k] for k in chosen)]) - share
        ledger.draft_seconds += share
        return chosen


def _step_ratio(prices: StepPrices, rows: int, draft_seconds: float, branched: bool) -> float | None:
    """A drafting step's seconds (``rows`` verified rows after ``draft_seconds`` of drafting) over
    a plain step's (``None`` before the target's steps were timed)."""
    step = prices.step_of(branched)
    if step is None:
        return None
    batch = prices.batch_size
    return max(float(step.seconds(batch + rows)) + draft_seconds, 1e-9) / max(float(step.seconds(batch)), 1e-9)


def utility(prices: StepPrices, gain: float, rows: int, draft_seconds: float, branched: bool = True) -> float | None:
    """A drafting step's expected tokens per second over a plain step's: ``gain`` expected tokens
    from ``rows`` verified rows (of trees that branch, or chains alone), after ``draft_seconds`` of
    drafting (``None`` before the target's steps were timed). Example: 8 requests,
    ``C(R) = 40 + 0.5 R`` ms, 2 tokens from 8 rows after 3 ms: ``(10 / 51) / (8 / 44) = 1.08``;
    after 9 ms ``0.96``."""
    ratio = _step_ratio(prices, rows, draft_seconds, branched)
    return None if ratio is None else (prices.batch_size + gain) / prices.batch_size / ratio


def overhead(prices: StepPrices, rows: int, draft_seconds: float, branched: bool = True) -> float | None:
    """A drafting step's seconds over a plain step's, less one: what ``rows`` verified rows and
    ``draft_seconds`` of drafting added (``None`` before the target's steps were timed). Example:
    ``C(R) = 40 + 0.5 R`` ms, 8 requests, 1 row after a 13 ms catch-up: ``57.5 / 44 - 1 = 0.31``."""
    ratio = _step_ratio(prices, rows, draft_seconds, branched)
    return None if ratio is None else ratio - 1


def load_bucket(batch_size: int) -> int:
    """The batch's load as the switch tells loads apart: 0 for none, 1 for one request, 2 for 2-3,
    3 for 4-7, ... (the bit length: a load change is a batch half or twice as large)."""
    return batch_size.bit_length()


@dataclass
class LoadVerdict:
    """What the :class:`Switch` judged of one load: its rest and its average utility."""

    rest: BackOff
    #: the average :func:`utility` of its drafting steps since its last rest (``None``: a probe next)
    utility: float | None = None


class Switch:
    """Whether a batch drafts at all this step.

    Each drafting step's :func:`utility` is averaged over the last few (the
    cost of drafting is paid every step, its tokens now and then); while that
    average is below :data:`REST_BELOW`, drafting costs the batch more than it
    commits, and the batch rests: its steps are vLLM's plain decode steps, with no drafting. It
    probes after 1, 2, 4, ... up to :data:`MAX_OFF_STEPS` steps, a probe's
    utility starting the average anew; a probe that pays turns it back on and
    halves the next rest, so a batch whose drafts pay now and then is not
    switched on and off every step. Each load (:func:`load_bucket`: 1, 2-3, 4-7, 8-15, ...
    requests) is judged apart, since drafting that pays at one request may cost eight:
    a load never seen probes at once, and a load seen before resumes its own verdict (its
    average, its rest and how long the next one is), so a closed batch's tail (8 requests,
    then 7) or a server's batch moving between 3 and 4 requests does not probe at every
    crossing. Requests that come and go at the same load (a server's continuous batch, where
    the batch changes nearly every step) keep its verdict too. A step whose drafts were all
    priced out rests the batch too (it would ask the drafter for nothing again). A step that
    only probed a draft (:class:`DraftGate`) is judged at the next one, once the probe's node
    was committed or not (:meth:`probed`); beside other drafts, a probe is valued at nothing. A
    step of unknown utility (unpriced drafts) counts as paying. Rests that reached
    :data:`MAX_OFF_STEPS` grow until a probe costs at most :data:`PROBE_SHARE` of the rest
    (its :func:`overhead` over a plain step, up to :data:`LONGEST_REST` steps): at a batch
    where a draft's catch-up costs half a step, a probe every 25 steps.

    Example: utilities 0.5 at steps 0 and 2, a probe at 5 of 1.2, then 0.4 at 6
    (averaged with 1.2: 0.96): off at 1, 3-4; on at 5; off 7-8 (the rest halved from 4 to 2).
    At 8 requests resting 16 steps, 3 steps at 7 requests (another load, probed at once), then
    8 again: the 8 requests' rest goes on where it stopped.
    """

    def __init__(self) -> None:
        #: every load's verdict (:func:`load_bucket`), and the one the batch is at
        self._verdicts: dict[int, LoadVerdict] = {}
        self._load = 0
        self._verdict = self._verdict_at(0)
        #: this step drafts after a rest (its utility starts the average anew)
        self.probing = False
        self._resting = False
        #: the :func:`overhead` of the last draft's probe (:meth:`probed`), not yet judged
        self._probe_overhead = 0.0

    def drafts(self, req_ids: Sequence[str]) -> bool:
        """Whether this step (of these requests) drafts; a step that does not passes one step of rest."""
        load = load_bucket(len(req_ids))
        if load != self._load:
            self._load, self._verdict = load, self._verdict_at(load)
        drafts = self._verdict.rest.allows()
        self.probing, self._resting = drafts and self._resting, not drafts
        if not drafts:
            self._verdict.utility = None  # the next drafting step is a probe: its own utility decides
        return drafts

    def _verdict_at(self, load: int) -> LoadVerdict:
        return self._verdicts.setdefault(load, LoadVerdict(BackOff(most=MAX_OFF_STEPS)))

    def rest(self) -> None:
        """Rest the next step whatever the utility (the runner times a plain step)."""
        self._verdict.rest.left = max(self._verdict.rest.left, 1)

    def after(self, utility: float | None, priced_out: bool = False, overhead: float | None = None) -> None:
        """Record a drafting step's :func:`utility`; ``priced_out``: the controller kept none of the
        drafts there were (the batch rests, whatever the average); ``overhead``: the step's
        :func:`overhead`, which with the last probe's (:meth:`probed`) spaces the probes of a long rest."""
        verdict = self._verdict
        if utility is not None:
            last = verdict.utility
            verdict.utility = utility if last is None else UTILITY_MEMORY * last + (1 - UTILITY_MEMORY) * utility
        paid = (verdict.utility is None or verdict.utility >= REST_BELOW) and not priced_out
        verdict.rest.after(paid=paid)
        dearest = max(overhead or 0.0, self._probe_overhead)
        if not paid and verdict.rest.left >= MAX_OFF_STEPS:
            verdict.rest.left = max(verdict.rest.left, min(math.ceil(dearest / PROBE_SHARE), LONGEST_REST))
        self._probe_overhead = 0.0

    def probed(self, overhead: float | None) -> None:
        """A step that drafted only a draft's probe: neither paid nor refused (the next step
        judges it, from the learnt values); its :func:`overhead` prices the rests after it."""
        self._probe_overhead = overhead or 0.0

    @property
    def off(self) -> bool:
        return self._verdict.rest.left > 0
