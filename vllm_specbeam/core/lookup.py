"""Prompt lookup: where the recent n-gram occurred before.

Shared by ``lookup_tree`` (its whole draft) and ``aded`` (the branches it
drafts before its tri-gram search).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from vllm_specbeam.core.tree import DraftTree


@dataclass(frozen=True)
class Matches:
    """Where one suffix n-gram of the query ends in a haystack, most recent first."""

    ends: np.ndarray  # [matches]
    length: int  # the n-gram's length (0: none of at least the minimum)


NO_MATCH = Matches(np.zeros(0, np.int64), 0)


def match_levels(
    haystack: np.ndarray, query: np.ndarray, min_n: int, max_n: int, last: np.ndarray | None = None
) -> list[Matches]:
    """Occurrences in ``haystack`` of the suffix n-grams of ``query``, ``n`` in ``[min_n, max_n]``,
    longest first: one entry per distinct set of occurrences, at the longest ``n`` that has it.
    ``last``: where the query's last token occurs in ``haystack``, ascending, when an index
    knows (None: a scan finds them).

    Vectorised: candidates are the positions of the query's last token, extended backwards
    together; each time some drop out, the set before is a level of its own. A request's own
    history is ``match_levels(tokens[:-1], tokens, ...)``. Example: haystack ``[5, 1, 2, 3, 9,
    1, 2, 4, 2]`` and a query ending ``[7, 1, 2]``: "1 2" (length 2) ends at 6 and 2, "2"
    (length 1) at 8, 6 and 2.
    """
    length = query.size
    if length < min_n or haystack.size == 0:
        return []
    alive = np.flatnonzero(haystack == query[-1]) if last is None else last  # [candidates]: they match 1 token
    if alive.size == 0:
        return []
    levels: list[Matches] = []
    best = 1
    for k in range(1, min(max_n, length)):  # the candidates that match k + 1 tokens, while any do
        longer = alive[alive >= k]
        longer = longer[haystack[longer - k] == query[-1 - k]]
        if longer.size == 0:
            break
        if longer.size < alive.size and best >= min_n:
            levels.append(Matches(alive[::-1], best))
        alive, best = longer, k + 1
    if best >= min_n:
        levels.append(Matches(alive[::-1], best))
    return levels[::-1]


def match_ends(haystack: np.ndarray, query: np.ndarray, min_n: int, max_n: int) -> Matches:
    """Occurrences in ``haystack`` of the longest suffix n-gram of ``query`` (``n`` in
    ``[min_n, max_n]``), most recent first: :func:`match_levels`' first. Example: haystack
    ``[5, 1, 2, 3, 9, 1, 2, 4]`` and a query ending ``[7, 1, 2]`` match "1 2" (length 2)
    ending at 6 and 2."""
    levels = match_levels(haystack, query, min_n, max_n)
    return levels[0] if levels else NO_MATCH


def chain_score(paths: list[np.ndarray]) -> float:
    """The expected accepted length of the most frequent chain through ``paths`` (most recent
    first): the sum over its tokens of the share of paths that continue through it, as suffix
    decoding scores a draft. Example: paths ``[4, 1]``, ``[4, 2]``, ``[3]``: the chain ``4, 1``
    scores 2/3 + 1/3 = 1."""
    alive: dict[tuple[int, ...], int] = Counter(tuple(path.tolist()) for path in paths)  # equal paths once
    total, score, depth = len(paths), 0.0, 0
    while len(alive) > 1:
        tokens: Counter[int] = Counter()
        for path, count in alive.items():
            if len(path) > depth:
                tokens[path[depth]] += count
        if not tokens:
            return score
        token = max(tokens, key=tokens.__getitem__)  # ties: the first seen, the most recent
        alive = {path: count for path, count in alive.items() if len(path) > depth and path[depth] == token}
        score += sum(alive.values()) / total  # the share of paths through the chain's token
        depth += 1
    for path, count in alive.items():  # one path left: the chain follows it to its end, added
        # depth by depth as above (the same float sum, so ties between match lengths break alike)
        for _ in range(len(path) - depth):
            score += count / total
    return score


def continuations(text: np.ndarray, ends: np.ndarray, depth: int) -> list[np.ndarray]:
    """Up to ``depth`` tokens of ``text`` after each of ``ends``, each stopping at the text's
    end or before its first negative entry (an index's separator between requests), in one
    gather. Example: text ``[5, 6, -1, 7, 8]``, ends ``[0, 3]``, depth 3: ``[6]`` and ``[8]``."""
    if ends.size == 0:
        return []
    places = ends[:, None] + 1 + np.arange(depth)  # [ends, depth]
    rows = np.where(places < text.size, text[np.minimum(places, text.size - 1)], -1)  # [ends, depth]
    stops = rows < 0
    lengths = np.where(stops.any(axis=1), stops.argmax(axis=1), depth)  # [ends]
    return [row[:n] for row, n in zip(rows, lengths.tolist())]


@dataclass(frozen=True)
class Source:
    """A text the recent n-gram is looked up in (``text``: its tokens, negative ones separating
    requests) and the n-gram's matches there by length (:func:`match_levels`)."""

    levels: list[Matches]
    text: np.ndarray

    @classmethod
    def own(cls, tokens: np.ndarray, min_n: int, max_n: int) -> Source:
        """A request's own tokens, the last one matched against those before."""
        return cls(match_levels(tokens[:-1], tokens, min_n, max_n), tokens)

    def continuations(self, ends: np.ndarray, depth: int) -> list[np.ndarray]:
        """What follows the matches ending at ``ends``, up to ``depth`` tokens (:func:`continuations`)."""
        return continuations(self.text, ends, depth)

    def longest(self, ends: list[int], length: int) -> list[int]:
        """The longest match ending at each of ``ends``, the ``length``-token suffix's occurrences."""
        lengths = [0] * len(ends)
        for level in self.levels:  # longest first; each level's occurrences hold the longer ones'
            if level.length <= length or all(lengths):
                break
            within = set(level.ends.tolist())
            lengths = [n or (level.length if end in within else 0) for n, end in zip(lengths, ends)]
        shortest = self.at(length).length
        return [n or shortest for n in lengths]

    def at(self, length: int) -> Matches:
        """The occurrences of the ``length``-token suffix: the shortest level at least that long."""
        covering = [level for level in self.levels if level.length >= length]
        return covering[-1] if covering else NO_MATCH


@dataclass(frozen=True)
class LookupChoice:
    """The match length chosen, and its occurrences, most recent first, earlier sources first:
    where each ends, its source (0: the request's own tokens; others: a cross-request index),
    its continuation, and the longest match it has."""

    length: int
    ends: list[int]
    sources: list[int]
    paths: list[np.ndarray]
    score: float
    lengths: list[int] = field(default_factory=list)

    def tree(self, max_nodes: int) -> DraftTree:
        """The continuations merged into one tree of at most ``max_nodes`` nodes
        (:func:`match_tree`)."""
        drafted = [i for i, path in enumerate(self.paths) if path.size]
        if not drafted:
            return DraftTree.empty()
        return match_tree(
            [self.paths[i] for i in drafted],
            [self.lengths[i] for i in drafted],
            [self.sources[i] > 0 for i in drafted],
            max_nodes,
        )


def best_match(sources: Sequence[Source], depth_of: Callable[[int], int], max_matches: int) -> LookupChoice | None:
    """Suffix decoding's rule: of every match length whose occurrences differ from a longer
    one's, in all ``sources`` together, the one whose continuations (``depth_of(length)``
    deep, the ``max_matches`` most recent, earlier sources first) score the most
    (:func:`chain_score`), the longer on a tie. Longest first, stopping once a length drafts
    no deeper than the best score (exact, as ``depth_of`` never shrinks with the length and a
    chain scores at most its depth). Example: a 6-token match whose one occurrence is followed
    by ``7`` and then the text's end (score 1) loses to its last 2 tokens, seen 3 times more,
    each followed by ``4 4``: 3/4 + 3/4 = 1.5."""
    best: LookupChoice | None = None
    for length in sorted({level.length for source in sources for level in source.levels}, reverse=True):
        depth = depth_of(length)
        if best is not None and depth <= best.score:
            break
        ends: list[int] = []
        origin: list[int] = []
        paths: list[np.ndarray] = []
        for i, source in enumerate(sources):
            found = source.at(length).ends[: max_matches - len(ends)]  # [found]
            ends += found.tolist()
            origin += [i] * found.size
            paths += source.continuations(found, depth)
        score = chain_score(paths)
        if best is None or score > best.score:
            best = LookupChoice(length, ends, origin, paths, score)
    if best is None:
        return None
    lengths = [
        n
        for i, source in enumerate(sources)
        for n in source.longest([end for end, s in zip(best.ends, best.sources) if s == i], best.length)
    ]
    return replace(best, lengths=lengths)


#: added to :func:`match_kind` for a match in other requests' text (a cross-request index)
INDEX_KIND = 4


def match_kind(length: int, indexed: bool = False) -> int:
    """The step budget's kind (``DraftTree.kinds``) of the nodes continuing a ``length``-token
    match: 0 for 4 tokens or more, 1 for 3, 2 for 2, 3 for 1, plus :data:`INDEX_KIND` in
    another request's text. Longer matches are accepted more often: replaying SmolLM2's greedy
    HumanEval answers through ``lookup_tree`` (a one-off script, docs/measurements.md "Node
    kinds"), the target kept 92 % of the tried nodes of 5-token matches and 60 % of 2-token
    ones. Other requests' text is accepted apart: code editing's first steps match the shared
    instruction into another request's answer."""
    return (0 if length >= 4 else 4 - max(length, 1)) + (INDEX_KIND if indexed else 0)


def match_tree(paths: list[np.ndarray], lengths: Sequence[int], indexed: Sequence[bool], max_nodes: int) -> DraftTree:
    """The continuations of matches (each of ``lengths`` tokens; ``indexed``: in another
    request's text) merged into one tree of at most ``max_nodes`` nodes. Equal weights: a node
    weighs how many matches continue through it; ties go to the most recent match (``paths``
    come most recent first). A node's kind (:func:`match_kind`) is the least of the matches
    continuing through it: the request's own before the index, then the longest;
    ``from_index`` marks the nodes an index match walks through (``None``: none does).
    Example: ``[5, 6]`` of a 3-token match in the request and ``[5, 7]`` of a 4-token one in
    the index: kinds ``[1, 1, 4]`` and ``from_index`` ``[True, False, True]`` for the nodes
    ``5, 6, 7``."""
    merged = _Distinct.of(paths, [match_kind(n, i) for n, i in zip(lengths, indexed, strict=True)], indexed)
    tree = DraftTree.from_weighted_paths(merged.paths, merged.counts, max_nodes)
    kinds = np.full(tree.num_nodes, max(merged.kinds, default=match_kind(1)), np.int64)  # [num_nodes]
    if len(set(merged.kinds)) <= 1:  # one kind is one source: every node has it, no walk needed
        walked_by_index = np.full(tree.num_nodes, any(indexed))  # [num_nodes]
    else:
        walked_by_index = np.zeros(tree.num_nodes, bool)
        for nodes, kind, in_index in zip(tree.walks(merged.paths), merged.kinds, merged.indexed):
            kinds[nodes] = np.minimum(kinds[nodes], kind)
            walked_by_index[nodes] |= in_index
    from_index = walked_by_index if any(indexed) else None
    return DraftTree(tree.tokens, tree.parents, tree.draft_probs, kinds=kinds, from_index=from_index)


@dataclass
class _Distinct:
    """Equal paths as one, first seen first: how many there were, the least kind and whether any
    was in the index (equal paths walk the same nodes, so a tree of these is the same tree)."""

    paths: list[np.ndarray]
    counts: list[int]
    kinds: list[int]
    indexed: list[bool]

    @classmethod
    def of(cls, paths: Sequence[np.ndarray], kinds: Sequence[int], indexed: Sequence[bool]) -> _Distinct:
        merged = cls([], [], [], [])
        where: dict[bytes, int] = {}
        for path, kind, in_index in zip(paths, kinds, indexed, strict=True):
            k = where.setdefault(path.tobytes(), len(merged.paths))
            if k == len(merged.paths):
                merged.paths.append(path)
                merged.counts.append(0)
                merged.kinds.append(kind)
                merged.indexed.append(False)
            merged.counts[k] += 1
            merged.kinds[k] = min(merged.kinds[k], kind)
            merged.indexed[k] |= bool(in_index)
        return merged
