"""DSBD's algorithmic core: the beam forest, per-depth verification, adaptive width.

Dynamic-width speculative beam decoding (Qin et al., arXiv 2409.16560): the
draft model runs beam sampling, the target checks at every depth that the
drafted (beam, token) pairs are draws from *its* beam-sampling distribution,
and the width of the target's beams adapts to how many pairs it can expect
to accept.

**Beam sampling here.** At depth ``t`` the live beams ``b`` (one: the
committed context, at ``t = 1``) carry scores ``S_b``, the sum of the
log-probabilities of their tokens so far, and the joint over pairs is
``P_t(b, x) = softmax_b(S_b) * p(x | b)``, i.e. ``norm(exp(S_b + log p(x | b)))``.
``p`` is the request's sampling distribution *per row* (temperature, top-k
and top-p applied to each beam's next-token distribution), because that is
what vLLM's sampler hands the verifier; the paper applies them to the joint
instead. The draft side mirrors it with ``q`` and its own scores ``s_b``.
Beams are drawn i.i.d. (with replacement) from the joint, so two beams may
hold the same tokens; they are then two nodes of the forest.

**Per-depth verification** (:func:`verify_depth`): the drafted pairs are
i.i.d. draws from the draft joint ``Q``. They are checked in order against a
current target ``r``: accept with ``min(1, r(j) / Q(j))``; on rejection
``r <- norm(max(r - Q, 0))``, after an acceptance ``r <- P``. This is the
multi-draft rule for i.i.d. drafts run once per output beam: each output
beam is an exact, independent draw from ``P`` (see ``tests/test_dsbd.py``).
Because the update never depends on *which* pair was rejected, ``r`` is
always one of the chain ``r_0 = P, r_{i+1} = norm(max(r_i - Q, 0))``
(:func:`residual_chain`), indexed by the rejections since the last
acceptance; the same chain gives the width rule its acceptance rates
``alpha_i = sum min(r_{i-1}, Q)``.

**Adaptive width** (:func:`choose_width`): with ``K`` the number of pairs the
process accepts out of the ``m`` drafted, the depth keeps
``W_t = max(min_w, max{n : Pr[K >= n] >= tau})`` beams (at most ``m``),
checking pairs until ``W_t`` are accepted. The width needs ``P``, which only
exists once the target has scored the forest, so it is chosen during
verification (as in the authors' code): the drafter draws ``max_width``
pairs at every depth and the verifier decides how many to keep.
:func:`count_distribution` is the formula of the paper with the residual
applied once per draft (the authors' code applies it twice).

**The forest** (:class:`BeamForest`): a :class:`DraftTree` whose depth-``t``
nodes are the pairs drafted at depth ``t``, each a child of its beam, in
draw order. ``draft_probs[i]`` is ``q(. | parent)`` as for every tree; the
beam weights are not stored, they follow from ``draft_probs`` (``s_b`` is a
sum of logs of drafted entries). A beam that drew no child still needs its
``q`` for the residual over the joint, hence ``next_probs``. Given the
parents, children are i.i.d. draws from ``q(. | parent)``, so the lossless
rejection verifier can also verify a forest exactly.
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
    which are never extended). ``min_width`` and ``width_threshold`` are the
    request's width options, travelling with its draft to the verifier.
    """

    next_probs: np.ndarray | None = None
    min_width: int = 1
    width_threshold: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.next_probs is not None and len(self.next_probs) != self.num_nodes:
            raise ValueError("next_probs needs one row per node")

    def truncate(self, num_nodes: int) -> BeamForest:
        """The first ``num_nodes`` nodes: a forest whose last depth may be narrower."""
        cut = DraftTree.truncate(self, num_nodes)
        nxt = None if self.next_probs is None else self.next_probs[:num_nodes]
        return BeamForest(cut.tokens, cut.parents, cut.draft_probs, nxt, self.min_width, self.width_threshold)


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
    chain: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor, width: int
) -> DepthOutcome:
    """Check drafted pairs (flat joint indices) in order until ``width`` are accepted.

    ``chain`` is :func:`residual_chain` of the target joint with at least as
    many steps as ``drafts``; ``uniforms[j]`` decides pair ``j`` (pairs after
    the ``width``-th acceptance are not checked, their uniforms go unused).
    """
    index = drafts.to(chain.device)
    ratios = (chain[:, index] / draft[index].clamp_min(torch.finfo(draft.dtype).tiny)).clamp(max=1)
    passes = (uniforms.to(ratios.dtype).unsqueeze(0) < ratios).cpu().numpy()  # passes[i, j]
    accepted: list[int] = []
    rejections = 0
    for j in range(index.numel()):
        if len(accepted) == width:
            break
        if passes[rejections, j]:
            accepted.append(j)
            rejections = 0
        else:
            rejections += 1
    return DepthOutcome(accepted, len(accepted) == width, chain[rejections])


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
