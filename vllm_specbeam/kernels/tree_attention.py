"""Tree attention over vLLM's paged KV cache (Triton).

One launch serves a whole mixed batch: requests verifying a draft tree (or a
forest), plain decodes and prefill chunks. Every key, this step's own
included, is read from the paged cache through the block table. Rows differ
only in which keys they see, given by ``tree_mask``
(:mod:`vllm_specbeam.kernels.reference` has the format):

* all-zero words -> causal row, keys ``[0, C + row]``;
* otherwise      -> keys ``[0, B)`` plus ``B + j`` for each set bit
  ``j < seq_len - B``, with ``B = tree_base[r]`` (default ``C``).

One program per (block of ``BLOCK_Q`` query rows, KV head, request), as in
vLLM's ``kernel_unified_attention_2d``: its score rows are the query rows
times the query heads sharing that KV head, so each K/V tile is loaded once
per GQA group. Two key phases share one online softmax: the dense prefix in
``TILE_N`` tiles, then the tree window one 64-key mask word at a time
(skipped when the program holds no tree row). Tested on CPU with
``TRITON_INTERPRET=1`` (docs/kernels.md: what ran where).
"""

from __future__ import annotations

import os

import torch

from vllm_specbeam.kernels.reference import tree_attention_ref

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if HAS_TRITON:

    @triton.jit
    def _online_softmax_step(
        q,  # [BLOCK_M, HEAD_SIZE_PAD]
        k_tile,  # [HEAD_SIZE_PAD, N]  (already transposed)
        v_tile,  # [N, HEAD_SIZE_PAD]
        allowed,  # [BLOCK_M, N] bool
        m_i,  # [BLOCK_M] running max (log2 domain)
        l_i,  # [BLOCK_M] running denominator
        acc,  # [BLOCK_M, HEAD_SIZE_PAD] fp32
        qk_scale,  # softmax_scale * log2(e)
        DOT_IN_FP32: tl.constexpr,
    ):
        """Fold one key tile into the running (max, sum, acc) of every row.

        Fully masked rows keep ``m_i = -inf``; the max is then clamped to 0 so
        ``exp2(-inf - 0) = 0`` instead of NaN. Rows that never see a key end
        with ``l_i = 0`` (only padding rows can).
        """
        if DOT_IN_FP32:
            s = tl.dot(q.to(tl.float32), k_tile.to(tl.float32))
        else:
            s = tl.dot(q, k_tile)
        s = tl.where(allowed, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_IN_FP32:
            pv = tl.dot(p, v_tile.to(tl.float32))
        else:
            pv = tl.dot(p.to(v_tile.dtype), v_tile)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _load_kv_tile(
        k_cache_ptr,
        v_cache_ptr,
        block_table_row_ptr,  # block table of this request
        key_pos,  # [N] token positions to load
        key_valid,  # [N] bool
        kv_head,
        offs_d,  # [HEAD_SIZE_PAD]
        d_valid,  # [HEAD_SIZE_PAD] bool
        stride_k_blk,
        stride_k_slot,
        stride_k_head,
        stride_v_blk,
        stride_v_slot,
        stride_v_head,
        BLOCK_SIZE: tl.constexpr,
    ):
        """Gather K^T ``[D, N]`` and V ``[N, D]`` for arbitrary positions.

        Positions are translated per key (block table lookup), so a tile may
        straddle page boundaries and start anywhere, e.g. at the context end.
        """
        block_ids = tl.load(block_table_row_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        block_ids = block_ids.to(tl.int64)
        in_block = (key_pos % BLOCK_SIZE).to(tl.int64)
        k_off = block_ids * stride_k_blk + in_block * stride_k_slot + kv_head * stride_k_head
        v_off = block_ids * stride_v_blk + in_block * stride_v_slot + kv_head * stride_v_head
        k_tile = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None],
            mask=key_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        v_tile = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :],
            mask=key_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        return k_tile, v_tile

    @triton.jit
    def _tree_attention_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        block_table_ptr,  # [num_reqs, max_blocks] int32
        query_start_loc_ptr,  # [num_reqs + 1] int32
        seq_lens_ptr,  # [num_reqs] int32
        tree_base_ptr,  # [num_reqs] int32, read only if HAS_TREE_BASE
        tree_mask_ptr,  # [num_tokens, NUM_WORDS] int64
        qk_scale,
        stride_q_tok,
        stride_q_head,
        stride_o_tok,
        stride_o_head,
        stride_k_blk,
        stride_k_slot,
        stride_k_head,
        stride_v_blk,
        stride_v_slot,
        stride_v_head,
        stride_bt_req,
        stride_tm_row,
        QPKV: tl.constexpr,  # query heads per KV head
        QPKV_PAD: tl.constexpr,  # next power of two of QPKV
        HEAD_SIZE: tl.constexpr,
        HEAD_SIZE_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # KV-cache page size
        BLOCK_Q: tl.constexpr,  # query rows per program
        TILE_N: tl.constexpr,  # keys per step in the dense phase
        NUM_WORDS: tl.constexpr,  # int64 mask words per row
        HAS_TREE_BASE: tl.constexpr,  # else the window starts at the context end
        DOT_IN_FP32: tl.constexpr,
    ):
        # q blocks vary fastest: the programs re-reading one request's context
        # for one KV head are scheduled together, so repeats hit L2, not HBM.
        q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
        req = tl.program_id(2)
        BLOCK_M: tl.constexpr = BLOCK_Q * QPKV_PAD

        q_start = tl.load(query_start_loc_ptr + req)
        query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        first_row = q_block * BLOCK_Q
        if first_row >= query_len:
            return  # grid is sized for the longest request
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - query_len
        if HAS_TREE_BASE:
            tree_base = tl.load(tree_base_ptr + req)
        else:
            tree_base = context_len
        tree_len = seq_len - tree_base  # keys in the tree window

        # Score row m = (query row, query head in the KV group).
        offs_m = tl.arange(0, BLOCK_M)
        row = first_row + offs_m // QPKV_PAD  # request-relative query row
        head = kv_head * QPKV + offs_m % QPKV_PAD
        row_valid = (row < query_len) & (offs_m % QPKV_PAD < QPKV)
        token = (q_start + row).to(tl.int64)
        offs_d = tl.arange(0, HEAD_SIZE_PAD)
        d_valid = offs_d < HEAD_SIZE

        q = tl.load(
            q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
            mask=row_valid[:, None] & d_valid[None, :],
            other=0.0,
        )

        # A row is a tree row iff any of its mask words is non-zero.
        is_tree = tl.zeros([BLOCK_M], dtype=tl.int1)
        for w in tl.static_range(NUM_WORDS):
            word = tl.load(tree_mask_ptr + token * stride_tm_row + w, mask=row_valid, other=0)
            is_tree = is_tree | (word != 0)
        dense_len = tl.where(is_tree, tree_base, context_len + row + 1)
        dense_len = tl.where(row_valid, dense_len, 0)
        dense_end = tl.max(dense_len, axis=0)
        num_tree_words = tl.minimum(tl.cdiv(tree_len, 64), NUM_WORDS)
        num_tree_words = tl.where(tl.max(is_tree.to(tl.int32), axis=0) > 0, num_tree_words, 0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], dtype=tl.float32)
        block_table_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req

        # Phase 1: keys before the tree window (and, for causal rows, up to themselves).
        offs_n = tl.arange(0, TILE_N)
        for start in range(0, dense_end, TILE_N):
            key_pos = start + offs_n
            key_valid = key_pos < dense_end
            k_tile, v_tile = _load_kv_tile(
                k_cache_ptr, v_cache_ptr, block_table_row_ptr, key_pos, key_valid, kv_head,
                offs_d, d_valid, stride_k_blk, stride_k_slot, stride_k_head,
                stride_v_blk, stride_v_slot, stride_v_head, BLOCK_SIZE,
            )  # fmt: skip
            allowed = key_pos[None, :] < dense_len[:, None]
            m_i, l_i, acc = _online_softmax_step(q, k_tile, v_tile, allowed, m_i, l_i, acc, qk_scale, DOT_IN_FP32)

        # Phase 2: the tree window, one 64-key tile per mask word.
        offs_bit = tl.arange(0, 64)
        for w in range(0, num_tree_words):
            tree_row = w * 64 + offs_bit  # window-relative index of each key
            key_valid = tree_row < tree_len
            k_tile, v_tile = _load_kv_tile(
                k_cache_ptr, v_cache_ptr, block_table_row_ptr, tree_base + tree_row, key_valid,
                kv_head, offs_d, d_valid, stride_k_blk, stride_k_slot, stride_k_head,
                stride_v_blk, stride_v_slot, stride_v_head, BLOCK_SIZE,
            )  # fmt: skip
            word = tl.load(tree_mask_ptr + token * stride_tm_row + w, mask=row_valid, other=0)
            bits = (word[:, None] >> offs_bit[None, :].to(tl.int64)) & 1
            allowed = (bits != 0) & is_tree[:, None] & key_valid[None, :]
            m_i, l_i, acc = _online_softmax_step(q, k_tile, v_tile, allowed, m_i, l_i, acc, qk_scale, DOT_IN_FP32)

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        result = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )


