"""The figures: one definition each of what the benchmarks measure.

No vLLM import: unit-tested (``tests/test_benchmarks.py``), so the numbers in
the JSON, the Markdown tables and the plots come from one definition each.

Definitions (per request, summed over a run):

* *target step*: one forward pass of the target for one request. Every step
  emits the target's own token plus the draft tokens it accepted, so
  ``steps = output_tokens - accepted`` (the prefill step emits the first
  token and counts as one). Without speculation ``steps == output_tokens``.
  vLLM's accepted counter also counts drafts accepted past a request's
  ``max_tokens`` (its ``draft_model`` drafts ``k`` tokens however few are
  left), which would undercount the steps; each step with a draft is counted
  too (``drafts``), so with ``requests`` prefill steps ``steps =
  max(output_tokens - accepted, drafts + requests)``, both lower bounds, the
  second exact whenever every step drafts; accepted tokens are then
  ``output_tokens - steps``.
* *accepted tokens per step*: ``accepted / steps``; the tokens gained per
  forward pass over plain decoding (vLLM's "mean acceptance length" is
  ``1 + accepted / drafts`` and only counts steps that had a draft).
* *acceptance rate*: ``accepted / draft tokens`` (for trees: accepted / tree
  nodes, so a wide tree lowers it even when it raises accepted per step).
* *target steps per output token*: ``steps / output_tokens``; 1.0 without
  speculation, lower is better.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpecFigures:
    """Speculation figures of one run."""

    accepted_per_step: float | None
    acceptance_rate: float | None
    steps_per_output_token: float | None


def counter_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """``after - before`` for scalar and per-position (list) counters.

    A counter missing before (vLLM creates the spec-decode counters lazily)
    counts from zero; lists of different lengths are padded with zeros.
    """
    delta: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, (list, tuple)):
            old = list(old or [])
            old += [0] * (len(value) - len(old))
            delta[key] = [a - b for a, b in zip(value, old)]
        else:
            delta[key] = value - (old or 0)
    return delta


def spec_figures(
    output_tokens: int, accepted: int | None, draft_tokens: int | None, drafts: int | None = None, requests: int = 0
) -> SpecFigures:
    """Figures of the module docstring; ``None`` where they are undefined
    (no counters, e.g. beam search; no drafts for the acceptance rate).
    ``drafts``: steps that verified a draft; ``requests``: their prefills."""
    if accepted is None or output_tokens <= 0:
        return SpecFigures(None, None, None)
    steps = min(max(output_tokens - accepted, (drafts or 0) + requests, 1), output_tokens)
    written = output_tokens - steps  # drafted tokens the output holds
    rate = written / draft_tokens if draft_tokens else None
    return SpecFigures(written / steps, rate, steps / output_tokens)


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0-100) of the non-missing
    values, as numpy's default; ``None`` when there are none."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    position = (len(values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, ``None`` when either side is missing or zero."""
    if value is None or not reference:
        return None
    return value / reference


def continuation_logprobs(
    prompt_logprobs: Sequence[Mapping[int, float] | None], token_ids: Sequence[int], start: int
) -> list[float]:
    """Log-probabilities of ``token_ids[start:]`` from a scoring pass.

    ``prompt_logprobs[i]`` maps candidate token ids at position ``i`` to their
    log-probability given ``token_ids[:i]`` (vLLM's ``prompt_logprobs``, with
    ``Logprob`` objects already reduced to floats); position 0 has none.
    Scoring prompt + output as one prompt gives the target's log-likelihood of
    the generated text whichever method generated it.
    """
    if start < 1:
        raise ValueError("the first scored token needs a context: start must be >= 1")
    if len(prompt_logprobs) != len(token_ids):
        raise ValueError(f"{len(prompt_logprobs)} logprob positions for {len(token_ids)} tokens")
    scored = []
    for position in range(start, len(token_ids)):
        candidates = prompt_logprobs[position]
        if candidates is None or token_ids[position] not in candidates:
            raise ValueError(f"no log-probability for token {token_ids[position]} at position {position}")
        scored.append(float(candidates[token_ids[position]]))
    return scored


def mean_loglik_per_token(per_sequence: Sequence[Sequence[float]]) -> float | None:
    """Token-weighted mean over all sequences (long outputs weigh more, as
    each token is one prediction of the target)."""
    tokens = [lp for sequence in per_sequence for lp in sequence]
    return math.fsum(tokens) / len(tokens) if tokens else None


def exact_match(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Share of requests whose token ids equal the reference's exactly."""
    if len(outputs) != len(references):
        raise ValueError(f"{len(outputs)} outputs for {len(references)} references")
    if not outputs:
        return 0.0
    return sum(list(a) == list(b) for a, b in zip(outputs, references)) / len(outputs)


#: Stop sequences of the HumanEval paper: a completion ends with the function body.
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def truncate_completion(text: str, stops: Sequence[str] = HUMANEVAL_STOPS) -> str:
    """Cut a completion at the first stop sequence. Generation runs with a
    fixed length (``ignore_eos``) so every method does the same work; the
    cut happens afterwards, only for the pass-rate check."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]
