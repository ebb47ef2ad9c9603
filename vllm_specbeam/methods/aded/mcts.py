"""ADED's draft-tree construction: Monte Carlo tree search over tri-gram successors.

A search node is a token sequence below the request's last two tokens; its
children are the tri-gram successors of its last two tokens, with the tri-gram
probability as prior ``P``. Each iteration walks down by

    Q/N + (c1 + ln((N_parent + c2 + 1) / c2)) * P * sqrt(N_parent) / (1 + N)

(``Q`` the child's summed reward, ``N`` its visits, ``Q/N = 0`` when unvisited),
expands the node it stops at, finishes the draft by sampling tri-gram
successors, and backs up the reward ``1 + sum of P`` along the whole draft.
The search spends its iterations where drafts are long *and* probable, while
the prior term keeps it trying less likely branches.

The draft tree is made of the most-visited root-to-leaf paths of the search
(the visit count of a path is its leaf's: counts only shrink going down),
each extended by one greedy token, merged most-visited first.

Speed: successors of a state are looked up once per search (the base matrix
is a binary search over memory-mapped arrays, the overlays a dict merge), the
selection rule is one numpy expression over a node's children, and all the
random numbers of the roll-outs are drawn up front.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vllm_specbeam.core.tree import DraftTree

#: ``(w1, w2) -> (successor ids, probabilities)``, most probable first
Successors = Callable[[int, int], tuple[np.ndarray, np.ndarray]]

C1 = 32.0
C2 = 8.0


@dataclass(frozen=True)
class SearchParams:
    iterations: int = 150
    num_paths: int = 24
    depth: int = 4
    max_nodes: int = 64
    c1: float = C1
    c2: float = C2


def selection_scores(
    values: np.ndarray, visits: np.ndarray, priors: np.ndarray, parent_visits: int, c1: float = C1, c2: float = C2
) -> np.ndarray:
    """ADED's selection score of every child (the one with the largest is taken)."""
    mean = np.divide(values, visits, out=np.zeros_like(values), where=visits > 0)
    explore = (c1 + math.log((parent_visits + c2 + 1) / c2)) * math.sqrt(parent_visits)
    return mean + explore * priors / (1.0 + visits)


class _Node:
    """One search node; statistics of its children are kept as arrays on it."""

    __slots__ = ("child_values", "child_visits", "children", "depth", "priors", "state", "tokens", "visits")

    def __init__(self, state: tuple[int, int], depth: int) -> None:
        self.state = state
        self.depth = depth
        self.tokens: np.ndarray | None = None  # None until expanded
        self.priors = np.zeros(0)
        self.visits = 0
        self.child_visits = np.zeros(0)
        self.child_values = np.zeros(0)
        self.children: list[_Node | None] = []

    def expand(self, successors: Successors) -> None:
        self.tokens, self.priors = successors(*self.state)
        self.child_visits = np.zeros(self.tokens.size)
        self.child_values = np.zeros(self.tokens.size)
        self.children = [None] * self.tokens.size

    def child(self, i: int) -> _Node:
        assert self.tokens is not None  # only an expanded node has children
        node = self.children[i]
        if node is None:
            node = self.children[i] = _Node((self.state[1], int(self.tokens[i])), self.depth + 1)
        return node


class _CachedSuccessors:
    """Successor lookups memoised for one search, with cumulative sums for sampling."""

    def __init__(self, successors: Successors) -> None:
        self._successors = successors
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def entry(self, w1: int, w2: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        entry = self._cache.get((w1, w2))
        if entry is None:
            tokens, probs = self._successors(w1, w2)
            entry = self._cache[(w1, w2)] = (tokens, probs, np.cumsum(probs))
        return entry

    def __call__(self, w1: int, w2: int) -> tuple[np.ndarray, np.ndarray]:
        return self.entry(w1, w2)[:2]


def search(successors: Successors, w1: int, w2: int, params: SearchParams, rng: np.random.Generator) -> DraftTree:
    """Run the search below context ``... w1 w2`` and merge its best paths into a tree."""
    cached = _CachedSuccessors(successors)
    root = _Node((w1, w2), 0)
    root.expand(cached)
    assert root.tokens is not None  # just expanded
    if root.tokens.size == 0 or params.depth < 1:
        return DraftTree.empty()
    uniforms = rng.random((params.iterations, params.depth))
    for i in range(params.iterations):
        _iterate(root, cached, params, uniforms[i])
    paths = [_extend(tokens, end, cached, params.depth) for tokens, end in _ranked_paths(root)]
    return DraftTree.from_paths(paths[: params.num_paths], params.max_nodes)


def _iterate(root: _Node, successors: _CachedSuccessors, params: SearchParams, uniforms: np.ndarray) -> None:
    """Select, expand, roll out and back up once."""
    node, reward = root, 1.0
    edges: list[tuple[_Node, int, _Node]] = []  # (parent, child index, child) along the walk
    while node.tokens is not None and node.tokens.size and node.depth < params.depth:
        scores = selection_scores(node.child_values, node.child_visits, node.priors, node.visits, params.c1, params.c2)
        i = int(np.argmax(scores))
        reward += float(node.priors[i])
        child = node.child(i)
        edges.append((node, i, child))
        node = child
    if node.tokens is None and node.depth < params.depth:
        node.expand(successors)
    reward += _rollout(node.state, params.depth - node.depth, successors, uniforms)
    root.visits += 1
    for parent, i, child in edges:
        parent.child_visits[i] += 1
        parent.child_values[i] += reward
        child.visits += 1


def _rollout(state: tuple[int, int], steps: int, successors: _CachedSuccessors, uniforms: np.ndarray) -> float:
    """Sum of the tri-gram probabilities of a draft finished by sampling them."""
    total = 0.0
    w1, w2 = state
    for u in uniforms[:steps]:
        tokens, probs, cumulative = successors.entry(w1, w2)
        if tokens.size == 0:
            break
        i = min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), tokens.size - 1)
        total += float(probs[i])
        w1, w2 = w2, int(tokens[i])
    return total


def _ranked_paths(root: _Node) -> list[tuple[list[int], tuple[int, int]]]:
    """Leaves of the visited part of the search, most visited first.

    Ties (every leaf above the depth limit has one visit) go to the more
    probable path, then to search order. Each path comes with its end state.
    """
    leaves: list[tuple[int, float, list[int], tuple[int, int]]] = []
    stack: list[tuple[_Node, list[int], float]] = [(root, [], 1.0)]
    while stack:
        node, tokens, prob = stack.pop()
        visited = [(i, child) for i, child in enumerate(node.children) if child is not None and child.visits]
        if not visited and tokens:
            leaves.append((node.visits, prob, tokens, node.state))
        for i, child in reversed(visited):
            # a child's state ends with its own token (see _Node.child)
            stack.append((child, [*tokens, child.state[1]], prob * float(node.priors[i])))
    leaves.sort(key=lambda leaf: (-leaf[0], -leaf[1]))
    return [(tokens, state) for _, _, tokens, state in leaves]


def _extend(tokens: list[int], state: tuple[int, int], successors: _CachedSuccessors, depth: int) -> list[int]:
    """The path plus its most probable next token, where the depth allows one."""
    if len(tokens) >= depth:
        return tokens
    following, _ = successors(*state)
    return [*tokens, int(following[0])] if following.size else tokens
