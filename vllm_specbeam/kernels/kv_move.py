"""Accepted-path KV move in vLLM's paged cache, all layers in one launch (Triton).

After verification, request ``r`` keeps the accepted rows ``row_0 < row_1 <
...`` of its tree; their K/V sit at positions ``C + row_i`` and must end at
``C + i`` so the cache again holds one linear sequence. Inputs are slots
(``block * block_size + offset``), ragged per request: moves
``cu_moves[r]:cu_moves[r + 1]`` of ``src_slots``/``dst_slots`` (build them
with :func:`.reference.accepted_path_moves`).

In place, without a scratch buffer: one request's moves run *in order inside
one program*, which is safe because target ``C + i`` never equals a later
source (``C + row_j``, ``row_j > row_i >= i``), only an earlier one, already
read. Parallelism comes from the other axes: programs = requests x layers x
chunks of the (head, content) row. It moves the whole packed content row, so
inline per-token-head quant scales travel with their data. Why a kernel
rather than vLLM's cache-update op, and what ran where: docs/kernels.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from vllm_specbeam.kernels.reference import kv_move_ref

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False


if HAS_TRITON:

    @triton.jit
    def _kv_move_kernel(
        layer_ptrs,  # [num_layers] int64 base addresses of the per-layer caches
        src_slots_ptr,  # [num_moves] int64
        dst_slots_ptr,  # [num_moves] int64
        cu_moves_ptr,  # [num_reqs + 1] int64
        stride_blk,
        stride_head,
        stride_slot,
        NUM_HEADS: tl.constexpr,
        CONTENT: tl.constexpr,  # elements per (slot, head): K|V (+ scales)
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        ELEM: tl.constexpr,  # integer type of the element size: bits are copied
    ):
        req = tl.program_id(0)
        layer = tl.program_id(1)
        chunk = tl.program_id(2)
        base = tl.load(layer_ptrs + layer).to(tl.pointer_type(ELEM))

        # This program's share of one slot: TILE (head, content) elements.
        offs = chunk * TILE + tl.arange(0, TILE)
        valid = offs < NUM_HEADS * CONTENT
        elem_off = (offs // CONTENT).to(tl.int64) * stride_head + offs % CONTENT

        begin = tl.load(cu_moves_ptr + req)
        end = tl.load(cu_moves_ptr + req + 1)
        for i in range(begin, end):  # in order: see the module docstring
            src = tl.load(src_slots_ptr + i)
            dst = tl.load(dst_slots_ptr + i)
            if (src != dst) & (src >= 0) & (dst >= 0):
                src_off = (src // BLOCK_SIZE) * stride_blk + (src % BLOCK_SIZE) * stride_slot
                dst_off = (dst // BLOCK_SIZE) * stride_blk + (dst % BLOCK_SIZE) * stride_slot
                row = tl.load(base + src_off + elem_off, mask=valid)
                tl.store(base + dst_off + elem_off, row, mask=valid)


def layer_pointer_table(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """Base addresses of the per-layer caches, after checking they share a view.

    Build it once at start-up and pass it as ``layer_ptrs`` (the caches never
    move), which also keeps the launch CUDA-graph friendly.
    """
    first = kv_caches[0]
    for cache in kv_caches:
        if cache.shape != first.shape or cache.stride() != first.stride() or cache.dtype != first.dtype:
            raise ValueError("all layers must share shape, strides and dtype")
        if cache.device != first.device:
            raise ValueError("all layers must be on one device")
    return torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64, device=first.device)


def kv_move(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    cu_moves: torch.Tensor,
    layer_ptrs: torch.Tensor | None = None,
) -> None:
    """Move K/V of the accepted nodes, every layer, one launch.

    Args:
        kv_caches: per-layer caches in vLLM's logical ``[num_blocks,
            num_kv_heads, block_size, content]`` order, the tensors the
            attention layers are bound to (any strides, content stride 1;
            all layers alike). For a ``[num_blocks, block_size, heads, dim]``
            cache pass ``.transpose(1, 2)``.
        src_slots, dst_slots: ``[num_moves]`` int64; negative = padding.
        cu_moves: ``[num_reqs + 1]`` int64, request ``r`` owns moves
            ``cu_moves[r]:cu_moves[r + 1]``, topologically ordered.
        layer_ptrs: optional cached :func:`layer_pointer_table`.
    """
    first = kv_caches[0]
    if not HAS_TRITON or (not first.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"):
        kv_move_ref(kv_caches, src_slots, dst_slots)
        return
    num_reqs = cu_moves.shape[0] - 1
    if num_reqs <= 0 or src_slots.numel() == 0:
        return
    if layer_ptrs is None:
        layer_ptrs = layer_pointer_table(kv_caches)
    assert layer_ptrs.shape[0] == len(kv_caches)
    assert src_slots.dtype == dst_slots.dtype == cu_moves.dtype == torch.int64
    _, num_heads, block_size, content = first.shape
    assert first.stride(3) == 1, "content dim must be contiguous"
    row = num_heads * content
    tile = min(1024, triton.next_power_of_2(row))
    grid = (num_reqs, len(kv_caches), triton.cdiv(row, tile))
    _kv_move_kernel[grid](
        layer_ptrs, src_slots, dst_slots, cu_moves,
        first.stride(0), first.stride(1), first.stride(2),
        NUM_HEADS=num_heads,
        CONTENT=content,
        BLOCK_SIZE=block_size,
        TILE=tile,
        ELEM=_triton_int(first.element_size()),
        num_warps=4,
    )  # fmt: skip


def _triton_int(size: int):
    """Triton integer type with ``size`` bytes: the move copies raw bits."""
    return {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[size]
