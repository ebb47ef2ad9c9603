"""Each step's draft nodes, chosen from measured costs (``"max_nodes": "auto"``).

A node is worth the probability that the target accepts its whole path: the
product along the path of ``c(k, d, r)``, the chance that a node of kind
``k`` (``DraftTree.kinds``) at depth ``d``, ranked ``r`` among its siblings, is
accepted when its parent was. A step verifying ``R`` rows costs ``C(R)``
seconds, so the budget keeps the ``n`` most valuable nodes of the batch that
maximise::

    (requests + sum of the n best values) / C(rows without drafts + n)

down to ``n = 0``. Values never grow down a path nor along siblings, so the
``n`` best nodes always form trees hanging from the roots.

``c`` is learnt per request from what the target committed after each draft
(pruned nodes included), shrunk towards the engine-wide rates. ``C`` is
fitted to the engine's own decode steps (:class:`StepCostModel`):
``C(R) = a + b R + c max(0, R - K)``, ``b, c >= 0``, the knee ``K`` the
candidate that fits best; a step with no node at all is vLLM's plain step,
timed apart (:class:`BatchCost`). Nothing here reads a drafted token's value or the
target's probabilities, so a pruned tree is one its drafter could have
proposed and every verifier's guarantee holds for it. Worked example and
rationale: docs/budget.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_specbeam.core.tree import ROOT, DraftTree, committed_path

#: depths, sibling ranks and node kinds beyond these share the last bucket
DEPTH_BUCKETS = 8
RANK_BUCKETS = 4
KIND_BUCKETS = 9
#: acceptance is counted per (kind, depth, rank) cell
CELLS = KIND_BUCKETS * DEPTH_BUCKETS * RANK_BUCKETS
#: a request's rate is ``(hits + PRIOR_TRIALS * engine rate) / (trials + PRIOR_TRIALS)``
PRIOR_TRIALS = 4.0
#: per observed tree: how much older trials still count (request, engine)
REQUEST_DECAY = 0.97
ENGINE_DECAY = 0.995
#: a request whose drafts were pruned to nothing sits out 1, 3, 7 steps before drafting again
MAX_IDLE_DOUBLINGS = 3
#: longest rest, in steps, of a source after fruitless tries (:class:`BackOff`: 1, 2, 4, 8)
MAX_REST = 8
#: the kind of the nodes that fill what lookup branches (kinds 0-7: by match length, and whether
#: only other requests' text continues through them) leave: a draft model's, or ``aded``'s search
FILL_KIND = 8


@dataclass(frozen=True)
class TreeShape:
    """A tree's parents, depths and rate-table cells as plain lists: trees are
    small, and per-node Python beats numpy's per-call cost at this size."""

    parents: list[int]
    depths: list[int]
    #: the cell of ``rates.ravel()`` each node reads:
    #: (kind bucket x DEPTH_BUCKETS + depth bucket) x RANK_BUCKETS + rank bucket
    cells: list[int]

    @classmethod
    def of(cls, tree: DraftTree) -> TreeShape:
        """Example: parents ``[-1, -1, 0, 0, 1]`` have depths ``[1, 1, 2, 2, 2]``,
        sibling ranks ``[0, 1, 0, 1, 0]``, cells ``[0, 1, 4, 5, 4]``; with kinds
        ``[0, 0, 0, 0, 2]`` the last node's cell is 2 x 32 + 4 = 68."""
        parents = tree.parents.tolist()
        kinds = [0] * len(parents) if tree.kinds is None else tree.kinds.tolist()
        depths: list[int] = []
        cells: list[int] = []
        children: dict[int, int] = {}
        for parent, kind in zip(parents, kinds):
            depth = 1 if parent == ROOT else depths[parent] + 1
            rank = children.get(parent, 0)
            children[parent] = rank + 1
            depths.append(depth)
            row = min(kind, KIND_BUCKETS - 1) * DEPTH_BUCKETS + min(depth, DEPTH_BUCKETS) - 1
            cells.append(row * RANK_BUCKETS + min(rank, RANK_BUCKETS - 1))
        return cls(parents, depths, cells)


