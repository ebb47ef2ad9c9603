"""Lossless stochastic tree acceptance: recursive rejection sampling.

The rule of SpecInfer and MCSD: at a node, try its children in draft order
against a residual ``r`` (initially the target ``p``). Child ``x`` drawn from
``q`` is accepted with probability ``min(1, r(x) / q(x))``; on rejection
``r <- norm(max(r - q, 0))``. An accepted child is descended into with
``r = p``; when every child is rejected the committed token is drawn from
the final ``r``, below an accepted leaf from ``p``.

``without_replacement`` picks the update (``tests/test_verifiers_sampling.py``
checks both by exact enumeration):

* ``True`` (default): also zero the tried tokens in ``q`` and skip a child
  whose token was already tried. Exact for draws without replacement, i.i.d.
  draws (repeats skipped), de-duplicated i.i.d. draws and one child per
  draft model.
* ``False``: the plain update for every child, repeats included. Exact only
  when siblings are independent draws; *not* for siblings drawn or
  de-duplicated to be distinct.

Deterministic children use the point mass on the tried token as ``q``.
Everything decided before drawing randomness is computed for all nodes at
once (:func:`acceptance_table`); sampling needs one uniform per node and
one per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.core.verifiers.base import TreeVerifier, Verdict
from vllm_specbeam.core.verifiers.residual import (
    FlatNodes,
    clipped_difference,
    draft_distributions,
    draw_uniforms,
    normalise,
    sample_rows,
    working_precision,
)


def child_step(residual: torch.Tensor, draft: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sibling test, batched over rows: ``(P(accept), residual if rejected)``.

    ``residual`` and ``draft`` are ``[n, V]`` distributions, ``tokens`` the
    tried child of each row. A child whose token has no draft mass left (a
    repeat, once the without-replacement rule removed its first copy) is
    skipped: never accepted, residual untouched. That is de-duplication,
    which the module docstring shows is exact.
    """
    index = tokens.unsqueeze(-1)
    q_token = draft.gather(-1, index).squeeze(-1)
    r_token = residual.gather(-1, index).squeeze(-1)
    drawable = q_token > 0
    accept = torch.where(drawable, (r_token / q_token.where(drawable, 1)).clamp(max=1), 0)
    rejected = normalise(clipped_difference(residual, draft), fallback=residual)
    return accept, torch.where(drawable.unsqueeze(-1), rejected, residual)


def without(draft: torch.Tensor, tried: torch.Tensor) -> torch.Tensor:
    """``draft`` conditioned on avoiding the ``tried`` tokens (all zero if nothing is left).

    No noise threshold here, unlike residuals: masking leaves genuine
    probabilities, and a tiny remainder is still the law the child was drawn from.
    """
    kept = draft.masked_fill(tried, 0)
    return kept / kept.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)


def sibling_ranks(parent_rows: np.ndarray) -> np.ndarray:
    """Position of every node among its siblings (0 = tried first)."""
    order = np.argsort(parent_rows, kind="stable")
    sorted_parents = parent_rows[order]
    first = np.flatnonzero(np.r_[True, sorted_parents[1:] != sorted_parents[:-1]])
    group_start = np.repeat(first, np.diff(np.r_[first, order.size]))
    ranks = np.empty_like(order)
    ranks[order] = np.arange(order.size) - group_start
    return ranks


@dataclass(frozen=True)
class AcceptanceTable:
    """Everything the rule decides before it draws any randomness.

    ``accept[n]`` is the probability that node ``n`` of the flattened batch is
    accepted given that its parent was reached and its earlier siblings were
    rejected. Residuals are deterministic given the tree (the uniforms only
    pick *which* branch happens), so the distribution of the committed target
    token when the walk stops at a row is fixed too: the final residual of an
    inner node, ``p`` itself at a leaf.
    """

    nodes: FlatNodes
    ranks: np.ndarray
    accept: torch.Tensor
    target: torch.Tensor
    #: final residual of every row that has children, indexed through ``residual_slot``
    residuals: torch.Tensor
    residual_slot: np.ndarray

    def stop_distribution(self, rows: np.ndarray) -> torch.Tensor:
        """``[len(rows), V]``: where the target's token comes from if the walk stops at ``rows``."""
        rows = np.asarray(rows, np.int64)
        slots = self.residual_slot[rows]
        out = self.target[torch.as_tensor(rows, device=self.target.device)].clone()
        inner = slots >= 0
        if inner.any():
            out[torch.as_tensor(np.flatnonzero(inner), device=out.device)] = self.residuals[
                torch.as_tensor(slots[inner], device=out.device)
            ]
        return out


