"""The benchmarks: metric definitions, scoring, JSON schema, method discovery,
and one end-to-end run of the offline comparison on the tiny model.

The metric tests pin the definitions the reports rely on (a wrong
denominator would silently inflate every speedup claim); the smoke test
checks that a real run produces a JSON, table and PNG that agree.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from benchmarks import (
    compare,
    divergence,
    figures,
    host,
    load_test,
    offline,
    plan,
    plots,
    processes,
    records,
    replay,
    report,
    serve_bench,
    tables,
    worker,
)
from benchmarks.prompts import load_prompts
from vllm_specbeam.core.budget import StepCost
from vllm_specbeam.core.config import METHODS, parse

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


# ---------------------------------------------------------------- metrics
def test_spec_figures_from_counters():
    # 100 output tokens, 60 of them accepted drafts: 40 target steps (the
    # prefill included), 1.5 accepted per step, 0.4 steps per token.
    counted = figures.spec_figures(output_tokens=100, accepted=60, draft_tokens=120)
    assert counted.accepted_per_step == pytest.approx(1.5)
    assert counted.acceptance_rate == pytest.approx(0.5)
    assert counted.steps_per_output_token == pytest.approx(0.4)
    plain = figures.spec_figures(output_tokens=50, accepted=0, draft_tokens=0)
    assert (plain.accepted_per_step, plain.acceptance_rate, plain.steps_per_output_token) == (0.0, None, 1.0)
    assert figures.spec_figures(50, None, None) == figures.SpecFigures(None, None, None)
    # vLLM's counters from a run of draft_model k5 (12 requests, 384 tokens): 87 steps drafted and
    # 306 tokens counted as accepted, 21 of them past max_tokens; the output holds 384 - 99 = 285
    vllm = figures.spec_figures(output_tokens=384, accepted=306, draft_tokens=435, drafts=87, requests=12)
    assert vllm.steps_per_output_token == pytest.approx(99 / 384)
    assert vllm.accepted_per_step == pytest.approx(285 / 99) and vllm.acceptance_rate == pytest.approx(285 / 435)
    # exact counters (the plugin's, or steps without a draft) keep output_tokens - accepted
    assert figures.spec_figures(100, 60, 120, drafts=20, requests=1) == counted


def test_counter_delta_handles_lists_and_late_counters():
    before = {"accepted": 5, "accepted_per_pos": [3, 2]}
    after = {"accepted": 9, "accepted_per_pos": [5, 3, 1], "drafts": 4}
    assert figures.counter_delta(before, after) == {"accepted": 4, "accepted_per_pos": [2, 1, 1], "drafts": 4}


def test_continuation_logprobs_and_mean():
    # Token ids [7, 8, 9, 10], prompt = first two tokens: only 9 and 10 are scored.
    table = [None, {8: -0.1, 1: -3.0}, {9: -0.5}, {10: -1.5, 9: -0.2}]
    scored = figures.continuation_logprobs(table, [7, 8, 9, 10], start=2)
    assert scored == [-0.5, -1.5]
    assert figures.mean_loglik_per_token([scored, [-2.0]]) == pytest.approx(-4.0 / 3)  # token-weighted
    assert figures.mean_loglik_per_token([]) is None
    with pytest.raises(ValueError, match="no log-probability"):
        figures.continuation_logprobs([None, {1: -1.0}], [0, 2], start=1)
    with pytest.raises(ValueError, match="start must be"):
        figures.continuation_logprobs(table, [7, 8, 9, 10], start=0)


def test_exact_match_percentile_ratio_truncation():
    assert figures.exact_match([[1, 2], [3]], [[1, 2], [4]]) == 0.5
    assert figures.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert figures.percentile([1, None, 11], 90) == pytest.approx(10.0)
    assert figures.ratio(3.0, 2.0) == 1.5 and figures.ratio(3.0, None) is None
    assert figures.truncate_completion("    return x\n\ndef other():\n    pass") == "    return x\n"


def synthetic_runs() -> list[dict]:
    def run(method: str, label: str, tps: float, speedup: float, batch: int = 1) -> dict:
        return {
            "method": method,
            "setting": {},
            "setting_label": label,
            "batch_size": batch,
            "temperature": 0.0,
            "engine": method,
            "tokens_per_s": tps,
            "tokens_per_s_runs": [tps],
            "speedup": speedup,
            "output_tokens": 64,
            "requests": 2,
            "accepted_per_step": 0.5,
            "acceptance_rate": 0.4,
            "steps_per_output_token": 0.7,
            "draft_time_share": None,
            "peak_rss_mib": 900.0,
            "mean_loglik_per_token": -0.8,
            "exact_match": 1.0,
            "pass_rate": None,
            "counters": {},
            "best": False,
        }

    return [
        run("none", "-", 10.0, 1.0),
        run("lookup_tree", "d3/n8", 12.0, 1.2),
        run("lookup_tree", "d5/n16", 14.0, 1.4),
        run("none", "-", 30.0, 1.0, batch=8),
    ]


def synthetic_result(runs: list[dict]) -> dict:
    return {
        "schema_version": report.SCHEMA_VERSION,
        "config": {
            "model": "m",
            "draft_model": None,
            "prompts": {},
            "max_tokens": 64,
            "batch_sizes": [1, 8],
            "temperatures": [0.0],
            "repeats": 1,
            "seed": 0,
            "dtype": "float32",
            "sweep": "quick",
            "execute_code": False,
        },
        "environment": {
            "vllm": "0.32.0",
            "torch": "2.13.0",
            "vllm_specbeam": "0.1.0",
            "git_commit": None,
            "python": "3.11",
            "cpu_count": 2,
            "cpu_model": "x",
        },
        "methods": {
            "none": {"status": "ok", "kind": "baseline"},
            "aded": {"status": "skipped", "kind": "plugin", "reason": "not available yet"},
        },
        "engines": [{"id": "none", "method": "none", "status": "ok"}],
        "runs": runs,
        "artifacts": {},
    }


def test_schema_best_setting_and_table(tmp_path):
    runs = synthetic_runs()
    report.mark_best(runs)
    assert [r["best"] for r in runs] == [True, False, True, True]
    # one of two outputs left no speculation's at its token 1, where the target's margin was 0.21
    diverged = divergence.divergence_report([[1, 2], [3, 9]], [[1, 2], [3, 4]], {(1, (3, 4)): [0.1, 0.21]}, 0.5)
    runs[2]["divergence"] = diverged.as_dict()
    result = synthetic_result(runs)
    report.validate_result(result)
    # best setting per method and scenario only, the baseline first, cells rounded per column
    assert tables.offline_table(runs).splitlines() == [
        "| batch | temp | method | best setting | tok/s (median) | speedup | paired speedup | accepted/step "
        "| acceptance | dsbd width | steps/token | draft share | steps off | peak RSS MiB | loglik/token | exact match "
        "| divergence | pass@1 |",
        "|" + "---|" * 18,
        "| 1 | 0.0 | none | - | 10.0 | 1.00 | – | 0.50 | 0.40 | – | 0.70 | – | – | 900 | -0.800 | 1.00 | – | – |",
        "| 1 | 0.0 | lookup_tree | d5/n16 | 14.0 | 1.40 | – | 0.50 | 0.40 | – | 0.70 | – | – | 900 | -0.800 | 1.00 "
        "| identical 1/2; 1 diverged (max margin 0.21) | – |",
        "| 8 | 0.0 | none | - | 30.0 | 1.00 | – | 0.50 | 0.40 | – | 0.70 | – | – | 900 | -0.800 | 1.00 | – | – |",
    ]
    assert tables.cost_cell({"step_cost_intercept_s": 0.0312, "step_cost_per_row_s": 0.0004}, "step_cost") == (
        "31.2 + 0.40/row"
    )
    assert tables.cost_cell({"step_cost_intercept_s": 0.0312, "step_cost_per_row_s": 0.0004}, "draft_cost") is None
    assert plots.write_plots(runs, {"lookup_tree": "plugin"}, tmp_path, "t") == [tmp_path / plots.BARS_PNG]
    assert (tmp_path / plots.BARS_PNG).read_bytes()[:4] == b"\x89PNG"

    broken = json.loads(json.dumps(result))
    del broken["runs"][0]["acceptance_rate"]
    with pytest.raises(jsonschema.ValidationError):
        report.validate_result(broken)
    two_best = json.loads(json.dumps(result))
    two_best["runs"][1]["best"] = True
    with pytest.raises(jsonschema.ValidationError, match="exactly one best"):
        report.validate_result(two_best)
    bad_status = json.loads(json.dumps(result))
    bad_status["methods"]["aded"]["status"] = "maybe"
    with pytest.raises(jsonschema.ValidationError):
        report.validate_result(bad_status)
    no_margin = json.loads(json.dumps(result))
    del no_margin["runs"][2]["divergence"]["max_margin"]
    with pytest.raises(jsonschema.ValidationError, match="max_margin"):
        report.validate_result(no_margin)


def test_plots_are_bars_for_greedy_rows_and_a_scatter_only_where_quality_differs(tmp_path):
    runs = synthetic_runs()
    report.mark_best(runs)
    chosen = plots.charts(runs)  # greedy and lossless: all the same quality, speed is the story
    assert [(r["method"], r["setting_label"]) for r in chosen.bars] == [("lookup_tree", "d5/n16")]
    assert chosen.scatter == []
    sampled = [{**r, "temperature": 0.7} for r in runs]
    lossy = {**runs[2], "method": "mjsd", "setting_label": "b4"}
    beam = {**runs[2], "method": "beam_search", "setting_label": "w4", "beam_width": 4}
    chosen = plots.charts([*runs, lossy, beam, *sampled])
    assert [r["method"] for r in chosen.bars] == ["lookup_tree"]  # neither lossy methods nor beams
    # each greedy scenario's rows whose quality differs beside its baseline; every sampled row
    assert {(r["method"], r["batch_size"], r["temperature"]) for r in chosen.scatter} == {
        *(("mjsd", 1, 0.0), ("beam_search", 1, 0.0), ("none", 1, 0.0)),
        *(("none", 1, 0.7), ("lookup_tree", 1, 0.7), ("none", 8, 0.7)),
    }
    written = plots.write_plots([*runs, lossy, *sampled], {"ngram": "vllm"}, tmp_path, "t")
    assert written == [tmp_path / plots.BARS_PNG, tmp_path / plots.SCATTER_PNG]
    assert all(path.read_bytes()[:4] == b"\x89PNG" for path in written)
    (tmp_path / "sampled").mkdir()
    assert plots.write_plots(sampled, {}, tmp_path / "sampled", "t") == [tmp_path / "sampled" / plots.SCATTER_PNG]


# ------------------------------------------------------------ divergence
def test_first_divergence_and_top2_margin():
    assert divergence.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert divergence.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert divergence.first_divergence([9], [1]) == 0
    assert divergence.first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early: it diverged where it stopped
    # the top 2 of whatever the pass returned (the scored token beside them), in any order
    assert divergence.top2_margin({4: -2.0, 7: -0.25, 9: -1.0}) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="logprobs >= 2"):
        divergence.top2_margin({4: -0.1})
    # prompt [5, 6] + output [7, 8]: the margins of positions 2 and 3, the output's tokens 0 and 1
    table = [None, {6: -0.1, 1: -3.0}, {7: -0.5, 2: -1.5}, {8: -0.2, 3: -0.3, 7: -4.0}]
    assert divergence.continuation_margins(table, start=2) == pytest.approx([1.0, 0.1])


def planted_divergences(near_tie: float = 0.5) -> divergence.DivergenceReport:
    """Four outputs against no speculation's: one identical, one leaving it at a near-tie
    (margin 0.1), one at exactly the threshold, one at a clear margin (2.5)."""
    references = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    outputs = [[1, 2, 3, 4], [1, 2, 7, 7], [5, 6, 7, 1], [9, 3, 3, 3]]
    margins = {
        (1, (1, 2, 3, 4)): [3.0, 3.0, 0.1, 3.0],
        (2, (5, 6, 7, 8)): [3.0, 3.0, 3.0, near_tie],
        (3, (9, 9, 9, 9)): [0.0, 2.5, 0.0, 0.0],
    }
    return divergence.divergence_report(outputs, references, margins, near_tie)


def test_divergence_report_flags_a_clear_margin_and_not_a_near_tie():
    planted = planted_divergences()
    assert planted.divergences == (
        divergence.Divergence(prompt=1, position=2, margin=0.1),
        divergence.Divergence(prompt=2, position=3, margin=0.5),
        divergence.Divergence(prompt=3, position=1, margin=2.5),
    )
    assert planted.max_margin == 2.5
    assert planted.clear == [divergence.Divergence(3, 1, 2.5)]  # "above" the threshold: 0.5 itself is a near-tie
    summary = planted.as_dict()
    assert (summary["compared"], summary["identical"], summary["diverged"]) == (4, 1, 3)
    assert summary["clear_margin"] == [{"prompt": 3, "position": 1, "margin": 2.5}]
    assert tables.divergence_cell(summary) == (
        "identical 1/4; 3 diverged (max margin 2.50); **1 at a clear margin (> 0.5)**"
    )
    assert planted_divergences(near_tie=3.0).clear == []  # all near-ties at a looser threshold
    # no margins scored (the float32 engine failed): positions still reported, nothing flagged
    unscored = divergence.divergence_report([[1, 9]], [[1, 2]], {}, 0.5)
    assert unscored.divergences == (divergence.Divergence(0, 1, None),) and unscored.clear == []
    assert tables.divergence_cell(unscored.as_dict()) == "identical 0/1; 1 diverged (max margin –)"
    assert tables.divergence_cell(divergence.divergence_report([[1]], [[1]], {}, 0.5).as_dict()) == "identical 1/1"
    assert divergence.diverged_references([[1, 2], [3, 9]], [[1, 2], [3, 4]]) == {(1, (3, 4))}


def assemble_planted(margins: dict) -> tuple[list[dict], list[set]]:
    """``report.assemble`` on made-up raw data: no speculation at batch 1 and 2 (its outputs
    differ between them), ``ngram`` leaving it at a near-tie at batch 1 and ``lookup_tree``
    at a clear margin at batch 2, ``mjsd`` (lossy) at a clear margin; the margins asked."""
    scenarios = [records.Scenario(1, 0.0), records.Scenario(2, 0.0)]

    def raw(*outputs: list[list[int]]) -> dict:
        runs = [
            {
                **{"scenario": k, "setting": 0, "wall_s": [1.0], "started_s": [0.0], "output_tokens_runs": [6]},
                **{"counters": {"accepted": 0}, "outputs": out, "texts": ["", ""], "logliks": [[-1.0] * 3] * 2},
            }
            for k, out in enumerate(outputs)
        ]
        return {"scenarios": scenarios, "runs": runs}

    none = [[1, 2, 3], [4, 5, 6]]
    none_b2 = [[1, 2, 3], [4, 5, 7]]
    engines = [
        plan.EngineSpec(name, name, kind, None, [plan.Setting("s", {})])
        for name, kind in (("ngram", "vllm"), ("lookup_tree", "plugin"), ("mjsd", "plugin"), ("none", "baseline"))
    ]
    data = {
        "ngram": raw([[1, 2, 3], [4, 9, 9]], none_b2),
        "lookup_tree": raw(none, [[1, 2, 3], [4, 5, 8]]),
        "mjsd": raw([[1, 7, 7], [4, 5, 6]], none_b2),
        "none": raw(none, none_b2),
    }
    engine_records = [engine_record(e, peak_rss_mib=1.0, dtype="bfloat16") for e in engines]
    asked: list[set] = []

    def margins_for(needed: set) -> dict:
        asked.append(needed)
        return margins

    return report.assemble(engines, engine_records, data, margins_for, near_tie=0.5), asked


def test_assemble_reports_divergences_against_the_same_batch_size():
    margins = {(1, (4, 5, 6)): [2.0, 0.2, 1.0], (1, (4, 5, 7)): [2.0, 2.0, 1.5], (0, (1, 2, 3)): [1.0, 3.0, 0.0]}
    runs, asked = assemble_planted(margins)
    # every no-speculation output some row left (each batch size's own), asked for once
    assert asked == [{(1, (4, 5, 6)), (1, (4, 5, 7)), (0, (1, 2, 3))}]
    by_row = {(r["method"], r["batch_size"]): r for r in runs}
    assert by_row[("ngram", 1)]["divergence"]["points"] == [{"prompt": 1, "position": 1, "margin": 0.2}]
    assert by_row[("ngram", 2)]["divergence"]["diverged"] == 0
    assert by_row[("lookup_tree", 2)]["divergence"]["points"] == [{"prompt": 1, "position": 2, "margin": 1.5}]
    assert by_row[("none", 1)]["divergence"]["identical"] == 2 and by_row[("none", 1)]["dtype"] == "bfloat16"
    clear = report.clear_margin_divergences(runs)
    assert [(d["method"], d["batch_size"], d["prompt"], d["position"], d["expected"]) for d in clear] == [
        ("lookup_tree", 2, 1, 2, False),
        ("mjsd", 1, 0, 1, True),
    ]


def test_clear_margin_divergences_are_printed_as_bug_signals_unless_lossy(capsys):
    runs, _ = assemble_planted({(1, (4, 5, 6)): [2.0, 0.2, 1.0], (1, (4, 5, 7)): [2.0, 2.0, 1.5]})
    report.print_clear_margin_divergences(report.clear_margin_divergences(runs), 0.5)
    printed = capsys.readouterr().out
    assert "!!! 1 CLEAR-MARGIN DIVERGENCE(S)" in printed
    assert "!!!   lookup_tree s batch 2: prompt 1, token 2, margin 1.500" in printed
    assert "ngram" not in printed  # its divergence was a near-tie
    assert "mjsd: lossy by design" not in printed  # its margin was not scored (not in the margins)
    runs, _ = assemble_planted({(0, (1, 2, 3)): [1.0, 3.0, 0.0]})
    report.print_clear_margin_divergences(report.clear_margin_divergences(runs), 0.5)
    printed = capsys.readouterr().out
    assert "!!!" not in printed and "(clear-margin divergences of mjsd: lossy by design" in printed


def engine_record(engine, peak_rss_mib: float, dtype: str) -> records.EngineRecord:
    record = records.EngineRecord(engine.id, engine.method, engine.speculative_config, {}, "log", peak_rss_mib)
    record.finished({"start_s": 1.0, "async_scheduling": False, "dtype": dtype})
    return record


def worker_record(scenario: int, outputs: list[list[int]], walls: list[float], counters: dict) -> dict:
    """A worker's record of one setting and scenario (every repeat with the same ``counters``),
    scored by the baseline: every token at log-probability -0.5."""
    run = records.RunRecord(scenario, 0, outputs, ["t"] * len(outputs), logliks=[[-0.5] * len(o) for o in outputs])
    run.step_cost = {"step_cost_intercept_s": 0.0312, "step_cost_per_row_s": 0.0004}
    for repeat, wall in enumerate(walls):
        run.add_repeat(wall, float(repeat), sum(map(len, outputs)), counters)
    return asdict(run)


def runner_counters(**counts: float) -> dict:
    """A run's counters as the worker writes them from the plugin runner's stats (its
    ``TreeCounts``, its index's, a fitted cost line kept apart), beside vLLM's own."""
    stats = dataclasses.asdict(records.TreeCounts())
    stats |= {name: value for name, value in counts.items() if name in stats}
    line = {"step_cost_intercept_s": 0.0312, "step_cost_per_row_s": 0.0004}
    counters, costs = worker.tree_counters({**stats, "index_partitions": 2, **line})
    assert costs == line and counters["tree_index_partitions"] == 2
    return {"accepted": 6, "draft_tokens": 12, "drafts": 4, **counters}


def assemble_greedy() -> list[dict]:
    """``report.assemble`` on a worker's records of ``none`` and ``lookup_tree`` (two repeats, 3
    prompts of 4 tokens, batch sizes 1 and 2, lossless greedy: the same outputs), as the
    end-to-end run gives them: rows marked best, as the table reads them."""
    outputs = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    counts = runner_counters(trees=4, nodes=16, depth_sum=12, steps=8, steps_off=2, draft_seconds=0.1)
    raw = {
        "none": {"runs": [worker_record(k, outputs, [1.0, 1.2], {}) for k in (0, 1)]},
        "lookup_tree": {"runs": [worker_record(k, outputs, [0.5, 0.8], counts) for k in (0, 1)]},
    }
    for data in raw.values():
        data["scenarios"] = [records.Scenario(1, 0.0), records.Scenario(2, 0.0)]
    engines = [
        plan.EngineSpec("lookup_tree", "lookup_tree", "plugin", {}, [plan.Setting("auto", {"max_nodes": "auto"})]),
        plan.EngineSpec("none", "none", "baseline", None, [plan.Setting("-", {})]),
    ]
    engine_records = [engine_record(e, peak_rss_mib=500.0, dtype="float32") for e in engines]
    runs = report.assemble(engines, engine_records, raw, lambda needed: {}, near_tie=0.5)
    report.mark_best(runs)
    return runs


def test_assembled_rows_agree_with_their_table_and_the_schema():
    """The table against the JSON, on a worker's records: each cell is its row's field rounded,
    the speedup the ratio of the tok/s cells, and the row's figures come from the counters."""
    runs = assemble_greedy()
    report.validate_result(
        synthetic_result([{k: v for k, v in r.items() if k not in ("outputs", "texts")} for r in runs])
    )
    by_row = {(r["method"], r["batch_size"]): r for r in runs}
    tree = by_row[("lookup_tree", 1)]
    assert tree["tokens_per_s_runs"] == [24.0, 15.0] and tree["tokens_per_s"] == pytest.approx(19.5)
    assert tree["speedup_paired"] == pytest.approx(statistics.median([24 / 12, 15 / 10]))  # run k against run k
    assert (tree["nodes_per_tree"], tree["mean_depth"], tree["steps_off_share"]) == (4.0, 3.0, 0.25)
    assert tree["draft_time_share"] == pytest.approx(0.2 / 1.3)
    assert tree["target_cost_cell"] == "31.2 + 0.40/row" and tree["chain_cost_cell"] is None
    assert tree["counters"]["tree_nodes"] == 32 and "tree_step_cost_intercept_s" not in tree["counters"]
    assert by_row[("none", 1)]["nodes_per_tree"] is None and by_row[("none", 1)]["draft_time_share"] is None
    table = read_markdown_table(tables.offline_table(runs))
    assert [(row["batch"], row["method"]) for row in table] == [
        (str(b), m) for b in (1, 2) for m in ("none", "lookup_tree")
    ]
    for row in table:
        run = by_row[(row["method"], int(row["batch"]))]
        assert row["temp"] == "0.0" and row["best setting"] == run["setting_label"]
        assert float(row["tok/s (median)"]) == pytest.approx(run["tokens_per_s"], abs=0.05)
        assert float(row["steps/token"]) == pytest.approx(run["steps_per_output_token"], abs=0.005)
        assert float(row["accepted/step"]) == pytest.approx(run["accepted_per_step"], abs=0.005)
        assert float(row["loglik/token"]) == pytest.approx(run["mean_loglik_per_token"], abs=5e-4) == -0.5
        assert row["exact match"] == "1.00" and row["pass@1"] == "–" and row["dsbd width"] == "–"
        assert row["divergence"] == "identical 3/3"
    for base, tree_row in (table[0:2], table[2:4]):
        assert base["speedup"] == "1.00" and base["steps/token"] == "1.00" and base["accepted/step"] == "0.00"
        ratio = float(tree_row["tok/s (median)"]) / float(base["tok/s (median)"])
        assert float(tree_row["speedup"]) == pytest.approx(ratio, rel=0.01, abs=0.01)