def matched_nodes(tree: DraftTree, shape: TreeShape, committed: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(trials, hits)``: the cells of the nodes tried and of those that matched,
    judged by the tokens the step committed after the tree's root (accepted
    drafts, then the target's own).

    Example: a root with children ``a`` (node 0) and ``b`` (node 1), ``a`` with
    child ``c`` (node 2), committed ``[a, d]``: all three were tried, only node 0
    matched (node 2 was tried at depth 2 and missed ``d``).
    """
    path = committed_path(tree.tokens.tolist(), shape.parents, committed)
    matched = set(path)
    trials = [
        cell
        for parent, depth, cell in zip(shape.parents, shape.depths, shape.cells)
        if depth <= len(committed) and (parent == ROOT or parent in matched)
    ]
    return trials, [shape.cells[node] for node in path]


def path_values(shape: TreeShape, rates: np.ndarray) -> list[float]:
    """Each node's chance of being accepted: the product of its cells' rates
    (``rates[kind, depth, rank]``) along its path."""
    flat = rates.ravel().tolist()
    values: list[float] = []
    for parent, cell in zip(shape.parents, shape.cells):
        values.append(flat[cell] * (1.0 if parent == ROOT else values[parent]))
    return values


@dataclass
class AcceptanceCounts:
    """Decayed trials and hits per (kind, depth, rank) cell."""

    trials: np.ndarray = field(default_factory=lambda: np.zeros(CELLS))
    hits: np.ndarray = field(default_factory=lambda: np.zeros(CELLS))

    def add(self, trials: list[int], hits: list[int], decay: float) -> None:
        self.trials = self.trials * decay + np.bincount(trials, minlength=self.trials.size)
        self.hits = self.hits * decay + np.bincount(hits, minlength=self.hits.size)


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step verifying ``rows`` rows: flat, then rising past a knee,
    ``intercept + slope * rows + bend * max(0, rows - knee)``.

    A target's pass costs about the same for a few rows as for one (the matrix
    units have room to spare), then more per row once they are full; without a
    bend it is a straight line.
    """

    intercept: float
    slope: float
    knee: float = 0.0
    bend: float = 0.0

    def seconds(self, rows: np.ndarray | float) -> np.ndarray | float:
        return self.intercept + self.slope * rows + self.bend * np.maximum(np.asarray(rows) - self.knee, 0.0)


@dataclass(frozen=True)
class BatchCost:
    """Seconds of a step of ``batch_size`` requests by its rows: ``plain`` when it verifies no
    node (vLLM's plain decode step: no tree metadata, masks, verification or KV move), else
    the tree steps' line. A batch's first node pays that difference too.

    Example: ``line = 20 + 1 R`` ms, 8 requests, a plain step of 25 ms: 8 rows cost 25 ms, 9
    rows 29 ms: the first node costs 4 ms, the second 1 ms."""

    line: StepCost
    batch_size: int
    plain: float

    @classmethod
    def of(cls, line: StepCost | None, batch_size: int, plain_line: StepCost | None) -> BatchCost | None:
        """The batch's costs (``None`` before any step was timed). Each line stands for the other
        until that one is timed: before a plain step, the tree line's seconds at one row a
        request; before a tree step, the plain line, so nodes cost their rows, not nothing."""
        line = line if line is not None else plain_line
        if line is None:
            return None
        plain = line if plain_line is None else plain_line
        return cls(line, batch_size, float(plain.seconds(batch_size)))

    def seconds(self, rows: np.ndarray | float) -> np.ndarray | float:
        rows = np.asarray(rows, float)
        seconds = np.where(rows <= self.batch_size, self.plain, self.line.seconds(rows))
        return seconds if seconds.ndim else float(seconds)


def step_line(branched: bool, tree: StepCost | None, chain: StepCost | None) -> StepCost | None:
    """The line of a step whose trees branch (``tree``) or are all chains (``chain``): on CPU a
    step with branches also recomputes the rows off each first branch, a cost per step that
    chains never pay (:attr:`DraftTree.first_branch`). Until one is timed, the other stands for it
    (until either is, :meth:`BatchCost.of` prices nodes by the plain steps' line)."""
    first, other = (tree, chain) if branched else (chain, tree)
    return first if first is not None else other


class StepCostModel:
    """Step seconds against rows, by exponentially weighted least squares of
    :class:`StepCost`'s hinge, its knee the best fitting of :attr:`KNEES`.

    Each candidate knee keeps its own weighted sums, so observing a step and
    fitting cost a few small array operations whatever the history. A little
    ridge, towards a slope of ``mean / PRIOR_ROWS`` past the knee and no bend,
    keeps the fit defined before the rows have varied (every step the same
    batch and tree): then it is a straight line through the steps seen. A knee
    with (almost) no step past it is no candidate: its bend would be the
    ridge's guess, not a measurement.
    """

    PRIOR_ROWS = 64.0
    RIDGE = 16.0
    #: candidate knees, in rows (a step's rows: one per request, plus the drafted nodes):
    #: 2, 4, 6, then four a doubling, 8, 10, 12, 14, 16, 20, ... up to 512
    KNEES = np.array(
        [2, 4, 6] + [base * quarter // 4 for base in 8 << np.arange(6) for quarter in (4, 5, 6, 7)] + [512]
    )
    #: the free parameters (intercept, slope, bend) on each face of ``slope, bend >= 0``
    FACES = np.array([[1, 1, 1], [1, 0, 1], [1, 1, 0], [1, 0, 0]])

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._gram = np.zeros((self.KNEES.size, 3, 3))  # [knees, 3, 3] weighted sums of f f', f = (1, x, hinge)
        self._moment = np.zeros((self.KNEES.size, 3))  # [knees, 3] weighted sums of f y

    def observe(self, rows: int, seconds: float) -> None:
        hinge = np.maximum(rows - self.KNEES, 0.0)  # [knees]
        features = np.stack([np.ones_like(hinge), np.full_like(hinge, rows), hinge], axis=1)  # [knees, 3]
        self._gram = self._gram * self.decay + features[:, :, None] * features[:, None, :]
        self._moment = self._moment * self.decay + features * float(seconds)

    @property
    def observed(self) -> bool:
        return bool(self._gram[0, 0, 0] > 0)

    def fitted(self) -> StepCost | None:
        """:meth:`fit`, or ``None`` before any step was observed."""
        return self.fit() if self.observed else None

    def fit(self) -> StepCost:
        """The knee, slope and bend (both >= 0) of least ridged squares.

        For parameters ``theta`` the ridged squares are ``theta' G theta -
        2 theta' m`` plus a constant; their least over ``slope, bend >= 0`` is
        the least of the unconstrained minima on the faces of that quadrant
        that land inside it (one face, intercept alone, always does).
        """
        weight, sx, sy = self._gram[0, 0, 0], self._gram[0, 0, 1], self._moment[0, 0]
        if weight <= 0:
            raise ValueError("no step observed yet")
        prior_slope = sy / (sx + weight * self.PRIOR_ROWS)  # mean seconds / (mean rows + PRIOR_ROWS)
        # RIDGE x ((slope + bend - prior_slope)^2 + bend^2): a bend the steps do not ask for costs
        gram = self._gram + self.RIDGE * np.array([[0, 0, 0], [0, 1, 1], [0, 1, 2]])  # [knees, 3, 3]
        moment = self._moment + self.RIDGE * prior_slope * np.array([0, 1, 1])  # [knees, 3]
        free = self.FACES[:, None, :, None] * self.FACES[:, None, None, :]  # [faces, 1, 3, 3]
        fixed = np.eye(3) * (1 - self.FACES[:, None, :, None])  # [faces, 1, 3, 3]: theta_i = 0
        rhs = moment * self.FACES[:, None, :]  # [faces, knees, 3]
        theta = np.linalg.solve(gram * free + fixed, rhs[..., None])[..., 0]  # [faces, knees, 3]
        loss = np.einsum("fki,kij,fkj->fk", theta, gram, theta) - 2 * np.einsum("fki,ki->fk", theta, moment)
        loss[(theta[..., 1:] < 0).any(axis=-1)] = np.inf  # outside the quadrant
        unmeasured = self._gram[:, 2, 2] < self.RIDGE  # [knees]: past it, the steps say less than the ridge
        loss[np.ix_(self.FACES[:, 2] > 0, unmeasured)] = np.inf
        face, knee = np.unravel_index(int(np.argmin(loss)), loss.shape)
        intercept, slope, bend = theta[face, knee].tolist()
        return StepCost(max(intercept, 0.0), slope, float(self.KNEES[knee]), bend)


def choose_counts(values: np.ndarray, base_tokens: float, base_rows: float, cost: StepCost | BatchCost) -> int:
    """How many of the nodes, best first, to keep: the ``n`` that maximises
    ``(base_tokens + sum of the n best values) / cost(base_rows + n)``."""
    best_first = np.sort(values)[::-1]  # [num_nodes]
    tokens = base_tokens + np.concatenate([[0.0], np.cumsum(best_first)])  # [num_nodes + 1]
    seconds = cost.seconds(base_rows + np.arange(best_first.size + 1))
    return int(np.argmax(tokens / np.maximum(seconds, 1e-12)))


def choose_nodes(
    trees: Sequence[DraftTree],
    values: Sequence[Sequence[float]],
    base_tokens: float,
    base_rows: float,
    cost: StepCost | BatchCost,
) -> list[np.ndarray]:
    """Which nodes of each tree to keep (boolean masks), the batch's best first.

    Ties between nodes go to the earlier tree, then the earlier node, so a
    parent (earlier, never worth less) is kept before its children.
    """
    flat = np.concatenate([np.asarray(v, float) for v in values]) if values else np.zeros(0)  # [all nodes]
    keep_count = choose_counts(flat, base_tokens, base_rows, cost)
    chosen = np.zeros(flat.size, bool)
    chosen[np.argsort(-flat, kind="stable")[:keep_count]] = True
    return np.split(chosen, np.cumsum([tree.num_nodes for tree in trees])[:-1])


def kept_rate(
    values: Sequence[Sequence[float]],
    masks: Sequence[np.ndarray],
    base_tokens: float,
    base_rows: float,
    cost: StepCost | BatchCost,
) -> float:
    """Expected committed tokens a second of a step keeping ``masks`` of nodes worth ``values``."""
    kept = [np.asarray(v, float)[mask] for v, mask in zip(values, masks)]
    tokens = base_tokens + sum(float(k.sum()) for k in kept)
    return tokens / max(float(cost.seconds(base_rows + sum(k.size for k in kept))), 1e-12)


def branches(trees: Sequence[DraftTree], masks: Sequence[np.ndarray]) -> bool:
    """Whether keeping ``masks`` leaves a node off its tree's first branch."""
    return any(bool(mask[tree.first_branch :].any()) for tree, mask in zip(trees, masks))


def choose_trees_or_chains(
    trees: Sequence[DraftTree],
    values: Sequence[Sequence[float]],
    batch_size: int,
    other_rows: int,
    tree_cost: BatchCost,
    chain_cost: BatchCost,
) -> tuple[list[np.ndarray], bool]:
    """:func:`choose_nodes` for a step of ``batch_size`` requests (and ``other_rows`` rows of
    trees it does not choose, which may branch): the best nodes under the line of steps whose
    trees branch, or the best of the first branches alone under the chains' line, whichever
    commits more a second; and whether the nodes kept branch.

    Example: one request, a 20 ms step, 1 ms a row, 10 ms more when a tree branches; a chain
    worth 0.9 and a sibling worth 0.5: the chain alone (1.9 tokens / 22 ms) beats both
    (2.4 / 33 ms); with branches 1 ms dearer, both (2.4 / 24 ms against 1.9 / 22 ms).
    """
    rows = batch_size + other_rows
    masks = choose_nodes(trees, values, batch_size, rows, tree_cost)
    if other_rows:
        return masks, True
    firsts = [  # off a first branch: never kept
        [*v[: t.first_branch], *[-np.inf] * (t.num_nodes - t.first_branch)] for t, v in zip(trees, values)
    ]
    chains = choose_nodes(trees, firsts, batch_size, rows, chain_cost)
    if branches(trees, masks) and kept_rate(values, masks, batch_size, rows, tree_cost) > kept_rate(
        values, chains, batch_size, rows, chain_cost
    ):
        return masks, True
    return chains, False


@dataclass
class BackOff:
    """How long a request's drafting source (``aded``'s search, a draft model behind lookup
    branches) sits out after tries none of whose own nodes the target committed.

    Example: fruitless tries at steps 0, 2 and 5 rest steps 1; 3-4; 6-9;
    a try at step 10 whose node the target commits halves the next rest: a
    fruitless try at step 11 rests steps 12-15. (A paid try among fruitless ones
    does not start them over, so a fill that pays one step in ten is tried about
    as often as it pays.)"""

    #: request-steps left to sit out
    left: int = 0
    #: the rest after the next fruitless try
    next: int = 1
    #: the longest rest
    most: int = MAX_REST

    def allows(self) -> bool:
        """Whether this request-step may try (one step of rest passes either way)."""
        resting = self.left > 0
        self.left = max(0, self.left - 1)
        return not resting

    def after(self, paid: bool) -> None:
        """Record how a try was judged: ``paid`` when the target committed one of its own nodes."""
        if paid:
            self.next = max(1, self.next // 2)
        else:
            self.left, self.next = self.next, min(2 * self.next, self.most)


@dataclass
class RequestBudget:
    """What the budget remembers of one request."""

    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    #: the last whole tree its drafter proposed, its shape, and the request's length then
    drafted: DraftTree | None = None
    drafted_shape: TreeShape | None = None
    drafted_at: int = 0
    #: most nodes to ask its drafter for (``None``: the cap), from its last non-empty draft
    ask: int | None = None
    #: consecutive drafts pruned to nothing, and steps left to sit out
    empty_streak: int = 0
    idle: int = 0


class StepBudget:
    """One engine's per-step node budget: acceptance per request, costs per step."""

    def __init__(self) -> None:
        #: steps that verified trees with branches, steps whose trees were all chains, and
        #: plain steps (one row a request), timed apart
        self.cost_model = StepCostModel()
        self.chain_model = StepCostModel()
        self.plain_model = StepCostModel()
        #: the lines decisions use, refitted by the runner (every rank of a
        #: tensor-parallel engine must decide alike, so the runner shares them)
        self.cost: StepCost | None = None
        self.chain_cost: StepCost | None = None
        self.plain_cost: StepCost | None = None
        self.engine = AcceptanceCounts()
        self.requests: dict[str, RequestBudget] = {}
        #: the expected accepted tokens of the nodes the last :meth:`prune` kept, each by its request's
        #: worth (0 when unpriced)
        self.kept_value = 0.0
        #: whether the nodes the last :meth:`prune` kept branch (priced by the trees' line)
        self.kept_branches = False

    def batch_cost(self, batch_size: int, branched: bool = True) -> BatchCost | None:
        """A step of ``batch_size`` requests by its rows, plain or verifying nodes (trees that
        branch, or chains alone: :func:`step_line`)."""
        return BatchCost.of(step_line(branched, self.cost, self.chain_cost), batch_size, self.plain_cost)

    def wake(self) -> None:
        """Every request drafts at its next step, none sitting out (the batch probes after a rest)."""
        for state in self.requests.values():
            state.idle = 0

    def draft_cap(self, req_id: str, cap: int) -> int:
        """Nodes to ask ``req_id``'s drafter for this step: 0 while it sits out
        after drafts that were pruned to nothing, else room to grow past what
        was kept last time (twice as many, and two more; drafting costs grow
        with the nodes asked for, e.g. ``aded``'s search)."""
        state = self.requests.setdefault(req_id, RequestBudget())
        if state.idle > 0:
            state.idle -= 1
            return 0
        return cap if state.ask is None else min(cap, state.ask)

    def observe_committed(self, req_id: str, committed: Sequence[int], num_tokens: int) -> None:
        """The tokens a step committed for ``req_id``; ``num_tokens`` is its length after them."""
        state = self.requests.get(req_id)
        if state is None or state.drafted is None:
            return
        tree, state.drafted = state.drafted, None
        if not committed or state.drafted_at + len(committed) != num_tokens:
            return  # not the step the tree was drafted for (preempted, rescheduled)
        assert state.drafted_shape is not None
        trials, hits = matched_nodes(tree, state.drafted_shape, committed)
        state.counts.add(trials, hits, REQUEST_DECAY)
        self.engine.add(trials, hits, ENGINE_DECAY)

    def judge(self, req_id: str, token_ids: np.ndarray) -> None:
        """Judge ``req_id``'s last tree by the tokens committed since (``token_ids``: all of the request's)."""
        state = self.requests.get(req_id)
        if state is not None and state.drafted is not None:
            self.observe_committed(req_id, token_ids[state.drafted_at :].tolist(), token_ids.size)

    def engine_rates(self) -> np.ndarray:
        """The engine-wide acceptance rate per cell (a uniform prior: 1/2 before anything was seen)."""
        return (self.engine.hits + 1.0) / (self.engine.trials + 2.0)

    def rates(self, req_id: str, engine_rates: np.ndarray | None = None, hopeful: bool = False) -> np.ndarray:
        """``c[kind bucket, depth bucket, rank bucket]`` for one request, non-increasing in rank;
        ``hopeful``: one standard error higher, for a value learnt only from its own tries (a
        draft that never runs is never measured: with 4 tries' weight of the engine's 0.45, 0.70;
        after 34 hits in 40 tries, 0.87 against 0.81).

        Example: a request of 3 hits in 4 trials, the engine at 0.5 a cell: ``(3 + 4 * 0.5) / 8 = 0.625``."""
        engine = self.engine_rates() if engine_rates is None else engine_rates
        counts = self.requests.setdefault(req_id, RequestBudget()).counts
        trials = counts.trials + PRIOR_TRIALS
        rate = (counts.hits + PRIOR_TRIALS * engine) / trials
        if hopeful:
            rate = np.minimum(rate + np.sqrt(rate * (1 - rate) / trials), 1.0)
        return np.minimum.accumulate(rate.reshape(KIND_BUCKETS, DEPTH_BUCKETS, RANK_BUCKETS), axis=2)

    def prune(
        self,
        req_ids: Sequence[str],
        trees: Sequence[DraftTree],
        num_tokens: Sequence[int],
        batch_size: int,
        other_rows: int = 0,
        worth: Sequence[float] | None = None,
    ) -> list[DraftTree]:
        """Keep the nodes of ``trees`` (one per request in ``req_ids``, of length
        ``num_tokens``) that pay for themselves in a step of ``batch_size``
        requests with ``other_rows`` draft rows the budget does not choose; ``worth``: each
        request's committed token against the step's average (``core/drain.py``; all 1 if not given)."""
        shapes = [self.drafted(req_id, tree, length) for req_id, tree, length in zip(req_ids, trees, num_tokens)]
        self.kept_value = 0.0
        tree_cost, chain_cost = self.batch_cost(batch_size), self.batch_cost(batch_size, branched=False)
        if tree_cost is None or chain_cost is None:  # nothing timed yet: the drafts as proposed
            kept = list(trees)
            self.kept_branches = any(tree.first_branch < tree.num_nodes for tree in trees)
        else:
            engine = self.engine_rates()
            values = [path_values(shape, self.rates(req_id, engine)) for req_id, shape in zip(req_ids, shapes)]
            if worth is not None:
                values = [[value * w for value in tree_values] for tree_values, w in zip(values, worth)]
            masks, self.kept_branches = choose_trees_or_chains(
                trees, values, batch_size, other_rows, tree_cost, chain_cost
            )
            kept = [tree.keep(mask) for tree, mask in zip(trees, masks)]
            self.kept_value = float(sum(np.asarray(v)[mask].sum() for v, mask in zip(values, masks)))
        for drafted, tree, req_id in zip(trees, kept, req_ids):
            if drafted.num_nodes == 0:  # the drafter found nothing: its own call, nothing learnt
                continue
            state = self.requests[req_id]
            state.ask = 2 * tree.num_nodes + 2
            state.empty_streak = 0 if tree.num_nodes else min(state.empty_streak + 1, MAX_IDLE_DOUBLINGS)
            state.idle = (1 << state.empty_streak) - 1
        return kept

    def drafted(self, req_id: str, tree: DraftTree, num_tokens: int) -> TreeShape:
        """Remember the tree drafted for ``req_id`` at length ``num_tokens``: the next step's
        committed tokens (:meth:`observe_committed`) score its nodes. Returns its shape."""
        state = self.requests.setdefault(req_id, RequestBudget())
        state.drafted, state.drafted_shape, state.drafted_at = tree, TreeShape.of(tree), num_tokens
        return state.drafted_shape

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)
