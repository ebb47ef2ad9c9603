"""In-process load mix: none vs a method, per-step log of the drafting step."""
import os, sys, time, json, statistics
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, ".")
method = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
from vllm import LLM, SamplingParams
from benchmarks import models
from benchmarks.load import workload
from benchmarks.prompts import load_prompts
from vllm_specbeam.adapter import drafting as dm

log = []
orig = dm.TreeDrafting.propose
def propose(self, batch, max_model_len, draft_cost):
    t0 = time.perf_counter()
    p = orig(self, batch, max_model_len, draft_cost)
    b = self.budget
    log.append(dict(t=t0, B=len(batch), drain=self.arrivals.draining, dt=time.perf_counter()-t0,
                    nodes=sum(map(len, p.drafts)), reqs_with=sum(1 for d in p.drafts if d),
                    kept_value=b.kept_value if b else 0, br=b.kept_branches if b else 0,
                    lines=" ".join(f"{n}={c.intercept*1e3:.0f}+{c.slope*1e3:.2f}|{c.knee:.0f}+{c.bend*1e3:.2f}" for n, c in (("T", b.cost), ("C", b.chain_cost), ("P", b.plain_cost)) if c is not None) if b else ""))
    return p
dm.TreeDrafting.propose = propose
if os.environ.get("NO_DRAIN"):
    dm.TreeDrafting._worth = lambda self, batch, max_model_len: {}
orig_dts = dm.TreeDrafting.drafts_this_step
def dts(self, req_ids, params):
    r = orig_dts(self, req_ids, params)
    if not r:
        log.append(dict(t=time.perf_counter(), B=len(req_ids), drain=self.arrivals.draining, off=True))
    return r
dm.TreeDrafting.drafts_this_step = dts
from vllm.v1.worker import gpu_model_runner as gmr
steps = []
orig_exec = gmr.GPUModelRunner.execute_model
def execute_model(self, scheduler_output, *a, **k):
    t0 = time.perf_counter()
    r = orig_exec(self, scheduler_output, *a, **k)
    steps.append((t0, time.perf_counter() - t0, self.input_batch.num_reqs, scheduler_output.total_num_scheduled_tokens))
    return r
gmr.GPUModelRunner.execute_model = execute_model

model = models.resolve_option("smollm2-135m-instruct")

from benchmarks.load import speculative_config
kw = {}
if method != "none":
    kw["speculative_config"] = speculative_config(method, None)
llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, seed=0, **kw)
tok = llm.get_tokenizer()
prompts = [p.text for p in load_prompts("humaneval", 40)]
calls = workload(prompts, 200, stops=["\n\n", "return", ":"], xargs={"num_speculative_tokens": 2, "max_nodes": 4})
ins, sps = [], []
for c in calls:
    text = tok.apply_chat_template([{"role": "user", "content": c.prompt}], tokenize=False, add_generation_prompt=True) if c.chat else c.prompt
    ins.append(text)
    sps.append(SamplingParams(max_tokens=c.max_tokens, temperature=0.0 if c.greedy else 0.8, n=1 if c.greedy else 2,
        seed=c.seed, logprobs=2 if c.logprobs else None, stop=list(c.stop) or None,
        extra_args=(c.xargs if (c.xargs and method != "none") else None)))
llm.generate(["hello"], SamplingParams(max_tokens=8), use_tqdm=False)
waves = []
for r in range(rounds):
    log.clear(); steps.clear()
    t = time.perf_counter(); llm.generate(ins, sps, use_tqdm=False); waves.append(time.perf_counter() - t)
    nsteps = len(log)
    on = [x for x in log if not x.get("off")]
    print(f"{method} wave {r}: {waves[-1]:.2f}s steps={nsteps} on={len(on)} drain_steps={sum(x['drain'] for x in log)} "
          f"nodes={sum(x['nodes'] for x in on)} draft_s={sum(x['dt'] for x in on):.2f}", flush=True)
    tot = sum(d for _, d, _, _ in steps)
    pre = sum(d for _, d, n, tok in steps if tok > n + 400)
    print(f"  exec steps={len(steps)} exec_s={tot:.2f} prefill-ish_s={pre:.2f} rows={sum(t for *_, t in steps)}", flush=True)
    if r == rounds - 1:
        for s0, d, n, tok in steps:
            print(f"   step {s0-steps[0][0]:6.2f} {d*1e3:7.1f}ms reqs={n:3d} tokens={tok}")
    if r == rounds - 1 and log:
        t0 = log[0]["t"]
        for x in log:
            print(f"  {x['t']-t0:6.2f} B={x['B']:3d} drain={int(x['drain'])} " + ("off" if x.get("off") else f"nodes={x['nodes']:3d} reqs={x['reqs_with']:3d} val={x['kept_value']:.2f} br={int(x['br'])} dt={x['dt']*1e3:.1f}ms {x['lines']}"))
print(method, "waves", [round(w, 2) for w in waves])
