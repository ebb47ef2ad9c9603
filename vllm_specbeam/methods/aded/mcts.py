"""ADED's draft-tree construction: Monte Carlo tree search over tri-gram successors.

A search node is a token sequence below the request's last two tokens; its
children are the tri-gram successors of its last two tokens, with the
tri-gram probability as prior ``P``. Each walk goes down by

    Q/N + (c1 + ln((N_parent + c2 + 1) / c2)) * P * sqrt(N_parent) / (1 + N)

expands the node it stops at, finishes the draft by sampling successors, and
backs up the reward ``1 + sum of P``. The draft tree is the most-visited
root-to-leaf paths, each extended by one greedy token, merged most-visited
first.

The walks run in ``sqrt(iterations) / 4`` *waves* selected together with
numpy, level by level; inside a wave a walk counts as a virtual visit for the
next, so the ``m`` walks on a node go to the top ``m`` of its children's scores
at ``0 .. m - 1`` virtual visits, what ``m`` one-by-one argmaxes would choose.
A wave of one walk is exactly the sequential search (``tests/test_aded.py``
checks both). Successors are kept as padded table rows (``_States``), so
roll-outs are table lookups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_specbeam.core.tree import DraftTree

C1 = 32.0
C2 = 8.0
NONE = -1


@dataclass(frozen=True)
class SuccessorTable:
    """Successors of many ``(w1, w2)`` states, one padded row each, most probable first.

    Example: states ``[(0, 1), (1, 2)]`` with successors ``{2: 0.6, 3: 0.4}`` and
    none give ``tokens [[2, 3], [0, 0]]``, ``probs [[0.6, 0.4], [0, 0]]``, ``counts [2, 0]``.
    """

    tokens: np.ndarray  # [states, width] int64
    probs: np.ndarray  # [states, width] float64, 0 past a row's count
    counts: np.ndarray  # [states] int64

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[Sequence[int], Sequence[float]]]) -> SuccessorTable:
        """From one ``(ids, probs)`` per state."""
        width = max((len(ids) for ids, _ in rows), default=0)
        tokens = np.zeros((len(rows), width), np.int64)
        probs = np.zeros((len(rows), width))
        for i, (ids, p) in enumerate(rows):
            tokens[i, : len(ids)], probs[i, : len(ids)] = ids, p
        return cls(tokens, probs, np.array([len(ids) for ids, _ in rows], np.int64))


#: ``pairs [states, 2] -> their successors``; called once per batch of states first reached
Successors = Callable[[np.ndarray], SuccessorTable]


@dataclass(frozen=True)
class SearchParams:
    """How long to search and how much of it to keep."""

    iterations: int = 150
    num_paths: int = 24
    depth: int = 4
    max_nodes: int = 64
    #: walks selected together; 0 = in ``ceil(sqrt(iterations) / 4)`` waves (1 = the sequential search)
    wave: int = 0
    c1: float = C1
    c2: float = C2

    @property
    def wave_size(self) -> int:
        """150 iterations: 4 waves of 38; 38: 2 of 19; 16 or fewer: one wave.

        A wave costs the same few numpy calls whatever its size, so a search
        costs about ``sqrt(iterations)``: a step drafting one token (10 walks
        at 150 for 16 nodes) is one wave."""
        return self.wave or math.ceil(self.iterations / math.ceil(math.sqrt(self.iterations) / 4))


@dataclass(frozen=True)
class SearchResult:
    """The draft tree, and how many walks made it (what the node budget scales)."""

    tree: DraftTree
    #: walks run, counted as the root's visits (0 when the root has no successors)
    iterations: int


def selection_scores(
    values: np.ndarray,
    visits: np.ndarray,
    priors: np.ndarray,
    parent_visits: np.ndarray | float,
    c1: float = C1,
    c2: float = C2,
) -> np.ndarray:
    """ADED's selection score of every child (the one with the largest is taken).

    Broadcasts: ``values``/``visits``/``priors`` ``[..., children]`` against
    ``parent_visits`` ``[...]`` with a trailing axis added by the caller.
    An unvisited child has no reward yet (``values`` 0), so ``Q/N`` is 0 for it.
    """
    parent = np.asarray(parent_visits, np.float64)
    mean = values / np.maximum(visits, 1.0)
    explore = (c1 + np.log((parent + c2 + 1) / c2)) * np.sqrt(parent)
    return mean + explore * priors / (1.0 + visits)


def _widen(array: np.ndarray, rows: int, cols: int, fill: float) -> np.ndarray:
    """``array`` padded with ``fill`` to at least ``rows`` x ``cols`` (doubling rows)."""
    new_rows = max(array.shape[0], rows if rows <= array.shape[0] else 2 * rows)
    if (new_rows, max(cols, array.shape[1])) == array.shape:
        return array
    out = np.full((new_rows, max(cols, array.shape[1])), fill, array.dtype)
    out[: array.shape[0], : array.shape[1]] = array
    return out


class _States:
    """Successor tables of every ``(w1, w2)`` state the search reached, one padded row each.

    Row ``r`` holds ``count[r]`` successors: ``tokens[r, :count]``, their
    ``probs`` and running sums ``cumulative`` (``inf`` past the count, so
    ``(cumulative <= x).sum()`` is ``searchsorted(..., side="right")``), and
    ``next[r, k]``, the row of ``(w2, tokens[r, k])`` once it was needed.
    States are looked up in batches: every state a wave's walks first reach
    at one level, in one call.
    """

    def __init__(self, successors: Successors, capacity: int) -> None:
        self._successors = successors
        self.rows: dict[tuple[int, int], int] = {}
        self.pairs = np.zeros((capacity, 2), np.int64)  # [states, 2]
        self.tokens = np.zeros((capacity, 1), np.int64)  # [states, width]
        self.probs = np.zeros((capacity, 1))  # [states, width]
        self.cumulative = np.full((capacity, 1), np.inf)  # [states, width]
        self.next = np.full((capacity, 1), NONE, np.int64)  # [states, width]
        self.count = np.zeros(capacity, np.int64)  # [states]

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def rows_of(self, pairs: np.ndarray) -> np.ndarray:
        """Rows of ``pairs`` ([n, 2]), looking the new ones up together ([n])."""
        keys = list(map(tuple, pairs.tolist()))
        new = list(dict.fromkeys(k for k in keys if k not in self.rows))
        if new:
            first = len(self.rows)
            self.rows.update((k, first + i) for i, k in enumerate(new))
            table = self._successors(np.array(new, np.int64).reshape(-1, 2))
            end = first + len(new)
            if end > self.count.size or table.tokens.shape[1] > self.width:
                self._grow(end, table.tokens.shape[1])
            width = table.tokens.shape[1]
            self.pairs[first:end] = new
            self.tokens[first:end, :width] = table.tokens
            self.probs[first:end, :width] = table.probs
            cumulative = np.cumsum(table.probs, axis=1)  # [new, width]
            self.cumulative[first:end, :width] = np.where(np.arange(width) < table.counts[:, None], cumulative, np.inf)
            self.count[first:end] = table.counts
        return np.array([self.rows[k] for k in keys], np.int64)

    def follow(self, rows: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Rows of the states after taking successor ``slots`` of ``rows`` ([n] each)."""
        nxt = self.next[rows, slots]  # [n]
        unknown = nxt == NONE
        if unknown.any():
            r, k = rows[unknown], slots[unknown]
            nxt[unknown] = self.next[r, k] = self.rows_of(np.stack([self.pairs[r, 1], self.tokens[r, k]], axis=1))
        return nxt

    def _grow(self, rows: int, width: int) -> None:
        self.pairs = _widen(self.pairs, rows, 2, 0)
        self.tokens = _widen(self.tokens, rows, width, 0)
        self.probs = _widen(self.probs, rows, width, 0.0)
        self.cumulative = _widen(self.cumulative, rows, width, np.inf)
        self.next = _widen(self.next, rows, width, NONE)
        self.count = _widen(self.count[:, None], rows, 1, 0)[:, 0]


