"""Full-width beam sampling: the target's law, its reference step and DSBD's speculative step.

**The law** (DSBD, arXiv 2409.16560; Hugging Face's beam sampling):
live beams ``b`` with raw cumulative logprobs ``S_b`` and raw next-token
logprobs ``log p(x | b)`` give the joint over pairs

    P(b, x) = norm(exp((S_b + log p(x | b)) / T) * [x kept in row b])

normalised jointly over all live beams x vocabulary: the temperature applies
to the joint (so to the whole sequence's likelihood, ``p(seq)^(1/T)``), and
top-k / top-p only *cut* each beam's row, as vLLM's sampler cuts a row
(:func:`kept_count`: top-k, then the nucleus of the tempered row); kept tokens
keep their joint weight. A step draws ``W`` pairs i.i.d. from ``P``
(:func:`draw_pairs`); the answer is the best beam by ``S / len``.

**Hugging Face's variant** (:func:`hf_candidates`): ``2W`` pairs drawn without
replacement, the ``W`` best kept: another law, a reference only.

**The speculative step** (:func:`speculative_depth`): drafted pairs, i.i.d.
from a draft joint ``Q``, are checked in order by
:func:`~vllm_specbeam.methods.dsbd.maths.verify_depth`; when fewer than ``W``
pass, the outputs are the accepted pairs, one draw from the residual, then
fresh draws from ``P``: ``W`` exact i.i.d. draws from ``P`` in every case
(``tests/test_beam_sampling.py`` enumerates it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_specbeam.methods.dsbd.maths import DepthOutcome, residual_chain, verify_depth


class InexactRowError(ValueError):
    """A row's kept tokens cannot be decided from the logprobs returned for it."""


@dataclass(frozen=True)
class SamplingLaw:
    """The request's sampling options as the beam-sampling law reads them."""

    temperature: float
    #: tokens a row keeps (0 or -1: all)
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"beam sampling needs temperature > 0, got {self.temperature}; use beam search for 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")

    @property
    def row_cap(self) -> int | None:
        """The most tokens a row keeps by top-k (``None``: no cap)."""
        return self.top_k if self.top_k > 0 else None


# ---------------------------------------------------------------- rows
def _tail_bound(last: float, mass: float, count: int, temperature: float) -> float:
    """The most ``sum p^(1/T)`` that ``count`` unseen tokens can hold: each at most
    ``last`` (the smallest seen probability), ``mass`` in all (convex for ``T < 1``:
    mass piled at ``last``; concave for ``T > 1``: spread evenly)."""
    if count <= 0 or mass <= 0:
        return 0.0
    exponent = 1.0 / temperature
    capped = count * last**exponent
    spread = mass * last ** (exponent - 1) if temperature <= 1 else count ** (1 - exponent) * mass**exponent
    return min(capped, spread)


def kept_count(top_logprobs: torch.Tensor, vocab: int, law: SamplingLaw) -> int:
    """How many of a row's best tokens its cut keeps (vLLM's sampler: top-k, then the
    smallest prefix of the tempered row holding ``top_p``, at least one token).

    ``top_logprobs``: the row's ``N`` best raw logprobs, descending (``N = vocab``: the
    whole row). The unseen ``vocab - N`` tokens' share is bounded (:func:`_tail_bound`),
    so the cut is exact when both bounds give the same prefix; else
    :class:`InexactRowError`. E.g. ``N = 2`` of probabilities 0.6, 0.3 at ``T = 1``,
    ``top_p = 0.8``: the first two hold 0.9 >= 0.8 whatever the rest: 2 kept.
    """
    seen = top_logprobs.double()
    cap = law.row_cap or vocab
    count = min(seen.numel(), cap)
    weights = torch.exp((seen[:count] - seen[0]) / law.temperature)  # [count], scaled by the best's
    unseen = min(vocab, cap) - count
    last = float(seen[count - 1].exp())
    tail = _tail_bound(last, max(0.0, 1.0 - float(seen.exp().sum())), unseen, law.temperature)
    tail /= math.exp(float(seen[0]) / law.temperature)
    before = torch.cumsum(weights, 0) - weights  # [count]: tempered mass before each token
    total = float(weights.sum())
    # kept iff before < top_p * Z for Z in [total, total + tail]; the unseen start after ``total``
    fewest = int((before < law.top_p * total).sum())
    most = int((before < law.top_p * (total + tail)).sum())
    reaches_all = total >= law.top_p * (total + tail)  # the unseen tokens (from ``total`` on) are cut
    if fewest != most or (most == count and unseen and not reaches_all):
        raise InexactRowError(
            f"the {seen.numel()} logprobs returned for a row do not decide its top_p={law.top_p} "
            f"nucleus at temperature {law.temperature}"
        )
    return max(1, fewest)


