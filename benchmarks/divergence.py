"""Where greedy outputs left no speculation's, and how close the target was to a tie there.

Greedy decoding that keeps the target's choices can only leave them where two
tokens nearly tie; a divergence at a clear top-2 margin (scored by a float32
target) is a bug signal. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: A no-speculation output, as the key of its margins: (prompt index, its token ids).
Reference = tuple[int, tuple[int, ...]]


def first_divergence(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """Token index where ``output`` first differs from ``reference`` (the shorter
    one's length when one is the other's prefix); ``None`` when they are equal."""
    for position, (token, expected) in enumerate(zip(output, reference)):
        if token != expected:
            return position
    return None if len(output) == len(reference) else min(len(output), len(reference))


def top2_margin(candidates: Mapping[int, float]) -> float:
    """The two most likely tokens' log-probability gap: both share one log-softmax
    normaliser, so it is their logit gap, the target's own confidence in its choice."""
    best = sorted(candidates.values(), reverse=True)[:2]
    if len(best) < 2:
        raise ValueError(f"{len(best)} candidate(s): the margin needs the top 2 (score with logprobs >= 2)")
    return best[0] - best[1]


def continuation_margins(prompt_logprobs: Sequence[Mapping[int, float] | None], start: int) -> list[float]:
    """:func:`top2_margin` at every position from ``start`` of a scoring pass run with
    ``prompt_logprobs >= 2``: entry ``i`` is the target's choice after ``token_ids[: start + i]``."""
    if start < 1:
        raise ValueError("the first scored token needs a context: start must be >= 1")
    margins = []
    for position in range(start, len(prompt_logprobs)):
        candidates = prompt_logprobs[position]
        if candidates is None:
            raise ValueError(f"no log-probabilities at position {position}")
        margins.append(top2_margin(candidates))
    return margins


@dataclass(frozen=True)
class Divergence:
    """Where one output first left no speculation's output for its prompt (``position``:
    the token index in the output) and the float32 target's top-2 logit margin there,
    given the prompt and no speculation's output before it (``None``: not scored)."""

    prompt: int
    position: int
    margin: float | None


@dataclass(frozen=True)
class DivergenceReport:
    """A greedy row's outputs against no speculation's. Greedy decoding that
    keeps the target's choices can only leave them where two tokens nearly tie
    (rounding, batch shapes): a divergence at a margin above ``near_tie`` is a
    bug signal (``clear``), unless the method is lossy by design."""

    compared: int
    divergences: tuple[Divergence, ...]
    near_tie: float

    @property
    def max_margin(self) -> float | None:
        return max((d.margin for d in self.divergences if d.margin is not None), default=None)

    @property
    def clear(self) -> list[Divergence]:
        return [d for d in self.divergences if d.margin is not None and d.margin > self.near_tie]

    def as_dict(self) -> dict[str, Any]:
        """The report as a result row's ``divergence`` field."""
        return {
            "compared": self.compared,
            "identical": self.compared - len(self.divergences),
            "diverged": len(self.divergences),
            "points": [asdict(d) for d in self.divergences],
            "max_margin": self.max_margin,
            "near_tie": self.near_tie,
            "clear_margin": [asdict(d) for d in self.clear],
        }


def diverged_references(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> set[Reference]:
    """The no-speculation outputs that ``outputs`` left: whose margins a report needs."""
    return {
        (prompt, tuple(reference))
        for prompt, (output, reference) in enumerate(zip(outputs, references, strict=True))
        if first_divergence(output, reference) is not None
    }


def divergence_report(
    outputs: Sequence[Sequence[int]],
    references: Sequence[Sequence[int]],
    margins: Mapping[Reference, Sequence[float]],
    near_tie: float,
) -> DivergenceReport:
    """Each output's first divergence from its reference, with the reference's
    margin there (``margins``: per-position margins of each reference)."""
    if len(outputs) != len(references):
        raise ValueError(f"{len(outputs)} outputs for {len(references)} references")
    divergences = []
    for prompt, (output, reference) in enumerate(zip(outputs, references)):
        position = first_divergence(output, reference)
        if position is None:
            continue
        along = margins.get((prompt, tuple(reference)), ())
        divergences.append(Divergence(prompt, position, along[position] if position < len(along) else None))
    return DivergenceReport(len(outputs), tuple(divergences), near_tie)


def margins_of(
    items: Iterable[tuple[int, Iterable[int]]], margins: Iterable[list[float]] | None
) -> dict[Reference, list[float]]:
    """A scoring pass's per-position margins by (prompt index, output); none when
    it gave none (an engine not in float32)."""
    if margins is None:
        return {}
    return {(prompt, tuple(output)): along for (prompt, output), along in zip(items, margins, strict=True)}


def complete_margins(
    known: dict[Reference, list[float]],
    needed: set[Reference],
    score: Callable[[list[Reference]], dict[Reference, list[float]]],
) -> dict[Reference, list[float]]:
    """``known`` margins with those of the ``needed`` references it lacks, from
    ``score`` (it starts an engine: called only when some are missing)."""
    missing = sorted(needed - known.keys())
    if missing:
        known.update(score(missing))
    return known
