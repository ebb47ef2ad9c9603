"""Greedy tree acceptance: the output equals plain greedy decoding exactly.

From the root, follow the child whose token is the target's argmax at the
current node; the first node without such a child gives the bonus token.
Vectorised: one argmax over every row of the batch, then per request one
masked reduction over its ancestor mask (no loop over tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.core.verifiers.base import TreeVerifier, Verdict


def greedy_path(tree: DraftTree, argmax_rows: np.ndarray) -> np.ndarray:
    """Accepted node indices, given the target's argmax at every row of ``tree``.

    A node is accepted when it and all its ancestors match the argmax of their
    parent's row. Siblings hold distinct tokens in a well-formed tree; if a
    drafter repeats one, the first (shallowest-index) match wins, as a walk would.
    """
    if tree.num_nodes == 0:
        return np.zeros(0, np.int64)
    match = tree.tokens == argmax_rows[tree.parents + 1]
    nodes_mask = tree.ancestor_mask[1:, 1:]
    accepted = ~(nodes_mask & ~match[None, :]).any(axis=1)
    if not accepted.any():
        return np.zeros(0, np.int64)
    depths = np.where(accepted, tree.depths, 0)
    deepest = int(np.argmax(depths))  # first node of the greatest accepted depth
    return np.asarray(tree.path_to(deepest), np.int64)


class GreedyTreeVerifier(TreeVerifier):
    """Temperature-0 acceptance over a batch of trees."""

    def verify(
        self,
        trees: Sequence[DraftTree],
        target: torch.Tensor,
        row_starts: np.ndarray,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> Verdict:
        # float32 first: exact for any logits dtype (the same argmax, first index on ties, as vLLM's
        # sampler, which takes float32 logits), and on CPU a bfloat16 argmax costs 4x as much
        argmax = target.to(torch.float32).argmax(dim=-1).cpu().numpy()
        accepted, tokens = [], []
        for tree, start in zip(trees, row_starts):
            rows = argmax[start : start + tree.num_nodes + 1]
            path = greedy_path(tree, rows)
            last_row = 0 if path.size == 0 else int(path[-1]) + 1
            accepted.append(path)
            tokens.append([*tree.tokens[path].tolist(), int(rows[last_row])])
        return Verdict(accepted, tokens)
