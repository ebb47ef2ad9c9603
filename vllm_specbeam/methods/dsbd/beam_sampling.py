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

from dataclasses import dataclass

import numpy as np
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
#: :func:`kept_counts`' answer for a row its logprobs do not decide
UNDECIDED = 0


def _tail_bounds(last: torch.Tensor, mass: torch.Tensor, count: int, temperature: float) -> torch.Tensor:
    """``[L]``: the most ``sum p^(1/T)`` that ``count`` unseen tokens can hold: each at most
    ``last`` (the smallest seen probability), ``mass`` in all (convex for ``T < 1``:
    mass piled at ``last``; concave for ``T > 1``: spread evenly)."""
    if count <= 0:
        return torch.zeros_like(last)
    exponent = 1.0 / temperature
    capped = count * last**exponent
    spread = mass * last ** (exponent - 1) if temperature <= 1 else count ** (1 - exponent) * mass**exponent
    return torch.where(mass > 0, torch.minimum(capped, spread), torch.zeros_like(last))


def kept_counts(top_logprobs: torch.Tensor, vocab: int, law: SamplingLaw) -> torch.Tensor:
    """``[L]``: how many of each row's best tokens its cut keeps (vLLM's sampler: top-k, then
    the smallest prefix of the tempered row holding ``top_p``, at least one token), or
    :data:`UNDECIDED`.

    ``top_logprobs``: ``[L, N]``, each row's ``N`` best raw logprobs, descending (``N = vocab``:
    whole rows, always decided). The unseen ``vocab - N`` tokens' share is bounded
    (:func:`_tail_bounds`), so a row is decided when both bounds give the same prefix.
    E.g. ``N = 2`` of probabilities 0.6, 0.3 at ``T = 1``, ``top_p = 0.8``: the first two
    hold 0.9 >= 0.8 whatever the rest: 2 kept.
    """
    seen = top_logprobs.double()  # [L, N]
    count = min(seen.shape[-1], law.row_cap or vocab)
    unseen = min(vocab, law.row_cap or vocab) - count
    best = seen[:, 0]  # [L]
    weights = torch.exp((seen[:, :count] - best.unsqueeze(-1)) / law.temperature)  # [L, count], best's = 1
    mass = (1.0 - seen.exp().sum(-1)).clamp(min=0.0)  # [L]
    tail = _tail_bounds(seen[:, count - 1].exp(), mass, unseen, law.temperature) / torch.exp(best / law.temperature)
    before = torch.cumsum(weights, -1) - weights  # [L, count]: tempered mass before each token
    total = weights.sum(-1)  # [L]
    # kept iff before < top_p * Z for Z in [total, total + tail]; the unseen start after ``total``
    fewest = (before < law.top_p * total.unsqueeze(-1)).sum(-1)  # [L]
    most = (before < law.top_p * (total + tail).unsqueeze(-1)).sum(-1)  # [L]
    reaches_all = total >= law.top_p * (total + tail)  # the unseen tokens (from ``total`` on) are cut
    undecided = (fewest != most) | ((most == count) & (unseen > 0) & ~reaches_all)
    return fewest.clamp(min=1).masked_fill(undecided, UNDECIDED)


def kept_count(top_logprobs: torch.Tensor, vocab: int, law: SamplingLaw) -> int:
    """:func:`kept_counts` of one row (``[N]``); :class:`InexactRowError` when undecided."""
    kept = int(kept_counts(top_logprobs.unsqueeze(0), vocab, law)[0])
    if kept == UNDECIDED:
        raise InexactRowError(
            f"the {top_logprobs.numel()} logprobs returned for a row do not decide its top_p={law.top_p} "
            f"nucleus at temperature {law.temperature}"
        )
    return kept


def cut_rows(logprobs: torch.Tensor, law: SamplingLaw) -> torch.Tensor:
    """``[L, V]`` raw logprob rows with the tokens their cut drops set to ``-inf`` (one sort,
    the counts batched: the draft cuts its rows over a real vocabulary at every depth)."""
    ordered, order = logprobs.sort(dim=-1, descending=True)  # [L, V]
    vocab = logprobs.shape[-1]
    kept = kept_counts(ordered, vocab, law)  # [L], whole rows: always decided
    drop = torch.arange(vocab, device=logprobs.device).unsqueeze(0) >= kept.unsqueeze(-1)  # [L, V] sorted order
    return logprobs.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


@dataclass(frozen=True)
class SparseRows:
    """Cut rows as their kept tokens only (a real vocabulary's cut row keeps a few of 150k
    tokens); :meth:`to_data` is plain bytes for ``collective_rpc`` (vLLM's msgpack passes
    bytes as they are, numpy arrays only with ``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""

    #: ``[L]`` int32: kept tokens per row
    counts: np.ndarray
    #: ``[K]`` int32: the kept token ids, row after row
    tokens: np.ndarray
    #: ``[K]`` float32: their raw logprobs (the draft's rows are float32)
    values: np.ndarray

    @classmethod
    def from_cut(cls, rows: torch.Tensor) -> SparseRows:
        """From :func:`cut_rows`' ``[L, V]`` (``-inf``: dropped)."""
        kept = torch.isfinite(rows)  # [L, V]
        tokens = kept.nonzero()[:, 1]  # [K], row-major as ``rows[kept]``
        return cls(kept.sum(-1).int().cpu().numpy(), tokens.int().cpu().numpy(), rows[kept].float().cpu().numpy())

    def to_data(self) -> list[bytes]:
        return [self.counts.tobytes(), self.tokens.tobytes(), self.values.tobytes()]

    @classmethod
    def from_data(cls, data: list[bytes]) -> SparseRows:
        counts, tokens, values = data
        return cls(np.frombuffer(counts, np.int32), np.frombuffer(tokens, np.int32), np.frombuffer(values, np.float32))

    def dense(self, indices: list[int], vocab: int) -> torch.Tensor:
        """``[len(indices), V]`` float64 rows: the raw logprob at kept tokens, ``-inf`` elsewhere."""
        ends = np.cumsum(self.counts)
        out = torch.full((len(indices), vocab), float("-inf"), dtype=torch.float64)
        for i, row in enumerate(indices):  # a few rows: the live beams
            span = slice(int(ends[row] - self.counts[row]), int(ends[row]))
            out[i, torch.tensor(self.tokens[span], dtype=torch.int64)] = torch.tensor(self.values[span]).double()
        return out


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
