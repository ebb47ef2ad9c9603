"""The Markdown tables of a result's rows: ``(title, key, digits)`` columns over the rows'
fields (:class:`benchmarks.records.Row`) and the cells made here (``divergence_cell``,
``tokens_per_pass``). Standard library only: ``gpu_kernels.py`` uses :func:`markdown_table`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if digits else str(round(value))
    return str(value)


def _salt_order(run: Mapping[str, Any]) -> tuple[bool, str]:
    """Unsalted rows first, then by salt: a sort key."""
    salt = run.get("cache_salt")
    return salt is not None, salt or ""


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, int]]) -> str:
    """A Markdown table of ``rows`` (dicts) with ``(title, key, digits)`` columns."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(key), digits) for _, key, digits in columns) + " |")
    return "\n".join(lines) + "\n"


def with_salt_column(
    columns: Sequence[tuple[str, str, int]], rows: Sequence[Mapping[str, Any]]
) -> Sequence[tuple[str, str, int]]:
    """``columns`` with the requests' ``cache_salt`` after the temperature when some row has one."""
    if all(row.get("cache_salt") is None for row in rows):
        return columns
    at = next(i for i, (_, key, _) in enumerate(columns) if key == "temperature") + 1
    return (*columns[:at], ("salt", "cache_salt", 0), *columns[at:])


def cost_cell(costs: Mapping[str, float] | None, prefix: str) -> str | None:
    """A fitted line as ``"a + b/row"`` in milliseconds (``docs/budget.md``), e.g. ``"31.2 + 0.40/row"``."""
    if not costs or f"{prefix}_intercept_s" not in costs:
        return None
    return f"{1e3 * costs[f'{prefix}_intercept_s']:.1f} + {1e3 * costs[f'{prefix}_per_row_s']:.2f}/row"


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


def with_divergence_cells(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with their ``divergence`` field as a table cell (``divergence_cell``)."""
    return [{**row, "divergence_cell": divergence_cell(row.get("divergence"))} for row in rows]


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


def offline_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """One row per method and scenario: its best setting (the sweep stays in
    the JSON). Speedups are against ``none`` in the same scenario and run."""
    rows = sorted(
        (r for r in runs if r["best"]),
        key=lambda r: (r["temperature"], r["batch_size"], _salt_order(r), r["method"] != "none", -r["tokens_per_s"]),
    )
    return markdown_table(with_divergence_cells(rows), with_salt_column(OFFLINE_COLUMNS, rows))


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
