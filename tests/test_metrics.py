"""The goodput controller's Prometheus metrics (``adapter/metrics.py``).

A runner's step writes its counters and fitted lines for the front end; the
front end's collector shows them as ``vllm:specbeam_*`` metrics equal to the
runner's own stats: here through a stub runner's step, and through an engine
core of its own process (``LLM.get_metrics()``); test_server.py compares a
server's ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from conftest import greedy, runner_stats
from specs import LOOKUP_AUTO

from vllm_specbeam.adapter.metrics import (
    COST_NAME,
    COUNTERS,
    KNEE_NAME,
    LINES,
    PARTS,
    ControllerCollector,
    RunnerMetrics,
)
from vllm_specbeam.adapter.runner import tree_runner_class
from vllm_specbeam.adapter.tree_counts import TreeCounts, cost_stats
from vllm_specbeam.core.budget import StepCost

#: a metric's name and its labels other than vLLM's (``model_name``, ``engine``)
Key = tuple[str, tuple[tuple[str, str], ...]]
VLLM_LABELS = {"model_name", "engine"}


def expected_metrics(stats: dict[str, Any]) -> dict[Key, float]:
    """The ``vllm:specbeam_*`` samples a runner's stats (``tree_stats``) should show."""
    expected: dict[Key, float] = {(name, ()): stats[field] for field, (name, _) in COUNTERS.items()}
    for line, prefix in LINES.items():
        if f"{prefix}_intercept_s" in stats:  # fitted
            for part in PARTS:
                expected[COST_NAME, (("line", line), ("part", part))] = stats[f"{prefix}_{part}_s"]
            expected[KNEE_NAME, (("line", line),)] = stats[f"{prefix}_knee_rows"]
    return expected


def specbeam_samples(samples: Iterable[tuple[str, dict[str, str], float]], model: str) -> dict[Key, float]:
    """``(name, labels, value)`` samples of ``vllm:specbeam_*`` metrics (counters named without
    ``_total``), by :data:`Key`; each labelled with ``model`` and engine 0."""
    found: dict[Key, float] = {}
    for name, labels, value in samples:
        if name.startswith("vllm:specbeam_"):
            assert (labels["model_name"], labels["engine"]) == (model, "0"), labels
            found[name, tuple(sorted((k, v) for k, v in labels.items() if k not in VLLM_LABELS))] = value
    return found


def page_samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """A ``/metrics`` page's samples, named by their metric (a counter without ``_total``)."""
    from prometheus_client.parser import text_string_to_metric_families

    return ((family.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples)


class _StubRunner:
    """vLLM's runner as the mixin's ``sample_tokens`` calls it: a step that counts one node."""

    def sample_tokens(self, *args: Any, **kwargs: Any) -> str:
        self.tree_counts.steps += 1  # type: ignore[attr-defined]
        self.tree_counts.nodes += 3  # type: ignore[attr-defined]
        return "output"


def test_a_step_shows_its_counts_and_fitted_lines(tmp_path):
    """The runner's step (its ``sample_tokens``) writes what the collector shows; an unfitted line has no samples."""
    path = str(tmp_path / "engine0.metrics")
    runner: Any = object.__new__(tree_runner_class(_StubRunner))
    runner.execute_model_state, runner.draft_runtime, runner.budget = object(), None, None
    runner.tree_counts = TreeCounts(steps=4, steps_off=2, steps_probed=1, nodes=20)
    runner.draft_cost = StepCost(0.004, 0.0005, knee=6.0, bend=0.001)
    runner.metrics = RunnerMetrics(path)
    collector = ControllerCollector("tiny", {0: path, 1: str(tmp_path / "absent")})
    assert all(value == 0 for value in collected(collector).values())  # nothing counted before the first step

    assert runner.sample_tokens() == "output"
    shown = collected(collector)
    assert shown == expected_metrics({**runner.tree_counts.as_dict(), **cost_stats("draft_cost", runner.draft_cost)})
    assert shown["vllm:specbeam_steps", ()] == 5 and shown["vllm:specbeam_nodes", ()] == 23
    assert shown[COST_NAME, (("line", "draft"), ("part", "per_row"))] == 0.0005
    assert not any(labels and labels[0] == ("line", "tree") for _, labels in shown)


def collected(collector: ControllerCollector) -> dict[Key, float]:
    return specbeam_samples(
        ((family.name, sample.labels, sample.value) for family in collector.collect() for sample in family.samples),
        "tiny",
    )


def test_engine_of_its_own_process_shows_the_runners_counts(engines, prompts):
    """``LLM.get_metrics()`` in this process shows what the runner counted in the engine core's
    process. Started anew: the registry shows the newest engine's metrics only."""
    engines.stop(LOOKUP_AUTO, own_process=True)
    llm = engines.get(LOOKUP_AUTO, own_process=True)
    try:
        llm.generate(prompts, greedy(), use_tqdm=False)
        stats = runner_stats(llm)
        metrics = [m for m in llm.get_metrics() if m.name.startswith("vllm:specbeam_")]
        shown = specbeam_samples(
            ((m.name, m.labels, m.value) for m in metrics), llm.llm_engine.model_config.served_model_name
        )
        assert runner_stats(llm) == stats, "the runner stepped between the reads"
    finally:
        engines.stop(LOOKUP_AUTO, own_process=True)
    assert stats["steps"] > 0 and stats["nodes"] > 0 and "step_cost_intercept_s" in stats
    assert shown == expected_metrics(stats)
