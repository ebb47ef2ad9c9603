"""A bounded index of finished requests' token sequences, searchable by suffix n-gram.

``lookup_tree`` with ``"scope": "global"`` drafts from every earlier
occurrence of a request's recent n-gram in its own tokens *and* in the
prompts and outputs of the requests this engine finished before (agents
re-asking, templated prompts, the same code edited again). Drafts only: the
target verifies every token, so another request's text can change how fast a
request runs, never what it outputs.

The sequences sit end to end in one array with a separator (``-1``, never a
token id) after each, so a match never spans two requests and a continuation
stops at its request's end. Matching is a vectorised scan of that array
(:func:`~vllm_specbeam.core.lookup.match_ends`), linear in
the indexed tokens: 0.30 ms per request and step at the default cap of 2^18
tokens (measured once on this 2-core CPU: 512 random sequences of 512 tokens
from a 49,152-token vocabulary, a 600-token query; text with frequent
tokens has more candidate positions to extend). When a new sequence would pass the cap, the oldest
sequences are dropped first (FIFO); a sequence longer than the cap keeps its
last ``capacity`` tokens.

Example: after ``add([5, 6, 7])`` and ``add([8, 6, 9])`` the array is
``[5, 6, 7, -1, 8, 6, 9, -1]``; the query ``[..., 6]`` matches at indices 1
and 5 and continues with ``[7]`` and ``[9]``.
"""

from __future__ import annotations

from collections import deque

import numpy as np

SEPARATOR = -1


class SuffixIndex:
    """Finished sequences end to end, oldest first, at most ``capacity`` tokens (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._sequences: deque[np.ndarray] = deque()
        self._tokens = 0
        self._corpus = np.zeros(0, np.int64)  # [tokens + sequences]: every sequence, then SEPARATOR

    @property
    def num_tokens(self) -> int:
        """Tokens indexed now (separators not counted); never above ``capacity``."""
        return self._tokens

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def nbytes(self) -> int:
        """Memory of the indexed tokens: at most ``8 * (capacity + num_sequences)`` bytes."""
        return int(self._corpus.nbytes)

    @property
    def corpus(self) -> np.ndarray:
        """Every indexed sequence followed by :data:`SEPARATOR`, oldest first (read-only)."""
        return self._corpus

    def add(self, tokens: np.ndarray) -> None:
        """Index one finished sequence, dropping the oldest ones past the cap."""
        sequence = np.asarray(tokens, np.int64)[-self.capacity :]
        if sequence.size == 0:
            return
        self._sequences.append(sequence)
        self._tokens += sequence.size
        while self._tokens > self.capacity:
            self._tokens -= self._sequences.popleft().size
        parts = [part for seq in self._sequences for part in (seq, np.full(1, SEPARATOR, np.int64))]
        self._corpus = np.concatenate(parts)

    def continuation(self, end: int, depth: int) -> np.ndarray:
        """Up to ``depth`` tokens after index ``end`` of the corpus, stopping at its sequence's end."""
        after = self._corpus[end + 1 : end + 1 + depth]
        stop = np.flatnonzero(after == SEPARATOR)
        return after[: stop[0]] if stop.size else after
