"""Topology-aware attention for tree rows on vLLM's CPU backend, and the
accepted-path KV move.

vLLM 0.32's CPU attention (v1/attention/backends/cpu_attn.py) knows causal,
non-causal and sliding-window masks only. The stock kernel still runs for the
whole batch (it is what non-tree rows need); afterwards the rows of each draft
tree are recomputed here with the right mask: every row sees the request's
committed context and, inside the tree, its ancestors and itself.

The CPU KV cache layout inside a block is private to the ISA kernel (the
``vec`` ISA stores keys transposed). Rather than hard-coding it, the layout is
*learned* once per shape by writing numbered keys and values through the
backend's own ``cpu_attn_reshape_and_cache`` and seeing where each number
lands, so reading and moving cache entries is correct by construction for
whatever ISA vLLM picked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vllm_specbeam.adapter import patches
from vllm_specbeam.adapter.attention.step import active_step, masked_rows, node_layout
from vllm_specbeam.core.tree import DraftTree


@dataclass(frozen=True)
class _BlockPlan:
    """What :func:`blockwise_attention` reads of a step, for one block size and head grouping."""

    block_ids: torch.Tensor  # [R x blocks per request]: each request's first blocks, in order
    per_request: int  # blocks per request, enough for the widest key window
    #: 0 where a row may see a key, -inf where not (keys past its window, other branches), laid
    #: out as the score matmul's batches: one add inside the matmul, no mask op
    bias: torch.Tensor  # [R x Hkv, group x Qmax, Kmax] float32


@dataclass
class TreeStep:
    """This step's trees, laid out for the attention layers (built once per step).

    Only rows whose ancestors are *not* simply all earlier rows need the tree
    mask: the stock causal kernel already gets the others right (a chain, or
    the first branch of a tree in depth-first order). Those rows alone are
    recomputed, for the requests that have any.
    """

    #: batch index of every request with rows to recompute
    req_indices: torch.Tensor  # [R]
    #: token row of every row to recompute, padded with row 0
    query_rows: torch.Tensor  # [R, Qmax]
    row_valid: torch.Tensor  # [R, Qmax] bool
    #: the valid rows, as flat indices into ``[R x Qmax]`` and as token rows (index ops, not
    #: boolean masks, in every layer: a mask costs a nonzero scan per use)
    valid_flat: torch.Tensor  # [rows]
    valid_rows: torch.Tensor  # [rows]
    #: which keys each such row may see: context, then the tree rows
    key_mask: torch.Tensor  # [R, Qmax, Kmax] bool
    #: token rows of all draft nodes and the positions they must have
    node_rows: torch.Tensor  # [sum of nodes]
    node_positions: torch.Tensor  # [sum of nodes]: context length + depth
    #: flat cache indices of the keys/values to read, per cache layout (filled lazily, shared by all layers)
    _gather: dict = field(default_factory=dict, repr=False)
    #: the requests' blocks and the blockwise key mask, per block size (filled lazily, shared by all layers)
    _blocks: dict[int, _BlockPlan] = field(default_factory=dict, repr=False)

    @property
    def needs_attention(self) -> bool:
        return self.req_indices.numel() > 0

    @classmethod
    def build(
        cls,
        req_indices: Sequence[int],
        first_rows: Sequence[int],
        context_lens: Sequence[int],
        trees: Sequence[DraftTree],
    ) -> TreeStep:
        """``first_rows[r]`` is the token row of request r's root, whose
        position (= number of committed tokens before it) is ``context_lens[r]``."""
        node_rows, node_positions = node_layout(first_rows, context_lens, trees)
        fixes = [
            (i, first, ctx, tree, masked_rows(tree))
            for i, first, ctx, tree in zip(req_indices, first_rows, context_lens, trees)
        ]
        fixes = [fix for fix in fixes if fix[-1].size]
        return cls.for_windows(
            [fix[0] for fix in fixes],
            [first + rows for _, first, _, _, rows in fixes],
            [(ctx, tree.ancestor_mask[rows]) for _, _, ctx, tree, rows in fixes],
            node_rows,
            node_positions,
        )

    @classmethod
    def for_windows(
        cls,
        req_indices: Sequence[int],
        query_rows: Sequence[np.ndarray],
        windows: Sequence[tuple[int, np.ndarray]],
        node_rows: torch.Tensor | None = None,
        node_positions: torch.Tensor | None = None,
    ) -> TreeStep:
        """Rows to recompute: request ``req_indices[r]``'s token rows ``query_rows[r]``, with
        ``windows[r] = (context, visible)``: each row sees keys ``[0, context)`` and, of the keys
        from ``context`` on, those ``visible`` ``[rows, keys]`` marks. Without ``node_rows``, no
        node's position is set (an in-worker draft's rows come with theirs)."""
        num_rows = max((rows.size for rows in query_rows), default=0)
        num_keys = max((ctx + visible.shape[1] for ctx, visible in windows), default=0)
        padded_rows = np.zeros((len(windows), num_rows), np.int64)
        row_valid = np.zeros((len(windows), num_rows), bool)
        key_mask = np.zeros((len(windows), num_rows, num_keys), bool)
        for r, (rows, (ctx, visible)) in enumerate(zip(query_rows, windows)):
            padded_rows[r, : rows.size] = rows
            row_valid[r, : rows.size] = True
            key_mask[r, : rows.size, :ctx] = True
            key_mask[r, : rows.size, ctx : ctx + visible.shape[1]] = visible
        empty = torch.zeros(0, dtype=torch.int64)
        valid_flat = np.flatnonzero(row_valid)
        return cls(
            torch.as_tensor(list(req_indices), dtype=torch.int64),
            torch.from_numpy(padded_rows),
            torch.from_numpy(row_valid),
            torch.from_numpy(valid_flat),
            torch.from_numpy(padded_rows.reshape(-1)[valid_flat]),
            torch.from_numpy(key_mask),
            empty if node_rows is None else node_rows,
            empty if node_positions is None else node_positions,
        )

    def blockwise_plan(self, block_table: torch.Tensor, block_size: int, kv_heads: int, group: int) -> _BlockPlan:
        """The requests' blocks and the key mask as a score bias (once per step, block size and
        head grouping: every layer of a KV-cache group shares them)."""
        key = (block_size, kv_heads, group)
        if key not in self._blocks:
            requests, rows, num_keys = self.key_mask.shape
            per_request = -(-num_keys // block_size)
            ids = block_table[self.req_indices][:, :per_request].reshape(-1).to(torch.int64)
            bias = torch.zeros(requests, rows, num_keys).masked_fill_(~self.key_mask, -torch.inf)
            bias = bias[:, None, None].expand(requests, kv_heads, group, rows, num_keys)
            self._blocks[key] = _BlockPlan(ids, per_request, bias.reshape(requests * kv_heads, group * rows, num_keys))
        return self._blocks[key]

    def gather_index(self, layer: torch.nn.Module, kv_cache: torch.Tensor, block_table: torch.Tensor):
        """Flat indices into a layer's cache storage of the keys and values of
        positions ``[0, Kmax)`` of each request, ``[R, heads, Kmax, head]``.

        Every layer of a KV-cache group has the same block table, shape and
        ISA, so this is computed once per step and reused by all layers.
        """
        key = (tuple(kv_cache.shape), kv_cache.dtype, getattr(layer, "isa", None))
        if key not in self._gather:
            key_index, value_index = _layout_for(layer, kv_cache)
            block_size = kv_cache.shape[2]
            positions = torch.arange(self.key_mask.shape[-1])
            blocks = block_table[self.req_indices][:, positions // block_size].to(torch.int64)  # [R, K]
            base = (blocks * kv_cache[0].numel())[:, :, None, None]  # [R, K, 1, 1]
            offsets = positions % block_size
            self._gather[key] = tuple(
                (base + index[offsets][None]).permute(0, 2, 1, 3) for index in (key_index, value_index)
            )
        return self._gather[key]


# ---------------------------------------------------------------- cache layout
def _split_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views exactly as vLLM 0.32.0 cpu_attn.py makes them."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)


@functools.cache
def block_layout(
    isa: str, dtype: torch.dtype, num_kv_heads: int, block_size: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each key and value element lives inside one cache block.

    Returns ``(key_index, value_index)``, each ``[block_size, heads, head_size]``
    holding positions in the block's flat storage. Learned by writing numbered
    elements with vLLM's own cache-write op; the numbers are written in base-64
    digits (plus one, so empty storage reads 0) so every dtype holds them
    exactly; keys are written positive and values negative to tell them apart.
    """
    from vllm import _custom_ops as ops

    shape = (block_size, num_kv_heads, head_size)
    ids = torch.arange(int(np.prod(shape)))
    base, digits = 64, 1
    while base**digits < ids.numel():
        digits += 1
    decoded = torch.zeros(num_kv_heads * block_size * 2 * head_size, dtype=torch.int64)
    sign = None
    for digit in range(digits):
        value = ((ids // base**digit) % base + 1).to(dtype).view(shape)
        cache = torch.zeros(1, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = _split_kv(cache)
        ops.cpu_attn_reshape_and_cache(
            value,
            -value,
            key_cache,
            value_cache,
            torch.arange(block_size),
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        flat = cache.view(-1).to(torch.float32)
        sign = torch.sign(flat).to(torch.int64) if sign is None else sign
        decoded += (flat.abs().to(torch.int64) - 1).clamp(min=0) * base**digit
    key_index = torch.empty(ids.numel(), dtype=torch.int64)
    value_index = torch.empty(ids.numel(), dtype=torch.int64)
    positions = torch.arange(decoded.numel())
    key_index[decoded[sign > 0]] = positions[sign > 0]
    value_index[decoded[sign < 0]] = positions[sign < 0]
    if (sign > 0).sum() != ids.numel() or (sign < 0).sum() != ids.numel():
        raise RuntimeError(f"could not learn the CPU KV cache layout for ISA {isa!r}")
    return key_index.view(shape), value_index.view(shape)


@dataclass(frozen=True)
class BlockStrides:
    """Where element ``(position, head, element)`` of a block's keys (or values) lives in the
    block's storage: ``offset + position * position_stride + ...``."""

    offset: int
    position: int
    head: int
    element: int


@functools.cache
def block_strides(
    isa: str, dtype: torch.dtype, num_kv_heads: int, block_size: int, head_size: int
) -> tuple[BlockStrides, BlockStrides] | None:
    """The learned layout (:func:`block_layout`) as strides, keys' then values', when both are
    strided (vLLM 0.32's ``vec`` ISA: keys ``[heads, head, block]``, values ``[heads, block, head]``);
    ``None`` for a packed layout."""
    found = []
    for index in block_layout(isa, dtype, num_kv_heads, block_size, head_size):
        origin = int(index[0, 0, 0])
        steps = [
            int(index[tuple(1 if d == axis else 0 for d in range(3))]) - origin if index.shape[axis] > 1 else 0
            for axis in range(3)
        ]
        grid = torch.meshgrid(*(torch.arange(n) for n in index.shape), indexing="ij")
        if not torch.equal(index, origin + sum(g * step for g, step in zip(grid, steps))):
            return None
        found.append(BlockStrides(origin, *steps))
    return found[0], found[1]


def _layout_for(layer: torch.nn.Module, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, num_kv_heads, block_size, two_head = kv_cache.shape
    return block_layout(layer.isa, kv_cache.dtype, num_kv_heads, block_size, two_head // 2)


# ---------------------------------------------------------------- attention
def recompute_tree_rows(
    impl: torch.nn.Module,
    layer: torch.nn.Module,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    output: torch.Tensor,
    step: TreeStep,
) -> None:
    """Overwrite the tree rows of ``output`` with topology-aware attention, in float32.

    Reads keys from the cache (vLLM has already written this step's rows), so
    the keys of tree rows carry the RoPE of their depth-based positions. A strided
    layout (:func:`block_strides`, vLLM 0.32's ``vec`` ISA) is read through its
    strides into one batched matmul (:func:`blockwise_attention`); a packed one
    element by element.
    """
    _, kv_heads, block_size, two_head = kv_cache.shape
    requests, num_rows = step.query_rows.shape
    q = query.index_select(0, step.query_rows.view(-1)).view(requests, num_rows, impl.num_heads, impl.head_size)
    strides = block_strides(layer.isa, kv_cache.dtype, kv_heads, block_size, two_head // 2)
    if strides is None:
        storage = kv_cache.view(-1)
        keys, values = (storage[index].to(torch.float32) for index in step.gather_index(layer, kv_cache, block_table))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2).to(torch.float32),
            keys,
            values,
            attn_mask=step.key_mask[:, None],
            scale=impl.scale,
            enable_gqa=q.shape[2] != keys.shape[1],
        )  # [R, Hq, Qmax, D]
    else:
        plan = step.blockwise_plan(block_table, block_size, kv_heads, impl.num_heads // kv_heads)
        out = blockwise_attention(q, kv_cache, plan, strides, impl.scale)  # [R, Hq, Qmax, D]
    rows = out.transpose(1, 2).reshape(requests * num_rows, impl.num_heads, impl.head_size)
    output.view(output.shape[0], impl.num_heads, impl.head_size).index_copy_(
        0, step.valid_rows, rows.index_select(0, step.valid_flat).to(output.dtype)
    )


def _float32_copy(view: torch.Tensor) -> torch.Tensor:
    """``view`` converted to float32 in one pass, laid out contiguously in its own dimension order."""
    return torch.empty(view.shape, dtype=torch.float32).copy_(view)


def blockwise_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, plan: _BlockPlan, strides: tuple[BlockStrides, BlockStrides], scale: float
) -> torch.Tensor:
    """Masked attention of ``q`` ``[R, Qmax, Hq, D]`` over each request's cache blocks, in float32:
    the blocks are read once through the layout's strides into contiguous keys and values, then
    one batched matmul with the mask's bias and scale folded in (``baddbmm``), one softmax, one
    matmul. Returns ``[R, Hq, Qmax, D]``. At these sizes (a tree's ~10 off-branch rows, ~150 keys)
    the time is in the number of torch ops, not their arithmetic (benchmarks/cpu_tree_rows.py)."""
    requests, rows, q_heads, head = q.shape
    kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    group, per = q_heads // kv_heads, plan.per_request
    blocks = kv_cache.index_select(0, plan.block_ids)  # [R x per, Hkv, block, 2 x D]
    numel = blocks[0].numel()
    key_view, value_view = strides
    keys_t = torch.as_strided(  # [R, Hkv, D, per, block]
        blocks,
        (requests, kv_heads, head, per, block_size),
        (per * numel, key_view.head, key_view.element, numel, key_view.position),
        key_view.offset,
    )
    values = torch.as_strided(  # [R, Hkv, per, block, D]
        blocks,
        (requests, kv_heads, per, block_size, head),
        (per * numel, value_view.head, numel, value_view.position, value_view.element),
        value_view.offset,
    )
    batches, num_keys = requests * kv_heads, plan.bias.shape[-1]  # keys past Kmax are never read
    # query head h reads kv head h // group: batch (request, kv head), rows (group, row)
    grouped = _float32_copy(q.view(requests, rows, kv_heads, group, head).permute(0, 2, 3, 1, 4))
    # hidden keys score -inf and weigh exactly 0: 0 x value is 0 since vLLM 0.32 zero-fills the
    # cache (v1/worker/utils.py allocate_kv_cache) and writes finite K/V
    scores = torch.baddbmm(  # [R x Hkv, group x Qmax, Kmax]
        plan.bias,
        grouped.view(batches, group * rows, head),
        _float32_copy(keys_t).view(batches, head, per * block_size)[..., :num_keys],
        alpha=scale,
    )
    values = _float32_copy(values).view(batches, per * block_size, head)[:, :num_keys]  # [R x Hkv, Kmax, D]
    out = torch.bmm(scores.softmax(-1), values)
    return out.view(requests, q_heads, rows, head)


def install_cpu_tree_attention() -> None:
    """Wrap vLLM 0.32.0's ``CPUAttentionBackendImpl.forward`` (once per process).

    The wrapper runs the stock kernel, then fixes the tree rows when a tree
    step is active; without one it is the stock call plus one global lookup.
    """
    patches.wrap(patches.CPU_ATTENTION_FORWARD, _tree_forward)


def _tree_forward(stock: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(stock)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = stock(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step = active_step()
        if step is not None and step.needs_attention and attn_metadata is not None:
            recompute_tree_rows(self, layer, query, kv_cache, attn_metadata.block_table, output, step)
        return result

    return forward


def check_cpu_attention_supported(attention_impls: Sequence[torch.nn.Module]) -> None:
    """Tree rows are recomputed with plain scaled-dot-product attention: refuse
    models whose attention needs more than that, at start-up."""
    for impl in attention_impls:
        problems = []
        if getattr(impl, "sliding_window", -1) not in (-1, None):
            problems.append("sliding-window attention")
        if getattr(impl, "alibi_slopes", None) is not None:
            problems.append("ALiBi")
        if getattr(impl, "logits_soft_cap", 0):
            problems.append("logit soft-capping")
        if getattr(impl, "sinks", None) is not None:
            problems.append("attention sinks")
        if getattr(impl, "is_fp8_kv_cache", False):
            problems.append("an fp8 KV cache")
        if problems:
            raise ValueError(
                f"vllm-specbeam tree verification on CPU does not support {', '.join(problems)} "
                f"(model layer uses it); use a model without it or vLLM's built-in speculative methods"
            )


# ---------------------------------------------------------------- KV move
def move_kv(
    layers: Sequence[tuple[torch.nn.Module, torch.Tensor]], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Copy the K/V of ``src_slots`` to ``dst_slots`` in every layer's cache.

    All sources are gathered before anything is written, so overlapping moves
    (an accepted node landing on the slot of a shallower accepted node) are
    safe in any order.
    """
    if src_slots.numel() == 0:
        return
    for layer, kv_cache in layers:
        key_index, value_index = _layout_for(layer, kv_cache)
        block_size = kv_cache.shape[2]
        block_numel = kv_cache[0].numel()
        elems = torch.cat([key_index, value_index], dim=1).flatten(1)  # [block_size, 2 * heads * head_size]
        src, dst = ((slots // block_size * block_numel)[:, None] + elems[slots % block_size]
                    for slots in (src_slots, dst_slots))  # fmt: skip
        storage = kv_cache.view(-1)
        storage[dst] = storage[src]
