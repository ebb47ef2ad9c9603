"""Compile the kernels' specializations for sm_80 and sm_90 on the CPU: no spills, shared memory fits.

    tools/check_gpu_compile.sh [args]     (make check-gpu-compile: the pinned Triton, in .venv-triton/)
    .venv-triton/3.8.0/bin/python tools/check_gpu_compile.py [--grid ci|full] [--targets 80,90]
        [--jobs 2] [--strict] [--all-rows] [--json out.json]

The kernels are tested on CPU under Triton's interpreter, which says nothing about registers or
shared memory. Here each specialization goes through Triton's whole NVIDIA pipeline down to a cubin
(the wheel's own ``ptxas``; no GPU, no driver), with what the JIT would specialize on. The check
fails if one does not compile, runs out of registers (spills at the 255-register cap), or needs more
shared memory than the device gives a block.

* What is launched: the real launchers (``tree_attention``, ``kv_move``) are called on small CPU
  tensors laid out as vLLM lays them out (the KV cache of ``TRITON_ATTN``, logical ``[blocks,
  kv_heads, block_size, 2 * head_size]``, physically ``[blocks, block_size, kv_heads, content]``),
  with the kernel replaced by a recorder: tile sizes, warps, constexprs and strides are the
  launchers' own, so this check follows them when they change. ``DOT_IN_FP32`` is set back to what
  a GPU gets (False: it is set only under the interpreter).
* What the JIT specializes on: the recorded arguments go through the JIT's own binder
  (``native_specialize_impl``) and argument packing, as ``JITFunction.run`` does: pointers and ints
  divisible by 16 get ``tt.divisibility = 16``, an int equal to 1 becomes a constant (one mask word:
  the mask's row stride). Without these hints the kernels would be checked as no GPU runs them.
* What is measured: ``metadata.shared`` (dynamic shared memory; a launch above the device's opt-in
  limit fails) and ``ptxas -v``'s registers and spill stores/loads, from the log of the very
  ``ptxas`` run that made the cubin (``TRITON_DUMP_PTXAS_LOG``).
* Spills: ``ptxas`` sometimes stops at 128 registers, a step of the occupancy ladder (two blocks of
  8 warps, four of 4 warps per SM), and spills a few bytes rather than go above. Each spilling kernel
  is compiled again with ``maxnreg=255`` (PTX ``.maxnreg``): if it then does not spill, the spill was
  ``ptxas``'s occupancy trade, reported but not failed (``--strict`` fails it too); if it still
  spills, the kernel needs more than 255 registers a thread: a failure.

What the tree backend can launch: fp16 and bf16 (``TreeTritonAttentionBackend.supported_dtypes``),
every ``BLOCK_Q`` that ``_launch_config`` picks for 1-128 rows per request, mask words 1 / 2 / 16
(the three ways the JIT specializes their row stride), ``tree_base`` on and off, KV block sizes
16/32/64, head sizes and GQA ratios as ``tree_attention.admits`` allows. ``--grid full``: every (dtype, head size,
group, tile config) shape, once each, with the other axes in rotation (~300 kernels a target);
``--grid ci``: every register and shared-memory footprint (dtype, head size, ``BLOCK_M``,
``TILE_N``, warps) once, the groups and other axes in rotation (~50 a target, about 2 minutes
on 2 cores for sm_80 and sm_90).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

#: Largest dynamic shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes.
SHARED_LIMIT = {
    80: 166912,  # A100: 163 KiB
    86: 101376,  # A10, A40, RTX 30xx: 99 KiB
    87: 166912,  # Jetson Orin
    89: 101376,  # L4, L40, RTX 40xx: 99 KiB
    90: 232448,  # H100, H200: 227 KiB
}
MAX_REGISTERS = 255  # a thread's, on every target here
REGISTERS_PER_SM = 65536

# ------------------------------------------------------------------ the axes
DTYPES = ("float16", "bfloat16")
#: every HEAD_SIZE_PAD from 32 to 256, both tile classes (<= 128, > 128) and sizes that are not
#: powers of two (masked lanes): Phi-2's 80, Phi-3's 96, 192
HEAD_SIZES = (32, 64, 80, 96, 128, 192, 256)
#: query heads per KV head: every padded group from 1 to 128, with ratios that are not a power of
#: two (Qwen2-7B's 7, StarCoder's MQA 48, Falcon-7B's MQA 71); ``tree_attention.admits`` drops what is too big
GROUPS = (1, 2, 3, 4, 7, 8, 16, 32, 48, 71)
#: rows per request in a step: every BLOCK_Q the launcher can pick comes from one of these
MAX_QUERY_LENS = tuple(2**i for i in range(8))
#: mask words (a power of two, ``cuda._num_words``): 1 makes the row stride the constant 1, 16 a
#: multiple of 16, 2 neither
NUM_WORDS = (1, 2, 16)
TREE_BASE = (False, True)
BLOCK_SIZES = (16, 32, 64)  # vLLM's Triton backend: multiples of 16
#: blocks per block-table row: divisible by 16 or not, the two ways ``stride_bt_req`` specializes
MAX_BLOCKS = (256, 257)
#: KV move: row = kv_heads x 2 x head_size elements, every TILE from 128 to 1024 (then chunks)
MOVE_SHAPES = ((1, 64), (1, 80), (2, 128), (8, 64), (8, 128), (16, 256), (4, 96), (1, 256))


@dataclass(frozen=True)
class Spec:
    """One launch to record: a tree-attention batch (one request) or a KV move, in vLLM's layout."""

    kernel: str  # "tree_attention" | "kv_move"
    dtype: str
    head_size: int
    num_kv_heads: int
    group: int = 1
    max_query_len: int = 1
    num_words: int = 1
    tree_base: bool = False
    block_size: int = 16
    max_blocks: int = 257