def admits_head_size(head_size: int) -> bool:
    """Head sizes compiled and checked for sm_80 and sm_90 (tools/check_gpu_compile.py): multiples
    of 16 (the JIT's divisibility hint on a head's row) from 32 to 256. Head 72 spills at 255
    registers; head 512 exceeds sm_80's shared memory."""
    return head_size % 16 == 0 and 32 <= head_size <= 256


def admits(head_size: int, query_heads_per_kv: int) -> bool:
    """Whether the kernel runs this shape as compiled and checked: a program holds a whole GQA
    group, so its score tile ``next_pow2(group) x next_pow2(head)`` must stay within the
    ``64 x 128`` :func:`_launch_config` is written for (head 256 with 48 query heads per KV
    head spills on sm_80)."""
    tile = triton.next_power_of_2(query_heads_per_kv) * triton.next_power_of_2(head_size)
    return admits_head_size(head_size) and tile <= 64 * 128


def _launch_config(query_heads_per_kv: int, head_size: int, max_query_len: int) -> dict[str, int]:
    """Tile sizes: enough score rows for ``tl.dot`` (>= 16) without spilling.

    More query rows per program means the context is re-read fewer times (the
    dominant cost, see docs/kernels.md); the cap keeps the fp32 accumulator
    ``BLOCK_M x head_size`` within registers.
    """
    qpkv_pad = triton.next_power_of_2(query_heads_per_kv)
    max_rows = 64 if head_size <= 128 else 32
    block_m = min(max_rows, max(16, triton.next_power_of_2(max(1, max_query_len) * qpkv_pad)))
    block_q = max(1, block_m // qpkv_pad)
    # Warps by the tile the kernel holds, BLOCK_M x HEAD_SIZE_PAD: with the head size itself,
    # 64 x 80, 64 x 96 and 32 x 192 tiles got 4 warps and spilled (tools/check_gpu_compile.py).
    tile = block_q * qpkv_pad * triton.next_power_of_2(head_size)
    return {
        "QPKV_PAD": qpkv_pad,
        "BLOCK_Q": block_q,
        "TILE_N": 32 if head_size <= 128 else 16,
        "num_warps": 8 if tile >= 64 * 128 else 4,
    }


def _checked_tree_mask(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    tree_base: torch.Tensor | None,
) -> torch.Tensor:
    """The launch's tree mask (all-causal when ``None``), once the layouts the kernel reads are checked."""
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads, cache_head_size = key_cache.shape[2], key_cache.shape[3]
    assert value_cache.shape == key_cache.shape and cache_head_size == head_size
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert key_cache.dtype == value_cache.dtype == q.dtype, "quantized KV caches are not supported"
    assert q.stride(-1) == out.stride(-1) == key_cache.stride(-1) == value_cache.stride(-1) == 1
    if tree_mask is None:
        tree_mask = torch.zeros(q.shape[0], 1, dtype=torch.int64, device=q.device)  # [num_tokens, 1]
    assert tree_mask.dtype == torch.int64 and tree_mask.stride(-1) == 1
    assert tree_mask.shape[0] == q.shape[0], "tree_mask needs one row per query row"
    if tree_base is not None:
        assert tree_base.dtype == torch.int32 and tree_base.shape == seq_lens.shape
        assert tree_base.device == seq_lens.device
    return tree_mask


def tree_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    softmax_scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    *,
    tree_base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a mixed tree/causal batch over the paged KV cache.

    Args:
        q: ``[num_tokens, num_heads, head_size]`` (rows past ``query_start_loc[-1]``, e.g.
            CUDA-graph padding, are ignored).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]`` views with unit
            last stride, exactly the backend's ``kv_cache.transpose(1, 2).split(head_size, -1)``.
        block_table, query_start_loc, seq_lens: ``[num_reqs, max_blocks]``, ``[num_reqs + 1]`` (vLLM's
            ``cu_seqlens_q``), ``[num_reqs]`` (context + this step's rows), int32.
        tree_mask: ``[num_tokens, num_words]`` int64 ancestor words (see :mod:`.reference`); ``None``:
            every row is causal.
        softmax_scale: usually ``head_size ** -0.5``.
        max_query_len: host-side bound on rows per request (vLLM metadata has it); computed with a
            device sync when omitted.
        out: optional output, same shape/dtype as ``q``.
        tree_base: ``[num_reqs]`` int32, where each request's tree window starts, ``0 <= B <= seq_len -
            query_len`` (not checked: that would sync); ``None`` means ``seq_len - query_len`` for all.

    Falls back to :func:`.reference.tree_attention_ref` without Triton, or on CPU without ``TRITON_INTERPRET=1``.
    """
    if out is None:
        out = torch.empty_like(q)
    if not HAS_TRITON or (not q.is_cuda and not _interpreting()):
        return tree_attention_ref(
            q, key_cache, value_cache, block_table, query_start_loc, seq_lens, tree_mask, softmax_scale, out,
            tree_base=tree_base,
        )  # fmt: skip
    num_reqs = seq_lens.shape[0]
    tree_mask = _checked_tree_mask(q, key_cache, value_cache, out, seq_lens, tree_mask, tree_base)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if num_reqs else 0
    if num_reqs == 0 or max_query_len == 0:
        return out
    _launch(q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens, tree_mask, softmax_scale,
            tree_base, max_query_len)  # fmt: skip
    return out


def _launch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float,
    tree_base: torch.Tensor | None,
    max_query_len: int,
) -> None:
    """The kernel over a grid of (row tiles, KV heads, requests), with :func:`_launch_config`'s tile."""
    num_heads, head_size = q.shape[1], q.shape[2]
    _num_blocks, block_size, num_kv_heads, _head_size = key_cache.shape
    group = num_heads // num_kv_heads
    cfg = _launch_config(group, head_size, max_query_len)
    num_warps = cfg.pop("num_warps")
    grid = (triton.cdiv(max_query_len, cfg["BLOCK_Q"]), num_kv_heads, seq_lens.shape[0])
    _tree_attention_kernel[grid](
        q, key_cache, value_cache, out,
        block_table, query_start_loc, seq_lens,
        seq_lens if tree_base is None else tree_base,  # any int32 pointer when unused
        tree_mask,
        softmax_scale * 1.4426950408889634,  # log2(e): the kernel works in base 2
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), tree_mask.stride(0),
        QPKV=group,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
        NUM_WORDS=tree_mask.shape[1],
        HAS_TREE_BASE=tree_base is not None,
        # The interpreter multiplies bf16 as raw uint16 bits (numpy has no
        # bf16), so there, and only there, dots run on fp32 copies.
        DOT_IN_FP32=_interpreting() and q.dtype == torch.bfloat16,
        num_warps=num_warps,
        **cfg,
    )  # fmt: skip