class _Tree:
    """The search tree as flat arrays; node 0 is the root, a child's statistics live on it."""

    def __init__(self, capacity: int, root_state: int) -> None:
        self.size = 1
        self.parent = np.full(capacity, NONE, np.int64)  # [nodes]
        self.slot = np.zeros(capacity, np.int64)  # [nodes] which successor of the parent's state
        self.token = np.zeros(capacity, np.int64)  # [nodes]
        self.state = np.zeros(capacity, np.int64)  # [nodes] row in _States
        self.depth = np.zeros(capacity, np.int64)  # [nodes]
        self.visits = np.zeros(capacity)  # [nodes]
        self.values = np.zeros(capacity)  # [nodes] summed rewards
        self.prior_sum = np.zeros(capacity)  # [nodes] sum of priors from the root
        self.prob = np.ones(capacity)  # [nodes] product of priors from the root
        self.children = np.full((capacity, 1), NONE, np.int64)  # [nodes, width]
        self.state[0] = root_state

    def add(self, parents: np.ndarray, slots: np.ndarray, states: _States) -> np.ndarray:
        """New children ``slots`` of ``parents`` ([n] each); their indices. Their
        states are left to :meth:`settle`, so a wave looks them all up in one call."""
        new = np.arange(self.size, self.size + parents.size)
        self.size += parents.size
        rows = self.state[parents]  # [n]
        priors = states.probs[rows, slots]  # [n]
        self.parent[new], self.slot[new] = parents, slots
        self.token[new] = states.tokens[rows, slots]
        self.state[new] = NONE
        self.depth[new] = self.depth[parents] + 1
        self.prior_sum[new] = self.prior_sum[parents] + priors
        self.prob[new] = self.prob[parents] * priors
        self.children = _widen(self.children, 0, states.width, NONE)
        self.children[parents, slots] = new
        return new

    def settle(self, nodes: np.ndarray, states: _States) -> None:
        """The states of nodes :meth:`add` left open ([n])."""
        parents = self.parent[nodes]
        self.state[nodes] = states.follow(self.state[parents], self.slot[nodes])