def test_table_columns_are_row_fields_or_cells_made_for_the_table():
    fields = {f.name for f in dataclasses.fields(records.Row)}
    for columns in (tables.OFFLINE_COLUMNS, tables.SETTINGS_COLUMNS, tables.BEAM_COLUMNS):
        assert {key for _, key, _ in columns} - fields <= {"divergence_cell", "tokens_per_pass"}


def test_the_report_reads_the_runners_counters_as_fields_of_tree_counts(monkeypatch):
    """Every counter of the plugin runner the report reads is a field of its ``TreeCounts``."""
    read: set[str] = set()

    class Recording(records.TreeCounts):
        def __getattribute__(self, name: str) -> object:
            read.add(name)
            return super().__getattribute__(name)

    monkeypatch.setattr(records, "TreeCounts", Recording)
    assemble_greedy()
    fields = {f.name for f in dataclasses.fields(records.TreeCounts)}
    assert {name for name in read if not name.startswith("_")} <= fields
    assert {"trees", "nodes", "steps", "steps_off", "draft_seconds", "beam_width_sum"} <= read


def test_a_renamed_tree_counts_field_fails_where_the_report_reads_it(monkeypatch):
    """Planted: the runner's ``steps_off`` renamed, the report not following. The worker writes
    the dataclass's fields; the report's read of the old name fails, not a silent ``None``."""
    renamed = [
        (("steps_rested" if f.name == "steps_off" else f.name), f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(records.TreeCounts)
    ]
    planted = dataclasses.make_dataclass("TreeCounts", renamed)
    monkeypatch.setattr(records, "TreeCounts", planted)
    monkeypatch.setattr(worker, "TreeCounts", planted)
    assert "tree_steps_rested" in runner_counters()
    with pytest.raises(AttributeError, match="steps_off"):
        assemble_greedy()


def test_margins_come_from_a_float32_engine_only_when_missing():
    known = {(0, (1, 2)): [1.0, 2.0]}
    started: list[list] = []

    def score(missing: list) -> dict:
        started.append(missing)
        return {reference: [0.5] * len(reference[1]) for reference in missing}

    # the baseline's own float32 pass had them all: no engine started
    assert divergence.complete_margins(known, {(0, (1, 2))}, score) == known and started == []
    assert divergence.complete_margins(known, set(), score) == known and started == []
    margins = divergence.complete_margins(known, {(0, (1, 2)), (1, (3,)), (0, (1, 3))}, score)
    assert started == [[(0, (1, 3)), (1, (3,))]]  # only the missing ones, in one start
    assert margins[(1, (3,))] == [0.5] and margins[(0, (1, 2))] == [1.0, 2.0]
    assert divergence.margins_of([(0, [1, 2])], None) == {}  # a pass in another dtype gave none
    assert divergence.margins_of([(0, [1, 2])], [[0.3, 0.4]]) == {(0, (1, 2)): [0.3, 0.4]}


def test_score_margins_are_the_float32_targets_top2_gap(engines):
    """The margins of the scoring pass (prompt_logprobs=2 along an output) are what one
    ``max_tokens=1, logprobs=2`` request at each context gives, on the float32 tiny model."""
    from conftest import make_prompts
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engines.get(None)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer.encode(text) for text in make_prompts(3)[1:]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], greedy, use_tqdm=False)
    outputs = [list(r.outputs[0].token_ids) for r in results]
    external = [{"prompt": p, "output": out} for p, out in enumerate(outputs)]
    scores = worker.score(llm, prompt_ids, external, [], "external")
    assert scores["own"] == [] and len(scores["margins"]) == len(outputs)
    contexts = [(p, position) for p in range(len(outputs)) for position in range(len(outputs[p]))]
    direct = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt_ids[p] + outputs[p][:position]) for p, position in contexts],
        SamplingParams(temperature=0.0, max_tokens=1, logprobs=2),
        use_tqdm=False,
    )
    for (p, position), result in zip(contexts, direct):
        top = {token: logprob.logprob for token, logprob in result.outputs[0].logprobs[0].items()}
        assert scores["margins"][p][position] == pytest.approx(divergence.top2_margin(top), abs=1e-3)
    assert worker.resolved_dtype(llm) == "float32"


