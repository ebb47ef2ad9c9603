"""MCSD's tree shapes and candidate draws (Yang et al. 2024; Lu et al. 2024).

A ``k_config`` gives candidates per node at each depth: ``[4, 2, 2]`` puts 4
children below the root, 2 below each of those, 2 below each of those. Depths
past the list keep one child (chains below the branching levels), so a
``k_config`` and the engine's ``num_speculative_tokens`` (the depth) fix the
largest tree. Nodes are laid out level by level, so the tree drafted to any
depth is a prefix of the largest one and its mask a slice of the largest
tree's (:meth:`~vllm_specbeam.core.tree.DraftTree.with_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_specbeam.core.tree import ROOT, DraftTree


def level_widths(k_config: Sequence[int], depth: int) -> list[int]:
    """Children per node at each depth: ``k_config`` then ones, ``depth`` entries.

    Example: ``[4, 2]`` at depth 4 gives ``[4, 2, 1, 1]``.
    """
    return [int(k) for k in k_config[:depth]] + [1] * max(0, depth - len(k_config))


def level_sizes(k_config: Sequence[int], depth: int) -> list[int]:
    """Nodes at each depth of the largest tree. Example: ``[4, 2]`` at depth 3 gives ``[4, 8, 8]``."""
    return np.cumprod(level_widths(k_config, depth)).tolist()


def largest_tree(k_config: Sequence[int], depth: int) -> DraftTree:
    """The shape every draft of this configuration is a prefix of (tokens all 0).

    Level by level, each node's children together and in its order.
    Example: ``[2, 2]`` at depth 2 gives parents ``[-1, -1, 0, 0, 1, 1]``.
    """
    parents: list[int] = []
    frontier = [ROOT]
    for width in level_widths(k_config, depth):
        first = len(parents)
        parents += [p for p in frontier for _ in range(width)]
        frontier = list(range(first, len(parents)))
    return DraftTree(np.zeros(len(parents), np.int64), np.asarray(parents, np.int64))


def best_candidates(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Greedy requests: each row's ``width`` most likely tokens, best first. ``[m, V]`` -> ``[m, width]``."""
    return torch.topk(logits, width, dim=-1).indices


def sampled_candidates(probs: torch.Tensor, width: int, generator: torch.Generator | None) -> torch.Tensor:
    """Sampling requests: ``width`` tokens per row drawn without replacement from ``probs`` ``[m, V]``.

    Rows whose support is smaller than ``width`` (a draft top-k / top-p)
    draw their whole support: the caller gets ``[m, w]`` with ``w`` the
    smallest support, so every node of a depth has the same number of children.
    """
    support = int((probs > 0).sum(dim=-1).min())  # host sync: the draw's width
    return torch.multinomial(probs, min(width, support), replacement=False, generator=generator)
