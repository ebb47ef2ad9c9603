"""The CUDA wiring, on CPU: the attention backend, the runner's step mask and
KV move, and the start-up selection of the worker, backend and cudagraph mode.

The backend's impl runs here with CPU tensors under ``TRITON_INTERPRET=1``
(set below before Triton is imported): the plugin's tree kernel, and vLLM's
own Triton kernels (cache write and ``unified_attention``) for comparison.
vLLM's CPU build swaps Triton for a placeholder; the ``vllm_triton`` fixture
points vLLM's Triton backend module at the real kernels. Nothing here proves
the kernels on a GPU (see docs/kernels.md, "What ran where").
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton  # noqa: F401  (in the test extra: without it these tests fail here, never skip)
from vllm.config import CUDAGraphMode, ParallelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.v1.attention.backends import triton_attn
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm_kernels import import_vllm_triton_module

from vllm_specbeam.adapter import draft_blocks, draft_model, engine_config, plugin
from vllm_specbeam.adapter.attention import cuda as gpu_attention
from vllm_specbeam.adapter.attention.step import masked_rows, tree_step
from vllm_specbeam.adapter.runner import TreeRunnerMixin
from vllm_specbeam.adapter.tree_counts import TreeCounts
from vllm_specbeam.core.config import SpecbeamConfigError
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.kernels import kv_move as km_mod
from vllm_specbeam.kernels import tree_attention as ta_mod
from vllm_specbeam.kernels.reference import (
    allowed_keys,
    build_tree_mask,
    kv_move_ref,
    split_kv_cache,
    token_slots,
    tree_attention_ref,
)

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
FP16 = dict(atol=2e-3, rtol=2e-3)  # kernel vs fp32 reference, as in test_tree_attention.py
NUM_KV_HEADS, GROUP, HEAD_SIZE, BLOCK_SIZE = 2, 4, 64, 16


@pytest.fixture(autouse=True)
def _kernels_must_run(monkeypatch):
    """Fail instead of silently comparing the torch fallbacks with themselves."""

    def fallback(*args, **kwargs):
        raise AssertionError("a kernel fell back to its torch reference")

    monkeypatch.setattr(ta_mod, "tree_attention_ref", fallback)
    monkeypatch.setattr(km_mod, "kv_move_ref", fallback)


@pytest.fixture
def vllm_triton(monkeypatch):
    """vLLM's Triton backend module with its kernels on the real Triton."""
    unified = import_vllm_triton_module("vllm.v1.attention.ops.triton_unified_attention")
    cache_ops = import_vllm_triton_module("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    monkeypatch.setattr(triton_attn, "unified_attention", unified.unified_attention)
    monkeypatch.setattr(triton_attn, "triton_reshape_and_cache_flash", cache_ops.triton_reshape_and_cache_flash)
    # The launchers ask CUDA for the SM version only to pick tile sizes.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))


# ------------------------------------------------------------------ a batch
def tree(parents: list[int]) -> DraftTree:
    return DraftTree(np.arange(100, 100 + len(parents)), np.asarray(parents, np.int64))


#: (committed tokens, rows scheduled before the root, tree or None = plain rows)
REQUESTS = [
    (37, 0, tree([-1, 0, -1, 2, 1, -1, 5, 0, 3])),  # context crosses a page
    (16, 1, None),  # plain decode, context ends on a page boundary
    (5, 12, None),  # prefill chunk
    (44, 0, tree([-1, 0, 1, 2, 3])),  # a chain: causal is already right
    (20, 3, tree([-1, 0, 0, -1, 3, 1])),  # resumed: recomputed rows, then the root
    (0, 0, tree([-1, -1, -1, 0])),  # a star with no context at all
]
#: the same batch shape with chains only: causal is right for every row
CHAINS = [
    (37, 0, tree([-1, 0, 1])),
    (16, 1, None),
    (5, 12, None),
    (44, 0, tree([-1, 0, 1, 2, 3])),
    (20, 3, tree([-1, 0])),
    (0, 0, tree([-1])),
]


def scheduled_rows(before: int, draft: DraftTree | None) -> int:
    return before if draft is None else before + draft.num_nodes + 1


def expected_segment(before: int, draft: DraftTree | None) -> np.ndarray | int:
    """Independent of the runner-side builder: the full ancestor mask (every
    tree row, not only the ones causal gets wrong), rows before the root causal."""
    if draft is None:
        return before
    rows = scheduled_rows(before, draft)
    segment = np.zeros((rows, rows), dtype=bool)
    segment[:before, :before] = np.tri(before, dtype=bool)
    segment[before:, :before] = True
    segment[before:, before:] = draft.ancestor_mask
    return segment if before else draft


def batch_layout(requests) -> tuple[list[int], list[int], list[int], list[int], list[DraftTree]]:
    """query lens, and for the requests with trees: first row, root row, root position, tree."""
    query_lens = [scheduled_rows(before, draft) for _, before, draft in requests]
    starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).tolist()
    with_tree = [(start, ctx, before, draft) for start, (ctx, before, draft) in zip(starts, requests) if draft]
    return (
        query_lens,
        [start for start, *_ in with_tree],
        [start + before for start, _, before, _ in with_tree],
        [ctx + before for _, ctx, before, _ in with_tree],
        [draft for *_, draft in with_tree],
    )