def test_beam_table_lists_every_width_side_by_side():
    assert tables.beam_table(synthetic_runs()) == ""  # no beam search ran: no table

    def beam(method, width, tps, steps_per_token=None, speedup=None, exact=None, depth=None):
        return {
            "method": method,
            "setting": {"beam_width": width},
            "setting_label": f"w{width}",
            "beam_width": width,
            "batch_size": 1,
            "tokens_per_s": tps,
            "speedup_vs_beam_search": speedup,
            "steps_per_output_token": steps_per_token,
            "draft_time_share": None,
            "mean_loglik_per_token": -0.5,
            "exact_match": exact,
            "mean_depth": depth,
        }

    # mjsd's beam_width option is no beam search: not in the table
    mjsd = {**beam("mjsd", 4, 5.0), "beam_width": None, "setting_label": "b4"}
    runs = [
        mjsd,
        beam(plan.SPEC_BEAM, 4, 3.0, 0.25, 1.5, 1.0, depth=3.5),
        beam("beam_search", 4, 2.0, speedup=1.0),
        beam("beam_search", 2, 4.0, speedup=1.0),
        beam(plan.SPEC_BEAM, 2, 6.0, 0.5, 1.5, 1.0, depth=5.25),
    ]
    rows = [line for line in tables.beam_table(runs).splitlines() if line.startswith("| 1 ")]
    # widths in order, vLLM's first; 1 / steps-per-token = tokens per target pass (vLLM's: 1)
    assert rows == [
        "| 1 | beam_search | w2 | – | 4.0 | 1.00 | 1.00 | – | -0.500 | – |",
        f"| 1 | {plan.SPEC_BEAM} | w2 | 5.25 | 6.0 | 1.50 | 2.00 | – | -0.500 | 1.00 |",
        "| 1 | beam_search | w4 | – | 2.0 | 1.00 | 1.00 | – | -0.500 | – |",
        f"| 1 | {plan.SPEC_BEAM} | w4 | 3.50 | 3.0 | 1.50 | 4.00 | – | -0.500 | 1.00 |",
    ]


