"""Prompt lookup's match choice (vllm_specbeam/core/lookup.py): every suffix length's
occurrences, and suffix decoding's rule for which of them drafts, against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_specbeam.core.lookup import Source, best_match, chain_score, match_kind, match_levels
from vllm_specbeam.core.tree import ROOT
from vllm_specbeam.methods.lookup_tree.index import SEPARATOR, SuffixIndex


def occurrences(haystack: list[int], query: list[int], n: int) -> list[int]:
    """Where the last ``n`` tokens of ``query`` end in ``haystack``, most recent first."""
    gram = query[-n:]
    return [i for i in range(len(haystack) - 1, n - 2, -1) if haystack[i - n + 1 : i + 1] == gram]


@pytest.mark.parametrize("seed", range(30))
def test_levels_are_every_distinct_set_of_occurrences(seed: int) -> None:
    rng = np.random.default_rng(seed)
    haystack, query = rng.integers(0, 3, rng.integers(1, 40)), rng.integers(0, 3, rng.integers(1, 10))
    low = int(rng.integers(1, 3))
    high = int(rng.integers(low, 8))
    sets = {n: occurrences(haystack.tolist(), query.tolist(), n) for n in range(low, min(high, query.size) + 1)}
    sets = {n: ends for n, ends in sets.items() if ends}
    expected = [(n, sets[n]) for n in sorted(sets, reverse=True) if sets.get(n + 1) != sets[n]]
    got = [(level.length, level.ends.tolist()) for level in match_levels(haystack, query, low, high)]
    assert got == expected


def until_separator(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(SEPARATOR)] if SEPARATOR in tokens else tokens


def greedy_score(paths: list[list[int]]) -> float:
    """The most frequent chain's expected length, from prefix counts: sum of count(prefix) / paths."""
    chain: list[int] = []
    score = 0.0
    while True:
        below = [p[len(chain)] for p in paths if len(p) > len(chain) and p[: len(chain)] == chain]
        if not below:
            return score
        counts = {token: below.count(token) for token in below}  # first seen first
        chain.append(max(counts, key=counts.__getitem__))
        score += counts[chain[-1]] / len(paths)


@pytest.mark.parametrize("seed", range(30))
def test_the_best_scoring_length_drafts(seed: int) -> None:
    """Every length from the longest down, own tokens then the index, scored without the early
    stop: the choice is the best score, the longer length on a tie."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 3, rng.integers(2, 40))
    index = SuffixIndex(500)
    for _ in range(rng.integers(0, 4)):
        index.add(None, rng.integers(0, 3, rng.integers(1, 30)))
    sources = [Source.own(tokens, 1, 6)]
    partition = index.partition(None)
    if partition is not None:
        corpus = partition.corpus
        sources.append(partition.source(tokens, 1, 6))
    factor = float(rng.choice([0.0, 1.0, 2.0]))
    max_matches = int(rng.integers(1, 6))

    def depth_of(n: int) -> int:
        return 5 if factor == 0 else min(5, int(factor * n))

    best: tuple[float, int] | None = None
    own_hay = tokens[:-1].tolist()
    for n in range(min(6, tokens.size), 0, -1):
        paths = [tokens[e + 1 : e + 1 + depth_of(n)].tolist() for e in occurrences(own_hay, tokens.tolist(), n)]
        paths = paths[:max_matches]
        if partition is not None:
            ends = occurrences(corpus.tolist(), tokens.tolist(), n)[: max_matches - len(paths)]
            paths += [until_separator(corpus.tolist()[e + 1 : e + 1 + depth_of(n)]) for e in ends]
        if paths and (best is None or greedy_score(paths) > best[0]):
            best = (greedy_score(paths), n)
    choice = best_match(sources, depth_of, max_matches)
    assert (None if choice is None else (pytest.approx(choice.score), choice.length)) == best
    if choice is not None:  # each path's own longest match, and the kind of the nodes it walks
        assert all(length >= choice.length for length in choice.lengths)
        tree = choice.tree(64)
        for nodes, length, source in zip(tree.walks(choice.paths), choice.lengths, choice.sources):
            assert all(tree.kinds[node] <= match_kind(length, indexed=source > 0) for node in nodes)


def test_a_frequent_shorter_match_beats_a_longer_one_that_ends() -> None:
    """The docstring's example: ``1 2 3 4 5 6`` occurred once, followed by ``7`` and the end of
    that request; its last two tokens ``5 6`` occurred three times more, each followed by ``4 4``."""
    index = SuffixIndex(500)
    for _ in range(3):
        index.add(None, np.asarray([9, 5, 6, 4, 4]))
    index.add(None, np.asarray([1, 2, 3, 4, 5, 6, 7]))
    partition = index.partition(None)
    tokens = np.asarray([8, 1, 2, 3, 4, 5, 6])
    sources = [Source.own(tokens, 1, 24), partition.source(tokens, 1, 24)]
    choice = best_match(sources, lambda n: min(24, 2 * n), 64)
    assert choice.length == 2 and choice.score == pytest.approx(1.5)
    tree = choice.tree(8)
    assert tree.tokens.tolist() == [4, 4, 7] and tree.parents.tolist() == [ROOT, 0, ROOT]
    # the shorter match drafts the chain; the sibling from the 6-token match keeps that match's
    # kind; all of them the index's
    assert tree.kinds.tolist() == [match_kind(2, True), match_kind(2, True), match_kind(6, True)]
    assert chain_score([np.asarray([4, 1]), np.asarray([4, 2]), np.asarray([3])]) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(40))
def test_chain_score_follows_the_most_frequent_token_depth_by_depth(seed):
    # brute force: at each depth every path still on the chain votes for its next token; the
    # most votes (ties: the first path's, the most recent) extend the chain, and the chain's
    # token scores the share of all paths that reached it
    rng = np.random.default_rng(seed)
    paths = [rng.integers(0, 3, rng.integers(0, 5)) for _ in range(rng.integers(1, 10))]
    paths += [paths[0]] * int(rng.integers(0, 3))  # equal paths, as repeated text gives
    on_chain, expected, depth = list(range(len(paths))), 0.0, 0
    while True:
        votes = [int(paths[k][depth]) for k in on_chain if paths[k].size > depth]
        if not votes:
            break
        token = max(votes, key=lambda t: (votes.count(t), -votes.index(t)))
        on_chain = [k for k in on_chain if paths[k].size > depth and paths[k][depth] == token]
        expected += len(on_chain) / len(paths)
        depth += 1
    assert chain_score(paths) == expected
