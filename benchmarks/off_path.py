"""What a batch at rest costs against an engine without speculation: the controller's off path.

A plugin engine whose step line is planted dear (a row costs a second: no node
pays, so the goodput controller rests the batch and probes now and then, as it
does on its own when drafting does not pay) and an engine without speculation
run the same closed batch in turns, each round in the other order. The ratio of
their throughputs is what the off path costs: the probes' drafting, the
controller's bookkeeping, and vLLM's speculative-decoding scaffolding, which a
plugin engine keeps even on its plain steps.

    python benchmarks/off_path.py                                  # SmolLM2-135M, lookup_tree, batch 8
    python benchmarks/off_path.py --method aded --batch-size 1 --rounds 8
    python benchmarks/off_path.py --model qwen-coder-1.5b --method mcsd --draft qwen-coder-0.5b

Runs both engines in this process (the planted line goes in through
``collective_rpc``), in the checkpoint's dtype. Writes ``OUT/off_path.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the package from the repository
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
import statistics
import time
from typing import Any

from benchmarks import models
from benchmarks.host import add_dtype_option, choose_dtype, environment
from benchmarks.processes import add_intel_openmp_option, set_engine_environment
from benchmarks.prompts import load_prompts
from vllm_specbeam.core.budget import StepCost, StepCostModel

#: a row costs a second: no draft node ever pays
DEAR = StepCost(0.02, 1.0)


class _PlantedLine(StepCostModel):
    """A cost model that answers :data:`DEAR` whatever the steps say."""

    def fitted(self) -> StepCost:
        return DEAR


def _plant(worker: Any) -> None:
    budget = worker.model_runner.budget
    budget.cost_model, budget.cost = _PlantedLine(), DEAR
    budget.chain_model, budget.chain_cost = _PlantedLine(), DEAR


def _stats(worker: Any) -> dict[str, Any]:
    return dict(worker.model_runner.tree_stats)


def timed(llm: Any, prompts: list[str], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_engine_environment(args.intel_openmp)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the KV cache is sized by kv_cache_memory_bytes
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the planted line is a Python object
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    model = models.resolve_option(args.model)
    dtype = choose_dtype(args.dtype)
    prompts = [p.text for p in load_prompts(args.prompts, args.batch_size)]
    settings = {"model": model, "dtype": dtype.engine, "max_model_len": 2048, "seed": 0}
    settings |= {"enforce_eager": args.enforce_eager, "kv_cache_memory_bytes": 1 << 30}
    speculative = {"method": args.method}
    if args.draft:
        speculative["model"] = models.resolve_option(args.draft)
    engines = {"none": LLM(**settings), args.method: LLM(**settings, speculative_config=speculative)}
    engines[args.method].collective_rpc(_plant)
    for llm in engines.values():
        timed(llm, prompts[:1], 8)  # warm
    before = engines[args.method].collective_rpc(_stats)[0]
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        for name in list(engines)[:: 1 if round_ % 2 == 0 else -1]:
            seconds[name].append(timed(engines[name], prompts, args.max_tokens))
    after = engines[args.method].collective_rpc(_stats)[0]
    counts = {key: after[key] - before[key] for key in ("steps", "steps_off", "steps_probed", "nodes")}
    ratios = [none / plugin for none, plugin in zip(seconds["none"], seconds[args.method])]
    result = {
        "config": vars(args) | {"engine_dtype": dtype.engine},
        "environment": environment(model, None),
        "seconds": seconds,
        "throughput_ratio_median": statistics.median(ratios),
        "throughput_ratios": ratios,
        "counters": counts,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "off_path.json").write_text(json.dumps(result, indent=1))
    print(
        f"{args.method} at rest vs none, batch {args.batch_size}: {result['throughput_ratio_median']:.3f} "
        f"(rounds {', '.join(f'{r:.3f}' for r in ratios)}); steps {counts['steps']}, off {counts['steps_off']}, "
        f"probed {counts['steps_probed']}, nodes verified {counts['nodes']}"
    )
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--method", default="lookup_tree", choices=("lookup_tree", "aded", "mcsd"))
    parser.add_argument("--draft", help="the draft model of a draft-model method (mcsd)")
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="results/off-path")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile (for checks, not figures)")
    add_dtype_option(parser)
    add_intel_openmp_option(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