def make_step(requests) -> gpu_attention.GpuTreeStep:
    query_lens, starts, roots, root_positions, trees = batch_layout(requests)
    return gpu_attention.GpuTreeStep.build(starts, roots, root_positions, trees, sum(query_lens), torch.device(DEVICE))


def random_half(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """fp16 normals on DEVICE, drawn from the CPU ``gen``: the same values on every device."""
    return torch.randn(*shape, generator=gen, device="cpu").half().to(DEVICE)


def random_kv_cache(num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """A random cache in vLLM's default layout LBNHC: [block, slot, head, content] in memory."""
    return random_half(gen, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE).transpose(1, 2)


def unit_scales() -> SimpleNamespace:
    """The attention layer's q/k/v scales, as the backend reads them."""
    return SimpleNamespace(**{name: torch.ones(1, device=DEVICE) for name in ("_q_scale", "_k_scale", "_v_scale")})


def host_blocks(ids: list[int]) -> torch.Tensor:
    """A draft request's block row: the runtime keeps it on the host (``block_table.cpu``)."""
    return torch.tensor(ids, dtype=torch.int32, device="cpu")


def make_impl(cls: type) -> triton_attn.TritonAttentionImpl:
    return cls(
        num_heads=NUM_KV_HEADS * GROUP, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5, num_kv_heads=NUM_KV_HEADS,
        alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
    )  # fmt: skip


def make_batch(requests, seed: int = 0) -> SimpleNamespace:
    """Queries, a paged cache whose context is random and whose step rows are
    written by the backend's own (vLLM's) ``do_kv_cache_update``, and
    hand-built ``TritonAttentionMetadata``."""
    gen = torch.Generator().manual_seed(seed)  # on the CPU: the same values on every device
    query_lens, *_ = batch_layout(requests)
    seq_lens = [ctx + n for (ctx, _, _), n in zip(requests, query_lens)]
    pages = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(pages) + 2
    perm = torch.randperm(num_blocks, generator=gen, device="cpu")
    block_table = torch.zeros(len(requests), max(pages) + 1, dtype=torch.int32, device=DEVICE)
    for r, offset in enumerate(np.cumsum([0, *pages[:-1]])):
        block_table[r, : pages[r]] = perm[offset : offset + pages[r]].int()
    kv_cache = random_kv_cache(num_blocks, gen)
    num_tokens = sum(query_lens)
    positions = torch.cat([ctx + torch.arange(n, device=DEVICE) for (ctx, _, _), n in zip(requests, query_lens)])
    request_of_row = torch.repeat_interleave(
        torch.arange(len(requests), device=DEVICE), torch.tensor(query_lens, device=DEVICE)
    )
    slot_mapping = torch.stack([token_slots(block_table[r], p[None], BLOCK_SIZE)[0]
                                for r, p in zip(request_of_row, positions)])  # fmt: skip
    num_heads = NUM_KV_HEADS * GROUP
    metadata = triton_attn.TritonAttentionMetadata(
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32, device=DEVICE),
        max_seq_len=max(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=block_table,
        slot_mapping=slot_mapping,
        # as TritonAttentionMetadataBuilder sizes them (3D split-KV decode path)
        seq_threshold_3D=triton_attn.MIN_LAUNCH_GRID_SIZE_2D // NUM_KV_HEADS,
        num_par_softmax_segments=triton_attn.NUM_PAR_SOFTMAX_SEGMENTS,
        softmax_segm_output=torch.empty(64, num_heads, triton_attn.NUM_PAR_SOFTMAX_SEGMENTS, HEAD_SIZE, device=DEVICE),
        softmax_segm_max=torch.empty(64, num_heads, triton_attn.NUM_PAR_SOFTMAX_SEGMENTS, device=DEVICE),
        softmax_segm_expsum=torch.empty(64, num_heads, triton_attn.NUM_PAR_SOFTMAX_SEGMENTS, device=DEVICE),
        causal=True,
    )
    layer = unit_scales()
    key = random_half(gen, num_tokens, NUM_KV_HEADS, HEAD_SIZE)
    value = random_half(gen, num_tokens, NUM_KV_HEADS, HEAD_SIZE)
    make_impl(gpu_attention.TreeTritonAttentionImpl).do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    return SimpleNamespace(
        q=random_half(gen, num_tokens, num_heads, HEAD_SIZE),
        key=key, value=value, kv_cache=kv_cache, metadata=metadata, layer=layer, query_lens=query_lens,
    )  # fmt: skip


def forward(impl, batch) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    impl.forward(batch.layer, batch.q, batch.key, batch.value, batch.kv_cache, batch.metadata, out)
    return out


def reference(batch, requests) -> torch.Tensor:
    key_cache, value_cache = split_kv_cache(batch.kv_cache, HEAD_SIZE)
    words = build_tree_mask([expected_segment(before, draft) for _, before, draft in requests], device=DEVICE)
    m = batch.metadata
    out = torch.zeros(batch.q.shape, dtype=torch.float32, device=DEVICE)
    return tree_attention_ref(batch.q, key_cache, value_cache, m.block_table, m.query_start_loc, m.seq_lens,
                              words, HEAD_SIZE**-0.5, out)  # fmt: skip


def rows_of(batch, request: int) -> slice:
    start = sum(batch.query_lens[:request])
    return slice(start, start + batch.query_lens[request])


# ------------------------------------------------------ (a) the backend impl
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # inside vLLM's kernel
def test_tree_step_runs_tree_kernel_for_the_whole_batch(vllm_triton):
    batch = make_batch(REQUESTS, seed=1)
    impl = make_impl(gpu_attention.TreeTritonAttentionImpl)
    stock = forward(make_impl(triton_attn.TritonAttentionImpl), batch)
    with tree_step(make_step(REQUESTS)):
        ours = forward(impl, batch)
    torch.testing.assert_close(ours.float(), reference(batch, REQUESTS), **FP16)
    # Causal rows (plain requests, the chain, rows before a root) = vLLM's stock Triton forward.
    resumed = rows_of(batch, 4).start
    causal = [rows_of(batch, 1), rows_of(batch, 2), rows_of(batch, 3), slice(resumed, resumed + 3)]
    for rows in causal:
        torch.testing.assert_close(ours[rows], stock[rows], **FP16)
    # ... and tree rows are not: siblings must not see each other (the test can fail).
    star = rows_of(batch, 5)
    assert (ours[star][2:].float() - stock[star][2:].float()).abs().amax() > 0.05
    torch.testing.assert_close(ours[star][:2], stock[star][:2], **FP16)  # root and first child are causal


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("active", ["no step", "chains only"])
def test_without_tree_rows_the_forward_is_vllms(vllm_triton, active):
    """No active step, or a step whose trees are chains: exactly vLLM's Triton path."""
    batch = make_batch(CHAINS, seed=2)
    step = make_step(CHAINS) if active == "chains only" else None
    assert step is None or not step.needs_attention
    with tree_step(step):
        ours = forward(make_impl(gpu_attention.TreeTritonAttentionImpl), batch)
    stock = forward(make_impl(triton_attn.TritonAttentionImpl), batch)
    assert torch.equal(ours, stock)
    torch.testing.assert_close(ours.float(), reference(batch, CHAINS), **FP16)


def test_tree_mask_must_cover_the_batch(vllm_triton):
    batch = make_batch(REQUESTS, seed=3)
    step = make_step(REQUESTS[:-1])  # built for fewer rows than attention runs
    with tree_step(step), pytest.raises(RuntimeError, match="tree mask has 39 rows but attention runs 44"):
        forward(make_impl(gpu_attention.TreeTritonAttentionImpl), batch)


# --------------------------------------------------- (b) the runner-side mask
def test_step_mask_equals_reference_mask():
    """Same keys for every row as ``reference.build_tree_mask``; words only on
    rows causal gets wrong (elsewhere zero, i.e. causal), one device tensor."""
    step = make_step(REQUESTS)
    query_lens, *_ = batch_layout(REQUESTS)
    words = build_tree_mask([expected_segment(before, draft) for _, before, draft in REQUESTS], device=DEVICE)
    assert step.tree_mask.dtype == torch.int64 and step.tree_mask.shape == (sum(query_lens), 1)
    start = 0
    for (ctx, before, draft), n in zip(REQUESTS, query_lens):
        ours, ref = step.tree_mask[start : start + n], words[start : start + n, :1]
        assert torch.equal(allowed_keys(ours, ctx), allowed_keys(ref, ctx))
        needs_mask = np.zeros(n, dtype=bool)
        if draft is not None:
            needs_mask[before + masked_rows(draft)] = True
        assert ((ours != 0).any(dim=1).cpu().numpy() == needs_mask).all()
        with_words = torch.as_tensor(needs_mask, device=DEVICE)
        assert torch.equal(ours[with_words], ref[with_words])  # the same words where there are words
        start += n
    # Node positions: context + depth, as on CPU.
    _, _, roots, root_positions, trees = batch_layout(REQUESTS)
    assert step.node_rows.tolist() == [r + 1 + i for r, t in zip(roots, trees) for i in range(t.num_nodes)]
    assert step.node_positions.tolist() == [p + d for p, t in zip(root_positions, trees) for d in t.depths]


def test_step_mask_wide_trees_and_chains():
    star = tree([-1] * 70)  # 71 rows: two words, bit 63 in use
    step = make_step([(9, 0, star), (3, 2, None)])
    assert step.tree_mask.shape == (73, 2)
    assert torch.equal(step.tree_mask, build_tree_mask([star, 2], num_words=2, device=DEVICE).masked_fill(
        torch.arange(73, device=DEVICE)[:, None] < 2, 0))  # root and first node: causal, zero words  # fmt: skip
    assert bool((step.tree_mask[:, 0] < 0).any())
    assert make_step([(5, 0, tree([-1, 0, 1])), (7, 2, None)]).tree_mask is None
    # 150 recomputed rows before a root: 153 bits need 3 words, rounded up to 4
    # (the kernel is compiled per word count).
    resumed = (8, 150, tree([-1, -1]))
    mask = make_step([resumed]).tree_mask
    assert mask.shape == (153, 4)
    expected = build_tree_mask([expected_segment(*resumed[1:])], num_words=4, device=DEVICE)
    assert torch.equal(allowed_keys(mask, 8), allowed_keys(expected, 8))


# ----------------------------------------------------- the runner's KV move
def test_runner_moves_accepted_kv_with_the_kernel_on_cuda():
    """``_move_accepted_kv`` on a CUDA runner: rows -> slots through the step's
    slot mapping, one kv_move launch for every layer, moves in order per request."""
    gen = torch.Generator().manual_seed(4)
    caches = [random_kv_cache(12, gen) for _ in range(3)]
    slot_mapping = torch.randperm(12 * BLOCK_SIZE, generator=gen, device="cpu")[:40].to(DEVICE)  # token row -> slot
    # Request 0 accepted rows [0, 2, 3] of its tree (root at row 5): row 7 -> 6 reads
    # the slot that row 8 -> 7 then overwrites. Request 1 (root at row 20) moved nothing.
    src_rows = [5 + 1 + np.array([1, 2]), np.array([], dtype=np.int64)]
    dst_rows = [5 + 1 + np.array([0, 1]), np.array([], dtype=np.int64)]
    runner = SimpleNamespace(
        device=torch.device("cuda"),
        input_batch=SimpleNamespace(block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(gpu=slot_mapping))]),
        _kv_layers=[(None, cache) for cache in caches],
        _kv_layer_pointers=km_mod.layer_pointer_table(caches),
        tree_counts=TreeCounts(),
    )
    expected = [cache.clone() for cache in caches]
    kv_move_ref(expected, slot_mapping[[7, 8]], slot_mapping[[6, 7]])
    TreeRunnerMixin._move_accepted_kv(runner, src_rows, dst_rows)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    assert runner.tree_counts.kv_moves == 2