def tree_specs(grid: str, head_sizes=HEAD_SIZES, groups=GROUPS, check_admitted=True) -> list[Spec]:
    """Tree-attention launches, one per shape of ``grid``, the other axes in rotation."""
    from vllm_specbeam.kernels.tree_attention import _launch_config, admits

    candidates: dict[tuple, list[tuple]] = {}
    for d, h, g, q in itertools.product(DTYPES, head_sizes, groups, MAX_QUERY_LENS):
        if check_admitted and not admits(h, g):
            continue
        cfg = _launch_config(g, h, q)
        if grid == "full":
            key = (d, h, g, tuple(sorted(cfg.items())))
        else:  # the footprint: the group only changes how BLOCK_M rows split into rows x heads
            key = (d, h, cfg["BLOCK_Q"] * cfg["QPKV_PAD"], cfg["TILE_N"], cfg["num_warps"])
        same = candidates.setdefault(key, [])
        if all(g != other for _, _, other, _ in same):
            same.append((d, h, g, q))
    shapes = [same[i % len(same)] for i, same in enumerate(candidates.values())]
    # Mask words vary fastest: the shapes of one dtype and head size, which come together, get different ones.
    sides = [(w, b, bs, mb) for b, bs, mb in itertools.product(TREE_BASE, BLOCK_SIZES, MAX_BLOCKS) for w in NUM_WORDS]
    return [
        Spec("tree_attention", d, h, 2, group=g, max_query_len=q, num_words=w, tree_base=b, block_size=bs,
             max_blocks=mb)
        for i, (d, h, g, q) in enumerate(shapes)
        for w, b, bs, mb in [sides[i % len(sides)]]
    ]  # fmt: skip


def move_specs() -> list[Spec]:
    """KV moves: the kernel copies raw bits, so fp16 and bf16 are one kernel (``ELEM`` int16)."""
    return [Spec("kv_move", "float16", h, n, block_size=BLOCK_SIZES[i % 2]) for i, (n, h) in enumerate(MOVE_SHAPES)]


