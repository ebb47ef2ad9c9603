"""The goodput controller's Prometheus metrics, beside vLLM's own on ``/metrics`` and ``LLM.get_metrics()``.

vLLM 0.32.0 keeps its metrics in the front end's process (the API server's, or the ``LLM``'s):
``PrometheusStatLogger`` (v1/metrics/loggers.py), built by ``StatLoggerManager`` in
v1/engine/async_llm.py and v1/engine/llm_engine.py, fed each step with the ``SchedulerStats``
(v1/metrics/stats.py) the engine core sends. ``/metrics`` serves that process's registry
(entrypoints/serve/instrumentator/metrics.py ``attach_router``: ``get_prometheus_registry()`` of
v1/metrics/prometheus.py, prometheus_client's ``REGISTRY`` unless ``PROMETHEUS_MULTIPROC_DIR`` is
set, which ``vllm serve`` does only for ``--api-server-count`` above 1, entrypoints/cli/serve.py);
``LLM.get_metrics()`` reads ``REGISTRY`` (v1/metrics/reader.py ``get_metrics_snapshot``). The
controller runs in the worker (the engine core's process, or a worker process of its own), and
what crosses from it to the front end, ``ModelRunnerOutput`` (v1/outputs.py) and
``SchedulerStats``, has no field for a plugin.

So the runner writes its counters and fitted lines into a small memory-mapped file after each
step (:class:`RunnerMetrics`; a few microseconds), named by the engine's
``VllmConfig.instance_id`` (config/vllm.py: set once where the config is made, in the front end,
and sent with it to the engine core), and the front end registers a collector that reads the file
at each scrape (:class:`ControllerCollector`), where vLLM builds its own metrics (patch 11,
:func:`with_controller_metrics`). Values are the runner's own, as exact as ``specbeam_stats``.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vllm_specbeam.adapter.engine_config import plugin_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_specbeam.adapter.tree_counts import TreeCounts
    from vllm_specbeam.core.budget import StepCost

#: runner counters (``TreeCounts`` fields) shown as Prometheus counters: field -> (name, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "steps": ("vllm:specbeam_steps", "Decode steps after which the goodput controller chose the next step's drafts."),
    "steps_off": (
        "vllm:specbeam_steps_off",
        "Of those, steps the whole batch rested: vLLM's plain decode step, nothing drafted or verified.",
    ),
    "steps_probed": ("vllm:specbeam_steps_probed", "Steps that drafted again after a rest (the controller's probes)."),
    "steps_draining": (
        "vllm:specbeam_steps_draining",
        "Steps of a batch no request had joined for a while (every priced method values its tokens by what they save).",
    ),
    "nodes": (
        "vllm:specbeam_nodes",
        "Draft-tree nodes verified; over vllm:specbeam_steps_total, the nodes chosen per step.",
    ),
}
#: the fitted cost lines by ``line`` label -> the runner stats' prefix (``tree_counts.cost_stats``):
#: the target's steps with branching trees, with chains alone, its plain steps, the in-worker draft's forwards
LINES: dict[str, str] = {"tree": "step_cost", "chain": "chain_cost", "plain": "plain_cost", "draft": "draft_cost"}
#: a line's parts in seconds (``part`` label) -> the ``StepCost`` field; each also has its knee in rows
PARTS: dict[str, str] = {"intercept": "intercept", "per_row": "slope", "bend": "bend"}
COST_NAME = "vllm:specbeam_step_cost_seconds"
KNEE_NAME = "vllm:specbeam_step_cost_knee_rows"
#: per line: the parts, then the knee
_PER_LINE = len(PARTS) + 1
_SLOTS = len(COUNTERS) + len(LINES) * _PER_LINE
_LABELS = ["model_name", "engine"]
#: the directory of :func:`share_directory`
DIRECTORY_ENV = "VLLM_SPECBEAM_METRICS_DIR"


def share_directory() -> None:
    """Make the directory the runners write in, once, in the process that configures a plugin engine (patch 1),
    before it starts the engine core: the engine core's and workers' processes inherit :data:`DIRECTORY_ENV`.
    This process removes it at exit, with what runners leave there: vLLM's worker processes end in
    ``os._exit`` (multiprocessing's, vLLM 0.32.0 v1/executor/multiproc_executor.py), where no clean-up runs.
    (vLLM's ``setup_multiprocess_prometheus``, v1/metrics/prometheus.py, shares its directory so too.)"""
    if DIRECTORY_ENV not in os.environ:
        directory = tempfile.mkdtemp(prefix="vllm-specbeam-metrics-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        os.environ[DIRECTORY_ENV] = directory


def metrics_path(directory: str, vllm_config: VllmConfig, engine: int) -> str:
    """The file engine ``engine``'s runner writes (``engine``: vLLM's data-parallel rank, its ``engine`` label)."""
    return os.path.join(directory, f"{vllm_config.instance_id}-engine{engine}")


def _as_values(counts: TreeCounts, lines: Mapping[str, StepCost | None]) -> list[float]:
    """The file's slots: the counters, then per line its parts and knee (NaN until it is fitted)."""
    values = [float(getattr(counts, field)) for field in COUNTERS]
    for prefix in LINES.values():
        cost = lines[prefix]
        if cost is None:
            values += [math.nan] * _PER_LINE
        else:
            values += [*(float(getattr(cost, field)) for field in PARTS.values()), float(cost.knee)]
    return values


class RunnerMetrics:
    """The runner's side: its engine's file, rewritten after each step; removed when the runner goes."""

    def __init__(self, path: str) -> None:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(descriptor, _SLOTS * 8)
            buffer = mmap.mmap(descriptor, _SLOTS * 8)
        finally:
            os.close(descriptor)
        self._values = np.frombuffer(buffer, np.float64)
        self._values[len(COUNTERS) :] = math.nan  # counters start at 0 (the file's zeros), lines unfitted
        weakref.finalize(self, _remove, path)

    @classmethod
    def for_runner(cls, vllm_config: VllmConfig) -> RunnerMetrics | None:
        """The first tensor-parallel rank's (every rank counts the same steps and shares rank 0's lines);
        ``None`` on the others (vLLM 0.32.0 vllm/distributed/parallel_state.py ``get_tp_group``), and where
        no front end shared a directory (an engine configured on another machine)."""
        from vllm.distributed.parallel_state import get_tp_group

        directory = os.environ.get(DIRECTORY_ENV)
        if directory is None or get_tp_group().rank_in_group != 0:
            return None
        return cls(metrics_path(directory, vllm_config, vllm_config.parallel_config.data_parallel_rank))

    def publish(self, counts: TreeCounts, lines: Mapping[str, StepCost | None]) -> None:
        """Write the counters and the lines (``lines`` keyed by :data:`LINES`' prefixes)."""
        self._values[:] = _as_values(counts, lines)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ControllerCollector:
    """The front end's side: a prometheus_client collector reading each engine's file when scraped.

    An engine whose runner has not written yet (or has gone) has no samples."""

    def __init__(self, model_name: str, paths: dict[int, str]) -> None:
        self.model_name = model_name
        self.paths = paths

    def collect(self) -> Iterator[Metric]:
        counters = {field: CounterMetricFamily(name, doc, labels=_LABELS) for field, (name, doc) in COUNTERS.items()}
        cost = GaugeMetricFamily(
            COST_NAME,
            "The goodput controller's fitted cost lines: seconds a step (intercept), a row "
            "(per_row) and a row past the knee more (bend).",
            labels=[*_LABELS, "line", "part"],
        )
        knee = GaugeMetricFamily(KNEE_NAME, "Rows past which a row costs the bend more.", labels=[*_LABELS, "line"])
        for engine, path in self.paths.items():
            values = _read(path)
            if values is None:
                continue
            labels = [self.model_name, str(engine)]
            for slot, family in enumerate(counters.values()):
                family.add_metric(labels, float(values[slot]))
            self._add_lines(cost, knee, labels, values[len(COUNTERS) :])
        yield from counters.values()
        yield from (cost, knee)

    @staticmethod
    def _add_lines(cost: GaugeMetricFamily, knee: GaugeMetricFamily, labels: list[str], values: np.ndarray) -> None:
        for index, line in enumerate(LINES):
            *parts, rows = values[index * _PER_LINE : (index + 1) * _PER_LINE]
            if math.isnan(rows):  # not fitted yet
                continue
            for part, seconds in zip(PARTS, parts):
                cost.add_metric([*labels, line, part], float(seconds))
            knee.add_metric([*labels, line], float(rows))


def _read(path: str) -> np.ndarray | None:
    try:
        values = np.fromfile(path, np.float64)
    except FileNotFoundError:
        return None
    return values if values.size == _SLOTS else None


#: the collector of the newest plugin engine's front end in this process
_shown: ControllerCollector | None = None


def show(collector: ControllerCollector | None) -> None:
    """Put ``collector`` in prometheus_client's ``REGISTRY`` in place of an earlier engine's, as each
    engine's ``PrometheusStatLogger`` replaces the earlier one's metrics (vLLM 0.32.0
    v1/metrics/prometheus.py ``unregister_vllm_metrics``); ``None``: an engine without a plugin method."""
    global _shown
    if _shown is not None:
        REGISTRY.unregister(_shown)
    _shown = collector
    if collector is not None:
        REGISTRY.register(collector)


def with_controller_metrics(stock: Callable[..., None]) -> Callable[..., None]:
    """Patch 11: ``PrometheusStatLogger.__init__`` (v1/metrics/loggers.py) also shows a plugin
    engine's controller metrics, labelled as vLLM labels its own (``model_name``, ``engine``)."""

    def init(self: Any, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        stock(self, vllm_config, engine_indexes)
        show(_collector_of(vllm_config, self.engine_indexes))

    return init


def _collector_of(vllm_config: VllmConfig, engines: list[int]) -> ControllerCollector | None:
    """The collector of a plugin engine's front end; ``None`` for other engines."""
    directory = os.environ.get(DIRECTORY_ENV)
    if directory is None or plugin_config(vllm_config) is None:
        return None
    paths = {engine: metrics_path(directory, vllm_config, engine) for engine in engines}
    return ControllerCollector(str(vllm_config.model_config.served_model_name), paths)