def test_humaneval_pass_rate_runs_the_tests():
    prompts = load_prompts("humaneval", 2)
    runs = [
        {"texts": [p.problem["canonical_solution"] + "\ndef extra():\n    pass" for p in prompts]},
        {"texts": ["    return None\n"] * 2},
    ]
    report.pass_rates(prompts, runs, timeout=10.0)
    assert [run["pass_rate"] for run in runs] == [1.0, 0.0]


# ---------------------------------------------------------- prompts, plan
def test_prompt_sets(tmp_path):
    humaneval = load_prompts("humaneval", 3)
    assert [p.id for p in humaneval] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert humaneval[0].problem["entry_point"] and "def " in humaneval[0].text
    assert len(load_prompts("natural")) == 16
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "id": "x"}\n')
    assert [(p.id, p.text) for p in load_prompts(str(path))] == [("mine/0", "a"), ("x", "b")]
    path.write_text('{"text": "a"}\n')
    with pytest.raises(SystemExit, match="no string 'prompt'"):
        load_prompts(str(path))


def plan_args(**kwargs) -> plan.PlanOptions:
    return plan.PlanOptions(**kwargs)


def test_plan_follows_plugin_methods():
    """Every plugin method is benchmarked, those with a draft model only with
    --draft (skipped otherwise); a beam method brings vLLM's beam search along."""
    from vllm_specbeam.core.config import METHODS
    from vllm_specbeam.methods.dsbd.drafter import DsbdDrafter

    status, engines = plan.plan(plan_args())
    for name, method in METHODS.items():
        if method.needs_draft_model:
            assert status[name].status == "skipped" and status[name].reason == "needs --draft"
        else:
            assert status[name].status == "ok" and name in [e.id for e in engines]
    assert status["draft_model"].status == "skipped" and status["beam_search"].status == "skipped"
    assert engines[-1].method == "none"  # last: it scores every output
    lookup = next(e for e in engines if e.id == "lookup_tree")
    # One engine at the grid's maximum, a fixed max_nodes so that the fixed points are fixed trees (a
    # request's number under an automatic engine only caps the budget); the sweep is per-request
    # options, led by the per-step budget at the method's defaults (depth 4, up to 16 nodes).
    assert lookup.speculative_config["max_nodes"] == max(16, *(n for _, n in plan.SWEEPS["quick"].tree))
    assert lookup.speculative_config["auto_max_nodes"] == 16
    assert [s.extra_args for s in lookup.settings] == [
        {"num_speculative_tokens": 4, "max_nodes": "auto", "auto_max_nodes": 16},
        *({"num_speculative_tokens": d, "max_nodes": n} for d, n in plan.SWEEPS["quick"].tree),
    ]
    assert lookup.settings[0].label == "auto"

    status, engines = plan.plan(plan_args(draft="/d"))
    ids = [e.id for e in engines]
    assert {"dsbd", "beam_search", plan.SPEC_BEAM, "draft_model-k3"} <= set(ids)
    by_id = {e.id: e for e in engines}
    dsbd = by_id["dsbd"].speculative_config
    assert dsbd["model"] == "/d"
    assert by_id["beam_search"].engine_kwargs["block_size"] == 32
    # in-engine dsbd: TREE_GRID's points, then the pruned ones, each a valid request of its engine
    pruned = plan.SWEEPS["quick"].dsbd_prune
    assert [s.label for s in by_id["dsbd"].settings] == [
        *(f"d{d}/n{n}" for d, n in plan.SWEEPS["quick"].tree),
        *(f"d{d}/n{n}/p{r}" for d, n, r in pruned),
    ]
    assert dsbd["num_speculative_tokens"] == max(d for d, _, _ in pruned)
    defaults = {name: option.default for name, option in DsbdDrafter.OPTIONS.items()}
    for setting in by_id["dsbd"].settings:
        DsbdDrafter.check_options({**defaults, **dsbd, **setting.extra_args})
        assert setting.extra_args["num_speculative_tokens"] <= dsbd["num_speculative_tokens"]
        assert setting.extra_args["max_nodes"] <= dsbd["max_nodes"]
    # the speculative beam search: the dsbd engine's config at TREE_GRID's depth (the pruned
    # settings' deeper trees are in-engine dsbd's), the same widths as vLLM's, whole prompts per step
    spec = by_id[plan.SPEC_BEAM]
    grid_depth = max(d for d, _ in plan.SWEEPS["quick"].tree)
    assert spec.speculative_config == {**dsbd, "num_speculative_tokens": grid_depth} and spec.greedy_only
    assert spec.engine_kwargs["enable_chunked_prefill"] is False
    assert [s.values for s in spec.settings] == [s.values for s in by_id["beam_search"].settings]
    assert all(s.speculative for s in spec.settings)
    # the beam searches alone: no in-engine dsbd rows; the draft's dtype reaches the plugin's config
    status, engines = plan.plan(
        plan_args(draft="/d", draft_dtype="bfloat16", methods=["none", plan.SPEC_BEAM, "beam_search"])
    )
    assert [e.id for e in engines] == [plan.SPEC_BEAM, "beam_search", "none"] and "dsbd" not in status
    assert engines[0].speculative_config["draft_dtype"] == "bfloat16"
    assert [s.beam_depth for s in engines[0].settings] == [None, None]  # the engine's depth
    # draft depths of the speculative search: one setting per width and depth, vLLM's widths unchanged
    _, engines = plan.plan(plan_args(draft="/d", beam_depths=[3, 5], methods=["none", plan.SPEC_BEAM, "beam_search"]))
    assert [(s.label, s.beam_width, s.beam_depth) for s in engines[0].settings] == [
        ("w2-d3", 2, 3), ("w2-d5", 2, 5), ("w4-d3", 4, 3), ("w4-d5", 4, 5)
    ]  # fmt: skip
    assert [s.label for s in engines[1].settings] == ["w2", "w4"]
    # in-engine dsbd beside its chain (max_width 1 at draft_model's K): no beam search unless named
    status, engines = plan.plan(plan_args(draft="/d", methods=["none", "draft_model", "dsbd", plan.DSBD_CHAIN]))
    by_id = {e.id: e for e in engines}
    ks = plan.SWEEPS["quick"].draft
    assert set(by_id) == {*(f"draft_model-k{k}" for k in ks), "dsbd", plan.DSBD_CHAIN, "none"}
    chain = by_id[plan.DSBD_CHAIN].speculative_config
    assert chain["max_width"] == 1 and chain["num_speculative_tokens"] == chain["max_nodes"] == max(ks)
    assert [s.extra_args for s in by_id[plan.DSBD_CHAIN].settings] == [
        {"num_speculative_tokens": k, "max_nodes": k} for k in ks
    ]
    # --draft-ks replaces the sweep's K for draft_model and the chain alike
    _, engines = plan.plan(
        plan_args(draft="/d", sweep="none", draft_ks=[5, 7], methods=["draft_model", plan.DSBD_CHAIN])
    )
    assert [e.id for e in engines] == ["draft_model-k5", "draft_model-k7", plan.DSBD_CHAIN, "none"]
    assert [s.label for s in engines[2].settings] == ["k5", "k7"]
    with pytest.raises(ValueError, match="unknown method"):
        plan.plan(plan_args(methods=["nope"]))


@pytest.mark.parametrize("sweep", sorted(plan.SWEEPS))
def test_every_sweep_level_plans_requests_its_engines_accept(sweep):
    """The plan table: each level plans every method (a draft, a corpus and a stop model given),
    vLLM's chains an engine per K, and each plugin setting is a request its engine accepts."""
    status, engines = plan.plan(plan_args(draft="/d", trigram="/m", stop_model="/s", sweep=sweep))
    grid = plan.SWEEPS[sweep]
    assert [e.id for e in engines if e.method == "ngram"] == [f"ngram-k{k}" for k in grid.chain]
    assert [e.id for e in engines if e.method == "draft_model"] == [f"draft_model-k{k}" for k in grid.draft]
    assert [s.label for s in {e.id: e for e in engines}["beam_search"].settings] == [f"w{w}" for w in grid.beam]
    assert {name for name, s in status.items() if s.status != "ok"} <= {"suffix"}  # without arctic-inference
    for engine in engines:
        if engine.kind != "plugin" or engine.method == plan.SPEC_BEAM:
            continue
        method = METHODS[engine.speculative_config["method"]]
        defaults = {name: option.default for name, option in method.options().items()}
        for setting in engine.settings:
            method.drafter_class().check_options({**defaults, **engine.speculative_config, **setting.extra_args})


