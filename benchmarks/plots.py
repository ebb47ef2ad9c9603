"""The plots of a result's rows: greedy rows as bars of their speedup over no speculation
(``speedup.png``), vLLM's methods beside the plugin's; speed against quality
(``speedup_vs_quality.png``) only for the rows whose output may differ in quality (sampling,
lossy methods, beams).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.plan import SPEC_BEAM
from benchmarks.report import is_lossy, scenario_key

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


def pyplot() -> Any:
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
    plt = pyplot()
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
    plt = pyplot()

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