# -------------------------------------------------- (c) start-up selection
@pytest.fixture
def custom_slot():
    """Leave vLLM's CUSTOM backend slot as it was."""
    slot = AttentionBackendEnum.CUSTOM
    before = slot.get_path() if slot.is_overridden() else None
    yield slot
    slot.clear_override()
    if before is not None:
        from vllm.v1.attention.backends.registry import register_backend

        register_backend(slot, before)


def create(monkeypatch, *, cuda: bool, spec: dict | None, **engine_args) -> tuple[EngineArgs, ParallelConfig]:
    """Run the plugin's speculative-config patch the way ``create_engine_config``
    does, on (mocked) CUDA or on this CPU; vLLM's own translation is stubbed."""

    class Args(EngineArgs):
        create_speculative_config = plugin._speculative_config(lambda self, model_config, parallel_config: None)

    args = Args(model="unused", speculative_config=spec, **engine_args)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: cuda)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: not cuda)
    parallel_config = ParallelConfig()
    args.create_speculative_config(target_model_config=None, target_parallel_config=parallel_config)
    return args, parallel_config


def test_cuda_with_a_plugin_method_selects_the_tree_backend(monkeypatch, custom_slot):
    args, parallel_config = create(monkeypatch, cuda=True, spec={"method": "lookup_tree", "max_nodes": 8})
    assert parallel_config.worker_cls == engine_config.GPU_WORKER
    assert args.attention_config.backend == custom_slot
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    backend = custom_slot.get_class()  # what vLLM's CUDA selector resolves
    assert backend is gpu_attention.TreeTritonAttentionBackend
    assert AttentionBackendEnum[backend.get_name()] is custom_slot  # vLLM's Attention layer maps it back
    assert backend.get_impl_cls() is gpu_attention.TreeTritonAttentionImpl
    assert backend.get_builder_cls().get_cudagraph_support(None, None).name == "NEVER"
    ok = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
              has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
              device_capability=None, attn_type="decoder")  # fmt: skip
    assert backend.validate_configuration(**ok) == []
    assert backend.validate_configuration(**{**ok, "has_sliding_window": True, "kv_cache_dtype": "fp8"}) == [
        "kv_cache_dtype not supported", "sliding window not supported"]  # fmt: skip


