"""A reference draft runtime for the vLLM-free drafters' tests: every row from its whole sequence.

It keeps each request's committed tokens and this round's tree nodes, and
answers every call by running a Transformers model on each row's full
sequence (the committed tokens, then the row's path from the root), with no
cache at all: slow, and obviously right. The engine's runtime
(``vllm_specbeam.adapter.draft_model``) is tested against the same
sequences in tests/test_worker_draft.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from vllm_specbeam.core.tree import ROOT


class ReferenceDraftRuntime:
    """The :class:`~vllm_specbeam.draft_runtime.base.DraftRuntime` API on a Transformers model."""

    def __init__(self, model: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self._context: dict[str, list[int]] = {}
        self._paths: dict[str, list[list[int]]] = {}  # per request, per tree node: its tokens from the root
        #: requests per non-empty call, in order: the draft forwards the engine's runtime would run
        self.batches: list[int] = []

    @property
    def live_requests(self) -> int:
        return len(self._context)

    def sync_many(self, requests: Sequence[tuple[str, Sequence[int] | np.ndarray, int]]) -> list[torch.Tensor | None]:
        self.batches += [len(requests)] if requests else []
        results: list[torch.Tensor | None] = []
        for req_id, tokens, _ in requests:
            self._context[req_id], self._paths[req_id] = [int(t) for t in tokens], []
            results.append(self._last_logits(self._context[req_id]))
        return results

    def sync_rows(self, req_id: str, token_ids: Sequence[int] | np.ndarray) -> int:
        """What a cache would feed: the tokens past the last sync's and its accepted tree path."""
        tokens, context = [int(t) for t in token_ids], self._context.get(req_id)
        if context is None or tokens[: len(context)] != context:
            return len(tokens)
        rest = tokens[len(context) :]
        kept = max((len(path) for path in self._paths[req_id] if rest[: len(path)] == path), default=0)
        return len(tokens) - min(len(context) + kept, len(tokens) - 1)

    def extend_many(self, nodes: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        self.batches += [len(nodes)] if nodes else []
        results = []
        for req_id, tokens, parents in nodes:
            paths = self._paths[req_id]
            rows = []
            for token, parent in zip(tokens, parents):
                paths.append(([] if parent == ROOT else paths[parent]) + [int(token)])
                rows.append(self._last_logits(self._context[req_id] + paths[-1]))
            results.append(torch.stack(rows))
        return results

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._context.pop(req_id, None)
            self._paths.pop(req_id, None)

    @torch.inference_mode()
    def _last_logits(self, sequence: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([sequence])).logits[0, -1].float()  # [vocab]
