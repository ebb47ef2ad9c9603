"""A bounded index of finished requests' token sequences, partitioned by ``cache_salt``, searchable by suffix n-gram.

``lookup_tree``'s global scope (and the draft-model methods' global lookup) drafts from the
prompts and outputs of the requests this engine finished. Drafts only, so outputs never change,
but speed does: a timing side channel between users, which vLLM's prefix cache closes with
``cache_salt``. So does the index: a sequence goes into its salt's partition and a request
matches only its own salt's; requests without a salt share one (key ``None``).

In a partition the sequences sit end to end with a separator (``-1``, never a token id) after
each, so a match never spans two requests and a continuation stops at its request's end.
Matching is a vectorised scan (:func:`~vllm_specbeam.core.lookup.match_ends`), linear in the
partition's tokens: 0.13 ms per request and step at 2^18 tokens (measured once on a 2-core AMD
EPYC: 512 random sequences of 512 tokens, 49,152-token vocabulary, a 600-token query).

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

SEPARATOR = -1
#: how many of the largest partitions :meth:`SuffixIndex.stats` reports the tokens of
REPORTED_PARTITIONS = 4


class Partition:
    """One salt's finished sequences end to end, oldest first (see the module docstring)."""

    def __init__(self) -> None:
        self._sequences: deque[np.ndarray] = deque()
        self.num_tokens = 0
        self._corpus: np.ndarray | None = None  # [tokens + sequences], built when read after a change

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

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

    def drop_oldest(self) -> None:
        self.num_tokens -= self._sequences.popleft().size
        self._corpus = None

    def continuation(self, end: int, depth: int) -> np.ndarray:
        """Up to ``depth`` tokens after index ``end`` of the corpus, stopping at its sequence's end."""
        after = self.corpus[end + 1 : end + 1 + depth]
        stop = np.flatnonzero(after == SEPARATOR)
        return after[: stop[0]] if stop.size else after


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
        """Memory of the indexed tokens: 8 bytes a token and a separator, at most ``8 * (capacity + sequences)``."""
        return 8 * sum(p.num_tokens + p.num_sequences for p in self._partitions.values())

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