def test_plan_runs_lookup_tree_global_as_its_own_row():
    """The global scope on engines of its own (its index is engine-wide), one per setting so that no
    setting drafts from text an earlier one indexed, deeper settings; alone when named."""
    status, engines = plan.plan(plan_args(methods=[plan.LOOKUP_GLOBAL]))
    grid = plan.SWEEPS["quick"].lookup_global
    labels = ["auto", *(f"d{d}-n{n}" for d, n in grid)]
    assert [e.id for e in engines] == [*(f"lookup_tree-global-{label}" for label in labels), "none"]
    assert "lookup_tree" not in status and all(len(e.settings) == 1 for e in engines[:-1])
    config = engines[0].speculative_config
    assert all(e.speculative_config == config for e in engines[:-1])
    assert config["scope"] == "global" and config["num_speculative_tokens"] == max(d for d, _ in grid)
    assert [e.settings[0].extra_args for e in engines[:-1]] == [
        {"num_speculative_tokens": 24, "max_nodes": "auto", "auto_max_nodes": 48},  # the scope's defaults
        *({"num_speculative_tokens": d, "max_nodes": n} for d, n in grid),
    ]
    status, engines = plan.plan(plan_args(methods=["lookup_tree"]))
    assert [e.id for e in engines] == ["lookup_tree", "none"]


def test_plan_runs_the_lookup_twins_of_mcsd_and_the_dsbd_chain_an_engine_per_setting():
    """``mcsd+lookup`` and ``dsbd-chain+lookup``: their rows' engines and settings with ``"lookup":
    "global"`` (issue #48), one engine per setting (the index is engine-wide); selectable beside
    their rows or alone, and under ``all``."""
    methods = ["none", "mcsd", plan.MCSD_LOOKUP, plan.DSBD_CHAIN, plan.DSBD_CHAIN_LOOKUP]
    status, engines = plan.plan(plan_args(draft="/d", sweep="none", methods=methods))
    by_id = {e.id: e for e in engines}
    mcsd, chain = by_id["mcsd"], by_id[plan.DSBD_CHAIN]
    assert status[plan.MCSD_LOOKUP].engines == ["mcsd-lookup-k1"]  # no no-stop twin: its draft runs every step
    assert status[plan.DSBD_CHAIN_LOOKUP].engines == ["dsbd-chain-lookup-k3"]
    for row, plain in ((plan.MCSD_LOOKUP, mcsd), (plan.DSBD_CHAIN_LOOKUP, chain)):
        twins = [by_id[engine_id] for engine_id in status[row].engines]
        assert all(e.method == row and e.kind == "plugin" and len(e.settings) == 1 for e in twins)
        # mcsd's twin at the node budget mcsd takes with the lookup on (room for its trees)
        nodes = {"max_nodes": 48} if row == plan.MCSD_LOOKUP else {}
        assert all(e.speculative_config == {**plain.speculative_config, "lookup": "global", **nodes} for e in twins)
        assert [e.settings[0] for e in twins] == [s for s in plain.settings if "no-stop" not in s.label]
        assert plain.speculative_config.get("lookup", "off") == "off"  # mcsd's own default is "global"
        method = METHODS[plain.speculative_config["method"]]
        defaults = {name: option.default for name, option in method.options().items()}
        for engine in twins:  # a request its engine accepts, and an engine the method accepts
            options = {**defaults, **engine.speculative_config, **engine.settings[0].extra_args}
            method.drafter_class().check_options(options)
            method.drafter_class().check_startup({**defaults, **engine.speculative_config})
    assert mcsd.speculative_config["k_config"] == [1] and mcsd.speculative_config["num_speculative_tokens"] == 6
    assert chain.speculative_config["max_width"] == 1 and chain.speculative_config["max_nodes"] == 3
    # the twins alone (no plain rows), and --draft-ks: an engine per K
    status, engines = plan.plan(
        plan_args(draft="/d", sweep="none", draft_ks=[3, 5], methods=[plan.MCSD_LOOKUP, plan.DSBD_CHAIN_LOOKUP])
    )
    assert [e.id for e in engines] == [
        "dsbd-chain-lookup-k3", "dsbd-chain-lookup-k5", "mcsd-lookup-k1", "none"
    ]  # fmt: skip
    assert {"mcsd", "dsbd", plan.DSBD_CHAIN} & set(status) == set()
    assert [e.settings[0].extra_args for e in engines[:2]] == [
        {"num_speculative_tokens": k, "max_nodes": k} for k in (3, 5)
    ]
    # a plain row alone brings no twin; "all" (with a draft) brings both
    _, engines = plan.plan(plan_args(draft="/d", methods=["mcsd", plan.DSBD_CHAIN]))
    assert not any((e.speculative_config or {}).get("lookup", "off") != "off" for e in engines)
    status, _ = plan.plan(plan_args(draft="/d"))
    assert status[plan.MCSD_LOOKUP].status == status[plan.DSBD_CHAIN_LOOKUP].status == "ok"
    status, _ = plan.plan(plan_args(methods=[plan.MCSD_LOOKUP]))
    assert status["mcsd"].status == "skipped" and plan.MCSD_LOOKUP not in status  # needs --draft


def test_plan_runs_aded_with_and_without_a_corpus():
    status, engines = plan.plan(plan_args(methods=["aded"]))
    assert plan.ADED_CORPUS not in status
    status, engines = plan.plan(plan_args(methods=["aded"], trigram="/m"))
    by_id = {e.id: e for e in engines}
    assert status[plan.ADED_CORPUS].status == "ok"
    assert "trigram" not in by_id["aded"].speculative_config
    corpus = by_id["aded-corpus"]
    assert corpus.method == plan.ADED_CORPUS and corpus.speculative_config["trigram"] == "/m"
    assert corpus.speculative_config["method"] == "aded" and corpus.settings == by_id["aded"].settings


def test_plan_runs_mcsd_settings_on_one_engine_and_the_stop_model_apart():
    from vllm_specbeam.methods.mcsd.drafter import McsdDrafter
    from vllm_specbeam.methods.mcsd.maths import level_sizes

    status, engines = plan.plan(plan_args(draft="/d", methods=["none", "mcsd"]))
    by_id = {e.id: e for e in engines}
    assert plan.MCSD_STOP not in status and set(by_id) == {"mcsd", "none"}
    config = by_id["mcsd"].speculative_config
    grid = plan.SWEEPS["quick"].mcsd
    assert config["max_nodes"] == max(sum(level_sizes(k, plan.MCSD_DEPTH)) for k in grid)
    # every setting is a valid request of that engine: with and without the stopping rule
    labels = [s.label for s in by_id["mcsd"].settings]
    assert labels == [f"k{','.join(map(str, k))}{tail}" for k in grid for tail in ("", "/no-stop")]
    for setting in by_id["mcsd"].settings:
        options = {name: option.default for name, option in McsdDrafter.OPTIONS.items()}
        McsdDrafter.check_options({**options, **config, **setting.extra_args})
    status, engines = plan.plan(plan_args(draft="/d", methods=["none", "mcsd"], stop_model="/s"))
    stop = {e.id: e for e in engines}["mcsd-stop"]
    assert stop.method == plan.MCSD_STOP and stop.speculative_config == {**config, "stop_model": "/s"}
    # the ablation on the stop model's own engine: each k_config with it and with no stopping at all
    assert [s.label for s in stop.settings] == [s.label for s in {e.id: e for e in engines}["mcsd"].settings]
    # named alone, the stop model's engine runs without the plain one
    status, engines = plan.plan(plan_args(draft="/d", methods=[plan.MCSD_STOP], stop_model="/s"))
    assert [e.id for e in engines] == ["mcsd-stop", "none"] and "mcsd" not in status


def test_plan_runs_mcsd_depths_as_settings_of_one_engine_sized_for_the_deepest():
    from vllm_specbeam.methods.mcsd.drafter import McsdDrafter

    _, engines = plan.plan(plan_args(draft="/d", methods=["none", "mcsd"], sweep="none", mcsd_depths=[6, 10]))
    engine = {e.id: e for e in engines}["mcsd"]
    assert engine.speculative_config["num_speculative_tokens"] == 10
    assert engine.speculative_config["max_nodes"] == 10  # the chain [1] at depth 10
    assert [s.label for s in engine.settings] == ["d6/k1", "d6/k1/no-stop", "d10/k1", "d10/k1/no-stop"]
    assert [s.extra_args["num_speculative_tokens"] for s in engine.settings] == [6, 6, 10, 10]
    for setting in engine.settings:
        options = {name: option.default for name, option in McsdDrafter.OPTIONS.items()}
        McsdDrafter.check_options({**options, **engine.speculative_config, **setting.extra_args})


def test_engine_rounds_alternate_and_pool_runs():
    """Engines restarted over rounds run in alternating order, the baseline last each time;
    their timed runs and counters pool, the first round's outputs stay and a difference shows."""
    a, b = plan.EngineSpec("a", "a", "plugin", {}, []), plan.EngineSpec("b", "b", "vllm", {}, [])
    none = plan.EngineSpec("none", "none", "baseline", None, [])
    order = [(r, e.id) for r, e in processes.engine_schedule([a, b, none], 3)]
    assert order == [(0, "a"), (0, "b"), (0, "none"), (1, "b"), (1, "a"), (1, "none"), (2, "a"), (2, "b"), (2, "none")]
    assert [e.id for _, e in processes.engine_schedule([a, b, none], 1)] == ["a", "b", "none"]

    def raw(walls: list[float], accepted: int, outputs: list[list[int]]) -> dict:
        run = records.RunRecord(0, 0, outputs, ["x"], walls, [100 * w for w in walls], [8] * len(walls))
        run.counters = {"accepted": accepted, "per_pos": [accepted, 1]}
        return {"runs": [asdict(run)]}

    merged = report.merge_rounds(raw([1.0, 2.0], 3, [[1, 2]]), raw([3.0], 4, [[1, 2]]))
    (run,) = merged["runs"]
    assert run["wall_s"] == [1.0, 2.0, 3.0] and run["output_tokens_runs"] == [8, 8, 8]
    assert run["started_s"] == [100.0, 200.0, 300.0]
    assert run["counters"] == {"accepted": 7, "per_pos": [7, 2]} and run["outputs"] == [[1, 2]]
    assert run["outputs_differ_between_rounds"] is False
    merged = report.merge_rounds(merged, raw([1.0], 0, [[1, 3]]))
    assert merged["runs"][0]["outputs_differ_between_rounds"] is True and merged["runs"][0]["outputs"] == [[1, 2]]