def search(
    successors: Successors,
    w1: int,
    w2: int,
    params: SearchParams,
    rng: np.random.Generator,
    first: Sequence[Sequence[int] | np.ndarray] = (),
) -> SearchResult:
    """Run the search below context ``... w1 w2`` and merge its best paths into a tree,
    after the paths ``first`` (which the node budget keeps first)."""
    states = _States(successors, 64)  # grows as the walks reach new states
    walking = params.depth >= 1 and params.iterations >= 1  # else the root is not even looked up
    root = int(states.rows_of(np.array([[w1, w2]]))[0]) if walking else None
    if root is None or states.count[root] == 0:
        return SearchResult(DraftTree.from_paths(first, params.max_nodes), 0)
    tree = _Tree(2 + params.iterations, root)  # the last node is never used: children NONE (-1) read it
    uniforms = rng.random((params.iterations, params.depth))  # [iterations, depth], one row per walk
    done = 0  # walks started
    while done < params.iterations:
        walks = min(params.wave_size, params.iterations - done)
        leaves = _select(tree, states, params, walks)  # [walks]
        rewards = 1.0 + tree.prior_sum[leaves] + _rollout(tree, states, params, leaves, uniforms[done : done + walks])
        _backup(tree, leaves, rewards)
        done += walks
    paths = _ranked_paths(tree, states, params)
    tree_of_paths = DraftTree.from_paths([*first, *paths[: params.num_paths]], params.max_nodes)
    return SearchResult(tree_of_paths, int(tree.visits[0]))