def acceptance_table(
    trees: Sequence[DraftTree],
    target: torch.Tensor,
    row_starts: np.ndarray,
    without_replacement: bool,
) -> AcceptanceTable:
    """Run the sibling tests of every node of the batch, one sibling rank at a time.

    Rank ``j`` holds at most one child per parent, so all parents advance in
    lockstep: the loop is over the widest node's child count, never over
    requests or tokens.
    """
    nodes = FlatNodes.of(trees, row_starts)
    target = working_precision(target)
    device = target.device
    draft = draft_distributions(trees, target)
    ranks = sibling_ranks(nodes.parent_rows)
    inner_rows = np.unique(nodes.parent_rows)
    slot = np.full(target.shape[0], -1, np.int64)
    slot[inner_rows] = np.arange(inner_rows.size)
    residuals = target[torch.as_tensor(inner_rows, device=device)].clone()
    tried = torch.zeros_like(residuals, dtype=torch.bool) if without_replacement else None
    accept = target.new_zeros(nodes.num_nodes)
    tokens = torch.as_tensor(nodes.tokens, device=device)
    for rank in range(int(ranks.max(initial=-1)) + 1):
        picked = np.flatnonzero(ranks == rank)
        at = torch.as_tensor(picked, device=device)
        parents = torch.as_tensor(slot[nodes.parent_rows[picked]], device=device)
        q = draft[at]
        if tried is not None:
            q = without(q, tried[parents])
            tried[parents, tokens[at]] = True
        accept[at], residuals[parents] = child_step(residuals[parents], q, tokens[at])
    return AcceptanceTable(nodes, ranks, accept, target, residuals, slot)


def chosen_children(table: AcceptanceTable, uniforms: torch.Tensor) -> np.ndarray:
    """Per verification row, the flat index of the child the walk takes there (-1: none).

    A child is taken when its own uniform passes and no earlier sibling's did:
    that is the sequential rule, evaluated for every node at once.
    """
    passes = (uniforms < table.accept).cpu().numpy()
    parent_rows = table.nodes.parent_rows
    chosen = np.full(table.target.shape[0], -1, np.int64)
    for rank in range(int(table.ranks.max(initial=-1)) + 1):
        picked = np.flatnonzero((table.ranks == rank) & passes)
        picked = picked[chosen[parent_rows[picked]] < 0]
        chosen[parent_rows[picked]] = picked
    return chosen


def follow(chosen: np.ndarray, nodes: FlatNodes, roots: np.ndarray) -> tuple[list[np.ndarray], list[int]]:
    """Per request, the accepted node indices (tree-local) and the row the walk stops at."""
    paths, last_rows = [], []
    for b, root in enumerate(roots):
        path, row = [], int(root)
        while chosen[row] >= 0:
            path.append(int(chosen[row]))
            row = int(nodes.rows[chosen[row]])
        paths.append(np.asarray(path, np.int64) - nodes.offsets[b])
        last_rows.append(row)
    return paths, last_rows


class RejectionTreeVerifier(TreeVerifier):
    """Lossless multi-draft acceptance over a batch of trees (see module docstring)."""

    def __init__(self, without_replacement: bool = True) -> None:
        self.without_replacement = without_replacement

    def verify(
        self,
        trees: Sequence[DraftTree],
        target: torch.Tensor,
        row_starts: np.ndarray,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> Verdict:
        """``target``: target probabilities per verification row; ``generators``:
        one per request (``None`` entries use the global generator).

        Each request draws ``num_nodes + 1`` uniforms: one per node in node
        order (used only if the node is tried), then one for the target's token.
        """
        if not trees:
            return Verdict([], [])
        table = acceptance_table(trees, target, row_starts, self.without_replacement)
        uniforms = draw_uniforms([tree.num_nodes + 1 for tree in trees], generators, target.device)
        node_uniforms = torch.cat([u[:-1] for u in uniforms]).to(table.target.dtype)
        chosen = chosen_children(table, node_uniforms)
        paths, last_rows = follow(chosen, table.nodes, np.asarray(row_starts[: len(trees)], np.int64))
        final_uniforms = torch.stack([u[-1] for u in uniforms])
        stops = table.stop_distribution(np.asarray(last_rows, np.int64))
        bonuses = sample_rows(stops, final_uniforms).tolist()
        tokens = [[*tree.tokens[path].tolist(), bonus] for tree, path, bonus in zip(trees, paths, bonuses)]
        return Verdict(paths, tokens)
