"""DSBD's algorithmic core: the beam forest, per-depth verification, adaptive width.

Dynamic-width speculative beam decoding (Qin et al., arXiv 2409.16560). At
depth ``t`` the live beams ``b`` carry scores ``S_b`` and the joint over pairs
is ``P_t(b, x) = softmax_b(S_b) * p(x | b)``, with ``p`` the request's sampling
distribution *per row* (as vLLM's sampler hands it over); the draft mirrors
it with ``q``. Beams are drawn i.i.d. from the joint.

* :func:`verify_depth`: the drafted pairs are checked in order against a
  current target ``r``: accept with ``min(1, r(j) / Q(j))``; on rejection
  ``r <- norm(max(r - Q, 0))``, after an acceptance ``r <- P``. Each output
  beam is an exact, independent draw from ``P``; ``r`` is always one of
  :func:`residual_chain`'s. :func:`verify_mixed_depth`: the same rule when the
  depth's first drafts are deterministic (lookup nodes, point masses).
* :func:`choose_width`: ``W_t = max(min_w, max{n : Pr[K >= n] >= tau})``
  beams for ``K`` the pairs accepted of ``m`` drafted
  (:func:`count_distribution`), chosen during verification.
* :class:`BeamForest`: a :class:`DraftTree` whose depth-``t`` nodes are the
  pairs drafted at depth ``t``, children of their beams in draw order;
  ``next_probs`` keeps ``q`` for beams that drew no child.

Derivations and figures: docs/methods/dsbd.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.core.verifiers.residual import clipped_difference, normalise


@dataclass(frozen=True)
class BeamForest(DraftTree):
    """A DSBD draft: beam-sampling pairs per depth (see the module docstring).

    ``next_probs[i]`` is the draft's ``q(. | path to node i)``, the distribution
    node ``i`` would draw its children from (zero for nodes of the last depth,
    which are never extended). ``min_width``, ``width_threshold`` and ``max_width`` are
    the request's width options, travelling with its draft to the verifier. Nodes whose
    ``kinds`` are below :data:`~vllm_specbeam.core.budget.FILL_KIND` are lookup nodes
    (deterministic drafts, ``"lookup"``); they come first at every depth.
    """

    next_probs: np.ndarray | None = None
    min_width: int = 1
    width_threshold: float = 0.5
    #: the most beams a depth keeps (``None``: as many as it drafted); lookup nodes add drafts to a depth
    max_width: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.next_probs is not None and len(self.next_probs) != self.num_nodes:
            raise ValueError("next_probs needs one row per node")

    def truncate(self, num_nodes: int) -> BeamForest:
        """The first ``num_nodes`` nodes: a forest whose last depth may be narrower."""
        cut = DraftTree.truncate(self, num_nodes)
        nxt = None if self.next_probs is None else self.next_probs[:num_nodes]
        return BeamForest(
            cut.tokens,
            cut.parents,
            cut.draft_probs,
            nxt,
            self.min_width,
            self.width_threshold,
            self.max_width,
            kinds=cut.kinds,
            from_index=cut.from_index,
        )


# ---------------------------------------------------------------- width rule
def residual_chain(target: torch.Tensor, draft: torch.Tensor, steps: int) -> torch.Tensor:
    """``[steps + 1, F]``: ``r_0 = target`` and ``r_{i+1} = norm(max(r_i - draft, 0))``."""
    chain = [target]
    for _ in range(steps):
        chain.append(normalise(clipped_difference(chain[-1], draft), fallback=chain[-1]))
    return torch.stack(chain)


def acceptance_rates(chain: torch.Tensor, draft: torch.Tensor) -> np.ndarray:
    """``alpha_i = sum_x min(r_{i-1}(x), Q(x))`` for ``i = 1 .. len(chain) - 1``:
    the chance a fresh draft is accepted after ``i - 1`` rejections in a row."""
    return torch.minimum(chain[:-1], draft).sum(dim=-1).double().cpu().numpy()


def count_distribution(alphas: np.ndarray) -> np.ndarray:
    """``Pr[K_m = k]`` for ``k = 0 .. m`` (``m = len(alphas)`` drafts), the paper's recursion.

    ``beta_j`` is the chance that the first acceptance after a reset is draft
    ``j``; after it the process starts afresh with ``i - j`` drafts left:
    ``Pr[K_i = k] = sum_j beta_j Pr[K_{i-j} = k - 1]``, ``Pr[K_i = 0] = prod_{j<=i}(1 - alpha_j)``.
    """
    alphas = np.asarray(alphas, np.float64)
    m = alphas.size
    survive = np.cumprod(np.r_[1.0, 1.0 - alphas])  # survive[i] = prod_{j<=i}(1 - alpha_j)
    beta = survive[:-1] * alphas  # beta[j - 1] = beta_j
    dist = np.zeros((m + 1, m + 1))  # dist[i, k] = Pr[K_i = k]
    dist[:, 0] = survive
    for i in range(1, m + 1):
        for k in range(1, i + 1):
            dist[i, k] = sum(beta[j - 1] * dist[i - j, k - 1] for j in range(1, i + 1))
    return dist[m]


def choose_width(alphas: np.ndarray, min_width: int, max_width: int, threshold: float) -> int:
    """``W = max(min_width, max{n : Pr[K >= n] >= threshold})``, capped at ``max_width``."""
    tail = np.cumsum(count_distribution(alphas)[::-1])[::-1]  # tail[n] = Pr[K >= n]
    likely = int(np.flatnonzero(tail >= threshold - 1e-12).max())
    return min(max(min_width, likely), max_width)


# ---------------------------------------------------------------- one depth
def joint(scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[L * V]``: ``norm(exp(S_b) * row_b(x))`` over beams ``b`` with probability rows ``rows``."""
    return (torch.softmax(scores.to(rows.dtype), dim=0).unsqueeze(-1) * rows).reshape(-1)


