"""Pure metric code for the benchmarks: no vLLM import, unit-tested.

Everything that turns raw counters, timings and log-probabilities into the
reported figures lives here, so the numbers in the JSON, the Markdown table
and the plot come from one definition each (see ``tests/test_benchmarks.py``).

Definitions (per request, summed over a run):

* *target step*: one forward pass of the target for one request. Every step
  emits the target's own token plus the draft tokens it accepted, so
  ``steps = output_tokens - accepted`` (the prefill step emits the first
  token and counts as one). Without speculation ``steps == output_tokens``.
  vLLM's accepted counter also counts drafts accepted past a request's
  ``max_tokens`` (its ``draft_model`` drafts ``k`` tokens however few are
  left, e.g. 306 counted where 285 were written), which would undercount
  the steps; each step with a draft is counted too (``drafts``), so with
  ``requests`` prefill steps ``steps = max(output_tokens - accepted,
  drafts + requests)``, both lower bounds, the second exact whenever every
  step drafts; accepted tokens are then ``output_tokens - steps``.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

#: vLLM's speculative-decoding counters (``LLM.get_metrics()``).
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


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


# ----------------------------------------------------------------- divergence
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


def divergence_cell(summary: Mapping[str, Any] | None) -> str:
    """A row's ``divergence`` field in a table cell: "identical 10/12; 2 diverged (max margin 0.21)"."""
    if summary is None:
        return "–"
    cell = f"identical {summary['identical']}/{summary['compared']}"
    if summary["diverged"]:
        cell += f"; {summary['diverged']} diverged (max margin {_fmt(summary['max_margin'])})"
    if summary["clear_margin"]:
        cell += f"; **{len(summary['clear_margin'])} at a clear margin (> {summary['near_tie']:g})**"
    return cell


#: Stop sequences of the HumanEval paper: a completion ends with the function body.
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def truncate_completion(text: str, stops: Sequence[str] = HUMANEVAL_STOPS) -> str:
    """Cut a completion at the first stop sequence. Generation runs with a
    fixed length (``ignore_eos``) so every method does the same work; the
    cut happens afterwards, only for the pass-rate check."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


# --------------------------------------------------------------------- schema
_NUM = {"type": ["number", "null"]}
_RUN = {
    "type": "object",
    "required": [
        "method",
        "setting",
        "setting_label",
        "batch_size",
        "temperature",
        "engine",
        "tokens_per_s",
        "tokens_per_s_runs",
        "speedup",
        "output_tokens",
        "requests",
        "accepted_per_step",
        "acceptance_rate",
        "steps_per_output_token",
        "draft_time_share",
        "peak_rss_mib",
        "mean_loglik_per_token",
        "exact_match",
        "pass_rate",
        "counters",
        "best",
    ],
    "properties": {
        "method": {"type": "string"},
        "setting": {"type": "object"},
        "setting_label": {"type": "string"},
        "beam_width": {"type": ["integer", "null"]},
        "batch_size": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0},
        "engine": {"type": "string"},
        "tokens_per_s": {"type": "number", "exclusiveMinimum": 0},
        "tokens_per_s_runs": {"type": "array", "items": {"type": "number"}, "minItems": 1},
        "speedup": _NUM,
        "speedup_paired": _NUM,
        "output_tokens": {"type": "integer", "minimum": 0},
        "requests": {"type": "integer", "minimum": 1},
        "accepted_per_step": _NUM,
        "acceptance_rate": _NUM,
        "mean_width": _NUM,
        "mean_depth": _NUM,
        "nodes_per_tree": _NUM,
        "step_cost": {"type": ["object", "null"]},
        "draft_forwards_per_token": _NUM,
        "off_argmax_per_token": _NUM,
        "drafter_state_bytes": {"type": ["integer", "null"], "minimum": 0},
        "steps_per_output_token": _NUM,
        "draft_time_share": _NUM,
        "peak_rss_mib": _NUM,
        "mean_loglik_per_token": _NUM,
        "exact_match": _NUM,
        "divergence": {
            "type": ["object", "null"],
            "required": ["compared", "identical", "diverged", "points", "max_margin", "near_tie", "clear_margin"],
        },
        "dtype": {"type": ["string", "null"]},
        "pass_rate": _NUM,
        "counters": {"type": "object"},
        "best": {"type": "boolean"},
    },
}
RESULT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["schema_version", "config", "environment", "methods", "engines", "runs", "artifacts"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "config": {
            "type": "object",
            "required": [
                "model",
                "draft_model",
                "prompts",
                "max_tokens",
                "batch_sizes",
                "temperatures",
                "repeats",
                "seed",
                "dtype",
                "sweep",
                "execute_code",
            ],
        },
        "environment": {
            "type": "object",
            "required": ["vllm", "torch", "vllm_specbeam", "git_commit", "python", "cpu_count", "cpu_model"],
        },
        "methods": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["status", "kind"],
                "properties": {
                    "status": {"enum": ["ok", "skipped", "failed"]},
                    "kind": {"enum": ["baseline", "vllm", "plugin", "beam"]},
                    "reason": {"type": ["string", "null"]},
                },
            },
        },
        "engines": {"type": "array", "items": {"type": "object", "required": ["id", "method", "status"]}},
        "runs": {"type": "array", "items": _RUN},
        "artifacts": {"type": "object"},
    },
}


def validate_result(result: Mapping[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``result`` has the schema,
    plus the cross-field rule the schema cannot say: exactly one best setting
    per method and scenario, and the baseline's speedup is 1."""
    import jsonschema

    jsonschema.validate(result, RESULT_SCHEMA)
    best: dict[tuple, int] = {}
    for run in result["runs"]:
        key = (run["method"], run["batch_size"], run["temperature"])
        best[key] = best.get(key, 0) + run["best"]
        if run["method"] == "none" and run["speedup"] is not None and abs(run["speedup"] - 1) > 1e-9:
            raise jsonschema.ValidationError(f"baseline speedup {run['speedup']} != 1")
    wrong = {key: n for key, n in best.items() if n != 1}
    if wrong:
        raise jsonschema.ValidationError(f"need exactly one best setting per method and scenario: {wrong}")


