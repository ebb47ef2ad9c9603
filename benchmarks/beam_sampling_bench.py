"""Full-width beam sampling: the target-only reference against DSBD's speculative version.

Both samplers (``vllm_specbeam.adapter.beam_sampling``: ``BeamSampling`` and
``SpeculativeBeamSampling``) run on the same ``dsbd`` engine, prompts and law
(temperature, top-p, top-k), every beam width x batch size, ``batch`` prompts at
a time. Each engine round is a process of its own (``--round JOB``), started
``--engine-rounds`` times, the two samplers' order alternating from one round to
the next; tokens per second are the best beam's generated tokens over the wall
time, the median over rounds, and the speedup is the ratio of the medians. Every
timed run starts on an empty prefix cache (``benchmarks/worker.py``'s ``fresh_start``).

Quality: the mean target log-likelihood per token of each prompt's best beam (the
beams' own cumulative raw logprobs, the target's) and, with ``--execute-code`` on
HumanEval, the best beam's pass@1 (``benchmarks/report.py``'s ``humaneval_checks``)
with its paired difference from the reference's and that difference's standard error
over problems (the noise: both samplers draw from one law, so only sampling separates
them). ``--samplers ... multinomial`` adds plain sampling at the same temperature and cuts
(vLLM's ``generate``, ``n`` = 1, speculated exactly; the width does not apply), the floor
beam sampling should beat.
Speculative rows also give target passes' steps per round and the accepted pairs
per depth per prompt-round.

    python benchmarks/beam_sampling_bench.py --model qwen-coder-1.5b --draft qwen-coder-0.5b \\
        --num-prompts 4 --max-tokens 32

Engines run in ``--dtype auto`` (the checkpoint's dtype; ``benchmarks/host.py``), with
prefix caching and blocks of 32 (``benchmarks/plan.py``'s ``BEAM_ENGINE``). The target's
rows are read exactly from its top ``--max-logprobs`` logprobs; a row they cannot decide
stops the run (``InexactBeamSamplingError``: raise it). Outputs: ``OUT/result.json``,
``OUT/table.md``, ``OUT/logs/round<k>.log``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the package from the repository
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks import models
from benchmarks.host import ROOT, add_dtype_option, choose_dtype, environment
from benchmarks.plan import BEAM_ENGINE
from benchmarks.processes import add_intel_openmp_option, failure_line, set_engine_environment
from benchmarks.prompts import BUILTIN, load_prompts

SAMPLERS = ("reference", "speculative", "multinomial")


@dataclass(frozen=True)
class Scenario:
    width: int
    batch_size: int


@dataclass
class RoundJob:
    """What one engine round runs, in its own process (JSON both ways)."""

    model: str
    draft: str
    dtype: str
    max_model_len: int
    max_logprobs: int
    depth: int
    enforce_eager: bool
    prompts: list[str]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    ignore_eos: bool
    seed: int
    scenarios: list[Scenario]
    #: the samplers in the order this round runs them, per scenario
    order: list[str]
    result: str

    @classmethod
    def load(cls, path: Path) -> RoundJob:
        data = json.loads(path.read_text())
        data["scenarios"] = [Scenario(**s) for s in data["scenarios"]]
        return cls(**data)


# ------------------------------------------------------------ one round (its own process)
def make_engine(job: RoundJob) -> Any:
    """The ``dsbd`` engine both samplers run on."""
    from vllm import LLM

    spec = {"method": "dsbd", "model": job.draft, "num_speculative_tokens": job.depth}
    return LLM(
        model=job.model,
        dtype=job.dtype,
        max_model_len=job.max_model_len,
        seed=job.seed,
        speculative_config=spec,
        max_logprobs=job.max_logprobs,
        enforce_eager=job.enforce_eager,
        **BEAM_ENGINE,
        enable_chunked_prefill=False,
    )


def sample(llm: Any, job: RoundJob, scenario: Scenario, sampler: str, prompt_ids: list[list[int]]) -> dict[str, Any]:
    """One timed run of ``sampler`` over every prompt, ``batch_size`` at a time; its figures."""
    from vllm.inputs import TokensPrompt

    from benchmarks.worker import fresh_start
    from vllm_specbeam.adapter.beam_sampling import BeamSampling, BeamSamplingParams, SpeculativeBeamSampling

    fresh_start(llm)
    runner = {"speculative": SpeculativeBeamSampling, "reference": BeamSampling, "multinomial": MultinomialSampling}
    answer = runner[sampler](llm)
    best: list[Sampled] = []
    started = time.perf_counter()
    for first in range(0, len(prompt_ids), scenario.batch_size):
        batch = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids[first : first + scenario.batch_size]]
        params = BeamSamplingParams(
            scenario.width,
            job.max_tokens,
            temperature=job.temperature,
            top_k=job.top_k,
            top_p=job.top_p,
            ignore_eos=job.ignore_eos,
            seed=job.seed + first,
        )
        best += answers(answer, batch, params)
    wall = time.perf_counter() - started
    tokenizer = llm.get_tokenizer()
    record: dict[str, Any] = {
        "sampler": sampler,
        "width": scenario.width,
        "batch_size": scenario.batch_size,
        "wall_s": wall,
        "output_tokens": sum(len(s.tokens) for s in best),
        "loglik_per_token": [s.cum_logprob / max(len(s.tokens), 1) for s in best],
        "texts": [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in best],
    }
    if isinstance(answer, SpeculativeBeamSampling):
        record.update(
            prompt_rounds=answer.stats.prompt_rounds,
            steps=answer.stats.steps,
            accepted_per_depth=answer.sampling_stats.accepted_per_depth,
        )
    return record


@dataclass(frozen=True)
class Sampled:
    """One prompt's answer: the best beam's (or the one sample's) new tokens and their target log-likelihood."""

    tokens: list[int]
    cum_logprob: float


def answers(sampler: Any, batch: list[Any], params: Any) -> list[Sampled]:
    """Each prompt's best beam, without its prompt; a plain sampler's own answers."""
    if isinstance(sampler, MultinomialSampling):
        return sampler.run(batch, params)
    outputs = sampler.run(batch, params)
    return [
        Sampled(output.sequences[0].tokens[len(prompt["prompt_token_ids"]) :], output.sequences[0].cum_logprob)
        for output, prompt in zip(outputs, batch)
    ]


class MultinomialSampling:
    """Plain sampling at the beam samplers' law, one sample a prompt: the engine's own ``generate``,
    with the ``dsbd`` engine's draft one beam wide (``max_width`` 1: a chain, verified exactly; wider,
    its one-sequence mode would draw beams, another law)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def run(self, batch: list[Any], params: Any) -> list[Sampled]:
        from vllm import SamplingParams

        sampling = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            ignore_eos=params.ignore_eos,
            seed=params.seed,
            logprobs=0,  # the sampled token's raw logprob, summed: the target's log-likelihood
            extra_args={"max_width": 1},
        )
        outputs = self.llm.generate(batch, sampling, use_tqdm=False)
        return [Sampled(list(out.outputs[0].token_ids), out.outputs[0].cumulative_logprob) for out in outputs]


def run_round(job: RoundJob) -> None:
    """Start the engine, warm both samplers up, then every scenario with both samplers in ``job.order``."""
    started = time.perf_counter()
    llm = make_engine(job)
    start_s = time.perf_counter() - started
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer.encode(text) for text in job.prompts]
    warm_up = Scenario(job.scenarios[0].width, 1)
    for sampler in job.order:
        sample(llm, replace(job, max_tokens=2), warm_up, sampler, prompt_ids[:1])
    records = [sample(llm, job, s, sampler, prompt_ids) for s in job.scenarios for sampler in job.order]
    Path(job.result).write_text(json.dumps({"start_s": start_s, "runs": records}))
    llm.llm_engine.engine_core.shutdown()


def start_round(job: RoundJob, log: Path) -> None:
    """Run one round in a process of its own (the repository on its ``PYTHONPATH``)."""
    job_file = Path(job.result).with_suffix(".job.json")
    job_file.write_text(json.dumps(asdict(job)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "benchmarks.beam_sampling_bench", "--round", str(job_file)]
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"engine round failed (exit code {done.returncode}): {failure_line(log)}; see {log}")


# ------------------------------------------------------------ pooling and the table
def round_order(round_index: int, samplers: tuple[str, ...] = SAMPLERS[:2]) -> list[str]:
    """The samplers' order in a round: alternating, so drift within a round hits them alike."""
    return list(samplers if round_index % 2 == 0 else samplers[::-1])


def pool(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per scenario and sampler (in ``SAMPLERS``' order): the median tokens/s over rounds,
    the speedup (medians' ratio to the scenario's reference, when it ran) and the figures pooled
    over rounds."""
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for record in (r for records in rounds for r in records):
        groups.setdefault((record["width"], record["batch_size"], record["sampler"]), []).append(record)
    rows = []
    for width, batch, sampler in sorted(groups, key=lambda key: (key[0], key[1], SAMPLERS.index(key[2]))):
        runs = groups[(width, batch, sampler)]
        speeds = [r["output_tokens"] / r["wall_s"] for r in runs]
        row: dict[str, Any] = {
            "sampler": sampler,
            "width": width,
            "batch_size": batch,
            "tokens_per_s": statistics.median(speeds),
            "tokens_per_s_runs": speeds,
            "mean_loglik_per_token": statistics.fmean(x for r in runs for x in r["loglik_per_token"]),
            "texts": [r["texts"] for r in runs],
        }
        if sampler == "speculative":
            row.update(speculative_figures(runs))
        rows.append(row)
    for row in rows:
        reference = reference_row(rows, row)
        row["speedup"] = row["tokens_per_s"] / reference["tokens_per_s"] if reference else None
    return rows


def reference_row(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """The reference sampler's row of ``row``'s width and batch size, if it ran."""
    same = (row["width"], row["batch_size"], "reference")
    return next((r for r in rows if (r["width"], r["batch_size"], r["sampler"]) == same), None)


def speculative_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps (tokens per beam) per target pass, and accepted pairs per depth, per prompt-round."""
    prompt_rounds = sum(r["prompt_rounds"] for r in runs)
    depths = max(len(r["accepted_per_depth"]) for r in runs)
    accepted = [
        sum(r["accepted_per_depth"][d] for r in runs if d < len(r["accepted_per_depth"])) for d in range(depths)
    ]
    return {
        "steps_per_round": sum(r["steps"] for r in runs) / prompt_rounds,
        "accepted_per_depth": [total / prompt_rounds for total in accepted],
    }


def pass_at_1(prompts: list[Any], rows: list[dict[str, Any]], timeout: float) -> None:
    """Each row's best-beam HumanEval pass@1 over every round's texts, and its paired difference
    from the reference's with that difference's standard error over problems, in place
    (``benchmarks/report.py``'s ``humaneval_checks``: EXECUTES the generated code)."""
    from benchmarks import report

    for row in rows:
        checks = report.humaneval_checks(prompts, row["texts"], timeout)  # [rounds][problems]
        row["passed_per_problem"] = [statistics.fmean(problem) for problem in zip(*checks)]
        row["pass_at_1"] = statistics.fmean(row["passed_per_problem"])
    for row in rows:
        reference = reference_row(rows, row)
        if reference is None or reference is row:
            continue
        gaps = [a - b for a, b in zip(row["passed_per_problem"], reference["passed_per_problem"])]
        row["pass_at_1_minus_reference"] = statistics.fmean(gaps)
        row["pass_at_1_minus_reference_se"] = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else None


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: a row per beam width, batch size and sampler."""
    lines = [
        "| W | batch | sampler | tok/s (median) | speedup | steps/round | accepted pairs per depth "
        "| loglik/token | pass@1 | pass@1 − reference (± 2 SE) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        accepted = " / ".join(f"{a:.2f}" for a in row.get("accepted_per_depth", [])) or "–"
        steps = f"{row['steps_per_round']:.2f}" if "steps_per_round" in row else "–"
        passed = f"{row['pass_at_1']:.3f}" if "pass_at_1" in row else "–"
        speedup = f"{row['speedup']:.2f}" if row["speedup"] is not None else "–"
        lines.append(
            f"| {row['width']} | {row['batch_size']} | {row['sampler']} | {row['tokens_per_s']:.2f} | "
            f"{speedup} | {steps} | {accepted} | {row['mean_loglik_per_token']:.4f} | {passed} | {gap(row)} |"
        )
    return "\n".join(lines) + "\n"


def gap(row: dict[str, Any]) -> str:
    """``+0.025 ± 0.061``: pass@1's paired difference from the reference, two standard errors."""
    if "pass_at_1_minus_reference" not in row:
        return "–"
    se = row["pass_at_1_minus_reference_se"]
    return f"{row['pass_at_1_minus_reference']:+.3f}" + (f" ± {2 * se:.3f}" if se is not None else "")


# ------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.round:
        run_round(RoundJob.load(Path(args.round)))
        return 0
    set_engine_environment(args.intel_openmp)
    model, draft = models.resolve_option(args.model), models.resolve_option(args.draft)
    assert model is not None and draft is not None
    prompts = load_prompts(args.prompts, args.num_prompts)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    dtype = choose_dtype(args.dtype)
    rounds = []
    for k in range(args.engine_rounds):
        job = round_job(args, model, draft, dtype.engine, [p.text for p in prompts], k, out)
        start_round(job, out / "logs" / f"round{k + 1}.log")
        rounds.append(json.loads(Path(job.result).read_text())["runs"])
    rows = pool(rounds)
    if args.execute_code:
        if args.prompts != "humaneval":
            raise SystemExit("--execute-code: pass@1 needs the humaneval prompt set")
        pass_at_1(prompts, rows, args.code_timeout)
    config = {k: v for k, v in vars(args).items() if k not in ("round", "out")}
    result = {
        "config": {**config, "engine_dtype": dtype.engine},
        "environment": environment(model, draft),
        "rows": rows,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "table.md").write_text(table(rows))
    print(table(rows))
    print(f"wrote {out / 'result.json'}, {out / 'table.md'}")
    return 0


def round_job(
    args: argparse.Namespace, model: str, draft: str, dtype: str, prompts: list[str], index: int, out: Path
) -> RoundJob:
    """Round ``index``'s job: every width x batch size, the samplers' order alternating by round."""
    return RoundJob(
        model=model,
        draft=draft,
        dtype=dtype,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        depth=args.depth,
        enforce_eager=args.enforce_eager,
        prompts=prompts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        scenarios=[Scenario(w, b) for w in args.widths for b in args.batch_sizes],
        order=round_order(index, tuple(args.samplers)),
        result=str(out / "logs" / f"round{index + 1}.result.json"),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen-coder-1.5b", help="target: path, hub or short name (%(default)s)")
    parser.add_argument("--draft", default="qwen-coder-0.5b", help="the dsbd draft model (%(default)s)")
    parser.add_argument("--prompts", default="humaneval", help=f"{' | '.join(BUILTIN)} | path to JSONL with 'prompt'")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4], help="beam widths W")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4], help="prompts sampled together")
    parser.add_argument(
        "--samplers",
        nargs="+",
        choices=SAMPLERS,
        default=list(SAMPLERS[:2]),
        help="multinomial: plain sampling at the same law, the quality floor (default: %(default)s)",
    )
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument("--depth", type=int, default=4, help="the draft's depth per round (num_speculative_tokens)")
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=1000,
        help="the engine's max_logprobs: the target's rows are read from this many logprobs (-1: all)",
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="beams run to --max-tokens (default), so both samplers time the same token counts",
    )
    parser.add_argument("--engine-rounds", type=int, default=2, help="engine starts; tokens/s: their median")
    add_dtype_option(parser)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--enforce-eager", action="store_true", help="quicker starts, slower steps (for checks)")
    parser.add_argument("--seed", type=int, default=0)
    add_intel_openmp_option(parser)
    parser.add_argument("--execute-code", action="store_true", help="HumanEval pass@1: EXECUTES generated code")
    parser.add_argument("--code-timeout", type=float, default=5.0)
    parser.add_argument("--out", default=f"results/beam-sampling-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--round", default=None, help=argparse.SUPPRESS)  # a round's process: its job file
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or min(args.widths) < 1 or args.engine_rounds < 1:
        parser.error("widths, batch sizes and --engine-rounds must be >= 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