@pytest.mark.parametrize(
    "cuda, spec, worker",
    [
        (False, {"method": "lookup_tree"}, engine_config.CPU_WORKER),
        (True, {"method": "ngram"}, "auto"),
        (True, None, "auto"),
    ],
)
def test_vllm_attention_is_left_alone_otherwise(monkeypatch, custom_slot, cuda, spec, worker):
    args, parallel_config = create(monkeypatch, cuda=cuda, spec=spec)
    assert args.attention_config.backend is None and args.attention_backend is None
    assert args.compilation_config.cudagraph_mode is None
    assert parallel_config.worker_cls == worker


def test_eager_and_piecewise_modes_are_kept(monkeypatch, custom_slot):
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        args, _ = create(monkeypatch, cuda=True, spec={"method": "aded"}, compilation_config={"cudagraph_mode": mode})
        assert args.compilation_config.cudagraph_mode == mode
    args, _ = create(monkeypatch, cuda=True, spec={"method": "aded"}, attention_backend="CUSTOM")
    assert args.attention_backend == "CUSTOM" and args.attention_config.backend is None  # already ours


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_full_cuda_graphs_are_refused(monkeypatch, custom_slot, mode):
    message = rf"needs cudagraph_mode PIECEWISE or NONE, got {mode}: .*--enforce-eager"
    with pytest.raises(SpecbeamConfigError, match=message):
        create(monkeypatch, cuda=True, spec={"method": "lookup_tree"}, compilation_config={"cudagraph_mode": mode})


