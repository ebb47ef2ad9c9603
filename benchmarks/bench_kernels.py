"""Benchmark tree attention and the accepted-path KV move.

On a GPU: times the Triton kernels against (a) a dense masked attention
baseline (gather each request's keys out of the paged cache, pad, run SDPA with
a boolean tree mask) and (b) for the KV move, re-writing through vLLM's own
cache-update op layer by layer.

On CPU: times the torch reference against the dense baseline (correctness +
rough CPU timings only), runs each Triton kernel once under the interpreter on
a small shape for correctness, and reports the analytic bytes moved per step,
which is what the GPU cost is expected to follow (see docs/kernels.md).

vLLM is optional: without it the GPU run leaves out the re-write through vLLM's
cache op (``benchmarks/gpu_kernels.py``, the kernels-only GPU run, imports this
module on machines with only torch and Triton).

    python benchmarks/bench_kernels.py --out /tmp/bench.json          # CPU, small grid
    python benchmarks/bench_kernels.py --full --out bench_gpu.json     # GPU, full grid
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))  # vLLM's own kernels, as the tests call them

GPU = torch.cuda.is_available()
if not GPU:  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")


from vllm_kernels import vllm_reshape_and_cache

from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.kernels import kv_move as km
from vllm_specbeam.kernels import tree_attention as ta
from vllm_specbeam.kernels.reference import (
    accepted_path_moves,
    allowed_keys,
    build_tree_mask,
    gather_paged,
    kv_move_ref,
    split_kv_cache,
    token_slots,
    tree_attention_ref,
)

DEVICE = "cuda" if GPU else "cpu"


def random_tree(rng: np.random.Generator, num_nodes: int) -> DraftTree:
    parents = [int(rng.integers(-1, i)) if rng.random() < 0.5 else i - 1 for i in range(num_nodes)]
    return DraftTree(rng.integers(0, 1000, num_nodes), np.asarray(parents, np.int64))


def make_inputs(batch: int, nodes: int, context: int, args, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, nodes) for _ in range(batch)]
    query_lens = [t.num_nodes + 1 for t in trees]
    seq_lens = [context + n for n in query_lens]
    pages = [math.ceil(s / args.block_size) for s in seq_lens]
    num_blocks = sum(pages)
    perm = torch.randperm(num_blocks)
    block_table = torch.zeros(batch, max(pages), dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages):
        block_table[r, :n] = perm[used : used + n].int()
        used += n
    dtype = getattr(torch, args.dtype)
    kv_cache = torch.randn(num_blocks, args.block_size, args.num_kv_heads, 2 * args.head_size, dtype=dtype)
    kv_cache = kv_cache.to(DEVICE).transpose(1, 2)  # vLLM default LBNHC
    key_cache, value_cache = split_kv_cache(kv_cache, args.head_size)
    q = torch.randn(sum(query_lens), args.num_heads, args.head_size, dtype=dtype, device=DEVICE)
    return dict(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(DEVICE),
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        tree_mask=build_tree_mask(trees, device=DEVICE),
        softmax_scale=args.head_size**-0.5,
    )


def dense_inputs(inp: dict) -> dict:
    """The dense copy a tree kernel avoids: each request's keys gathered out of the
    paged cache into contiguous ``[reqs, heads, max_k, dim]`` K/V (the GQA groups
    expanded), queries padded to ``[reqs, heads, max_q, dim]``, and the boolean
    ``[reqs, 1, max_q, max_k]`` mask of the same keys the kernel lets each row see."""
    q, key_cache, value_cache = inp["q"], inp["key_cache"], inp["value_cache"]
    starts, seq_lens = inp["query_start_loc"].tolist(), inp["seq_lens"].tolist()
    num_reqs, block_size = len(seq_lens), key_cache.shape[1]
    max_q = max(b - a for a, b in itertools.pairwise(starts))
    max_k = max(seq_lens)
    heads, kv_heads, dim = q.shape[1], key_cache.shape[2], q.shape[2]
    qd = q.new_zeros(num_reqs, heads, max_q, dim)
    kd = q.new_zeros(num_reqs, kv_heads, max_k, dim)
    vd = q.new_zeros(num_reqs, kv_heads, max_k, dim)
    mask = torch.zeros(num_reqs, 1, max_q, max_k, dtype=torch.bool, device=q.device)
    tree_mask = inp["tree_mask"]
    for r, seq_len in enumerate(seq_lens):
        rows = slice(starts[r], starts[r + 1])
        n = starts[r + 1] - starts[r]
        slots = token_slots(inp["block_table"][r], torch.arange(seq_len, device=q.device), block_size)
        qd[r, :, :n] = q[rows].transpose(0, 1)
        kd[r, :, :seq_len] = gather_paged(key_cache, slots).transpose(0, 1)
        vd[r, :, :seq_len] = gather_paged(value_cache, slots).transpose(0, 1)
        words = tree_mask[rows] if tree_mask is not None else torch.zeros(n, 1, dtype=torch.int64, device=q.device)
        mask[r, 0, :n, :seq_len] = allowed_keys(words, seq_len - n)
    mask[:, :, :, 0] |= ~mask.any(-1)  # padded query rows: avoid all -inf rows
    group = heads // kv_heads
    return dict(q=qd, k=kd.repeat_interleave(group, 1), v=vd.repeat_interleave(group, 1), mask=mask, starts=starts)


def dense_attention(dense: dict, scale: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """SDPA with the boolean mask over :func:`dense_inputs`, unpadded back to
    ``[num_tokens, heads, dim]``; computed in ``dtype`` (default: the inputs'; fp32
    on CPU, for accuracy) and returned in the inputs' dtype."""
    qd, kd, vd = dense["q"], dense["k"], dense["v"]
    out_dtype = qd.dtype
    dtype = dtype or (out_dtype if qd.is_cuda else torch.float32)
    qd, kd, vd = qd.to(dtype), kd.to(dtype), vd.to(dtype)
    out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=dense["mask"], scale=scale)
    starts = dense["starts"]
    return torch.cat([out[r, :, : starts[r + 1] - starts[r]].transpose(0, 1) for r in range(len(starts) - 1)]).to(
        out_dtype
    )