def test_engine_rounds_pool_each_engines_runs_and_the_baseline_scores_once(monkeypatch, tmp_path):
    """``--engine-rounds 2`` with a stand-in worker: every engine started twice, in
    alternating order, its timed runs and counters pooled; the baseline scores every
    output once, in the last round."""
    started: list[tuple[str, bool, int]] = []

    def run_worker(job: records.Job, log: Path, bar: object) -> processes.WorkerExit:
        started.append((job.name, job.score_outputs, len(job.score)))
        run = {"scenario": 0, "setting": 0, "wall_s": [2.0], "started_s": [0.0], "output_tokens_runs": [3]}
        run |= {"counters": {"accepted": 1}, "outputs": [[1, 2, 3]], "texts": ["x"]}
        scores = {"external": [[-1.0] * 3] * len(job.score), "own": [[[-1.0] * 3]], "margins": None}
        data = {"start_s": 1.0, "async_scheduling": False, "dtype": "float32", "runs": [run]}
        Path(job.result).write_text(json.dumps({**data, "scores": scores if job.score_outputs else None}))
        return processes.WorkerExit(0, 10.0)

    monkeypatch.setattr(offline, "run_worker", run_worker)
    engines = [
        plan.EngineSpec("lookup_tree", "lookup_tree", "plugin", {}, [plan.Setting("s", {})]),
        plan.EngineSpec("none", "none", "baseline", None, [plan.Setting("-", {})]),
    ]
    status = {e.method: plan.MethodStatus(e.kind) for e in engines}
    workload = offline.Workload("m", "float32", 64, 0, ["p"], 3, 1, [records.Scenario(1, 0.0)])
    comparison, runs = offline.compare(engines, status, workload, tmp_path, rounds=2)
    assert started == [("lookup_tree.r1", False, 0), ("none.r1", False, 0), ("lookup_tree.r2", False, 0)] + [
        ("none.r2", True, 1)
    ]
    assert {e: (r.rounds, r.start_s_rounds) for e, r in comparison.records.items()} == {
        "lookup_tree": (2, [1.0, 1.0]),
        "none": (2, [1.0, 1.0]),
    }
    tree = next(r for r in runs if r["method"] == "lookup_tree")
    assert tree["tokens_per_s_runs"] == [1.5, 1.5] and tree["counters"] == {"accepted": 2}
    assert tree["speedup"] == 1.0 and tree["exact_match"] == 1.0 and tree["mean_loglik_per_token"] == -1.0
    assert tree["outputs_differ_between_rounds"] is False


class FakeLLM:
    """vLLM's ``LLM`` as the benchmark worker calls it, without an engine: it records the
    requests it is given and the prefix-cache resets in ``events``; every output repeats
    its prompt's last token."""

    def __init__(self, events: list[tuple], **engine_args: object) -> None:
        self.events = events
        config = SimpleNamespace(
            scheduler_config=SimpleNamespace(async_scheduling=False), model_config=SimpleNamespace(dtype="float32")
        )
        self.llm_engine = SimpleNamespace(vllm_config=config, engine_core=SimpleNamespace(shutdown=lambda: None))

    def get_tokenizer(self) -> SimpleNamespace:
        return SimpleNamespace(encode=lambda text: [ord(c) for c in text], decode=lambda ids: str(ids))

    def generate(self, prompts: list[dict], params: object, use_tqdm: bool) -> list[SimpleNamespace]:
        self.events.append(("generate", [dict(p) for p in prompts]))
        each = params if isinstance(params, list) else [params] * len(prompts)
        outputs = [[p["prompt_token_ids"][-1]] * sp.max_tokens for p, sp in zip(prompts, each, strict=True)]
        # a scoring pass: every token at log-probability -0.5, a runner-up (token 0) at -2.0
        top2 = [{t: SimpleNamespace(logprob=-0.5), 0: SimpleNamespace(logprob=-2.0)} for t in range(256)]
        scored = [[None] + [top2[t] for t in p["prompt_token_ids"][1:]] for p in prompts]
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids)], prompt_logprobs=table)
            for ids, table in zip(outputs, scored, strict=True)
        ]

    def get_metrics(self) -> list:
        return []

    def collective_rpc(self, method: object) -> list[None]:
        return [None]  # no plugin runner: no drafter to empty, no tree counters

    def reset_prefix_cache(self) -> bool:
        self.events.append(("reset prefix cache",))
        return True


def test_cache_salt_reaches_every_request_the_worker_generates(monkeypatch, tmp_path):
    """``--cache-salt tenant -``: every scenario once per salt, and every request of a timed run
    carries its scenario's salt (an unsalted one no ``cache_salt`` at all), through the job file
    the parent writes and the worker loads, with a stand-in engine; every timed run starts on an
    emptied prefix cache (no salt per run keeps runs apart any more)."""
    import vllm

    args = compare.parse_args(["--cache-salt", "tenant", "-", "--batch-sizes", "1", "2", "--temperatures", "0"])
    assert compare.cache_salts(args) == ["tenant", None]
    salted, unsalted = [[records.Scenario(b, 0.0, salt) for b in (1, 2)] for salt in ("tenant", None)]
    assert compare.scenarios(args) == [salted[0], unsalted[0], salted[1], unsalted[1]]
    assert compare.cache_salts(compare.parse_args([])) == [None]  # the default: unsalted requests
    for wrong in (["a", "a"], [""]):
        with pytest.raises(SystemExit):
            compare.parse_args(["--cache-salt", *wrong])

    engine = plan.EngineSpec("lookup_tree", "lookup_tree", "plugin", {}, [plan.Setting("s", {}, {"max_nodes": 4})])
    workload = offline.Workload("m", "float32", 64, 0, ["ab", "cd", "ef"], 2, 1, compare.scenarios(args))
    job = offline.Comparison([engine], {}, workload, tmp_path).job(engine, "lookup_tree", scores=False)
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(asdict(job)))  # as processes.start_worker hands it over
    events: list[tuple] = []
    monkeypatch.setattr(vllm, "LLM", functools.partial(FakeLLM, events))
    worker.run_job(records.Job.load(job_file))

    warm_up, *timed = events
    assert warm_up[0] == "generate" and "cache_salt" not in warm_up[1][0]  # the warm-up text: unsalted
    runs = [list(group) for reset, group in itertools.groupby(timed, key=len) if reset != 1]
    assert [event[0] for event in timed if len(event) == 1] == ["reset prefix cache"] * 4
    assert timed[0] == ("reset prefix cache",) and len(runs) == 4
    for scenario, calls in zip(compare.scenarios(args), runs, strict=True):
        assert [len(requests) for _, requests in calls] == ([1, 1, 1] if scenario.batch_size == 1 else [2, 1])
        requests = [request for _, batch in calls for request in batch]
        assert [r["prompt_token_ids"] for r in requests] == [[ord(c) for c in text] for text in ("ab", "cd", "ef")]
        if scenario.cache_salt is None:
            assert all("cache_salt" not in r for r in requests)
        else:
            assert [r["cache_salt"] for r in requests] == ["tenant"] * 3
    assert len(json.loads(Path(job.result).read_text())["runs"]) == 4


class ThreadWorker:
    """An engine worker in a thread of the test's process, on :class:`FakeLLM`: what the
    parent uses of ``processes.RunningWorker``."""

    def __init__(self, job: records.Job) -> None:
        self.progress = Path(job.progress)
        self.thread = threading.Thread(target=worker.run_job, args=(job,))
        self.proc = SimpleNamespace(poll=lambda: None if self.thread.is_alive() else 0)
        self.thread.start()

    steps_done = processes.RunningWorker.steps_done

    def wait(self) -> processes.WorkerExit:
        self.thread.join()
        return processes.WorkerExit(0, 1.0)

    def stop(self) -> None:
        self.thread.join()


def test_interleaved_engines_take_turns_and_the_baseline_scores_at_the_end(monkeypatch, tmp_path):
    """``--interleave``: both engines alive together, their timed runs one at a time in turns
    (lookup_tree, none, then the other way round), never overlapping; the baseline scores every
    output afterwards. Workers in threads on a stand-in engine: the turns are the point."""
    import vllm

    monkeypatch.setattr(vllm, "LLM", functools.partial(FakeLLM, []))
    monkeypatch.setattr(processes, "start_worker", lambda job, log, bar: ThreadWorker(job))
    monkeypatch.setattr(processes, "INTERLEAVE_SETTLE_S", 0.01)
    engines = [
        plan.EngineSpec("lookup_tree", "lookup_tree", "plugin", {}, [plan.Setting("s", {})]),
        plan.EngineSpec("none", "none", "baseline", None, [plan.Setting("-", {})]),
    ]
    status = {e.method: plan.MethodStatus(e.kind) for e in engines}
    workload = offline.Workload("m", "float32", 64, 0, ["ab", "cd"], 3, 2, [records.Scenario(1, 0.0)])
    _, runs = offline.compare(engines, status, workload, tmp_path, interleave=True)
    by_method = {run["method"]: run for run in runs}
    spans = sorted(
        (start, start + wall, method)
        for method, run in by_method.items()
        for start, wall in zip(run["started_s_runs"], run["wall_s_runs"], strict=True)
    )
    assert [method for *_, method in spans] == ["lookup_tree", "none", "none", "lookup_tree"]
    assert all(end <= later for (_, end, _), (later, _, _) in itertools.pairwise(spans))
    tree, base = by_method["lookup_tree"], by_method["none"]
    assert tree["exact_match"] == 1.0 and tree["mean_loglik_per_token"] == base["mean_loglik_per_token"] == -0.5
    ratios = [a / b for a, b in zip(tree["tokens_per_s_runs"], base["tokens_per_s_runs"], strict=True)]
    assert tree["speedup_paired"] == pytest.approx(statistics.median(ratios)) and base["speedup_paired"] == 1.0


