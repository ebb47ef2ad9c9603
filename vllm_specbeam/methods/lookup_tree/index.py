"""A bounded index of finished requests' token sequences, partitioned by ``cache_salt``, searchable by suffix n-gram.

``lookup_tree``'s global scope (and the draft-model methods' global lookup) drafts from the
prompts and outputs of the requests this engine finished. Drafts only, so outputs never change,
but speed does: a timing side channel between users, which vLLM's prefix cache closes with
``cache_salt``. So does the index: a sequence goes into its salt's partition and a request
matches only its own salt's; requests without a salt share one (key ``None``).

In a partition the sequences sit end to end with a separator (``-1``, never a token id) after
each, so a match never spans two requests and a continuation stops at its request's end.
Matching starts from where the query's last token occurs, in the partition's occurrence lists
(sorted runs merged as a log-structured merge), not from a scan of the partition: costs at
capacity in docs/methods/lookup_tree.md, "The index at its capacity".

``capacity`` bounds all partitions together. Past it the oldest sequence of the *largest*
partition goes (ties: the partition created first), never the sequence just added; a sequence
longer than the cap keeps its last ``capacity`` tokens. So a tenant's text evicts its own first:
a partition holding at most an equal share of what a new sequence leaves, ``(capacity - its
length) / partitions``, loses nothing to it, and another tenant's volume can neither flush its
text nor be read from its speed. With one partition this is first in, first out.

Example: after ``add(None, [5, 6, 7])`` and ``add(None, [8, 6, 9])`` the unsalted corpus is
``[5, 6, 7, -1, 8, 6, 9, -1]``; the query ``[..., 6]`` matches at 1 and 5, continuing ``[7]`` and ``[9]``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from vllm_specbeam.core.lookup import Source, match_levels

SEPARATOR = -1
#: how many of the largest partitions :meth:`SuffixIndex.stats` reports the tokens of
REPORTED_PARTITIONS = 4


@dataclass(frozen=True)
class Run:
    """Where each token of a stretch of whole sequences occurs: the occurrences sorted by token,
    each token's in the order of the text. Places count along the partition's stream, every
    sequence ever added and its separator end to end, so they stay valid as the oldest go."""

    tokens: np.ndarray  # [occurrences] int32, ascending
    places: np.ndarray  # [occurrences] int64, ascending within a token
    begin: int  # the stream's stretch [begin, end) this run covers
    end: int

    @classmethod
    def of(cls, sequence: np.ndarray, begin: int) -> Run:
        order = np.argsort(sequence, kind="stable")  # [tokens]
        return cls(sequence[order].astype(np.int32), begin + order, begin, begin + sequence.size + 1)

    @property
    def size(self) -> int:
        return self.tokens.size

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.places.nbytes

    def merged(self, newer: Run) -> Run:
        """This run and the next one as one; the stable sort of two sorted runs is a linear merge."""
        tokens = np.concatenate([self.tokens, newer.tokens])
        order = np.argsort(tokens, kind="stable")  # equal tokens: this run's (the older) first
        return Run(tokens[order], np.concatenate([self.places, newer.places])[order], self.begin, newer.end)

    def from_place(self, begin: int) -> Run:
        """The occurrences at ``begin`` or later (filtering keeps the order)."""
        kept = self.places >= begin
        return Run(self.tokens[kept], self.places[kept], begin, self.end)

    def find(self, token: int) -> np.ndarray:
        """The places of ``token``, in the order of the text."""
        low, high = np.searchsorted(self.tokens, np.asarray((token, token + 1), self.tokens.dtype))
        return self.places[low:high]


class Partition:
    """One salt's finished sequences end to end, oldest first, with the occurrences of their
    tokens in runs (see the module docstring)."""

    def __init__(self) -> None:
        self._sequences: deque[np.ndarray] = deque()
        self.num_tokens = 0
        self._corpus: np.ndarray | None = None  # [tokens + sequences], built when read after a change
        self._runs: list[Run] = []  # oldest first, each less than half the size of the one before
        self._begin = 0  # the stream's place of the corpus's first token
        self._end = 0  # the stream's place of the next sequence

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def nbytes(self) -> int:
        """8 bytes a token and a separator, and 12 an occurrence: at most ``20 * tokens + 8 *
        sequences``, and a third more for the oldest run, whose evicted tokens' occurrences go
        once they are a quarter of it."""
        return 8 * (self.num_tokens + self.num_sequences) + sum(run.nbytes for run in self._runs)

    @property
    def corpus(self) -> np.ndarray:
        """Every sequence followed by :data:`SEPARATOR`, oldest first (read-only)."""
        if self._corpus is None:
            separator = np.full(1, SEPARATOR, np.int64)
            self._corpus = np.concatenate([part for seq in self._sequences for part in (seq, separator)])
        return self._corpus

    def add(self, sequence: np.ndarray) -> None:
        self._sequences.append(sequence)
        self.num_tokens += sequence.size
        self._corpus = None
        self._runs.append(Run.of(sequence, self._end))
        self._end += sequence.size + 1
        while len(self._runs) > 1 and self._runs[-2].size <= 2 * self._runs[-1].size:
            newer = self._runs.pop()
            self._runs[-1] = self._runs[-1].merged(newer)

    def drop_oldest(self) -> None:
        oldest = self._sequences.popleft()
        self.num_tokens -= oldest.size
        self._corpus = None
        self._begin += oldest.size + 1
        while self._runs and self._runs[0].end <= self._begin:
            self._runs.pop(0)
        first = self._runs[0] if self._runs else None
        if first is not None and 4 * (self._begin - first.begin) > first.end - first.begin:
            self._runs[0] = first.from_place(self._begin)

    def occurrences(self, token: int) -> np.ndarray:
        """Where ``token`` occurs in :attr:`corpus`, ascending: ``np.flatnonzero(corpus == token)``."""
        found = np.concatenate([run.find(token) for run in self._runs]) if self._runs else np.zeros(0, np.int64)
        return found[found >= self._begin] - self._begin

    def source(self, query: np.ndarray, min_n: int, max_n: int) -> Source:
        """The suffix n-grams of ``query`` matched in this partition, from its last token's
        occurrences (:func:`match_levels`)."""
        last = self.occurrences(int(query[-1])) if query.size else None
        return Source(match_levels(self.corpus, query, min_n, max_n, last), self.corpus)


@dataclass(frozen=True)
class IndexStats:
    """What the index holds now, and what it dropped so far."""

    partitions: int
    #: tokens of the largest partitions, largest first (at most :data:`REPORTED_PARTITIONS`)
    largest_partition_tokens: list[int]
    #: sequences dropped to stay within the capacity
    evicted_sequences: int


class SuffixIndex:
    """Finished sequences by ``cache_salt``, at most ``capacity`` tokens in all (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._partitions: dict[str | None, Partition] = {}
        self.num_tokens = 0  # never above capacity
        self.evicted_sequences = 0

    @property
    def nbytes(self) -> int:
        """Memory of the indexed tokens and their occurrences, all partitions (:attr:`Partition.nbytes`)."""
        return sum(p.nbytes for p in self._partitions.values())

    def partition(self, salt: str | None) -> Partition | None:
        """The sequences of requests with ``salt`` (``None``: unsalted), or ``None`` when there are none."""
        return self._partitions.get(salt)

    def add(self, salt: str | None, tokens: np.ndarray) -> None:
        """Index one finished sequence in its salt's partition, evicting past the cap (module docstring)."""
        sequence = np.asarray(tokens, np.int64)[-self.capacity :]
        if sequence.size == 0:
            return
        newest = self._partitions.setdefault(salt, Partition())
        newest.add(sequence)
        self.num_tokens += sequence.size
        while self.num_tokens > self.capacity:
            # the sequence just added is the only one of its partition that must stay
            salt_out, largest = max(
                ((key, p) for key, p in self._partitions.items() if p is not newest or p.num_sequences > 1),
                key=lambda item: item[1].num_tokens,
            )
            before = largest.num_tokens
            largest.drop_oldest()
            self.num_tokens -= before - largest.num_tokens
            self.evicted_sequences += 1
            if largest.num_sequences == 0:
                del self._partitions[salt_out]

    def stats(self) -> IndexStats:
        sizes = sorted((p.num_tokens for p in self._partitions.values()), reverse=True)
        return IndexStats(len(self._partitions), sizes[:REPORTED_PARTITIONS], self.evicted_sequences)