def cut_rows(logprobs: torch.Tensor, law: SamplingLaw) -> torch.Tensor:
    """``[L, V]`` raw logprob rows with the tokens their cut drops set to ``-inf``."""
    ordered, order = logprobs.sort(dim=-1, descending=True)
    vocab = logprobs.shape[-1]
    kept = torch.tensor([kept_count(row, vocab, law) for row in ordered])  # [L]
    drop = torch.arange(vocab).unsqueeze(0) >= kept.unsqueeze(-1)  # [L, V] in sorted order
    return logprobs.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


# ---------------------------------------------------------------- the law
def beam_joint(scores: torch.Tensor, rows: torch.Tensor, law: SamplingLaw) -> torch.Tensor:
    """``[L * V]``: ``P(b, x) = norm(exp((S_b + row_b(x)) / T))`` over all beams and tokens.

    ``scores``: ``[L]`` raw cumulative logprobs; ``rows``: ``[L, V]`` raw logprobs, already
    :func:`cut_rows` (``-inf``: dropped). One softmax over the flat joint: normalised jointly,
    never per beam.
    """
    joint_logits = (scores.to(rows.dtype).unsqueeze(-1) + rows) / law.temperature  # [L, V]
    return torch.softmax(joint_logits.reshape(-1), dim=0)


def draw_pairs(joint: torch.Tensor, width: int, generator: torch.Generator | None) -> torch.Tensor:
    """``[width]`` flat pair indices (``beam * V + token``) drawn i.i.d. from ``joint``."""
    return torch.multinomial(joint.float(), width, replacement=True, generator=generator)


def hf_candidates(joint: torch.Tensor, width: int, generator: torch.Generator | None) -> torch.Tensor:
    """Hugging Face's beam-sampling candidates (transformers ``_get_top_k_continuations``
    with ``do_sample``): ``2 * width`` pairs drawn without replacement, in draw order.
    HF keeps the ``width`` best non-EOS of them by score as its next beams, and completes
    the EOS ones among the first ``width`` drawn."""
    support = int((joint > 0).sum())
    return torch.multinomial(joint.float(), min(2 * width, support), replacement=False, generator=generator)


def length_normalised(score: float, length: int, length_penalty: float = 1.0) -> float:
    """``S / len^length_penalty``: how the best beam is picked at the end."""
    return score / max(length, 1) ** length_penalty


# ---------------------------------------------------------------- speculative
@dataclass(frozen=True)
class SpeculativeDepth:
    """One depth of speculative beam sampling: its ``W`` output pairs as accepted
    drafts and the laws of the outputs still to draw."""

    #: what :func:`~vllm_specbeam.methods.dsbd.maths.verify_depth` decided
    outcome: DepthOutcome
    #: flat pair indices of the accepted drafts, in order
    accepted: list[int]
    #: ``[width - len(accepted), F]``: the law of each output still to draw: the
    #: residual of the last rejections, then ``P`` (empty when the depth succeeded)
    remaining: torch.Tensor

    @property
    def succeeded(self) -> bool:
        return self.outcome.succeeded


def speculative_depth(
    target: torch.Tensor, draft: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor, width: int
) -> SpeculativeDepth:
    """``width`` i.i.d. draws from ``target`` (``[F]``) from drafts i.i.d. from ``draft``.

    ``drafts``: flat pair indices in draw order; ``uniforms[j]`` decides draft ``j``.
    """
    outcome = verify_depth(residual_chain(target, draft, drafts.numel()), draft, drafts, uniforms, width)
    accepted = drafts[outcome.accepted].tolist()
    missing = width - len(accepted)
    laws = [remaining_law(outcome, target, i) for i in range(missing)]
    remaining = torch.stack(laws) if laws else target.new_zeros(0, target.numel())
    return SpeculativeDepth(outcome, accepted, remaining)


def remaining_law(outcome: DepthOutcome, target: torch.Tensor, index: int) -> torch.Tensor:
    """The law of a failed depth's ``index``-th output after its accepted ones: the
    residual first (the rejections after the last acceptance), then ``target``."""
    return outcome.residual if index == 0 else target


def complete_depth(depth: SpeculativeDepth, generator: torch.Generator | None) -> list[int]:
    """The depth's ``W`` output pairs: the accepted ones, then one draw from each remaining law."""
    drawn = [int(draw_pairs(law, 1, generator)[0]) for law in depth.remaining]
    return depth.accepted + drawn
