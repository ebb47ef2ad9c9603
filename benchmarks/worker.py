"""The engine worker: one engine, in a process of its own, through every setting x
scenario x repeat of its :class:`Job`; it writes the raw measurements (timings,
counter deltas, token ids) as JSON for the parent to assemble.

    python -m benchmarks.worker JOB.json      (started by benchmarks.processes.start_worker)

The no-speculation engine also scores outputs: log-probabilities under the
target and, in float32, the top-2 margins the divergence reports need.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.divergence import Reference, continuation_margins
from benchmarks.figures import continuation_logprobs, counter_delta
from benchmarks.plan import Setting
from benchmarks.processes import ENV_DEFAULTS, wait_for
from benchmarks.records import SPEC_COUNTERS, TREE_PREFIX, BeamCounts, Job, RunRecord, Scenario, WorkerResult
from vllm_specbeam.adapter.tree_counts import TreeCounts

WARM_UP_TEXT = "A short sentence to warm the engine up."
#: the runner's stats that are fitted lines, not counters (``TreeRunnerMixin.tree_stats``)
COST_PREFIXES = ("step_cost_", "chain_cost_", "plain_cost_", "draft_cost_")


def run_job(job: Job) -> None:
    """Run the job's engine through every setting x scenario x repeat; write its raw data."""
    engine = Engine.start(job)
    records = engine.timed_runs()
    if job.score_outputs and job.score_file:  # --interleave: the others' outputs come at their end
        job.score = json.loads(wait_for(Path(job.score_file)))
    llm = engine.llm
    scores = score(llm, engine.prompt_ids, job.score, records, job.margins_along) if job.score_outputs else None
    engine.tick()
    # as vLLM resolved it: never for custom_class methods (the plugin's), never on CPU (its platform)
    async_scheduling = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    result = WorkerResult(engine.start_s, async_scheduling, resolved_dtype(llm), records, scores)
    Path(job.result).write_text(json.dumps(asdict(result)))
    llm.llm_engine.engine_core.shutdown()


