"""The interface every acceptance rule implements.

The target has scored every verification row of every request in one pass:
row ``row_starts[r]`` is request ``r``'s root, followed by one row per node of
its tree. A verifier turns those scores into, per request, the accepted path
(node indices, root excluded) and the tokens to commit: the accepted drafts
plus exactly one token from the target (bonus or correction), so every step
commits at least one token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specbeam.core.tree import DraftTree


@dataclass
class Verdict:
    """The outcome of verifying one batch of trees."""

    #: per request: indices of the accepted nodes, shallowest first
    accepted: list[np.ndarray]
    #: per request: tokens to commit (accepted draft tokens, then the target's token)
    tokens: list[list[int]]
    #: beam rules only: per request, the beams kept at each accepted depth (DSBD's chosen width)
    widths: list[list[int]] | None = None
    #: lossy rules only: per request, accepted drafts that were not the target's argmax at their row
    off_argmax: list[int] | None = None


class TreeVerifier(ABC):
    """An acceptance rule over a batch of draft trees."""

    @abstractmethod
    def verify(
        self,
        trees: Sequence[DraftTree],
        target: torch.Tensor,
        row_starts: np.ndarray,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> Verdict:
        """``target`` holds one row per verification row: logits for greedy
        rules, probabilities (after temperature/top-k/top-p) for sampling rules.
        ``generators`` (one per request, for seeded requests) drive the random
        choices of sampling rules; deterministic rules ignore them."""