# ------------------------------------------------------ recording a launch
class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@contextlib.contextmanager
def _patched(obj, name, value):
    real = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield value
    finally:
        setattr(obj, name, real)


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def record(spec: Spec):
    """``(jit_function, args, kwargs)`` of the launch ``spec`` describes, from the launcher itself."""
    import torch

    from vllm_specbeam.kernels import kv_move, tree_attention

    dtype = getattr(torch, spec.dtype)
    d, hkv, bs = spec.head_size, spec.num_kv_heads, spec.block_size
    # vLLM's TRITON_ATTN cache: logical [blocks, kv_heads, block_size, 2 * head], physically
    # [blocks, block_size, kv_heads, content] (KVCacheLayout LBNHC, the default).
    kv_cache = torch.zeros(2, bs, hkv, 2 * d, dtype=dtype).transpose(1, 2)
    if spec.kernel == "kv_move":
        kernel = kv_move._kv_move_kernel
        moves = torch.zeros(2, dtype=torch.int64)
        # CPU tensors take the launcher's interpreter path, which launches the same kernel.
        with _patched(kv_move, "_kv_move_kernel", _Recorder()) as rec, _env("TRITON_INTERPRET", "1"):
            kv_move.kv_move([kv_cache, kv_cache.clone()], moves, moves + 1, torch.tensor([0, 2]))
        (args, kwargs), = rec.calls  # fmt: skip
        return kernel, args, kwargs

    kernel = tree_attention._tree_attention_kernel
    rows = spec.max_query_len
    # The backend's views: kv_cache.transpose(1, 2).split(head_size, -1) (cuda.py _tree_forward).
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    q = torch.zeros(rows, hkv * spec.group, d, dtype=dtype)
    with (
        _patched(tree_attention, "_tree_attention_kernel", _Recorder()) as rec,
        _patched(tree_attention, "_interpreting", lambda: True),  # past the CPU fallback
    ):
        tree_attention.tree_attention(
            q, key_cache, value_cache,
            torch.zeros(1, spec.max_blocks, dtype=torch.int32),  # block_table
            torch.tensor([0, rows], dtype=torch.int32),  # query_start_loc
            torch.tensor([rows], dtype=torch.int32),  # seq_lens
            torch.zeros(rows, spec.num_words, dtype=torch.int64),  # tree_mask
            d**-0.5, max_query_len=rows,
            tree_base=torch.zeros(1, dtype=torch.int32) if spec.tree_base else None,
        )  # fmt: skip
    (args, kwargs), = rec.calls  # fmt: skip
    assert "DOT_IN_FP32" in kwargs
    kwargs["DOT_IN_FP32"] = False  # what a GPU launch passes: it is for the interpreter only
    return kernel, args, kwargs


