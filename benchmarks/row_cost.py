"""A target pass's cost against the rows it computes: the shape the step budget fits.

One request whose first ``--context`` tokens are in the prefix cache is sent
with R new tokens and ``max_tokens=1``: one pass computes exactly R rows over
that cached context, as a verification step computes a tree's R rows (a batch
of 8 trees of 16 nodes is R = 136). Each repetition draws fresh tokens, so no
new row is ever a cache hit. Row counts are timed in turns (1, 8, 16, ...,
then again), so a drift of the machine's speed reaches every count alike.

    python benchmarks/row_cost.py --model qwen-coder-1.5b --out results/row-cost-qwen.json

prints the median pass and its ratio to one row per R, and the hinge
``C(R) = a + bR + c max(0, R - K)`` that ``"max_nodes": "auto"`` fits to the
same points (vllm_specbeam/core/budget.py). Runs in-process, in the
checkpoint's dtype unless ``--dtype`` says otherwise.
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
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks import models
from benchmarks.host import environment
from vllm_specbeam.core.budget import StepCostModel


@dataclass
class RowCost:
    rows: int
    median_s: float
    ratio_to_one_row: float
    samples_s: list[float]


def measure(model: str, dtype: str, context: int, row_counts: list[int], repeats: int, seed: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=context + max(row_counts) + 8,
        enable_prefix_caching=True,
        seed=0,
        kv_cache_memory_bytes=1 << 30,
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(seed)
    base = rng.integers(100, vocab, context).tolist()  # [context] cached by the warm-up below
    one_token = SamplingParams(max_tokens=1, temperature=0.0)

    def timed(new_rows: int) -> float:
        fresh = rng.integers(100, vocab, new_rows).tolist()  # [new_rows]: never a cache hit
        start = time.perf_counter()
        llm.generate(TokensPrompt(prompt_token_ids=base + fresh), one_token, use_tqdm=False)
        return time.perf_counter() - start

    for count in row_counts:  # warm-up: caches the context, compiles each shape once
        timed(count)
    samples: dict[int, list[float]] = {count: [] for count in row_counts}
    for _ in range(repeats):
        for count in row_counts:
            samples[count].append(timed(count))
    resolved = str(llm.model_config.dtype).removeprefix("torch.")
    llm.llm_engine.engine_core.shutdown()

    one_row = statistics.median(samples[min(row_counts)])
    costs = [RowCost(c, statistics.median(s), statistics.median(s) / one_row, s) for c, s in samples.items()]
    fit = StepCostModel(decay=1.0)
    for count, seconds in samples.items():
        for second in seconds:
            fit.observe(count, second)
    return {
        "dtype": resolved,
        "environment": environment(model, None),
        "context": context,
        "repeats": repeats,
        "rows": [asdict(cost) for cost in costs],
        "fitted_step_cost": asdict(fit.fit()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="path, hub name, or a name of benchmarks/models.py")
    parser.add_argument("--dtype", default="auto", help="vLLM's dtype (default auto: the checkpoint's)")
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the new rows (256)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if min(args.rows) < 1:
        parser.error("--rows: every count must be at least 1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    result = measure(
        models.resolve(args.model), args.dtype, args.context, sorted(set(args.rows)), args.repeats, args.seed
    )
    machine = result["environment"]
    print(f"{args.model}, {result['dtype']}, {machine.get('cpu_model')}, context {args.context}")
    print("| rows | pass ms (median) | / 1 row |\n|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['rows']} | {1e3 * row['median_s']:.1f} | {row['ratio_to_one_row']:.2f} |")
    cost = result["fitted_step_cost"]
    print(f"fitted hinge: {cost}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
