"""The in-step check behind "A draft's catch-up priced over the steps it buys" (docs/results.md).

One in-process engine, the Qwen pair, bfloat16, 8 HumanEval prompts x 64 tokens at batch 8,
greedy, three timed runs after a warm-up; prints their tok/s and the median. ``FORCE_ON=1``
removes the goodput controller's switch, so the draft runs every step as configured.

    python docs/results/qwen-batch8-catch-up/in_step_check.py                       # none
    FORCE_ON=1 python docs/results/qwen-batch8-catch-up/in_step_check.py \\
        '{"method": "mcsd", "k_config": [1], "num_speculative_tokens": 1, "stop_threshold": 0.0, "lookup": "off"}'
    python docs/results/qwen-batch8-catch-up/in_step_check.py '{"method": "mcsd", "lookup": "off"}'
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import vllm_specbeam.adapter.drafting as drafting
from benchmarks.models import resolve
from benchmarks.prompts import load_prompts

if os.environ.get("FORCE_ON") == "1":
    init = drafting.TreeDrafting.__init__

    def without_switch(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.switch = None

    drafting.TreeDrafting.__init__ = without_switch

from vllm import LLM, SamplingParams

spec = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
if spec is not None:
    spec.setdefault("model", resolve("qwen-coder-0.5b"))
llm = LLM(model=resolve("qwen-coder-1.5b"), dtype="bfloat16", max_model_len=2048, seed=0, speculative_config=spec)
prompts = [p.text for p in load_prompts("humaneval", 8)]
llm.generate(["A short sentence to warm the engine up."], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
rates = []
for _ in range(3):
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
print(sys.argv[1:], "switch removed" if spec and os.environ.get("FORCE_ON") == "1" else "", [round(r, 1) for r in rates],
      "median", round(statistics.median(rates), 1))