def mark_best(runs: list[dict[str, Any]]) -> None:
    """Flag the fastest setting (median tokens/s) of each method per scenario."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["method"], run["batch_size"], run["temperature"]), []).append(run)
    for group in groups.values():
        top = max(group, key=lambda run: run["tokens_per_s"])
        for run in group:
            run["best"] = run is top


# ------------------------------------------------------------------ reporting
def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if digits else str(round(value))
    return str(value)


#: (title, key, digits) of the offline table.
OFFLINE_COLUMNS = (
    ("batch", "batch_size", 0),
    ("temp", "temperature", 1),
    ("method", "method", 0),
    ("best setting", "setting_label", 0),
    ("tok/s (median)", "tokens_per_s", 1),
    ("speedup", "speedup", 2),
    ("paired speedup", "speedup_paired", 2),
    ("accepted/step", "accepted_per_step", 2),
    ("acceptance", "acceptance_rate", 2),
    ("dsbd width", "mean_width", 2),
    ("steps/token", "steps_per_output_token", 2),
    ("draft share", "draft_time_share", 2),
    ("peak RSS MiB", "peak_rss_mib", 0),
    ("loglik/token", "mean_loglik_per_token", 3),
    ("exact match", "exact_match", 2),
    ("divergence", "divergence_cell", 0),
    ("pass@1", "pass_rate", 2),
)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, int]]) -> str:
    """A Markdown table of ``rows`` (dicts) with ``(title, key, digits)`` columns."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(key), digits) for _, key, digits in columns) + " |")
    return "\n".join(lines) + "\n"


def offline_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """One row per method and scenario: its best setting (the sweep stays in
    the JSON). Speedups are against ``none`` in the same scenario and run."""
    rows = sorted(
        (r for r in runs if r["best"]),
        key=lambda r: (r["temperature"], r["batch_size"], r["method"] != "none", -r["tokens_per_s"]),
    )
    return markdown_table(with_divergence_cells(rows), OFFLINE_COLUMNS)


#: (title, key, digits) of the beam-search table.
BEAM_COLUMNS = (
    ("batch", "batch_size", 0),
    ("method", "method", 0),
    ("width", "setting_label", 0),  # w4, or w4-d3 with the speculative search's draft depth
    ("draft depth (mean)", "mean_depth", 2),
    ("tok/s (median)", "tokens_per_s", 1),
    ("vs vLLM beam search", "speedup_vs_beam_search", 2),
    ("tokens per target pass", "tokens_per_pass", 2),
    ("draft share", "draft_time_share", 2),
    ("loglik/token", "mean_loglik_per_token", 3),
    ("same beams as vLLM", "exact_match", 2),
)