def test_other_backends_and_a_taken_slot_are_refused(monkeypatch, custom_slot):
    with pytest.raises(SpecbeamConfigError, match="backend FLASH_ATTN was requested; remove --attention-backend"):
        create(monkeypatch, cuda=True, spec={"method": "lookup_tree"}, attention_backend="FLASH_ATTN")
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(custom_slot, "other.package.Backend")
    with pytest.raises(
        SpecbeamConfigError, match=r"CUSTOM attention backend slot already holds other\.package\.Backend"
    ):
        create(monkeypatch, cuda=True, spec={"method": "lookup_tree"})


@pytest.fixture
def cuda_platform(monkeypatch, custom_slot):
    """vLLM's CUDA platform class, importable on the CPU build: its compiled
    extension stubbed, the device capability set by the test, the tree
    backend in the CUSTOM slot (as ``register()`` puts it on CUDA)."""
    import types

    monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    from vllm.platforms import cuda

    gpu_attention.register_tree_backend()
    return cuda.CudaPlatform


SELECTOR_CONFIG = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                       has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                       attn_type="decoder")  # fmt: skip


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
def test_vllms_cuda_selector_picks_the_tree_backend(monkeypatch, cuda_platform, capability):
    """vLLM's own selection (platforms/cuda.py ``get_attn_backend_cls``) of the slot patch 1 names."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(
        cuda_platform, "get_device_capability", classmethod(lambda cls, device_id=0: DeviceCapability(*capability))
    )
    fields = set(AttentionSelectorConfig._fields)
    config = AttentionSelectorConfig(**{k: v for k, v in SELECTOR_CONFIG.items() if k in fields})
    path = cuda_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, config)
    assert path == f"{gpu_attention.__name__}.TreeTritonAttentionBackend"
    with pytest.raises(ValueError, match="sliding window not supported"):
        cuda_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, config._replace(has_sliding_window=True))
    for head_size in (72, 512):  # not compiled and checked (tools/check_gpu_compile.py): spills, shared memory
        with pytest.raises(ValueError, match="head_size not supported"):
            cuda_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, config._replace(head_size=head_size))


def piecewise_config(tiny_model: str, mode: CUDAGraphMode):
    """A VllmConfig as vLLM builds it on CUDA with ``mode`` (the CPU platform
    turns cudagraphs off at construction; they are set back here)."""
    from vllm.config import CompilationConfig, CompilationMode, ModelConfig, VllmConfig

    config = VllmConfig(model_config=ModelConfig(tiny_model, dtype="bfloat16"), compilation_config=CompilationConfig())
    config.compilation_config.mode = CompilationMode.VLLM_COMPILE
    config.compilation_config.cudagraph_mode = mode
    config.compilation_config.splitting_ops = list(CompilationConfig._attention_ops)  # as vLLM sets them on CUDA
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8]
    return config


@pytest.mark.parametrize(
    "requested, resolved",
    [
        ("PIECEWISE", "PIECEWISE"),
        ("NONE", "NONE"),
        ("FULL_DECODE_ONLY", "PIECEWISE"),
        ("FULL_AND_PIECEWISE", "PIECEWISE"),
    ],
)
def test_vllm_resolves_cudagraphs_against_the_tree_builder(monkeypatch, tiny_model, requested, resolved):
    """gpu_model_runner.py ``_check_and_update_cudagraph_mode``: the builder's NEVER keeps
    PIECEWISE and NONE, downgrades full decode graphs (should a mode get past patch 1), and the
    builder builds under the resolved mode."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    config = piecewise_config(tiny_model, CUDAGraphMode[requested])
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    builder_cls = gpu_attention.TreeTritonAttentionBackend.get_builder_cls()
    support = builder_cls.get_cudagraph_support(config, spec)
    assert support.name == "NEVER"
    mode = config.compilation_config.resolve_cudagraph_mode_and_sizes(support, "TreeTritonAttentionBackend", 5)
    assert mode == CUDAGraphMode[resolved]
    config.compilation_config.cudagraph_mode = mode
    builder = builder_cls(spec, [], config, torch.device(DEVICE))
    assert not builder.decode_cudagraph_enabled  # no full decode graph: the tree rows' shapes vary