def specialize(fn, args, kwargs, capability: int):
    """``(signature, constexprs, attrs, options)`` as ``JITFunction.run`` makes them for a launch."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", capability, 32))
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options.__dict__


def kernel_key(spec: Spec, capability: int) -> str:
    """Two launches with the same key are one compiled kernel (the JIT's cache would hit)."""
    fn, args, kwargs = record(spec)
    signature, constexprs, attrs, options = specialize(fn, args, kwargs, capability)
    parts = (signature, constexprs, attrs, options)
    return repr((fn.__name__, *(sorted(p.items(), key=repr) for p in parts)))


# ---------------------------------------------------------------- compiling
@dataclass
class Result:
    capability: int
    spec: Spec
    label: str
    num_warps: int
    shared: int = -1
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    #: for a spilling kernel: registers and spilled bytes with maxnreg=255 (-1: not tried)
    registers_free: int = -1
    spills_free: int = -1
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process and its ptxas runs: the wall time on an idle core
    error: str = ""

    @property
    def spills(self) -> int:
        return max(0, self.spill_stores) + max(0, self.spill_loads)

    @property
    def occupancy_spill(self) -> bool:
        """Spills that ``ptxas`` chose (under 255 registers) and that ``maxnreg=255`` removes."""
        return self.spills > 0 and self.spills_free == 0

    def problems(self, strict: bool = False) -> list[str]:
        if self.error:
            return [f"does not compile: {self.error}"]
        out = []
        if self.spills and (strict or not self.occupancy_spill):
            why = "ptxas's occupancy trade" if self.occupancy_spill else "out of registers"
            out.append(f"spills {self.spill_stores} B stored / {self.spill_loads} B loaded "
                       f"at {self.registers} registers ({why})")  # fmt: skip
        limit = SHARED_LIMIT[self.capability]
        if self.shared > limit:
            out.append(f"shared memory {self.shared} B > {limit} B")
        if self.registers * self.num_warps * 32 > REGISTERS_PER_SM:
            out.append(f"{self.registers} registers x {self.num_warps * 32} threads > {REGISTERS_PER_SM}")
        return out


_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def label(spec: Spec, kwargs) -> str:
    if spec.kernel == "kv_move":
        return f"kv_move kv_heads={spec.num_kv_heads} content={kwargs['CONTENT']} TILE={kwargs['TILE']}"
    dt = "bf16" if spec.dtype == "bfloat16" else "fp16"
    return (
        f"tree {dt} head={spec.head_size} G={spec.group} BLOCK_M={kwargs['BLOCK_Q']}x{kwargs['QPKV_PAD']} "
        f"TILE_N={kwargs['TILE_N']} warps={kwargs['num_warps']} words={spec.num_words} "
        f"tree_base={int(spec.tree_base)} block={spec.block_size} bt_row={spec.max_blocks}"
    )


def _compile(fn, signature, constexprs, attrs, options, capability):
    """``(compiled kernel, registers, spill stores, spill loads)`` from ``ptxas -v``'s own report."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    log = io.StringIO()
    with contextlib.redirect_stdout(log), knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True  # the compiler prints ptxas -v's report
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", capability, 32), options=options)  # fmt: skip
    text = log.getvalue()
    frame, regs = _PTXAS_FRAME.search(text), _PTXAS_REGS.search(text)
    if frame is None or regs is None:
        raise RuntimeError(f"no ptxas report in the compiler's output: {text[-500:]!r}")
    return compiled, int(regs.group(1)), int(frame.group(2)), int(frame.group(3))


def compile_one(job: tuple[Spec, int]) -> Result:
    """Compile one specialization for ``sm_<capability>`` and read its resources."""
    spec, capability = job
    fn, args, kwargs = record(spec)
    result = Result(capability, spec, label(spec, kwargs), num_warps=kwargs.get("num_warps", 4))
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    try:
        signature, constexprs, attrs, options = specialize(fn, args, kwargs, capability)
        compiled, result.registers, result.spill_stores, result.spill_loads = _compile(
            fn, signature, constexprs, attrs, options, capability
        )
        result.shared = compiled.metadata.shared
        if result.spills:
            _, result.registers_free, stores, loads = _compile(
                fn, signature, constexprs, attrs, dict(options, maxnreg=MAX_REGISTERS), capability
            )
            result.spills_free = stores + loads
    except Exception as e:  # reported per specialization, the run goes on
        lines = str(e).strip().splitlines()
        result.error = f"{type(e).__name__}: {lines[0] if lines else ''}"
    result.seconds = time.perf_counter() - start
    result.cpu_seconds = _cpu_seconds() - cpu_start
    return result


def _cpu_seconds() -> float:
    import resource

    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _init_worker(cache_dir: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    from triton import knobs

    knobs.compilation.always_compile = True  # a cached kernel would come without a ptxas report


# --------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", choices=("ci", "full"), default="ci")
    parser.add_argument("--targets", default="80,90", help="compute capabilities, e.g. 80,86,89,90")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--strict", action="store_true", help="fail on ptxas's occupancy spills too")
    parser.add_argument("--heads", help="tree attention's head sizes instead of the grid's, e.g. 128,512")
    parser.add_argument("--groups", help="GQA ratios instead of the grid's, e.g. 1,8")
    parser.add_argument("--any-shape", action="store_true", help="compile what tree_attention.admits leaves out too")
    parser.add_argument("--no-move", action="store_true", help="tree attention only")
    parser.add_argument("--expect-triton", help="fail unless this Triton version is the one imported")
    parser.add_argument("--list", action="store_true", help="print the specializations, compile nothing")
    parser.add_argument("--all-rows", action="store_true", help="print every result, not only the worst")
    parser.add_argument("--json", help="write every result here")
    opts = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be @triton.jit, not interpreted

    import triton

    targets = [int(t) for t in opts.targets.split(",")]
    if any(t not in SHARED_LIMIT for t in targets):
        parser.error(f"targets: one of {sorted(SHARED_LIMIT)}")
    print(f"Triton {triton.__version__} ({os.path.dirname(triton.__file__)})")
    if opts.expect_triton and triton.__version__ != opts.expect_triton:
        print(f"FAIL: expected Triton {opts.expect_triton}")
        return 1

    heads = tuple(int(h) for h in opts.heads.split(",")) if opts.heads else HEAD_SIZES
    groups = tuple(int(g) for g in opts.groups.split(",")) if opts.groups else GROUPS
    specs = tree_specs(opts.grid, heads, groups, check_admitted=not opts.any_shape)
    specs += [] if opts.no_move else move_specs()
    start = time.perf_counter()
    jobs, seen = [], set()
    for capability in targets:
        for spec in specs:
            key = (capability, kernel_key(spec, capability))
            if key not in seen:
                seen.add(key)
                jobs.append((spec, capability))
    print(f"{len(jobs)} specializations ({opts.grid} grid), targets {', '.join(f'sm_{t}' for t in targets)}, "
          f"{opts.jobs} jobs")  # fmt: skip
    if opts.list:
        for spec, capability in jobs:
            print(f"  sm_{capability} {label(spec, record(spec)[2])}")
        return 0

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="specbeam-triton-cache-") as cache_dir:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(opts.jobs, initializer=_init_worker, initargs=(cache_dir,)) as pool:
            # The slow ones (big heads, sm_90) first, so the pool does not end on one of them.
            ordered = sorted(jobs, key=lambda j: (j[0].kernel == "kv_move", -j[0].head_size, -j[1]))
            for i, result in enumerate(pool.imap_unordered(compile_one, ordered), 1):
                results.append(result)
                if i % 50 == 0:
                    print(f"  {i}/{len(ordered)} compiled, {time.perf_counter() - start:.0f} s", flush=True)
    elapsed = time.perf_counter() - start
    results.sort(key=lambda r: (r.capability, r.spec.kernel, -r.shared, -r.registers))
    _report(results, targets, opts, elapsed)

    failures = [(r, p) for r in results for p in r.problems(opts.strict)]
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"triton": triton.__version__, "grid": opts.grid, "seconds": elapsed,
                       "results": [dict(asdict(r), spec=asdict(r.spec)) for r in results]}, f, indent=1)  # fmt: skip
    if failures:
        print(f"\nFAIL: {len(failures)} problem(s)")
        for r, problem in failures:
            print(f"  sm_{r.capability} {r.label}: {problem}")
        return 1
    print("OK: every specialization compiles, no register shortage, shared memory within each device's limit")
    return 0


def _report(results: list[Result], targets: list[int], opts, elapsed: float) -> None:
    rows = results if opts.all_rows else _worst_rows(results, opts.strict)
    print(f"\n{'target':6} {'shared B':>9} {'regs':>4} {'spills':>10}  specialization")
    for r in rows:
        if r.error:
            spills = "ERROR"
        elif r.spills:
            spills = f"{r.spills}>{r.spills_free}@{r.registers_free}"  # spilled bytes > with maxnreg=255
        else:
            spills = "0"
        print(f"sm_{r.capability:<3} {r.shared:>9} {r.registers:>4} {spills:>10}  {r.label}")
    print()
    for capability in targets:
        ok = [r for r in results if r.capability == capability and not r.error]
        if not ok:
            continue
        top_shared = max(ok, key=lambda r: r.shared)
        top_regs = max(ok, key=lambda r: r.registers)
        occupancy = [r for r in ok if r.occupancy_spill]
        short = [r for r in ok if r.spills and not r.occupancy_spill]
        trades = f"{len(occupancy)} ptxas occupancy trades"
        if occupancy:
            regs = "/".join(str(n) for n in sorted({r.registers for r in occupancy}))
            trades += f" (<= {max(r.spills for r in occupancy)} B at {regs} registers, none with maxnreg=255)"
        print(
            f"sm_{capability}: {len(ok)} compiled; spills: {len(short)} out of registers, {trades}; "
            f"worst shared memory {top_shared.shared} B = {top_shared.shared / 1024:.1f} KiB of "
            f"{SHARED_LIMIT[capability] / 1024:.0f} ({top_shared.label}); most registers {top_regs.registers} "
            f"({top_regs.label})"
        )
    cpu = sum(r.cpu_seconds for r in results)
    print(
        f"{len(results)} specializations in {elapsed:.0f} s; the compiles took {cpu:.0f} s of CPU "
        f"(~{cpu / opts.jobs:.0f} s on {opts.jobs} idle cores)"
    )


def _worst_rows(results: list[Result], strict: bool, n: int = 4) -> list[Result]:
    """Per target and kernel: the spills and failures, the ``n`` largest shared, the ``n`` most registers."""
    keep: dict[int, Result] = {}
    for _, group in itertools.groupby(results, key=lambda r: (r.capability, r.spec.kernel)):
        group = list(group)
        keep.update((id(r), r) for r in group if r.spills or r.problems(strict))
        for key in (lambda r: r.shared, lambda r: r.registers):
            keep.update((id(r), r) for r in sorted(group, key=key, reverse=True)[:n])
    return sorted(keep.values(), key=lambda r: (r.capability, r.spec.kernel, -r.shared, -r.registers))


if __name__ == "__main__":
    sys.exit(main())
