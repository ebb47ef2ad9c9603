"""The engine worker: one engine, in a process of its own, through every setting x
scenario x repeat of its :class:`Job`; it writes the raw measurements (timings,
counter deltas, token ids) as JSON for the parent to assemble.

    python -m benchmarks.worker JOB.json      (started by benchmarks.processes.start_worker)

The no-speculation engine also scores outputs: log-probabilities under the
target and, in float32, the top-2 margins the divergence reports need.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.plan import Setting
from benchmarks.processes import ENV_DEFAULTS, wait_for

WARM_UP_TEXT = "A short sentence to warm the engine up."


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


def run_job(job: Job) -> None:
    """Run the job's engine through every setting x scenario x repeat; write its raw data."""
    progress = Path(job.progress)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        progress.write_text(str(done))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter.runner import STATE_BYTES

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
    prompt_ids = [tokenizer.encode(text) for text in job.prompts]
    # Warm-up on a text outside the workload: methods that remember earlier requests
    # (suffix, lookup_tree's global scope) must not have seen a prompt before it runs
    # (nor, by _forget_finished, the outputs of an earlier run of the same prompts).
    warm_up = TokensPrompt(prompt_token_ids=tokenizer.encode(WARM_UP_TEXT))
    llm.generate([warm_up], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    tick()  # started and warm (--interleave hands out turns after every engine's first step)

    state_bytes: int | None = None  # the drafter's cross-request memory after the last run
    step_cost: dict[str, float] = {}  # the fitted costs (target's steps, draft's forwards) after the last run

    def counters() -> dict[str, Any]:
        nonlocal state_bytes
        snapshot = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
        values = {key: snapshot[name] for key, name in report.SPEC_COUNTERS.items() if name in snapshot}
        tree = llm.collective_rpc(_read_tree_stats)[0]
        if tree is not None:
            state_bytes = tree.pop(STATE_BYTES)
            step_cost.update({key: tree.pop(key) for key in list(tree) if key.startswith(COST_PREFIXES)})
            values.update({f"tree_{key}": value for key, value in tree.items()})
        searches = [speculative_search(d) for d in {s.beam_depth for s in job.settings if s.speculative}]
        if searches:  # rounds are target passes; steps are tokens per beam
            values.update(
                beam_rounds=sum(s.stats.prompt_rounds for s in searches),
                beam_steps=sum(s.stats.steps for s in searches),
                beam_draft_seconds=sum(s.stats.draft_seconds for s in searches),
                beam_scored_rows=sum(s.stats.scored_rows for s in searches),
                beam_shared_rounds=sum(s.stats.shared_rounds for s in searches),
                beam_drafted_depths=sum(s.stats.drafted_depths for s in searches),
            )
        return values

    @functools.cache
    def speculative_search(depth: int | None) -> Any:
        from vllm_specbeam.adapter.beam_search import SpeculativeBeamSearch

        return SpeculativeBeamSearch(llm, num_speculative_tokens=depth)

    def run(setting: Setting, scenario: Scenario) -> list[list[int]]:
        """All prompts, at most ``batch_size`` requests in flight at a time, every request with
        the scenario's ``cache_salt`` (or none). Each run starts on an empty prefix cache
        (:func:`fresh_start`), so none reads the KV blocks an earlier run left."""
        token_prompts = request_prompts(prompt_ids, scenario.cache_salt)
        outputs: list[list[int]] = []
        for first in range(0, len(token_prompts), scenario.batch_size):
            indices = range(first, min(first + scenario.batch_size, len(token_prompts)))
            if setting.beam_width:
                beam = BeamSearchParams(beam_width=setting.beam_width, max_tokens=job.max_tokens, ignore_eos=True)
                search = speculative_search(setting.beam_depth).run if setting.speculative else llm.beam_search
                for index, result in zip(indices, search([token_prompts[i] for i in indices], beam)):
                    outputs.append(list(result.sequences[0].tokens[len(prompt_ids[index]) :]))
                continue
            sampled = scenario.temperature > 0
            params = [
                SamplingParams(
                    temperature=scenario.temperature,
                    max_tokens=job.max_tokens,
                    ignore_eos=True,
                    seed=job.seed + i if sampled else None,
                    extra_args=setting.extra_args,
                )
                for i in indices
            ]
            results = llm.generate([token_prompts[i] for i in indices], params, use_tqdm=False)
            outputs.extend(list(r.outputs[0].token_ids) for r in results)
        return outputs

    runs: dict[tuple[int, int], dict[str, Any]] = {}
    turns = itertools.count()
    for _ in range(job.repeats):  # repeats outermost: drift on a shared machine hits every setting alike
        for scenario_index, scenario in enumerate(job.scenarios):
            for setting_index, setting in enumerate(job.settings):
                fresh_start(llm)
                before = counters()
                if job.turn:
                    wait_for(Path(job.turn), f"{job.name} {next(turns)}")
                started_at = time.time()
                t0 = time.perf_counter()
                outputs = run(setting, scenario)
                wall = time.perf_counter() - t0
                delta = report.counter_delta(before, counters())
                record = runs.setdefault(
                    (scenario_index, setting_index),
                    {
                        "scenario": scenario_index,
                        "setting": setting_index,
                        "wall_s": [],
                        "started_s": [],
                        "output_tokens_runs": [],
                        "counters": {},
                        "outputs": outputs,
                        "texts": [tokenizer.decode(ids) for ids in outputs],
                    },
                )
                record["wall_s"].append(wall)
                record["started_s"].append(started_at)
                record["drafter_state_bytes"] = state_bytes
                record["step_cost"] = dict(step_cost)
                record["output_tokens_runs"].append(sum(map(len, outputs)))
                record["counters"] = report.add_counters(record["counters"], delta)
                tick()

    records = list(runs.values())
    if job.score_outputs and job.score_file:  # --interleave: the others' outputs come at their end
        job.score = json.loads(wait_for(Path(job.score_file)))
    scores = score(llm, prompt_ids, job.score, records, job.margins_along) if job.score_outputs else None
    tick()
    # as vLLM resolved it: never for custom_class methods (the plugin's), never on CPU (its platform)
    async_scheduling = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    result = {
        "start_s": start_s,
        "async_scheduling": async_scheduling,
        "dtype": resolved_dtype(llm),
        "runs": records,
        "scores": scores,
    }
    Path(job.result).write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()


def request_prompts(prompt_ids: list[list[int]], cache_salt: str | None) -> list[Any]:
    """The requests of a run: the prompts' token ids, each with ``cache_salt`` when one is given
    (vLLM's ``TokensPrompt``; no ``cache_salt`` key otherwise: an unsalted request)."""
    from vllm.inputs import TokensPrompt

    salted = {} if cache_salt is None else {"cache_salt": cache_salt}
    return [TokensPrompt(prompt_token_ids=ids, **salted) for ids in prompt_ids]


#: the runner's stats that are fitted lines, not counters (``TreeRunnerMixin.tree_stats``)
COST_PREFIXES = ("step_cost_", "chain_cost_", "plain_cost_", "draft_cost_")


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
    own_runs: list[dict[str, Any]],
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
    items += [(i, tuple(out)) for run in own_runs for i, out in enumerate(run["outputs"])]
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
        scored[(p, o)] = report.continuation_logprobs(table, prompt_ids[p] + list(o), len(prompt_ids[p]))
        if (p, o) in wanted:
            margins[(p, o)] = report.continuation_margins(table, len(prompt_ids[p]))

    def per_item(values: dict[report.Reference, list[float]], group: str) -> list[Any]:
        if group == "external":
            return [values[item] for item in items[: len(external)]]
        return [[values[(i, tuple(out))] for i, out in enumerate(run["outputs"])] for run in own_runs]

    return {
        "external": per_item(scored, "external"),
        "own": per_item(scored, "own"),
        "margins": per_item(margins, margins_along) if wanted else None,
    }


if __name__ == "__main__":
    for key, value in ENV_DEFAULTS.items():  # before vLLM is imported
        os.environ.setdefault(key, value)
    run_job(Job.load(Path(sys.argv[1])))
