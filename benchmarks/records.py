"""The records the worker and the report share: what a worker runs (:class:`Job`), what it
measured (:class:`RunRecord`, one per setting x scenario, in a :class:`WorkerResult`), the
counters it read, and a result row (:class:`Row`), from which the result's JSON schema comes.

The plugin runner's counters are its :class:`TreeCounts`, under ``tree_`` in a run's
``counters``: the worker writes the dataclass's fields and the report reads them back as a
``TreeCounts``, so a renamed field fails where the report reads it, not as a silent ``None``.
No vLLM import.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.plan import Setting
from vllm_specbeam.adapter.tree_counts import TreeCounts

#: vLLM's speculative-decoding counters (``LLM.get_metrics()``), by their key in a run's counters.
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
#: the prefix of the plugin runner's counters (:class:`TreeCounts`, its cross-request index's) in a run's counters
TREE_PREFIX = "tree_"
#: the prefix of the speculative beam search's counters (:class:`BeamCounts`)
BEAM_PREFIX = "beam_"


@dataclass(frozen=True)
class Scenario:
    batch_size: int
    temperature: float
    #: every request's ``cache_salt`` (``compare.py --cache-salt``; None: unsalted requests): vLLM's
    #: prefix-cache salt, by which the plugin's cross-request index is partitioned (issue #60)
    cache_salt: str | None = None


@dataclass
class Job:
    """What one worker runs, and where it reports (paths the parent reads)."""

    name: str
    model: str
    dtype: str
    max_model_len: int
    seed: int
    speculative_config: dict[str, Any] | None
    engine_kwargs: dict[str, Any]
    prompts: list[str]
    max_tokens: int
    repeats: int
    scenarios: list[Scenario]
    settings: list[Setting]
    #: the raw data (JSON) and the steps done so far (a count, for progress and turns)
    result: str
    progress: str
    #: whether this (no-speculation) engine scores outputs after its timed runs
    score_outputs: bool = False
    #: the divergence reports' contexts: the margins along its ``own`` outputs or the ``external`` ones
    margins_along: str = "own"
    #: other engines' outputs to score: {"engine", "run", "prompt", "output"} each
    score: list[dict[str, Any]] = field(default_factory=list)
    #: ``--interleave``: the file whose content says whose turn it is, and where ``score`` comes at the end
    turn: str | None = None
    score_file: str | None = None

    @property
    def timed_runs(self) -> int:
        return self.repeats * len(self.scenarios) * len(self.settings)

    @classmethod
    def load(cls, path: Path) -> Job:
        data = json.loads(path.read_text())
        data["scenarios"] = [Scenario(**s) for s in data["scenarios"]]
        data["settings"] = [Setting(**s) for s in data["settings"]]
        return cls(**data)


def add_counters(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``total + more`` key by key (a key new in ``more`` counts from zero); scalars,
    or per-position lists of any length."""

    def add(old: Any, value: Any) -> Any:
        if isinstance(value, list):
            old = old + [0] * (len(value) - len(old))
            return [a + b for a, b in zip(old, value)]
        return old + value

    return {key: add(total.get(key, [] if isinstance(value, list) else 0), value) for key, value in more.items()}


def tree_counts(counters: Mapping[str, Any]) -> TreeCounts | None:
    """The plugin runner's counters of a run, typed (``None``: vLLM's own runner ran it)."""
    if not any(key.startswith(TREE_PREFIX) for key in counters):
        return None
    return TreeCounts(**{f.name: counters[TREE_PREFIX + f.name] for f in dataclasses.fields(TreeCounts)})


@dataclass(frozen=True)
class BeamCounts:
    """The speculative beam search's counters of a run (``SpeculativeBeamSearch.stats``, summed over
    its searches): target passes (``rounds``), tokens appended per beam (``steps``), drafting time,
    rows the target scored, rounds shared by prompts, and draft depths drafted."""

    rounds: int
    steps: int
    draft_seconds: float
    scored_rows: int
    shared_rounds: int
    drafted_depths: int

    def as_counters(self) -> dict[str, Any]:
        return {BEAM_PREFIX + key: value for key, value in dataclasses.asdict(self).items()}

    @classmethod
    def of(cls, counters: Mapping[str, Any]) -> BeamCounts | None:
        """A run's, from its counters (``None``: no speculative beam search ran)."""
        if BEAM_PREFIX + "rounds" not in counters:
            return None
        return cls(**{f.name: counters[BEAM_PREFIX + f.name] for f in dataclasses.fields(cls)})


