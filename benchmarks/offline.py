"""The offline comparison's run: every planned engine through a worker process, one
after the other over ``rounds`` or all alive and taking turns (``interleave``), their
raw data pooled and scored, assembled into result rows (:func:`benchmarks.report.assemble`).

The no-speculation engine runs last and scores every output (log-likelihood under
the target), so no extra engine start is paid; a float32 no-speculation engine is
started afterwards only when some greedy output diverged and the baseline's pass
gave no float32 margins to judge it by.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import report
from benchmarks.divergence import Reference, complete_margins, margins_of
from benchmarks.plan import EngineSpec, MethodStatus
from benchmarks.processes import WorkerExit, atomic_write, engine_schedule, failure_line, run_interleaved, run_worker
from benchmarks.records import EngineRecord, Job, Scenario


@dataclass(frozen=True)
class Workload:
    """What every engine runs: the model in a dtype, the prompts and scenarios, timed ``repeats`` times."""

    model: str
    dtype: str
    max_model_len: int
    seed: int
    prompts: list[str]
    max_tokens: int
    repeats: int
    scenarios: list[Scenario]
    #: engine arguments of every engine, besides its own (``enforce_eager``)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def scenarios_of(self, engine: EngineSpec) -> list[Scenario]:
        return [s for s in self.scenarios if not engine.greedy_only or s.temperature == 0]


@dataclass
class Comparison:
    """One comparison's engines and what they gave: ``records`` per engine (the result's
    ``engines``), ``raw`` data per engine, the float32 margins along no speculation's outputs."""

    engines: list[EngineSpec]
    status: dict[str, MethodStatus]
    workload: Workload
    logs: Path
    records: dict[str, EngineRecord] = field(default_factory=dict)
    raw: dict[str, dict[str, Any]] = field(default_factory=dict)
    margins: dict[Reference, list[float]] = field(default_factory=dict)
    #: the float32 engine started for margins, if any
    margin_engine: dict[str, Any] | None = None

    @property
    def baseline(self) -> EngineSpec:
        return next(e for e in self.engines if e.kind == "baseline")

    def steps(self, rounds: int) -> int:
        """The progress bar's total: per engine start, warm-up and scoring besides its timed runs."""
        return rounds * sum(
            2 + len(e.settings) * len(self.workload.scenarios_of(e)) * self.workload.repeats for e in self.engines
        )

    def job(self, engine: EngineSpec, name: str, scores: bool) -> Job:
        w = self.workload
        return Job(
            name=name,
            model=w.model,
            dtype=w.dtype,
            max_model_len=w.max_model_len,
            seed=w.seed,
            speculative_config=engine.speculative_config,
            engine_kwargs={**w.engine_kwargs, **engine.engine_kwargs},
            prompts=w.prompts,
            max_tokens=w.max_tokens,
            repeats=w.repeats,
            scenarios=w.scenarios_of(engine),
            settings=engine.settings,
            result=str(self.logs / f"{name}.result.json"),
            progress=str(self.logs / f"{name}.progress"),
            score_outputs=scores,
        )

    def score_list(self) -> list[dict[str, Any]]:
        """Every other engine's outputs, for the baseline to score."""
        return [
            {"engine": other, "run": k, "prompt": i, "output": out_ids}
            for other, data in self.raw.items()
            if other != self.baseline.id
            for k, run in enumerate(data["runs"])
            for i, out_ids in enumerate(run["outputs"])
        ]

    def run_rounds(self, rounds: int, bar: tqdm) -> None:
        """Each engine to its end, one after the other, over ``rounds`` in alternating order;
        the baseline scores every output once, in the last round."""
        for round_index, engine in engine_schedule(self.engines, rounds):
            bar.set_postfix_str(f"{engine.id} (round {round_index + 1})" if rounds > 1 else engine.id)
            scores = engine.kind == "baseline" and round_index == rounds - 1
            name = engine.id if rounds == 1 else f"{engine.id}.r{round_index + 1}"
            job = self.job(engine, name, scores)
            if scores:
                job.score = self.score_list()
            self.collect(engine, job, run_worker(job, self.logs / f"{name}.log", bar))

    def run_interleaved(self, bar: tqdm) -> None:
        """Every engine alive, their timed runs in turns; the baseline scores at the end."""
        jobs = {e.id: self.job(e, e.id, scores=e.kind == "baseline") for e in self.engines}
        baseline = jobs[self.baseline.id]
        baseline.score_file = str(self.logs / "score.json")
        running = run_interleaved([jobs[e.id] for _, e in engine_schedule(self.engines, 1)], self.logs, bar)
        try:
            for engine in self.engines:  # the baseline last: it scores the others' outputs
                if engine is not self.baseline:
                    self.collect(engine, jobs[engine.id], running[engine.id].wait())
            baseline.score = self.score_list()
            atomic_write(Path(baseline.score_file), json.dumps(baseline.score))
            self.collect(self.baseline, baseline, running[baseline.name].wait())
        except BaseException:
            for worker in running.values():
                worker.stop()
            raise

    def collect(self, engine: EngineSpec, job: Job, ended: WorkerExit) -> None:
        """One finished worker's figures into ``records`` and ``raw``."""
        log = self.logs / f"{job.name}.log"
        record = self.records.setdefault(
            engine.id,
            EngineRecord(engine.id, engine.method, engine.speculative_config, job.engine_kwargs, str(log)),
        )
        record.peak_rss_mib = max(record.peak_rss_mib, ended.peak_rss_mib)
        if ended.code != 0:
            record.status, record.reason = "failed", f"worker exit code {ended.code}: {failure_line(log)}"
            self.status[engine.method].status, self.status[engine.method].reason = "failed", record.reason
            self.raw.pop(engine.id, None)
            tqdm.write(f"engine {job.name} failed: {record.reason}")
            if engine.kind == "baseline":
                raise SystemExit(f"the no-speculation engine failed; see {record.log}")
            return
        if record.status == "failed":
            return  # failed in an earlier round: its figures stay out
        data = json.loads(Path(job.result).read_text())
        data["scenarios"] = job.scenarios
        record.finished(data)
        self.raw[engine.id] = data if engine.id not in self.raw else report.merge_rounds(self.raw[engine.id], data)
        if job.score_outputs:
            report.attach_scores(self.raw, job.score, self.raw[engine.id], data)
            # keyed by the outputs this round scored (the first round's are the ones compared)
            own = [(i, out) for run in data["runs"] for i, out in enumerate(run["outputs"])]
            along = data["scores"]["margins"]
            self.margins.update(margins_of(own, None if along is None else itertools.chain.from_iterable(along)))

    def float32_margins(self, missing: list[Reference]) -> dict[Reference, list[float]]:
        """Margins along the ``missing`` no-speculation outputs from a float32
        no-speculation engine started for them alone (no timed runs): the
        baseline's dtype was not float32, or its scored round's outputs differed."""
        name = "none-float32-margins"
        job = replace(self.job(self.baseline, name, scores=True), dtype="float32", repeats=0, scenarios=[])
        job.score = [{"prompt": prompt, "output": list(output)} for prompt, output in missing]
        job.margins_along = "external"
        log = self.logs / f"{name}.log"
        tqdm.write(f"{len(missing)} no-speculation output(s) diverged from: scoring their margins in float32")
        with tqdm(total=2, desc="float32 margins", unit="step") as margin_bar:
            ended = run_worker(job, log, margin_bar)
        self.margin_engine = {
            "id": name,
            "dtype": "float32",
            "log": str(log),
            "peak_rss_mib": ended.peak_rss_mib,
            "status": "ok",
        }
        if ended.code != 0:
            self.margin_engine.update(status="failed", reason=f"worker exit code {ended.code}: {failure_line(log)}")
            tqdm.write(
                f"the float32 margin engine failed ({self.margin_engine['reason']}): divergences without margins"
            )
            return {}
        scored = json.loads(Path(job.result).read_text())
        self.margin_engine["start_s"] = scored["start_s"]
        return margins_of(missing, scored["scores"]["margins"])


def compare(
    engines: list[EngineSpec],
    status: dict[str, MethodStatus],
    workload: Workload,
    logs: Path,
    rounds: int = 1,
    interleave: bool = False,
    near_tie: float = 0.5,
) -> tuple[Comparison, list[dict[str, Any]]]:
    """Run every engine (``status`` records the ones that failed); the comparison and its rows."""
    comparison = Comparison(engines, status, workload, logs)
    with tqdm(total=comparison.steps(rounds), desc="benchmark", unit="step") as bar:
        if interleave:
            comparison.run_interleaved(bar)
        else:
            comparison.run_rounds(rounds, bar)
    records = [comparison.records[e.id] for e in engines if e.id in comparison.records]
    runs = report.assemble(
        engines,
        records,
        comparison.raw,
        lambda needed: complete_margins(comparison.margins, needed, comparison.float32_margins),
        near_tie,
    )
    return comparison, runs
