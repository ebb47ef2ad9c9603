"""Prompt lookup: where the recent n-gram occurred before.

Shared by ``lookup_tree`` (its whole draft) and ``aded`` (the branches it
drafts before its tri-gram search).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_specbeam.core.tree import DraftTree


@dataclass(frozen=True)
class Matches:
    """Where the query's longest matched suffix n-gram ends in a haystack, most recent first."""

    ends: np.ndarray  # [matches]
    length: int  # the n-gram's length (0: none of at least the minimum)


NO_MATCH = Matches(np.zeros(0, np.int64), 0)


def match_ends(haystack: np.ndarray, query: np.ndarray, min_n: int, max_n: int) -> Matches:
    """Occurrences in ``haystack`` of the longest suffix n-gram of ``query``.

    Looks for the suffix of length ``n`` for the largest ``n`` in
    ``[min_n, max_n]`` that occurs in ``haystack``, and returns the index of
    the last token of every such occurrence, most recent first. A request's
    own history is ``match_ends(tokens[:-1], tokens, ...)``. Vectorised:
    candidates are the positions of the query's last token, extended
    backwards together. Example: haystack ``[5, 1, 2, 3, 9, 1, 2, 4]`` and a
    query ending ``[7, 1, 2]`` match "1 2" (length 2) ending at 6 and 2.
    """
    length = query.size
    if length < min_n or haystack.size == 0:
        return NO_MATCH
    longest = np.flatnonzero(haystack == query[-1])  # [candidates]: they match 1 token
    best = 1 if longest.size else 0
    for k in range(1, min(max_n, length)):  # the candidates that match k + 1 tokens, while any do
        alive = longest[longest >= k]
        alive = alive[haystack[alive - k] == query[-1 - k]]
        if alive.size == 0:
            break
        longest, best = alive, k + 1
    if best < min_n:
        return NO_MATCH
    return Matches(longest[::-1], best)


def continuations(tokens: np.ndarray, matches: Matches, depth: int) -> list[np.ndarray]:
    """Up to ``depth`` tokens after each match in ``tokens`` (the haystack plus the
    query's last token), most recent match first. Example: tokens ``[5, 1, 2, 3, 9,
    1, 2, 4, 1, 2]`` (matches of "1 2" end at 6 and 2), depth 2: ``[[4, 1], [3, 9]]``."""
    return [tokens[end + 1 : end + 1 + depth] for end in matches.ends]


def match_kind(length: int) -> int:
    """The step budget's kind (``DraftTree.kinds``) of the nodes continuing a ``length``-token
    match: 0 for 4 tokens or more, 1 for 3, 2 for 2, 3 for 1. Longer matches are accepted
    more often: replaying SmolLM2's greedy HumanEval answers through ``lookup_tree`` (a one-off
    script, docs/measurements.md "Node kinds"), the target kept 92 % of the tried nodes of
    5-token matches and 60 % of 2-token ones."""
    return 0 if length >= 4 else 4 - max(length, 1)


def match_tree(paths: list[np.ndarray], length: int, max_nodes: int) -> DraftTree:
    """The continuations of a ``length``-token match merged into one tree of at most
    ``max_nodes`` nodes, labelled with :func:`match_kind`. Equal weights: a node weighs
    how many matches continue through it; ties go to the most recent match (``paths``
    come most recent first)."""
    return DraftTree.from_weighted_paths(paths, np.ones(len(paths)), max_nodes).with_kinds(match_kind(length))