def test_full_mixed_cudagraphs_are_refused_by_vllm_against_the_tree_builder(tiny_model):
    config = piecewise_config(tiny_model, CUDAGraphMode.FULL)
    builder_cls = gpu_attention.TreeTritonAttentionBackend.get_builder_cls()
    with pytest.raises(ValueError, match="please try cudagraph_mode=PIECEWISE"):
        config.compilation_config.resolve_cudagraph_mode_and_sizes(
            builder_cls.get_cudagraph_support(config, None), "TreeTritonAttentionBackend", 5
        )


def test_layers_without_the_tree_backend_or_with_alibi_are_refused():
    gpu_attention.check_tree_backend([make_impl(gpu_attention.TreeTritonAttentionImpl)])
    with pytest.raises(ValueError, match="a layer uses TritonAttentionImpl"):
        gpu_attention.check_tree_backend([make_impl(triton_attn.TritonAttentionImpl)])
    alibi = gpu_attention.TreeTritonAttentionImpl(
        num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=[0.5] * 8, sliding_window=None,
        kv_cache_dtype="auto", logits_soft_cap=30.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="does not support ALiBi, logit soft-capping"):
        gpu_attention.check_tree_backend([alibi])
    wide_group = gpu_attention.TreeTritonAttentionImpl(
        num_heads=48, head_size=256, scale=0.0625, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
        kv_cache_dtype="auto",
    )  # fmt: skip
    with pytest.raises(ValueError, match="head size 256 with 48 query heads per KV head; use vLLM's built-in"):
        gpu_attention.check_tree_backend([wide_group])


