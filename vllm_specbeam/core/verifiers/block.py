"""Block verification of draft chains (Sun et al. 2024, arXiv 2403.10444).

Token-by-token verification stops at the first rejected token even when a
later token would have made up for it; block verification decides the
accepted length from the whole block and is still exact, and its expected
accepted length is never below token-by-token verification. With ``P_0 = 1``
and the clipped prefix ratio ``P_i = min(P_{i-1} p(x_i) / q(x_i), 1)``:

* position ``i < γ`` ends the block when ``η_i < h_i = m_i / (m_i + 1 - P_i)``,
  ``m_i = Σ_x max(P_i p(x | x_{≤i}) - q(x | x_{≤i}), 0)``; the last position
  uses ``h_γ = P_γ``; the accepted length ``τ`` is the largest passing ``i``
  (0 if none);
* the committed target token comes from ``p(· | x_{≤γ})`` when ``τ = γ``,
  else from ``norm(max(P_τ p(· | x_{≤τ}) - q(· | x_{≤τ}), 0))``.

This matches the ``USE_BLOCK_VERIFICATION`` branch of vLLM's GPU rejection
sampler (``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``),
including its treatment of drafts without draft probabilities: the point mass
on the drafted token, which is exact because such a token was certain given
its context. The rule needs one draft token per position, so only chains are
accepted.
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


def check_chains(trees: Sequence[DraftTree]) -> None:
    """Block verification is defined for one draft token per position only."""
    for b, tree in enumerate(trees):
        if not np.array_equal(tree.parents, np.arange(tree.num_nodes) - 1):
            raise ValueError(
                f"block verification needs chain drafts; request {b} has a branching tree "
                "(use RejectionTreeVerifier for trees)"
            )


def clipped_prefix_ratios(log_ratios: torch.Tensor) -> torch.Tensor:
    """``P_i = min(P_{i-1} · ratio_i, 1)`` along the last axis, with ``P_0 = 1`` prepended.

    In logs this is a reflected random walk, ``log P_i = S_i - max_{j ≤ i} S_j``
    with ``S`` the partial sums and ``S_0 = 0``, so one ``cumsum`` and one
    ``cummax`` replace a loop over positions.
    """
    sums = torch.cat([log_ratios.new_zeros(*log_ratios.shape[:-1], 1), log_ratios.cumsum(-1)], dim=-1)
    return (sums - sums.cummax(-1).values).exp()


@dataclass(frozen=True)
class BlockTable:
    """Everything block verification decides before drawing randomness, per request.

    Chains are padded to the longest one, ``G`` tokens. ``ends[b, i]`` is
    ``h_i``, the probability that position ``i`` passes (``h_0 = 1``: the empty
    prefix always qualifies; padding never passes); ``stops[b, i]`` is the
    distribution of the committed target token when the block ends at ``i``.
    """

    ends: torch.Tensor  # [B, G + 1]
    stops: torch.Tensor  # [B, G + 1, V]


def padded_node_ids(nodes: FlatNodes, lengths: np.ndarray, width: int) -> np.ndarray:
    """``[B, G]`` flat index of each position's draft node; ``nodes.num_nodes`` past a chain's end."""
    ids = nodes.offsets[:-1, None] + np.arange(width)
    return np.where(np.arange(width) < lengths[:, None], ids, nodes.num_nodes)


def block_table(trees: Sequence[DraftTree], target: torch.Tensor, row_starts: np.ndarray) -> BlockTable:
    """Prefix ratios, end probabilities and residuals of every chain position.

    Vectorised over requests and positions. Position ``i`` reads target row
    ``i`` (``p(· | x_{≤i})``) and the draft row of node ``i`` (``q(· | x_{≤i})``,
    the law of the next draft token). Past the last token the draft row is
    zero, which makes the general formulas give ``h_γ = P_γ`` and a stop
    distribution ``p``, as the rule prescribes; ``P_0 = 1`` likewise gives
    ``h_0 = 1``.
    """
    check_chains(trees)
    target = working_precision(target)
    device, vocab = target.device, target.shape[-1]
    lengths = np.asarray([tree.num_nodes for tree in trees], np.int64)
    width = int(lengths.max(initial=0))
    positions = np.arange(width + 1)
    starts = np.asarray(row_starts[: len(trees)], np.int64)
    rows = starts[:, None] + np.minimum(positions, lengths[:, None])  # padding repeats the last row
    p = target[torch.as_tensor(rows, device=device)]  # [B, G + 1, V]

    nodes = FlatNodes.of(trees, row_starts)
    ids = torch.as_tensor(padded_node_ids(nodes, lengths, width), device=device)
    q = torch.cat([draft_distributions(trees, target), target.new_zeros(1, vocab)])[ids]  # [B, G, V]
    tokens = torch.as_tensor(np.r_[nodes.tokens, 0], device=device)[ids]
    real = torch.as_tensor(positions[:-1] < lengths[:, None], device=device)

    p_token = p[:, :-1].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    q_token = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    drawable = q_token > 0  # a token the draft could not produce counts as a certain rejection
    log_ratio = torch.where(drawable, p_token.log() - q_token.where(drawable, 1).log(), -torch.inf)
    prefix = clipped_prefix_ratios(log_ratio.where(real, 0))  # [B, G + 1]

    q_next = torch.cat([q, q.new_zeros(len(trees), 1, vocab)], dim=1)
    mass = clipped_difference(prefix.unsqueeze(-1) * p, q_next)
    m = mass.sum(-1)
    denom = m + 1 - prefix
    ends = torch.where(denom > 0, m / denom.clamp_min(torch.finfo(m.dtype).tiny), 1.0)
    beyond = torch.as_tensor(positions[None, :] > lengths[:, None], device=device)
    return BlockTable(ends.masked_fill(beyond, 0.0), normalise(mass, fallback=p))


class BlockVerifier(TreeVerifier):
    """Block verification over a batch of chains (see module docstring)."""

    def verify(
        self,
        trees: Sequence[DraftTree],
        target: torch.Tensor,
        row_starts: np.ndarray,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> Verdict:
        """``target``: target probabilities per verification row; ``generators``:
        one per request (``None`` entries use the global generator).

        Each request draws ``γ + 1`` uniforms: ``η_1..η_γ``, then one for the token.
        """
        if not trees:
            return Verdict([], [])
        table = block_table(trees, target, row_starts)
        uniforms = draw_uniforms([tree.num_nodes + 1 for tree in trees], generators, target.device)
        width = table.ends.shape[1]
        etas = table.ends.new_ones(len(trees), width)  # padding: 1 never passes (h = 0 there)
        etas[:, 0] = 0
        for b, u in enumerate(uniforms):
            etas[b, 1 : u.numel()] = u[:-1]
        passes = etas < table.ends
        taus = (passes * torch.arange(width, device=target.device)).amax(-1)  # the last passing position
        stops = table.stops[torch.arange(len(trees), device=target.device), taus]
        bonuses = sample_rows(stops, torch.stack([u[-1] for u in uniforms])).tolist()
        accepted = [np.arange(tau, dtype=np.int64) for tau in taus.tolist()]
        tokens = [[*tree.tokens[path].tolist(), bonus] for tree, path, bonus in zip(trees, accepted, bonuses)]
        return Verdict(accepted, tokens)
