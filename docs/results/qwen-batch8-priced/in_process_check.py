"""The in-process check behind "Draft forwards priced as they cost" (docs/results.md).

One in-process engine, the Qwen pair, bfloat16, 8 HumanEval prompts x 64 tokens, greedy, at
``BATCH`` requests a call (1 or 8), after a one-sentence warm-up; prints each timed run's tok/s.
The first run is the one that counts for methods that remember earlier requests (``mcsd``'s
global lookup drafts the later runs from the first's outputs). ``ROOT``: the checkout to import
the plugin from (a worktree of the code before the change, or this one).

    ROOT=/tmp/old BATCH=8 RUNS=3 python docs/results/qwen-batch8-priced/in_process_check.py '{"method": "mcsd"}'
    ROOT=. BATCH=8 RUNS=3 python docs/results/qwen-batch8-priced/in_process_check.py none
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
root = str(Path(os.environ.get("ROOT", Path(__file__).resolve().parents[3])).resolve())
sys.path.insert(0, root)

from benchmarks.models import resolve
from benchmarks.prompts import load_prompts
from vllm import LLM, SamplingParams

spec = None if sys.argv[1] == "none" else json.loads(sys.argv[1])
if spec is not None:
    spec.setdefault("model", resolve("qwen-coder-0.5b"))
batch = int(os.environ.get("BATCH", 8))
llm = LLM(model=resolve("qwen-coder-1.5b"), dtype="bfloat16", max_model_len=2048, seed=0, speculative_config=spec)
prompts = [p.text for p in load_prompts("humaneval", 8)]
llm.generate(["A short sentence to warm the engine up."], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
rates = []
for _ in range(int(os.environ.get("RUNS", 2))):
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(prompts), batch):
        params = SamplingParams(temperature=0.0, max_tokens=64)
        outputs = llm.generate(prompts[first : first + batch], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    rates.append(tokens / (time.perf_counter() - start))
print(os.path.basename(root), "batch", batch, sys.argv[1], [round(r, 1) for r in rates], flush=True)