def _select(tree: _Tree, states: _States, params: SearchParams, walks: int) -> np.ndarray:
    """Walk ``walks`` walks down together; the node each stops at (new nodes are added).

    A node holding ``m`` walks scores its children at ``0 .. m - 1`` virtual
    visits, with its own count as it will be when the last of them leaves
    (``N_parent + m - 1``), and sends them to the ``m`` best. Example: the
    root, unvisited, priors ``[0.6, 0.4]``, 3 walks: explore factor
    ``(32 + ln(11 / 8)) * sqrt(2)`` = 45.7, scores ``[27.4, 13.7, 9.1]`` and
    ``[18.3, 9.1, 6.1]``: 2 walks to child 0, 1 to child 1.
    """
    at = np.zeros(1, np.int64)  # [F] nodes walks stand on (the frontier)
    many = np.array([walks])  # [F] walks on each
    stops: list[np.ndarray] = []
    added: list[np.ndarray] = []
    while at.size:
        rows = tree.state[at]  # [F]
        width = states.width
        tree.children = _widen(tree.children, 0, width, NONE)
        kids = tree.children[at]  # [F, K]; NONE reads the spare last node: no visits, no value
        virtual = np.arange(many.max())  # [V]
        visits = tree.visits[kids][:, :, None] + virtual  # [F, K, V]
        parent = (tree.visits[at] + many - 1)[:, None, None]  # [F, 1, 1]
        scores = selection_scores(
            tree.values[kids][:, :, None], visits, states.probs[rows][:, :, None], parent, params.c1, params.c2
        )
        absent = np.arange(width) >= states.count[rows][:, None]  # [F, K] not a successor
        scores[absent] = -np.inf
        # the top m per node; a child's scores fall with its virtual visits, so the
        # (child, v) taken are always v = 0, 1, ... for each child (ties: lower flat index)
        ranked = np.argsort(-scores.reshape(at.size, -1), axis=1, kind="stable")[:, : virtual.size]  # [F, V]
        taken = virtual < many[:, None]  # [F, V]
        picks = np.flatnonzero(taken) // virtual.size * width + ranked[taken] // virtual.size
        sent_to = np.bincount(picks, minlength=at.size * width).reshape(at.size, width)  # [F, K] walks per child
        frontier, slots = np.nonzero(sent_to)  # [moves] each
        sent = sent_to[frontier, slots]  # [moves]
        children = kids[frontier, slots]  # [moves]
        fresh = children == NONE
        if fresh.any():
            children[fresh] = tree.add(at[frontier[fresh]], slots[fresh], states)
            added.append(children[fresh])
        # a new node stops the walk (its state is looked up below); an old one at full depth or without successors too
        stop = fresh | (tree.depth[children] >= params.depth) | (states.count[tree.state[children]] == 0)
        stops.append(np.repeat(children[stop], sent[stop]))
        at, many = children[~stop], sent[~stop]
    if added:
        tree.settle(np.concatenate(added), states)
    return np.concatenate(stops)


def _rollout(
    tree: _Tree, states: _States, params: SearchParams, leaves: np.ndarray, uniforms: np.ndarray
) -> np.ndarray:
    """Sum of the tri-gram probabilities of each walk's draft finished by sampling them ([walks])."""
    rows = tree.state[leaves]  # [walks]
    steps = params.depth - tree.depth[leaves]  # [walks]
    total = np.zeros(leaves.size)  # [walks]
    for step in range(int(steps.max())):
        live = np.flatnonzero((steps > step) & (states.count[rows] > 0))
        if not live.size:
            break
        r = rows[live]
        drawn = uniforms[live, step] * states.cumulative[r, states.count[r] - 1]
        slots = np.minimum((states.cumulative[r] <= drawn[:, None]).sum(axis=1), states.count[r] - 1)
        total[live] += states.probs[r, slots]
        rows[live] = states.follow(r, slots)
    return total


def _backup(tree: _Tree, leaves: np.ndarray, rewards: np.ndarray) -> None:
    """Every node from each leaf up to the root gains a visit and the walk's reward."""
    nodes, gains = leaves, rewards
    while nodes.size:
        np.add.at(tree.visits, nodes, 1.0)
        np.add.at(tree.values, nodes, gains)
        up = tree.parent[nodes]
        nodes, gains = up[up != NONE], gains[up != NONE]


def _ranked_paths(tree: _Tree, states: _States, params: SearchParams) -> list[list[int]]:
    """Token paths to the leaves of the search, most visited first, each extended by
    its most probable next token where the depth allows one.

    Ties (every leaf above the depth limit has one visit) go to the more
    probable path, then to search order (depth first, successors in order).
    """
    n = tree.size
    inner = np.zeros(n, bool)
    inner[tree.parent[1:n]] = True
    leaves = np.flatnonzero(~inner)
    leaves = leaves[leaves != 0]  # [L]
    ancestry = np.full((leaves.size, params.depth), NONE, np.int64)  # [L, depth] node at each depth
    node = leaves.copy()
    for _ in range(params.depth):
        ok = node > 0
        ancestry[ok, tree.depth[node[ok]] - 1] = node[ok]
        node = np.where(ok, tree.parent[np.maximum(node, 0)], 0)
    slots = np.where(ancestry != NONE, tree.slot[ancestry], NONE)  # [L, depth]
    order = np.lexsort((*slots.T[::-1], -tree.prob[leaves], -tree.visits[leaves]))
    paths: list[list[int]] = []
    for i in order[: params.num_paths].tolist():
        path = tree.token[ancestry[i][ancestry[i] != NONE]].tolist()
        row = tree.state[leaves[i]]
        if len(path) < params.depth and states.count[row]:
            path.append(int(states.tokens[row, 0]))
        paths.append(path)
    return paths