#: (title, key, digits) of the settings table.
SETTINGS_COLUMNS = (
    ("batch", "batch_size", 0),
    ("temp", "temperature", 1),
    ("method", "method", 0),
    ("setting", "setting_label", 0),
    ("tok/s (median)", "tokens_per_s", 1),
    ("speedup", "speedup", 2),
    ("accepted/step", "accepted_per_step", 2),
    ("mean depth", "mean_depth", 2),
    ("nodes/tree", "nodes_per_tree", 1),
    ("draft share", "draft_time_share", 2),
    ("draft forwards/token", "draft_forwards_per_token", 2),
    ("accepted off argmax/token", "off_argmax_per_token", 3),
    ("drafter state bytes", "drafter_state_bytes", 0),
    ("loglik/token", "mean_loglik_per_token", 3),
    ("exact match", "exact_match", 2),
    ("divergence", "divergence_cell", 0),
)


def with_divergence_cells(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with their ``divergence`` field as a table cell (``divergence_cell``)."""
    return [{**row, "divergence_cell": divergence_cell(row.get("divergence"))} for row in rows]


def settings_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """Every setting of the methods that ran several (ablations: one engine,
    per-request settings); empty when none did."""
    counts: dict[str, set[str]] = {}
    for r in runs:
        counts.setdefault(r["method"], set()).add(r["setting_label"])
    rows = [r for r in runs if len(counts[r["method"]]) > 1]
    if not rows:
        return ""
    rows.sort(key=lambda r: (r["temperature"], r["batch_size"], r["method"], -r["tokens_per_s"]))
    return "\nEvery setting of the methods that swept several:\n\n" + markdown_table(
        with_divergence_cells(rows), SETTINGS_COLUMNS
    )


def beam_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """Beam searches at every width (not only the fastest): vLLM's
    ``LLM.beam_search`` and the plugin's speculative one side by side;
    empty when no beam search ran."""
    rows = [
        {
            **r,
            "tokens_per_pass": 1 / r["steps_per_output_token"]
            if r.get("steps_per_output_token")
            else (1.0 if r["method"] == "beam_search" else None),
        }
        for r in runs
        if r.get("beam_width")
    ]
    if not rows:
        return ""
    rows.sort(key=lambda r: (r["batch_size"], r["beam_width"], r["method"] != "beam_search"))
    return "\nBeam search (greedy; widths side by side):\n\n" + markdown_table(rows, BEAM_COLUMNS)


def plot_speedup_vs_quality(runs: Sequence[Mapping[str, Any]], path: Path, title: str) -> None:
    """Speedup (x) against mean log-likelihood per token under the target (y),
    one point per method and setting, one panel per batch size and
    temperature. Lossless methods should sit on the baseline's horizontal
    line; anything below it changed the output distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch_size"] for r in runs})
    temperatures = sorted({r["temperature"] for r in runs})
    methods = sorted({r["method"] for r in runs})
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(
        len(temperatures), len(batches), squeeze=False, figsize=(5 * len(batches), 4 * len(temperatures))
    )
    for (row, temperature), (col, batch) in ((r, c) for r in enumerate(temperatures) for c in enumerate(batches)):
        ax = axes[row][col]
        for run in runs:
            if (run["batch_size"], run["temperature"]) != (batch, temperature):
                continue
            x, y = run["speedup"], run["mean_loglik_per_token"]
            if x is None or y is None:
                continue
            ax.scatter(
                x,
                y,
                color=colours[run["method"]],
                s=70 if run["best"] else 25,
                edgecolors="black" if run["best"] else "none",
                label=run["method"] if run["best"] else None,
            )
            ax.annotate(
                run["setting_label"] if run["method"] != "none" else "none",
                (x, y),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        baseline = [
            r["mean_loglik_per_token"]
            for r in runs
            if r["method"] == "none"
            and (r["batch_size"], r["temperature"]) == (batch, temperature)
            and r["mean_loglik_per_token"] is not None
        ]
        if baseline:
            ax.axhline(baseline[0], color="grey", lw=0.8, ls=":")
        ax.set_title(f"batch {batch}, temperature {temperature}")
        ax.set_xlabel("output tokens/s ÷ no speculation")
        ax.set_ylabel("mean log-likelihood / token (target)")
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