def test_salted_scenarios_are_compared_with_the_baseline_under_the_same_salt():
    """Rows of the same batch size with and without a salt: each its own scenario (its best
    setting, its baseline), the salt a table column only when some row has one."""
    runs = synthetic_runs()[:3]
    runs += [{**r, "cache_salt": "s", "tokens_per_s": 2 * r["tokens_per_s"]} for r in runs]
    report.mark_best(runs)
    assert [r["best"] for r in runs] == [True, False, True] * 2
    report.validate_result(synthetic_result(runs))
    table = read_markdown_table(tables.offline_table(runs))
    assert [(row["salt"], row["method"], row["tok/s (median)"]) for row in table] == [
        ("–", "none", "10.0"),
        ("–", "lookup_tree", "14.0"),
        ("s", "none", "20.0"),
        ("s", "lookup_tree", "28.0"),
    ]
    assert "salt" not in read_markdown_table(tables.offline_table(runs[:3]))[0]
    assert report.scenario_key(runs[0]) == (1, 0.0, None) and report.scenario_key(runs[3]) == (1, 0.0, "s")


def test_plan_runs_every_draft_model_engine_again_with_the_draft_vocabulary():
    args = dict(draft="/d", methods=["none", "draft_model", "dsbd-chain", "mcsd", "mjsd"])
    _, plain = plan.plan(plan_args(**args))
    status, engines = plan.plan(plan_args(**args, draft_vocab="/v"))
    by_id = {e.id: e for e in engines}
    drafting = [e for e in plain if e.kind == "plugin"]
    assert {e.method for e in drafting} == {"dsbd-chain", "mcsd", "mjsd"}
    for engine in drafting:
        twin = by_id[engine.id + "-vocab"]
        assert twin.method == engine.method + plan.VOCAB_SUFFIX and status[twin.method].engines == [twin.id]
        assert twin.speculative_config == {**engine.speculative_config, "draft_vocab": "/v"}
        assert twin.settings == engine.settings
    # vLLM's own methods and the baseline run once, without it
    assert len(engines) == len(plain) + len(drafting)
    assert all("draft_vocab" not in (e.speculative_config or {}) for e in plain)
    # "X+vocab" without "X": only the twin runs
    only = dict(args, methods=["draft_model", plan.MCSD_STOP + plan.VOCAB_SUFFIX], stop_model="/s")
    status, engines = plan.plan(plan_args(**only, draft_vocab="/v"))
    assert [e.id for e in engines] == ["draft_model-k3", "draft_model-k5", "mcsd-stop-vocab", "none"]
    assert plan.MCSD_STOP not in status and status[plan.MCSD_STOP + plan.VOCAB_SUFFIX].status == "ok"
    with pytest.raises(ValueError, match="need --draft-vocab"):
        plan.plan(plan_args(**only))
    for named in ("lookup_tree+vocab", "draft_model+vocab"):  # no plugin draft model: no twin to run
        with pytest.raises(ValueError, match="name the method without"):
            plan.plan(plan_args(**dict(args, methods=[named]), draft_vocab="/v"))


