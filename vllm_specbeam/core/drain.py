"""What a committed token is worth to a batch that drains: one no request joins any more.

While requests keep joining, every request's token is worth the same, a step's
average ``P(B) / B`` seconds: the step budget's tokens per second. Once they
stop (a closed batch, a burst's end), the batch's time is the sum of its
remaining steps, and a request's accepted token saves only what that request
adds to a later step, ``P'(B)`` (its row; nothing below the knee), unless the
request is one of the ``k`` the batch waits for last: then it also brings the
batch's last step nearer, ``P(k) / k`` seconds for each of them. With every
request alike (a batch of equal requests started together) that is
``P(B) / B`` again; with one request, a whole step. The batch waits for every
request that, undrafted, would end after the last one drafted at the batch's
pace (:class:`Pace`): at 3 tokens a step, any with a third of its tokens left.

Example: ``P(R) = 20 ms + 0.7 ms * max(0, R - 6)``, 200 requests (a 156 ms
step, 0.78 ms a request), 5 of them with the most tokens left: their tokens
are worth ``P(5) / 5 = 4`` ms, 5.1 times the average, the others' 0.7 ms,
0.9 times: a node on those pays only if it is accepted more often than once
for the row it costs, which no node is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_specbeam.core.budget import StepCost

#: a batch drains once no request joined it for this many of its usual gaps between joins
DRAIN_AFTER_GAPS = 4
#: ... and for at least this many steps
MIN_DRAIN_STEPS = 4
#: how much of the gap between joins carries over to the next one
GAP_MEMORY = 0.7
#: requests this close to the most tokens left (a share of it) end the batch together
LAST_SHARE = 1 / 8
#: how much of a drafted request's committed tokens a step carries over to the next (:class:`Pace`)
PACE_MEMORY = 0.7


@dataclass
class Arrivals:
    """Whether requests still join the batch: it drains once none joined for
    :data:`DRAIN_AFTER_GAPS` times the usual gap between the steps that some did. A join
    into a batch that had emptied (none of the last step's requests left) starts a new
    batch: the time since the last one's joins is no gap between arrivals.

    Example: joins at steps 0, 2, 4 and 6 (a gap of 2): the batch drains from
    step 15 (more than 8 steps since the last join) until the next one joins.
    """

    #: the requests of the last step
    members: frozenset[str] = frozenset()
    #: steps since a request last joined (``None``: none has)
    since_join: int | None = None
    #: the average gap, in steps, between steps that requests joined (``None``: not one yet)
    gap: float | None = None

    def observe(self, req_ids: Sequence[str]) -> None:
        """One step's requests."""
        members = frozenset(req_ids)
        if members - self.members:
            if self.since_join is not None and members & self.members:
                steps = self.since_join + 1
                self.gap = steps if self.gap is None else GAP_MEMORY * self.gap + (1 - GAP_MEMORY) * steps
            self.since_join = 0
        elif self.since_join is not None:
            self.since_join += 1
        self.members = members

    @property
    def draining(self) -> bool:
        usual = DRAIN_AFTER_GAPS * (self.gap or 0.0)
        return self.since_join is not None and self.since_join > max(MIN_DRAIN_STEPS, usual)


@dataclass
class Pace:
    """The committed tokens a step of a drafted request, averaged over the last few drafting steps
    (1 before any: no request is faster than one token a step)."""

    tokens: float = 1.0

    def observe(self, committed: Sequence[int]) -> None:
        """One step's committed tokens of the requests it verified drafts for (none: no change)."""
        if committed:
            self.tokens = PACE_MEMORY * self.tokens + (1 - PACE_MEMORY) * max(sum(committed) / len(committed), 1.0)


def token_worth(left: Sequence[int | None], plain: StepCost | None, pace: float = 1.0) -> np.ndarray:
    """Each request's committed token in seconds of a draining batch's time, over the average
    ``P(B) / B`` (``left``: each request's tokens left to generate, ``None`` where no limit was
    set; ``plain``: the plain steps' line ``P``; ``pace``: :class:`Pace`). All ones where any limit
    is unknown or no step was timed: which request ends the batch is then anybody's guess.

    Example: ``P(R) = 20 + 0.7 max(0, R - 6)`` ms, tokens left ``[40, 38, 10]``: the first two end
    the batch (within 40 / 8 = 5 tokens of the most), each token worth ``P(2) / 2 = 10`` ms against
    an average of ``P(3) / 3 = 6.7``: ``[1.5, 1.5, 0]`` (3 rows are below the knee: free). At a pace
    of 4 tokens a step, the third would end after the first two (10 steps undrafted, 40 / 4
    drafted): ``[1, 1, 1]``; priced at a row, it would fall behind by drafting for the others."""
    batch = len(left)
    if plain is None or batch == 0 or any(n is None for n in left):
        return np.ones(batch)
    tokens_left = np.maximum(np.asarray(left, float), 0.0)  # [batch]: a request past its end has none
    last = tokens_left >= tokens_left.max() * (1 - LAST_SHARE) / max(pace, 1.0)  # [batch]
    ending = int(last.sum())
    average = float(plain.seconds(batch)) / batch
    row = plain.slope + (plain.bend if batch > plain.knee else 0.0)
    ends_batch = float(plain.seconds(ending)) / ending
    return np.where(last, ends_batch, row) / max(average, 1e-12)