@dataclass
class Engine:
    """A worker's engine, started and warm, with what it read of the plugin runner after the
    last run (the drafter's cross-request memory, the fitted costs: not counters)."""

    llm: Any
    job: Job
    tokenizer: Any
    prompt_ids: list[list[int]]
    start_s: float
    steps_done: int = 0
    state_bytes: int | None = None
    step_cost: dict[str, float] = field(default_factory=dict)
    searches: dict[int | None, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, job: Job) -> Engine:
        """The job's engine, started and warmed up; its start time recorded."""
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        started = time.perf_counter()
        llm = LLM(
            model=job.model,
            dtype=job.dtype,
            max_model_len=job.max_model_len,
            seed=job.seed,
            speculative_config=job.speculative_config,
            disable_log_stats=False,
            **job.engine_kwargs,
        )
        start_s = time.perf_counter() - started
        tokenizer = llm.get_tokenizer()
        engine = cls(llm, job, tokenizer, [tokenizer.encode(text) for text in job.prompts], start_s)
        # Warm-up on a text outside the workload: methods that remember earlier requests
        # (suffix, lookup_tree's global scope) must not have seen a prompt before it runs
        # (nor, by _forget_finished, the outputs of an earlier run of the same prompts).
        warm_up = TokensPrompt(prompt_token_ids=tokenizer.encode(WARM_UP_TEXT))
        llm.generate([warm_up], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        engine.tick()  # started and warm (--interleave hands out turns after every engine's first step)
        return engine

    def tick(self) -> None:
        """One more step done, in the progress file the parent reads."""
        self.steps_done += 1
        Path(self.job.progress).write_text(str(self.steps_done))

    def timed_runs(self) -> list[RunRecord]:
        """Every setting x scenario x repeat, repeats outermost (drift on a shared machine
        hits every setting alike); one record per setting and scenario."""
        records: dict[tuple[int, int], RunRecord] = {}
        job = self.job
        runs = itertools.product(range(job.repeats), enumerate(job.scenarios), enumerate(job.settings))
        for turn, (_, (scenario_index, scenario), (setting_index, setting)) in enumerate(runs):
            fresh_start(self.llm)
            before = self.counters()
            if job.turn:
                wait_for(Path(job.turn), f"{job.name} {turn}")
            started_at = time.time()
            t0 = time.perf_counter()
            outputs = self.generate(setting, scenario)
            wall = time.perf_counter() - t0
            delta = counter_delta(before, self.counters())
            texts = [self.tokenizer.decode(ids) for ids in outputs]
            record = records.setdefault(
                (scenario_index, setting_index), RunRecord(scenario_index, setting_index, outputs, texts)
            )
            record.add_repeat(wall, started_at, sum(map(len, outputs)), delta)
            record.drafter_state_bytes, record.step_cost = self.state_bytes, dict(self.step_cost)
            self.tick()
        return list(records.values())

    def counters(self) -> dict[str, Any]:
        """vLLM's spec-decode counters, the plugin runner's and the speculative beam search's."""
        snapshot = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in self.llm.get_metrics()}
        values = {key: snapshot[name] for key, name in SPEC_COUNTERS.items() if name in snapshot}
        stats = self.llm.collective_rpc(_read_tree_stats)[0]
        if stats is not None:
            from vllm_specbeam.adapter.tree_counts import STATE_BYTES

            self.state_bytes = stats.pop(STATE_BYTES)
            counters, costs = tree_counters(stats)
            self.step_cost.update(costs)
            values.update(counters)
        searches = [self.speculative_search(d) for d in {s.beam_depth for s in self.job.settings if s.speculative}]
        if searches:
            values.update(beam_counts(searches).as_counters())
        return values

    def speculative_search(self, depth: int | None) -> Any:
        """The plugin's speculative beam search at draft ``depth``, one per depth."""
        if depth not in self.searches:
            from vllm_specbeam.adapter.beam_search import SpeculativeBeamSearch

            self.searches[depth] = SpeculativeBeamSearch(self.llm, num_speculative_tokens=depth)
        return self.searches[depth]

    def generate(self, setting: Setting, scenario: Scenario) -> list[list[int]]:
        """All prompts, at most ``batch_size`` requests in flight at a time, every request with
        the scenario's ``cache_salt`` (or none). Each run starts on an empty prefix cache
        (:func:`fresh_start`), so none reads the KV blocks an earlier run left."""
        prompts = request_prompts(self.prompt_ids, scenario.cache_salt)
        outputs: list[list[int]] = []
        for first in range(0, len(prompts), scenario.batch_size):
            indices = range(first, min(first + scenario.batch_size, len(prompts)))
            batch = self.beam_search if setting.beam_width else self.sample
            outputs += batch(setting, scenario, [prompts[i] for i in indices], indices)
        return outputs

    def beam_search(self, setting: Setting, _: Scenario, prompts: list[Any], indices: range) -> list[list[int]]:
        """vLLM's beam search or the plugin's speculative one: each prompt's best beam."""
        from vllm.sampling_params import BeamSearchParams

        beam = BeamSearchParams(beam_width=setting.beam_width, max_tokens=self.job.max_tokens, ignore_eos=True)
        search = self.speculative_search(setting.beam_depth).run if setting.speculative else self.llm.beam_search
        results = search(prompts, beam)
        return [list(result.sequences[0].tokens[len(self.prompt_ids[i]) :]) for i, result in zip(indices, results)]

    def sample(self, setting: Setting, scenario: Scenario, prompts: list[Any], indices: range) -> list[list[int]]:
        """Greedy or sampled (seeded per prompt) with the setting's per-request options."""
        from vllm import SamplingParams

        sampled = scenario.temperature > 0
        params = [
            SamplingParams(
                temperature=scenario.temperature,
                max_tokens=self.job.max_tokens,
                ignore_eos=True,
                seed=self.job.seed + i if sampled else None,
                extra_args=setting.extra_args,
            )
            for i in indices
        ]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in results]