# ------------------------------------------------------------ end to end
def read_markdown_table(text: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in ``text``, as {column title: cell}."""
    lines = [line for line in text.split("\n\n")[0].splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    assert set("".join(cells[1])) == {"-"}, "the second line separates the header"
    return [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]


def test_stop_process_tree_ends_the_worker_and_its_engine_processes(tmp_path):
    """An interrupted benchmark must not leave vLLM's engine processes behind: a
    stand-in worker whose child ignores SIGTERM (killed after the timeout)."""
    import psutil

    child_pid = tmp_path / "child.pid"
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    worker = (
        f"import subprocess, sys, time, pathlib; c = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        f"pathlib.Path({str(child_pid)!r}).write_text(str(c.pid)); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", worker])
    for _ in range(200):
        if child_pid.exists() and child_pid.read_text():
            break
        time.sleep(0.05)
    tree = [psutil.Process(proc.pid), psutil.Process(int(child_pid.read_text()))]
    processes.stop_process_tree(proc.pid, timeout=2)  # reaps the worker, its direct child
    deadline = time.monotonic() + 10
    for process in tree:
        while time.monotonic() < deadline:
            try:
                if process.status() == psutil.STATUS_ZOMBIE:  # dead, not reaped by whoever adopted it
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"process {process.pid} outlived stop_process_tree")


def test_intel_openmp_preload_prepends_once_and_respects_off(monkeypatch, tmp_path):
    # A copy of the environment: ENV_DEFAULTS (a 2 GiB KV cache) must not leak
    # into the engines later tests start from this process.
    monkeypatch.setattr(processes.os, "environ", dict(processes.os.environ))
    library = tmp_path / "libiomp5.so"
    library.write_bytes(b"")
    monkeypatch.setattr(processes, "INTEL_OPENMP", library)
    monkeypatch.setattr(processes.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    processes.set_engine_environment("off")
    assert processes.os.environ["LD_PRELOAD"] == "libother.so"
    processes.set_engine_environment("auto")
    processes.set_engine_environment("auto")  # a second call does not add it twice
    assert processes.os.environ["LD_PRELOAD"] == f"{library} libother.so"
    monkeypatch.setenv("LD_PRELOAD", "/torch/lib/libgomp.so.1")
    processes.set_engine_environment("auto")  # vLLM refuses GNU and Intel OpenMP together
    assert processes.os.environ["LD_PRELOAD"] == "/torch/lib/libgomp.so.1"
    monkeypatch.setattr(processes.platform, "machine", lambda: "aarch64")
    monkeypatch.setenv("LD_PRELOAD", "")
    processes.set_engine_environment("auto")
    assert processes.os.environ["LD_PRELOAD"] == ""  # Intel OpenMP is x86 only
    assert processes.os.environ["VLLM_CPU_KVCACHE_SPACE"] == processes.ENV_DEFAULTS["VLLM_CPU_KVCACHE_SPACE"]


def test_dtype_auto_is_the_checkpoints_unless_the_cpu_lacks_bfloat16(monkeypatch, capsys):
    assert [script.parse_args([]).dtype for script in (compare, serve_bench, load_test)] == ["auto"] * 3
    monkeypatch.setattr(host.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(host, "engines_run_on_cpu", lambda: True)
    for flags in ({"avx512f", "avx512_bf16"}, {"amx_bf16", "amx_tile"}):
        monkeypatch.setattr(host, "cpu_flags", lambda flags=flags: flags)
        assert host.choose_dtype("auto") == host.DtypeChoice("auto", "auto")
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(host, "cpu_flags", lambda: {"avx2", "avx512f", "amx_tile"})  # AMX tiles, no bf16
    choice = host.choose_dtype("auto")
    assert choice.engine == "float32" and "no native bfloat16" in choice.fallback
    assert capsys.readouterr().out.startswith("--dtype auto: this x86_64 CPU has no native bfloat16")
    assert host.choose_dtype("bfloat16") == host.DtypeChoice("bfloat16", "bfloat16")  # asked for: kept
    monkeypatch.setattr(host, "engines_run_on_cpu", lambda: False)  # a GPU's engines: the host CPU is no matter
    assert host.choose_dtype("auto").engine == "auto"
    monkeypatch.setattr(host, "engines_run_on_cpu", lambda: True)
    monkeypatch.setattr(host.platform, "machine", lambda: "aarch64")
    assert host.choose_dtype("auto").engine == "float32"
    monkeypatch.setattr(host, "cpu_flags", lambda: {"asimd", "bf16"})
    assert host.choose_dtype("auto").engine == "auto"
    # the result records the flags
    monkeypatch.setattr(host, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert host.environment("m", None)["cpu_bf16"] == {
        "amx_bf16": False,
        "amx_tile": False,
        "avx512_bf16": True,
        "bf16": False,
    }


def test_cpu_flags_reads_proc_cpuinfo(monkeypatch, tmp_path):
    monkeypatch.setattr(host, "CPUINFO", tmp_path / "cpuinfo")
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert host.cpu_flags() == {"fpu", "avx512f", "avx512_bf16"}
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # aarch64
    assert host.cpu_flags() == {"fp", "asimd", "bf16"}
    (tmp_path / "cpuinfo").unlink()
    assert host.cpu_flags() == set()


def tiny_benchmark(tiny_model, tmp_path, *options: str) -> tuple[dict, Path]:
    """``compare.py`` with ``none`` and ``lookup_tree`` on the tiny model: 3 prompts,
    24 greedy tokens, float32, the defaults only; its validated result and output directory."""
    from conftest import make_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"tiny/{i}", "prompt": p}) + "\n" for i, p in enumerate(make_prompts(4)[1:]))
    )
    out = tmp_path / "out"
    command = [
        *(sys.executable, str(BENCH / "compare.py"), "--model", tiny_model, "--prompts", str(prompts)),
        *("--max-tokens", "24", "--temperatures", "0", "--methods", "none", "lookup_tree", "--sweep", "none"),
        *("--max-model-len", "512", "--dtype", "float32", "--out", str(out), *options),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    report.validate_result(result)
    return result, out


@pytest.mark.server  # compare.py's worker processes
def test_offline_benchmark_end_to_end(tiny_model, tmp_path):
    """none + lookup_tree on the tiny model, compiled as a benchmark runs them: two engines,
    greedy, batch sizes 1 and 2: the real pipe from the workers' engines to the JSON, table and
    plot. (Rounds: test_engine_rounds_pool_each_engines_runs_and_the_baseline_scores_once; turns:
    test_interleaved_engines_take_turns_and_the_baseline_scores_at_the_end.)"""
    result, out = tiny_benchmark(tiny_model, tmp_path, "--batch-sizes", "1", "2", "--repeats", "1")
    assert result["methods"]["lookup_tree"]["status"] == "ok"
    assert {e["id"]: (e["status"], e["rounds"]) for e in result["engines"]} == {
        "lookup_tree": ("ok", 1),
        "none": ("ok", 1),
    }
    # vLLM's own resolution, recorded: off for custom_class methods, and for every engine on CPU
    assert {e["id"]: e["async_scheduling"] for e in result["engines"]} == {"lookup_tree": False, "none": False}
    assert result["environment"]["vllm"].startswith("0.32")
    # the dtype asked for, given and resolved by vLLM (each engine's model config), the CPU's bf16 flags
    config = result["config"]
    assert (config["dtype"], config["engine_dtype"], config["dtype_resolved"]) == ("float32",) * 3
    assert config["dtype_fallback"] is None and config["near_tie"] == 0.5
    assert {e["id"]: e["dtype"] for e in result["engines"]} == {"lookup_tree": "float32", "none": "float32"}
    assert set(result["environment"]["cpu_bf16"]) == set(host.RECORDED_FLAGS)
    # nothing diverged: no float32 engine started for margins, nothing flagged
    assert result["clear_margin_divergences"] == [] and result["margin_engine"] is None
    runs = {(r["method"], r["batch_size"]): r for r in result["runs"]}
    assert set(runs) == {(m, b) for m in ("none", "lookup_tree") for b in (1, 2)}
    for batch in (1, 2):
        base, tree = runs[("none", batch)], runs[("lookup_tree", batch)]
        assert base["speedup"] == 1.0 and base["steps_per_output_token"] == 1.0
        assert tree["speedup"] == pytest.approx(tree["tokens_per_s"] / base["tokens_per_s"])
        # Lossless greedy: identical tokens, hence an identical score.
        assert tree["exact_match"] == 1.0 and tree["dtype"] == "float32"
        assert (tree["divergence"]["identical"], tree["divergence"]["points"]) == (3, [])
        assert tree["mean_loglik_per_token"] == pytest.approx(base["mean_loglik_per_token"], abs=1e-4)
        assert math.isfinite(base["mean_loglik_per_token"]) and base["mean_loglik_per_token"] < 0
        # the engine's counters reached the record: every step asked the controller, which verified
        # trees or rested the batch; which of the two is its call on the machine that runs the test
        # (a tiny model's plain step costs little beside a tree step's, and CI's CPU differs)
        counters = tree["counters"]
        assert counters["tree_steps"] > 0 and counters["tree_trees"] + counters["tree_steps_off"] > 0
        assert tree["counters"]["accepted"] == tree["counters"]["tree_accepted"] >= 0
        assert tree["steps_per_output_token"] <= 1
        assert tree["output_tokens"] == 3 * 24 and tree["peak_rss_mib"] > 100
        assert len(tree["tokens_per_s_runs"]) == len(base["tokens_per_s_runs"]) == 1
    # The table written, one row per method and batch size, the baseline first (its cells against
    # the JSON: test_assembled_rows_agree_with_their_table_and_the_schema)
    table = read_markdown_table((out / "table.md").read_text())
    assert [(row["batch"], row["method"]) for row in table] == [
        (str(b), m) for b in (1, 2) for m in ("none", "lookup_tree")
    ]
    assert [row["divergence"] for row in table] == ["identical 3/3"] * 4
    # greedy and lossless: the bar chart alone (every method's quality is the baseline's)
    assert result["artifacts"]["plots"] == [str(out / plots.BARS_PNG)]
    assert (out / plots.BARS_PNG).read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- replay
Batch = tuple[list[list[int]], list[list[int]]]


@pytest.fixture
def closed_batch() -> Batch:
    """Two requests of 24 tokens: one goes on repeating its prompt (lookup drafts it
    deep), one never repeats anything (nothing to draft)."""
    cycle = list(range(1, 9))
    return [cycle * 2, [50, 51, 52]], [cycle * 3, list(range(100, 124))]


def replay_lookup(closed_batch: Batch, policy: str, slope: float) -> replay.Replay:
    options = parse({"method": "lookup_tree"}).options
    drafter = METHODS["lookup_tree"].drafter_class()(options)
    return replay.replay(drafter, options, *closed_batch, policy, StepCost(0.050, slope))


@pytest.mark.parametrize("policy", ["none", "budget", "oracle"])
def test_replay_commits_every_answer_token_once(closed_batch: Batch, policy: str) -> None:
    result = replay_lookup(closed_batch, policy, slope=0.0025)
    tokens = sum(map(len, closed_batch[1]))
    assert result.rows == tokens + result.rejected  # every token took one row; the rest were rejected drafts
    assert result.seconds == pytest.approx(max(result.steps) * 0.050 + result.rows * 0.0025)
    assert result.steps[1] == 24  # nothing to draft for the request that never repeats
    if policy == "none":
        assert result.steps == [24, 24] and result.drafted_steps == 0
    if policy == "oracle":
        assert result.rejected == 0 and result.steps[0] <= 24 // 5 + 1  # 4 drafts and the target's token a step


def test_replay_budget_drafts_all_when_rows_are_free_and_none_when_dear(closed_batch: Batch) -> None:
    oracle = replay_lookup(closed_batch, "oracle", slope=0.0025)
    assert replay_lookup(closed_batch, "budget", slope=0.0).steps == oracle.steps  # the drafter's whole trees
    dear = replay_lookup(closed_batch, "budget", slope=1.0)  # a row costs 20 steps' intercepts
    assert dear.steps == [24, 24] and dear.rows == 48


def test_lossy_rows_are_the_joint_rule_and_dsbds_beams_not_its_chain():
    assert report.is_lossy("mjsd") and report.is_lossy("dsbd") and report.is_lossy("dsbd+vocab")
    assert not any(report.is_lossy(row) for row in ("mcsd", plan.DSBD_CHAIN, plan.DSBD_CHAIN_LOOKUP, "lookup_tree"))


def test_the_load_table_gives_each_servers_wave_time_against_none():
    from benchmarks.load import ServerReport, markdown

    none = ServerReport("none", {}, clean_wave_seconds=[10.0, 12.0, 11.0])
    tree = ServerReport("lookup_tree", {"method": "lookup_tree"}, clean_wave_seconds=[12.0, 11.5, 10.5])
    rows = {line.split("|")[1].strip(): line for line in markdown([none, tree]).splitlines()[2:]}
    assert rows["none"].rstrip(" |").endswith("11.00 | 1.000")
    assert rows["lookup_tree"].rstrip(" |").endswith(f"11.50 | {11.5 / 11.0:.3f}")


def test_servers_in_turns_are_each_put_against_none_of_the_same_turn():
    """The machine ran twice as fast in the second turn: each turn's ratio is 1.1, though the
    method's waves overall are no faster than none's (against none's median of all waves: 0.73, 1.40)."""
    turns = load_test.Turns({"none": [[20.0, 22.0], [10.0, 12.0]], "aded": [[23.0, 23.2], [12.0, 12.2]]})
    assert turns.ratios("aded") == pytest.approx([23.1 / 21.0, 12.1 / 11.0])
    rows = {line.split("|")[1].strip(): line for line in turns.markdown().splitlines()[2:]}
    assert rows["aded"].rstrip(" |").endswith(f"1.100, 1.100 | {1.1:.3f}")


def test_servers_take_every_place_of_a_turn_once_in_as_many_turns():
    names = ["none", "lookup_tree", "aded"]
    orders = [load_test.turn_order(names, turn) for turn in range(4)]
    assert orders[0] == names and orders[3] == names
    for place in range(len(names)):  # reversing every other turn would keep lookup_tree in the middle
        assert sorted(order[place] for order in orders[:3]) == sorted(names)


@pytest.mark.server
def test_the_off_path_benchmark_rests_the_batch_and_compares_it_with_none(tiny_model, tmp_path):
    """In its own process: the script's two engines are not the session's to manage."""
    out = tmp_path / "off"
    command = [sys.executable, str(BENCH / "off_path.py"), "--model", tiny_model, "--batch-size", "2"]
    command += ["--max-tokens", "24", "--rounds", "2", "--intel-openmp", "off", "--enforce-eager", "--dtype", "float32"]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "off_path.json").read_text())
    counts = result["counters"]
    # no node verified; the batch rests where the lookup found drafts (the dear line prices them out)
    assert counts["nodes"] == 0 and counts["steps_off"] > 0 and counts["steps_probed"] > 0
    assert len(result["throughput_ratios"]) == 2 and result["throughput_ratio_median"] > 0


def test_an_engine_records_json_leaves_out_what_no_round_reached():
    """An engine that failed before any round has no start figures; one that ran has no reason."""
    spec = SimpleNamespace(id="lookup_tree", method="lookup_tree", speculative_config={"method": "lookup_tree"})
    failed = records.EngineRecord(spec.id, spec.method, spec.speculative_config, {}, "log")
    failed.status, failed.reason = "failed", "worker exit code 1: boom"
    started = {"id", "method", "speculative_config", "engine_kwargs", "log", "peak_rss_mib", "status", "rounds"}
    assert set(failed.as_json()) == started | {"reason"}
    ran = engine_record(spec, peak_rss_mib=2.0, dtype="bfloat16")
    ran.finished({"start_s": 3.0, "async_scheduling": True, "dtype": "float32"})
    shown = ran.as_json()
    assert "reason" not in shown and shown["speculative_config"] == {"method": "lookup_tree"}
    assert (shown["rounds"], shown["start_s_rounds"], shown["start_s"], shown["dtype"]) == (
        2,
        [1.0, 3.0],
        1.0,
        "float32",
    )