@dataclass(frozen=True)
class DepthOutcome:
    """What one depth's checks decided."""

    #: positions (in the drafted order) of the accepted pairs
    accepted: list[int]
    #: ``width`` pairs were accepted: they are the next depth's beams
    succeeded: bool
    #: on failure, the law of the next output beam: the residual of the last
    #: rejections (``P`` itself if none followed the last acceptance)
    residual: torch.Tensor


def verify_depth(
    chain: torch.Tensor,
    draft: torch.Tensor,
    drafts: torch.Tensor,
    uniforms: torch.Tensor,
    width: int,
    restart: torch.Tensor | None = None,
) -> DepthOutcome:
    """Check drafted pairs (flat joint indices) in order until ``width`` are accepted.

    ``chain`` is :func:`residual_chain` of the target joint with at least as
    many steps as ``drafts``; ``uniforms[j]`` decides pair ``j`` (pairs after
    the ``width``-th acceptance are not checked, their uniforms go unused).
    ``restart``: the chain after an acceptance, when ``chain`` starts from a residual
    of the target joint instead (:func:`verify_mixed_depth`); default ``chain``.
    """
    index = drafts.to(chain.device)
    chains = [chain] if restart is None else [chain, restart]

    def passes_of(c: torch.Tensor) -> np.ndarray:
        ratios = (c[:, index] / draft[index].clamp_min(torch.finfo(draft.dtype).tiny)).clamp(max=1)
        return (uniforms.to(ratios.dtype).unsqueeze(0) < ratios).cpu().numpy()  # passes[i, j]

    passes = [passes_of(c) for c in chains]
    accepted: list[int] = []
    rejections = 0
    for j in range(index.numel()):
        if len(accepted) == width:
            break
        if passes[min(len(accepted), len(chains) - 1)][rejections, j]:
            accepted.append(j)
            rejections = 0
        else:
            rejections += 1
    return DepthOutcome(accepted, len(accepted) == width, chains[min(len(accepted), len(chains) - 1)][rejections])


def _point_mass(pair: int, like: torch.Tensor) -> torch.Tensor:
    """``[F]``: a deterministic draft of ``pair`` as a law over the joint."""
    return torch.zeros_like(like).index_fill_(0, torch.tensor([pair], device=like.device), 1.0)


def _fixed_residual(target: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """The target joint after rejecting each deterministic draft in ``drafts`` in turn, and the
    chance each had to be accepted there (``alpha_i = r_{i-1}(pair_i)``)."""
    r, alphas = target, []
    for pair in drafts.tolist():
        chain = residual_chain(r, _point_mass(pair, r), 1)
        alphas.append(float(r[pair]))
        r = chain[1]
    return r, np.asarray(alphas, np.float64)


def mixed_rates(target: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor, fixed: int) -> np.ndarray:
    """:func:`acceptance_rates` for a depth whose first ``fixed`` drafts are deterministic:
    along the chain that rejects every draft in order (the width rule's estimate; a lookup
    draft's chance depends on which drafts before it were rejected)."""
    r, alphas = _fixed_residual(target, drafts[:fixed])
    return np.r_[alphas, acceptance_rates(residual_chain(r, draft, drafts.numel() - fixed), draft)]


def verify_mixed_depth(
    target: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor, width: int, fixed: int
) -> DepthOutcome:
    """:func:`verify_depth` for a depth whose first ``fixed`` drafts are deterministic (lookup
    nodes) and the rest i.i.d. draws from ``draft`` (``target``: the target joint ``P``).

    Each deterministic draft is checked as a draft of its point mass (accepted with
    probability ``r(pair)``, on rejection ``r <- norm(r without pair)``); the draws then
    start from the residual the last acceptance left (``P`` after an acceptance). Every
    draft is fixed before any uniform is read, so each output beam is still an exact,
    independent draw from ``P`` (``tests/test_dsbd_lookup.py`` enumerates it).
    """
    accepted: list[int] = []
    r = target
    for j in range(fixed):
        if len(accepted) == width:
            break
        point = _point_mass(int(drafts[j]), target)
        one = verify_depth(residual_chain(r, point, 1), point, drafts[j : j + 1], uniforms[j : j + 1], 1)
        accepted += [j] if one.succeeded else []
        r = target if one.succeeded else one.residual
    steps = drafts.numel() - fixed
    restart = None if r is target else residual_chain(target, draft, steps)
    rest = verify_depth(
        residual_chain(r, draft, steps), draft, drafts[fixed:], uniforms[fixed:], width - len(accepted), restart
    )
    return DepthOutcome(accepted + [fixed + j for j in rest.accepted], rest.succeeded, rest.residual)


def greedy_depth(scores: torch.Tensor, drafts: torch.Tensor) -> list[int]:
    """Temperature 0: positions of the drafted pairs that are the target's top pairs.

    The target's beam search keeps its ``n`` best pairs, ``n`` as large as the
    drafts cover: the longest run of the target's ranking (by joint log-score)
    that was drafted. Empty when the target's best pair was not drafted.
    """
    drafted = drafts.tolist()
    ranking = torch.topk(scores, min(len(drafted), scores.numel())).indices.tolist()
    accepted: list[int] = []
    for pair in ranking:
        if pair not in drafted:
            break
        accepted.append(drafted.index(pair))
    return accepted