def tree_counters(stats: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """The plugin runner's stats (the drafter's memory taken out) as counters under ``tree_``: its
    :class:`TreeCounts` fields and its cross-request index's stats; and its fitted cost lines apart."""
    costs = {key: value for key, value in stats.items() if key.startswith(COST_PREFIXES)}
    counts = {f.name: stats[f.name] for f in dataclasses.fields(TreeCounts)}
    index = {key: value for key, value in stats.items() if key not in counts and key not in costs}
    return {TREE_PREFIX + key: value for key, value in {**counts, **index}.items()}, costs


def beam_counts(searches: list[Any]) -> BeamCounts:
    """The speculative beam searches' stats, summed: rounds are target passes (``prompt_rounds``)."""
    stats = [search.stats for search in searches]
    names = {f.name: "prompt_rounds" if f.name == "rounds" else f.name for f in dataclasses.fields(BeamCounts)}
    return BeamCounts(**{key: sum(getattr(s, name) for s in stats) for key, name in names.items()})


def request_prompts(prompt_ids: list[list[int]], cache_salt: str | None) -> list[Any]:
    """The requests of a run: the prompts' token ids, each with ``cache_salt`` when one is given
    (vLLM's ``TokensPrompt``; no ``cache_salt`` key otherwise: an unsalted request)."""
    from vllm.inputs import TokensPrompt

    salted = {} if cache_salt is None else {"cache_salt": cache_salt}
    return [TokensPrompt(prompt_token_ids=ids, **salted) for ids in prompt_ids]


def fresh_start(llm: Any) -> None:
    """Before each timed run: the engine as newly started for the workload. Its cross-request
    memory emptied (:func:`_forget_finished`: every run drafts only from its own requests), and
    vLLM's prefix cache emptied, so no run reads the KV blocks an earlier run of the same
    prompts left there (beam searches re-submit their beams, and would find them); a salt per
    run did this before ``--cache-salt``, when the salt meant nothing to the plugin."""
    llm.collective_rpc(_forget_finished)
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not empty its prefix cache between timed runs (blocks still in use)")


def _forget_finished(worker: Any) -> None:
    """Empty what the engine drafts from across requests, as a newly started engine has it: the
    plugin drafter's index (``specbeam_forget_finished``), vLLM ``suffix``'s cache of responses
    (``SuffixDecodingProposer.suffix_cache``, vllm/v1/spec_decode/suffix_decoding.py in 0.32,
    an arctic-inference ``SuffixDecodingCache``). Otherwise a repeat, or a batch size after
    another, drafts the same prompts' outputs from the run before it."""
    runner = worker.model_runner
    if hasattr(runner, "tree_drafter"):
        worker.specbeam_forget_finished()
    cache = getattr(getattr(runner, "drafter", None), "suffix_cache", None)
    if cache is not None:
        for req_id in list(cache.cached_requests):
            cache.evict_cached_response(req_id)


def _read_tree_stats(worker: Any) -> dict[str, Any] | None:
    """The plugin runner's counters (``None`` on vLLM's own runner)."""
    stats = getattr(worker.model_runner, "tree_stats", None)
    return (
        None
        if stats is None
        else {key: value.item() if hasattr(value, "item") else value for key, value in stats.items()}
    )


def resolved_dtype(llm: Any) -> str:
    """The dtype vLLM runs the target in (its model config's, after ``auto``)."""
    return str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")


def score(
    llm: Any,
    prompt_ids: list[list[int]],
    external: list[dict[str, Any]],
    own_runs: list[RunRecord],
    margins_along: str,
) -> dict[str, Any]:
    """Log-probabilities of outputs under this (no-speculation) engine's target,
    and, on a float32 engine, the target's top-2 margins along the ``own`` or
    the ``external`` outputs (``margins_along``): the contexts of the divergence reports.

    Prompt + output is scored as one prompt with ``prompt_logprobs=0`` (the
    actual token's log-probability at every position), with ``2`` for the
    outputs whose margins are asked (``margins[i]``, the top-2 gap after the
    prompt and the output's first ``i`` tokens: what one ``max_tokens=1,
    logprobs=2`` request there gives); identical sequences, common across
    lossless methods, are scored once. ``margins`` is ``None`` on other dtypes:
    a rounded target's near-ties are not the target's.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    items = [(e["prompt"], tuple(e["output"])) for e in external]
    items += [(i, tuple(out)) for run in own_runs for i, out in enumerate(run.outputs)]
    unique = sorted(set(items))
    wanted = set(items[: len(external)] if margins_along == "external" else items[len(external) :])
    if resolved_dtype(llm) != "float32":
        wanted = set()
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt_ids[p] + list(o)) for p, o in unique],
        [SamplingParams(max_tokens=1, prompt_logprobs=2 if item in wanted else 0, temperature=0.0) for item in unique],
        use_tqdm=False,
    )
    scored, margins = {}, {}
    for (p, o), result in zip(unique, results):
        table = [None if pos is None else {t: lp.logprob for t, lp in pos.items()} for pos in result.prompt_logprobs]
        scored[(p, o)] = continuation_logprobs(table, prompt_ids[p] + list(o), len(prompt_ids[p]))
        if (p, o) in wanted:
            margins[(p, o)] = continuation_margins(table, len(prompt_ids[p]))

    def per_item(values: dict[Reference, list[float]], group: str) -> list[Any]:
        if group == "external":
            return [values[item] for item in items[: len(external)]]
        return [[values[(i, tuple(out))] for i, out in enumerate(run.outputs)] for run in own_runs]

    return {
        "external": per_item(scored, "external"),
        "own": per_item(scored, "own"),
        "margins": per_item(margins, margins_along) if wanted else None,
    }


if __name__ == "__main__":
    for key, value in ENV_DEFAULTS.items():  # before vLLM is imported
        os.environ.setdefault(key, value)
    run_job(Job.load(Path(sys.argv[1])))
