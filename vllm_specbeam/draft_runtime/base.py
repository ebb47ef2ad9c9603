"""What a drafter needs from a draft model's runtime, whichever runs it.

The engine's runtime is ``vllm_specbeam.adapter.draft_model`` (the draft
loaded by vLLM inside the worker, its K/V in vLLM's paged cache); the tests
drive the vLLM-free drafters with a small reference runtime
(``tests/reference_draft.py``, whole sequences through Transformers).
Drafters are typed against this protocol, so they never know which runs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import torch


class DraftRuntime(Protocol):
    """A draft model run for many requests at once, one forward per call."""

    @property
    def live_requests(self) -> int:
        """Requests the runtime holds state for (freed by :meth:`remove`)."""
        ...

    def sync_many(self, requests: Sequence[tuple[str, Sequence[int] | np.ndarray, int]]) -> list[torch.Tensor | None]:
        """For ``(req_id, committed tokens, reserve)`` triples: the draft's float32
        logits ``[vocab_size]`` after each request's last committed token.

        Drops the tree nodes of the previous round (the rollback). ``reserve``
        tree nodes are about to be appended; ``None``: they do not fit, leave
        the request undrafted.
        """
        ...

    def sync_rows(self, req_id: str, token_ids: Sequence[int] | np.ndarray) -> int:
        """The rows :meth:`sync_many` would feed for ``req_id`` at these committed tokens: the
        tokens the draft lacks (after it keeps what it drafted and the target accepted), the last
        one at least. A request it never fed: all of them. Reads only: nothing is fed."""
        ...

    def extend_many(self, nodes: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        """For ``(req_id, tokens, parents)`` triples, one tree depth each: logits
        ``[len(tokens), vocab_size]`` at the new nodes.

        ``parents`` index the nodes appended since the last sync (in order) or
        are ``-1`` for children of the last committed token.
        """
        ...

    def defer(self, req_ids: Iterable[str]) -> None:
        """These requests run no draft forward this step (their trees need no draft node): their
        committed tokens may wait for their next :meth:`sync_many`, which feeds whatever the draft
        lacks. (The engine's runtime still feeds, at the step's end, the tokens that fill a block:
        a prefix hit may read that block's draft K/V.)"""
        ...

    def remove(self, req_ids: Iterable[str]) -> None:
        """Forget finished, aborted or preempted requests (unknown ids are ignored)."""
        ...
