"""Groundwork the lossless sampling verifiers share.

Tree rejection sampling and block verification both need the batch's nodes
laid out flat against the verification rows, the draft distribution behind
every node (a point mass when the drafter picked the token deterministically),
the positive part of a (scaled) target minus a draft distribution and its
normalisation, per-request uniforms drawn from the request's own generator,
and sampling one token per row from given uniforms. Keeping them here means
the two rules cannot drift apart on, say, how a zero-mass residual is handled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specbeam.core.tree import DraftTree

#: A residual whose mass is at most this many machine epsilons is treated as
#: rounding noise: the rejection that leads to it has probability equal to that
#: mass, so replacing it costs at most that much (see :func:`normalise`).
_NOISE_EPS = 8


@dataclass(frozen=True)
class FlatNodes:
    """Every node of a batch of trees, flattened in request order.

    Node ``n`` of the batch sits at verification row ``rows[n]`` and its
    parent at ``parent_rows[n]`` (the root row for first-level nodes);
    request ``b`` owns nodes ``offsets[b]:offsets[b + 1]``.
    """

    tokens: np.ndarray
    rows: np.ndarray
    parent_rows: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, trees: Sequence[DraftTree], row_starts: np.ndarray) -> FlatNodes:
        starts = np.asarray(row_starts, np.int64)
        sizes = np.asarray([tree.num_nodes for tree in trees], np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        base = np.repeat(starts[: len(trees)], sizes) + 1  # row of node 0 of each node's tree
        tokens = np.concatenate([tree.tokens for tree in trees] or [np.zeros(0, np.int64)])
        parents = np.concatenate([tree.parents for tree in trees] or [np.zeros(0, np.int64)])
        local = np.arange(offsets[-1]) - np.repeat(offsets[:-1], sizes)
        return cls(tokens, base + local, base + parents, offsets)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.size)


def draft_distributions(trees: Sequence[DraftTree], like: torch.Tensor) -> torch.Tensor:
    """One row per node of the batch: the distribution the node was drawn from.

    Trees without ``draft_probs`` were drafted deterministically (lookup,
    tri-grams, top-k picks): given the context the token was certain, so its
    draft distribution is the point mass on it. With that row the general
    rules reduce to the exact deterministic-candidate rules (accept with
    probability ``r(x)``, then zero ``x`` in the residual), so no separate code
    path is needed.
    """
    vocab = like.shape[-1]
    rows = []
    for tree in trees:
        if tree.draft_probs is None:
            tokens = torch.as_tensor(tree.tokens, device=like.device)
            rows.append(torch.nn.functional.one_hot(tokens, vocab).to(like.dtype))
            continue
        probs = torch.as_tensor(tree.draft_probs, device=like.device).to(like.dtype)
        if probs.shape != (tree.num_nodes, vocab):
            shape, expected = tuple(probs.shape), (tree.num_nodes, vocab)
            raise ValueError(f"draft_probs has shape {shape}, expected {expected} (one row per node)")
        rows.append(probs)
    return torch.cat(rows) if rows else like.new_zeros(0, vocab)


def working_precision(target: torch.Tensor) -> torch.Tensor:
    """Target probabilities in at least float32.

    Residual masses and probability ratios are differences and quotients of
    probabilities; in half precision their rounding noise would swamp the
    small masses the rules must still get right.
    """
    return target.to(torch.promote_types(target.dtype, torch.float32))


def clipped_difference(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """``max(target - draft, 0)``: the unnormalised residual of every rule here."""
    return (target - draft).clamp_min(0)


def normalise(mass: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows of ``mass`` scaled to sum to one; ``fallback`` rows where the mass is nil.

    A nil residual only follows a rejection of probability zero (e.g.
    ``r <= q`` everywhere means ``r = q`` and every child is accepted), so
    what it is replaced by cannot change the output distribution; falling back
    to the distribution before the update keeps a rounding-error rejection from
    sampling amplified noise.
    """
    total = mass.sum(dim=-1, keepdim=True)
    noise = _NOISE_EPS * torch.finfo(mass.dtype).eps
    return torch.where(total > noise, mass / total.clamp_min(noise), fallback)


def draw_uniforms(
    counts: Sequence[int],
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device,
) -> list[torch.Tensor]:
    """``counts[b]`` uniforms in ``[0, 1)`` per request, from its own generator.

    Every request draws a count fixed by its tree alone, never by the
    outcome, so a seeded request replays identically whatever else is in the
    batch and whatever was accepted at earlier steps. Requests without a
    generator share one draw from the global generator.
    """
    gens = list(generators) if generators is not None else [None] * len(counts)
    if len(gens) != len(counts):
        raise ValueError(f"got {len(gens)} generators for {len(counts)} requests")
    out: list[torch.Tensor] = [torch.empty(0)] * len(counts)
    unseeded = [b for b, gen in enumerate(gens) if gen is None]
    shared = torch.rand(sum(counts[b] for b in unseeded), device=device)
    for b, u in zip(unseeded, shared.split([counts[b] for b in unseeded])):
        out[b] = u
    for b, gen in enumerate(gens):
        if gen is not None:
            out[b] = torch.rand(counts[b], generator=gen, device=gen.device).to(device)
    return out


def sample_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row by inverting the row's CDF at the given uniform.

    Batched over rows (one ``searchsorted``) and deterministic given the
    uniforms, which is what makes per-request seeding work. ``right=True``
    never lands on a zero-probability token: its CDF interval is empty.
    """
    cdf = probs.cumsum(dim=-1)
    points = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, points, right=True).squeeze(-1)
    return tokens.clamp_max(probs.shape[-1] - 1)