# ------------------------------------------- (d) the in-worker draft model on CUDA
def cuda_draft_runtime(runner: SimpleNamespace, block_source: SimpleNamespace) -> draft_model.PagedDraftRuntime:
    """A draft runtime as the CUDA worker would hold it, on a loaded draft without a model (the
    attention-side parts), its tensors on DEVICE."""
    draft = SimpleNamespace(device=torch.device(DEVICE), on_cuda=True)
    return draft_model.PagedDraftRuntime(runner, draft, block_source)


def feed(context: int, slots: list[int], visible: list[list[int]] | None) -> draft_model._Feed:
    """Rows at ``slots`` of a request whose committed context is ``context`` tokens."""
    return draft_model._Feed(blocks=host_blocks([0] * 8), tokens=[0] * len(slots), rope_positions=slots, slots=slots,
                             seq_len=slots[-1] + 1, visible=visible, context=context)  # fmt: skip


#: one draft forward: per request its feed and the keys each row must see (independent of the runtime)
DRAFT_FEEDS = [
    # depth 2 of a tree after 37 committed tokens (root in slot 36): depth-1 nodes in slots 37, 38,
    # depth-2 nodes now in 39 (under 38), 40 (under 37), 41 (under 38)
    (feed(37, [39, 40, 41], [[38, 39], [37, 40], [38, 41]]),
     [[*range(37), 38, 39], [*range(37), 37, 40], [*range(37), 38, 41]]),
    # committed tokens fed causally (a request catching up): no mask bits
    (feed(16, [16, 17, 18], None), [[*range(17)], [*range(18)], [*range(19)]]),
    # depth 1 of a star after 20 tokens: siblings must not see each other
    (feed(20, [20, 21, 22], [[20], [21], [22]]), [[*range(20), 20], [*range(20), 21], [*range(20), 22]]),
    # depth 3 of a chain 70 nodes deep into a wide window (two mask words)
    (feed(5, [77], [[*range(5, 78, 2)]]), [[*range(5), *range(5, 78, 2)]]),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_draft_tree_depth_sees_its_context_and_ancestors_through_the_cuda_backend(vllm_triton):
    """The runtime's step for a draft depth (``tree_base`` at the committed context) through the
    backend's forward: every row equals attention over exactly its keys, gathered by hand."""
    feeds = [f for f, _ in DRAFT_FEEDS]
    counts = [len(f.tokens) for f in feeds]
    starts = np.concatenate([[0], np.cumsum(counts)])
    step = draft_model._tree_step(feeds, starts, True, torch.device(DEVICE))
    assert isinstance(step, gpu_attention.GpuTreeStep) and step.needs_attention
    assert step.tree_base.tolist() == [37, 16, 20, 5]  # the causal request's: seq_len - query_len
    assert step.tree_mask.shape == (sum(counts), 2)
    assert not step.tree_mask[3:6].any()  # the causal feed's rows

    gen = torch.Generator().manual_seed(5)
    pages = [-(-f.seq_len // BLOCK_SIZE) for f in feeds]
    num_blocks = sum(pages) + 1
    perm = torch.randperm(num_blocks, generator=gen, device="cpu")
    block_table = torch.zeros(len(feeds), max(pages), dtype=torch.int32, device=DEVICE)
    for r, offset in enumerate(np.cumsum([0, *pages[:-1]])):
        block_table[r, : pages[r]] = perm[offset : offset + pages[r]].int()
    # every earlier slot (context, earlier depths) holds K/V already; vLLM's LBNHC layout
    kv_cache = random_kv_cache(num_blocks, gen)
    slot_mapping = torch.cat(
        [token_slots(block_table[r], torch.tensor(f.slots, device=DEVICE), BLOCK_SIZE) for r, f in enumerate(feeds)]
    )
    num_tokens, num_heads = sum(counts), NUM_KV_HEADS * GROUP
    metadata = triton_attn.TritonAttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(counts),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        max_seq_len=max(f.seq_len for f in feeds),
        seq_lens=torch.tensor([f.seq_len for f in feeds], dtype=torch.int32, device=DEVICE), block_table=block_table,
        slot_mapping=slot_mapping, seq_threshold_3D=triton_attn.MIN_LAUNCH_GRID_SIZE_2D // NUM_KV_HEADS,
        num_par_softmax_segments=triton_attn.NUM_PAR_SOFTMAX_SEGMENTS,
        softmax_segm_output=torch.empty(64, num_heads, triton_attn.NUM_PAR_SOFTMAX_SEGMENTS, HEAD_SIZE, device=DEVICE),
        softmax_segm_max=torch.empty(64, num_heads, triton_attn.NUM_PAR_SOFTMAX_SEGMENTS, device=DEVICE),
        softmax_segm_expsum=torch.empty(64, num_heads, triton_attn.NUM_PAR_SOFTMAX_SEGMENTS, device=DEVICE),
        causal=True,
    )  # fmt: skip
    layer = unit_scales()
    key = random_half(gen, num_tokens, NUM_KV_HEADS, HEAD_SIZE)
    value = random_half(gen, num_tokens, NUM_KV_HEADS, HEAD_SIZE)
    q = random_half(gen, num_tokens, num_heads, HEAD_SIZE)
    impl = make_impl(gpu_attention.TreeTritonAttentionImpl)
    out, stock = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    with tree_step(step):
        impl.forward(layer, q, key, value, kv_cache, metadata, out)  # writes this depth's K/V, then attends
    make_impl(triton_attn.TritonAttentionImpl).forward(layer, q, key, value, kv_cache, metadata, stock)

    key_cache, value_cache = split_kv_cache(kv_cache, HEAD_SIZE)
    row = 0
    for r, (_, keys_of_rows) in enumerate(DRAFT_FEEDS):
        for keys in keys_of_rows:
            slots = token_slots(block_table[r], torch.tensor(keys, device=DEVICE), BLOCK_SIZE)
            k = key_cache.flatten(0, 1)[slots].float().repeat_interleave(GROUP, dim=1)  # [keys, heads, D]
            v = value_cache.flatten(0, 1)[slots].float().repeat_interleave(GROUP, dim=1)
            probs = torch.softmax(torch.einsum("hd,khd->hk", q[row].float(), k) * HEAD_SIZE**-0.5, dim=-1)
            torch.testing.assert_close(out[row].float(), torch.einsum("hk,khd->hd", probs, v), **FP16)
            row += 1
    # causal rows are vLLM's; the star's siblings and the depth-2 rows are not (the test has teeth)
    torch.testing.assert_close(out[3:6], stock[3:6], **FP16)
    assert (out[6:9].float() - stock[6:9].float()).abs().amax() > 0.05
    assert (out[:3].float() - stock[:3].float()).abs().amax() > 0.05


def test_draft_moves_accepted_kv_with_the_kernel_on_cuda():
    """An accepted path of last round's draft tree: its nodes' K/V moved to their committed slots
    in every draft layer by one ``kv_move`` launch (the runtime's ``_keep_accepted`` on CUDA)."""
    gen = torch.Generator().manual_seed(6)
    caches = [random_kv_cache(4, gen) for _ in range(2)]
    blocks = host_blocks([2, 0, 3, 1])
    source = SimpleNamespace(block_size=BLOCK_SIZE, kv_caches=lambda: [(None, c) for c in caches])
    runtime = cuda_draft_runtime(SimpleNamespace(tree_counts=TreeCounts()), source)
    # root at slot 14 (length 15); nodes a, b, c in slots 15, 16, 17 with parents [-1, -1, 1]:
    # the target committed b c x, so b, c move from 16, 17 to 15, 16
    request = draft_model._Request(kv_len=15, length=15, tokens=[7, 8, 9], parents=[-1, -1, 1], depths=[1, 1, 2])
    expected = [c.clone() for c in caches]
    on_device = blocks.to(DEVICE)
    src = token_slots(on_device, torch.tensor([16, 17], device=DEVICE), BLOCK_SIZE)
    kv_move_ref(expected, src, token_slots(on_device, torch.tensor([15, 16], device=DEVICE), BLOCK_SIZE))
    runtime._keep_accepted(request, blocks, [8, 9, 5])
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    assert request.kv_len == 17 and runtime.runner.tree_counts.draft_kv_moves == 2


def test_search_pool_blocks_keep_the_engine_cache_layout():
    """The beam search's own draft blocks are laid out in memory as vLLM's cache is (here LBNHC)."""
    # logical [B, H, N, 2D]
    engine = torch.zeros(5, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE, device=DEVICE).transpose(1, 2)
    blocks = draft_blocks._blocks_like(engine, 9)
    assert blocks.shape == (9, *engine.shape[1:])
    assert blocks.stride() == (BLOCK_SIZE * NUM_KV_HEADS * 2 * HEAD_SIZE, *engine.stride()[1:])
    contiguous = torch.zeros(5, 3, 4, device=DEVICE)
    assert draft_blocks._blocks_like(contiguous, 2).stride() == torch.zeros(2, 3, 4, device=DEVICE).stride()