@dataclass
class RunRecord:
    """One setting x scenario of an engine, over its repeats (and engine rounds): the worker's
    measurements, and the baseline's scores of its outputs once the parent attached them."""

    scenario: int
    setting: int
    #: the first repeat's outputs (token ids) and their texts, one per prompt
    outputs: list[list[int]]
    texts: list[str]
    wall_s: list[float] = field(default_factory=list)
    started_s: list[float] = field(default_factory=list)
    output_tokens_runs: list[int] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    #: the drafter's cross-request memory and the fitted cost lines after the last repeat
    drafter_state_bytes: int | None = None
    step_cost: dict[str, float] | None = None
    outputs_differ_between_rounds: bool = False
    #: per prompt, the target's log-probability of each output token (from the baseline's scoring)
    logliks: list[list[float]] = field(default_factory=list)

    def add_repeat(self, wall: float, started: float, output_tokens: int, counters: dict[str, Any]) -> None:
        """One more timed repeat of the same setting and scenario."""
        self.wall_s.append(wall)
        self.started_s.append(started)
        self.output_tokens_runs.append(output_tokens)
        self.counters = add_counters(self.counters, counters)

    def merge_round(self, later: RunRecord) -> None:
        """A later engine round's repeats and counters pooled into this one; its outputs kept
        (``outputs_differ_between_rounds`` says whether the later one's differed)."""
        self.wall_s += later.wall_s
        self.started_s += later.started_s
        self.output_tokens_runs += later.output_tokens_runs
        self.counters = add_counters(self.counters, later.counters)
        self.drafter_state_bytes, self.step_cost = later.drafter_state_bytes, later.step_cost
        self.outputs_differ_between_rounds |= self.outputs != later.outputs


@dataclass
class EngineRecord:
    """One engine across its rounds (the result's ``engines``): how it was started, its peak
    memory, whether every round ran, the first round's start time and the settings vLLM resolved."""

    id: str
    method: str
    speculative_config: dict[str, Any] | None
    engine_kwargs: dict[str, Any]
    log: str
    peak_rss_mib: float = 0.0
    status: str = "ok"
    rounds: int = 0
    reason: str | None = None
    start_s_rounds: list[float] = field(default_factory=list)

    #: the first round's start time, and what vLLM resolved (``None`` until a round finished)
    start_s: float | None = None
    async_scheduling: bool | None = None
    dtype: str | None = None

    def finished(self, worker_json: Mapping[str, Any]) -> None:
        """A finished round's figures (the worker's :class:`WorkerResult` JSON)."""
        self.rounds += 1
        self.start_s_rounds.append(worker_json["start_s"])
        self.start_s = self.start_s_rounds[0]
        self.async_scheduling, self.dtype = worker_json["async_scheduling"], worker_json["dtype"]

    def as_json(self) -> dict[str, Any]:
        """The record's JSON: what no round reached (a reason while ok, figures before a round) left out."""
        unset = {"reason": None, "start_s_rounds": [], "start_s": None, "async_scheduling": None, "dtype": None}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in unset or v != unset[k]}


@dataclass
class WorkerResult:
    """What a worker writes: its engine's start time and resolved settings, its runs, and (the
    baseline's) scores: ``external`` and ``own`` log-probabilities, ``margins`` along one of them."""

    start_s: float
    async_scheduling: bool
    dtype: str
    runs: list[RunRecord]
    scores: dict[str, Any] | None = None


def _schema(annotation: str) -> dict[str, Any]:
    """A field's JSON schema from its annotation (``float | None``: a number or null)."""
    kinds = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "dict": "object", "list": "array"}
    types = [kinds[part.strip().split("[")[0]] if part.strip() != "None" else "null" for part in annotation.split("|")]
    return {"type": types[0] if len(types) == 1 else types}