def dense_masked_baseline(inp: dict) -> torch.Tensor:
    """What one would do without a tree kernel: gather, pad, SDPA with a bool mask."""
    return dense_attention(dense_inputs(inp), inp["softmax_scale"])


def timed(fn, iters: int) -> tuple[float, object]:
    result = fn()  # warm-up (and JIT compile on GPU)
    if GPU:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        result = fn()
    if GPU:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3, result


def attention_bytes(batch: int, nodes: int, context: int, args) -> dict:
    """KV bytes read per layer and step (the attention cost is bandwidth bound)."""
    elem = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    per_token = 2 * args.num_kv_heads * args.head_size * elem  # K + V of one position
    rows = nodes + 1
    cfg = ta._launch_config(args.num_heads // args.num_kv_heads, args.head_size, rows) if ta.HAS_TRITON else None
    passes = math.ceil(rows / cfg["BLOCK_Q"]) if cfg else rows
    seq = context + rows
    # every program (BLOCK_Q rows x one KV head) re-reads the context and the step's rows
    tree_kernel = batch * passes * (context + rows) * per_token
    return {
        "stock_decode_1_row": batch * (context + 1) * per_token,
        "tree_kernel": tree_kernel,
        "tree_kernel_context_passes": passes,
        # gather (read cache, write dense) + SDPA read of the dense copy + the mask
        "dense_masked_baseline": batch * (3 * seq * per_token + rows * seq),
    }


def bench_attention(args, results: dict) -> None:
    grid = [(b, n, c) for b in args.batch for n in args.tree_nodes for c in args.context]
    for batch, nodes, context in grid:
        inp = make_inputs(batch, nodes, context, args)
        entry = {"batch": batch, "tree_nodes": nodes, "context": context}
        entry["bytes_per_layer"] = attention_bytes(batch, nodes, context, args)
        dense_ms, dense = timed(lambda: dense_masked_baseline(inp), args.iters)
        entry["dense_masked_ms"] = dense_ms
        if GPU:
            kern_ms, out = timed(lambda: ta.tree_attention(**inp, max_query_len=nodes + 1), args.iters)
            entry["tree_kernel_ms"] = kern_ms
        else:
            kern_ms, out = timed(lambda: tree_attention_ref(**inp), args.iters)
            entry["torch_reference_ms"] = kern_ms
        entry["max_abs_diff_vs_dense"] = float((out.float() - dense.float()).abs().max())
        results["attention"].append(entry)
        print(json.dumps(entry), flush=True)


def kv_move_case(batch: int, args, rng: np.random.Generator, context: int = 1000, rows: int = 64) -> dict:
    """One step's accepted-path move: ``args.num_layers`` paged caches, each of ``batch``
    requests verified ``rows`` rows after ``context`` tokens and accepted a root-to-node
    path of 6 of them. Returns the layers, the moves and their analytic cost."""
    block_size = args.block_size
    pages = math.ceil((context + rows + 1) / block_size)
    dtype = getattr(torch, args.dtype)
    layers = [
        torch.randn(
            batch * pages, block_size, args.num_kv_heads, 2 * args.head_size, dtype=dtype, device=DEVICE
        ).transpose(1, 2)
        for _ in range(args.num_layers)
    ]
    block_table = torch.arange(batch * pages, dtype=torch.int32, device=DEVICE).view(batch, pages)
    accepted = [[0, *sorted(rng.choice(np.arange(1, rows + 1), size=5, replace=False).tolist())] for _ in range(batch)]
    src, dst, cu = accepted_path_moves(block_table, [context] * batch, accepted, block_size)
    moved = src.numel() * args.num_kv_heads * 2 * args.head_size * layers[0].element_size() * args.num_layers
    return {"layers": layers, "src": src, "dst": dst, "cu": cu, "bytes_moved": moved}


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def bench_kv_move(args, results: dict) -> None:
    """Fused all-layer move vs gather + vLLM's reshape_and_cache per layer (when vLLM
    is installed)."""
    rng = np.random.default_rng(1)
    with_vllm = GPU and vllm_available()
    for batch in args.batch:
        case = kv_move_case(batch, args, rng)
        layers, src, dst, cu, moved = case["layers"], case["src"], case["dst"], case["cu"], case["bytes_moved"]
        entry = {
            "batch": batch,
            "layers": args.num_layers,
            "bytes_fused": 2 * moved,
            "bytes_rewrite_via_cache_op": 4 * moved,
            "launches_fused": 1,
            "launches_rewrite_via_cache_op": 3 * args.num_layers,
        }
        if GPU:
            ptrs = km.layer_pointer_table(layers)
            entry["fused_ms"], _ = timed(lambda: km.kv_move(layers, src, dst, cu, ptrs), args.iters)

            def rewrite():
                for layer in layers:
                    key_cache, value_cache = split_kv_cache(layer, args.head_size)
                    key, value = gather_paged(key_cache, src), gather_paged(value_cache, src)
                    vllm_reshape_and_cache(key, value, key_cache, value_cache, dst)

            if with_vllm:
                entry["rewrite_via_cache_op_ms"], _ = timed(rewrite, args.iters)
            entry["torch_index_copy_ms"], _ = timed(lambda: kv_move_ref(layers, src, dst), args.iters)
        else:
            entry["torch_reference_ms"], _ = timed(lambda: kv_move_ref(layers, src, dst), args.iters)
        results["kv_move"].append(entry)
        print(json.dumps(entry), flush=True)


def interpreter_check(args, results: dict) -> None:
    """Run both Triton kernels once under the interpreter (CPU only)."""
    small = argparse.Namespace(**{**vars(args), "num_heads": 8, "num_kv_heads": 2, "head_size": 64})
    inp = make_inputs(2, 8, 40, small, seed=3)
    got = ta.tree_attention(**inp)
    want = tree_attention_ref(**inp)
    results["interpreter"]["tree_attention_max_abs_diff"] = float((got.float() - want.float()).abs().max())
    layers = [torch.cat([inp["key_cache"], inp["value_cache"]], -1).transpose(1, 2).contiguous()]
    expected = [layers[0].clone()]
    src, dst, cu = accepted_path_moves(inp["block_table"], [40, 40], [[0, 2, 5], [0, 1, 7, 8]], args.block_size)
    kv_move_ref(expected, src, dst)
    km.kv_move(layers, src, dst, cu)
    results["interpreter"]["kv_move_exact"] = bool(torch.equal(layers[0], expected[0]))
    print(json.dumps(results["interpreter"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--full", action="store_true", help="batch 1-64, trees 8-64, contexts 512-8k (GPU)")
    parser.add_argument("--batch", type=int, nargs="+")
    parser.add_argument("--tree-nodes", type=int, nargs="+")
    parser.add_argument("--context", type=int, nargs="+")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()
    if args.full:
        args.batch = args.batch or [1, 8, 64]
        args.tree_nodes = args.tree_nodes or [8, 32, 64]
        args.context = args.context or [512, 2048, 8192]
    else:  # small enough for a shared 2-core CPU
        args.batch = args.batch or [1, 4]
        args.tree_nodes = args.tree_nodes or [8, 64]
        args.context = args.context or [512, 2048]
        if not GPU:
            args.num_heads, args.num_kv_heads, args.num_layers = 8, 2, 4
    args.iters = args.iters or (20 if GPU else 2)

    results = {
        "device": torch.cuda.get_device_name() if GPU else f"cpu ({platform.processor() or platform.machine()})",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "note": "GPU rows time the Triton kernels; CPU rows time the torch reference (not representative).",
        "attention": [],
        "kv_move": [],
        "interpreter": {},
    }
    bench_attention(args, results)
    bench_kv_move(args, results)
    if not GPU and ta.HAS_TRITON:
        interpreter_check(args, results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