def _meta(schema: dict[str, Any] | None = None, required: bool = False, omit_none: bool = False) -> dict[str, Any]:
    """A :class:`Row` field's metadata: ``required`` in the schema, with ``schema`` beside its
    type's; ``omit_none``: left out of the row's JSON while ``None``."""
    return {"required": required, "schema": schema or {}, "omit_none": omit_none}


REQUIRED = _meta(required=True)
DIVERGENCE_KEYS = ["compared", "identical", "diverged", "points", "max_margin", "near_tie", "clear_margin"]


@dataclass
class Row:
    """One row of the result: a method's setting in one scenario, its figures from the runs'
    records (``report.assemble``); its fields are the JSON schema's ``runs`` items."""

    method: str = field(metadata=REQUIRED)
    setting: dict[str, Any] = field(metadata=REQUIRED)
    setting_label: str = field(metadata=REQUIRED)
    batch_size: int = field(metadata=_meta({"minimum": 1}, required=True))
    temperature: float = field(metadata=_meta({"minimum": 0}, required=True))
    engine: str = field(metadata=REQUIRED)
    tokens_per_s: float = field(metadata=_meta({"exclusiveMinimum": 0}, required=True))
    tokens_per_s_runs: list[float] = field(metadata=_meta({"items": {"type": "number"}, "minItems": 1}, required=True))
    output_tokens: int = field(metadata=_meta({"minimum": 0}, required=True))
    requests: int = field(metadata=_meta({"minimum": 1}, required=True))
    accepted_per_step: float | None = field(metadata=REQUIRED)
    acceptance_rate: float | None = field(metadata=REQUIRED)
    steps_per_output_token: float | None = field(metadata=REQUIRED)
    draft_time_share: float | None = field(metadata=REQUIRED)
    peak_rss_mib: float | None = field(metadata=REQUIRED)
    mean_loglik_per_token: float | None = field(metadata=REQUIRED)
    counters: dict[str, Any] = field(metadata=REQUIRED)
    #: set once the rows are compared (:func:`benchmarks.report.assemble`), checked, and marked best
    speedup: float | None = field(default=None, metadata=REQUIRED)
    exact_match: float | None = field(default=None, metadata=REQUIRED)
    pass_rate: float | None = field(default=None, metadata=REQUIRED)
    best: bool = field(default=False, metadata=REQUIRED)
    #: set for beam searches only (mjsd's "beam_width" option is not one)
    beam_width: int | None = None
    cache_salt: str | None = None
    wall_s_runs: list[float] = field(default_factory=list)
    started_s_runs: list[float] = field(default_factory=list)
    #: run k against the baseline's run k (with --interleave they ran next to each other)
    speedup_paired: float | None = None
    #: beam searches: against vLLM's beam search at the same width (absent: none ran at that width)
    speedup_vs_beam_search: float | None = field(default=None, metadata=_meta(omit_none=True))
    mean_width: float | None = None
    mean_depth: float | None = None
    nodes_per_tree: float | None = None
    step_cost: dict[str, Any] | None = None
    steps_off_share: float | None = None
    nodes_per_step: float | None = None
    target_cost_cell: str | None = None
    chain_cost_cell: str | None = None
    plain_cost_cell: str | None = None
    draft_cost_cell: str | None = None
    draft_forwards_per_token: float | None = None
    off_argmax_per_token: float | None = None
    drafter_state_bytes: int | None = field(default=None, metadata=_meta({"minimum": 0}))
    outputs_differ_between_rounds: bool = False
    divergence: dict[str, Any] | None = field(default=None, metadata=_meta({"required": DIVERGENCE_KEYS}))
    dtype: str | None = None
    outputs: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    @property
    def scenario(self) -> tuple[int, float, str | None]:
        """Its scenario, as ``report.scenario_key`` gives a row's in the JSON."""
        return self.batch_size, self.temperature, self.cache_salt

    def as_json(self) -> dict[str, Any]:
        """The row as the result's ``runs`` hold it (an unset ``omit_none`` field left out)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not (f.metadata.get("omit_none") and getattr(self, f.name) is None)
        }

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        fields = dataclasses.fields(cls)
        return {
            "type": "object",
            "required": [f.name for f in fields if f.metadata.get("required")],
            "properties": {f.name: {**_schema(str(f.type)), **f.metadata.get("schema", {})} for f in fields},
        }
