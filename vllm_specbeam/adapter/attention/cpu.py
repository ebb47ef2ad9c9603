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
    #: which keys each such row may see: context, then the tree rows
    key_mask: torch.Tensor  # [R, Qmax, Kmax] bool
    #: token rows of all draft nodes and the positions they must have
    node_rows: torch.Tensor  # [sum of nodes]
    node_positions: torch.Tensor  # [sum of nodes]: context length + depth
    #: flat cache indices of the keys/values to read, per cache layout (filled lazily, shared by all layers)
    _gather: dict = field(default_factory=dict, repr=False)
    #: the requests' blocks to copy whole, per block size (filled lazily, shared by all layers)
    _blocks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

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
        return cls(
            torch.as_tensor(list(req_indices), dtype=torch.int64),
            torch.from_numpy(padded_rows),
            torch.from_numpy(row_valid),
            torch.from_numpy(key_mask),
            empty if node_rows is None else node_rows,
            empty if node_positions is None else node_positions,
        )

    def gather_kv(
        self, layer: torch.nn.Module, kv_cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``[0, Kmax)`` of each request, ``[R, heads, Kmax, head]``
        in ``dtype``. Where the layout is strided (:func:`block_strides`), the requests' blocks
        are copied whole and read through a strided view, in one pass that converts too; else
        element by element (:meth:`gather_index`)."""
        _, heads, block_size, two_head = kv_cache.shape
        head_size = two_head // 2
        strides = block_strides(layer.isa, kv_cache.dtype, heads, block_size, head_size)
        if strides is None:
            storage = kv_cache.view(-1)
            keys, values = (storage[index].to(dtype) for index in self.gather_index(layer, kv_cache, block_table))
            return keys, values
        requests, num_keys = self.key_mask.shape[0], self.key_mask.shape[-1]
        per_request = -(-num_keys // block_size)
        if block_size not in self._blocks:  # the same for every layer of the step
            self._blocks[block_size] = block_table[self.req_indices][:, :per_request].reshape(-1).to(torch.int64)
        blocks = kv_cache[self._blocks[block_size]]  # [R x blocks, heads, block_size, 2 x head]
        numel = kv_cache[0].numel()
        out = []
        for stride in strides:
            view = torch.as_strided(
                blocks,
                (requests, per_request, block_size, heads, head_size),
                (per_request * numel, numel, stride.position, stride.head, stride.element),
                stride.offset,
            )
            dense = torch.empty((requests, heads, per_request, block_size, head_size), dtype=dtype)
            dense.copy_(view.permute(0, 3, 1, 2, 4))  # [R, heads, blocks, block_size, head]
            out.append(dense.view(requests, heads, per_request * block_size, head_size)[:, :, :num_keys])
        return out[0], out[1]

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
    """Overwrite the tree rows of ``output`` with topology-aware attention.

    Reads keys from the cache (vLLM has already written this step's rows), so
    the keys of tree rows carry the RoPE of their depth-based positions.
    """
    compute = torch.float32
    keys, values = step.gather_kv(layer, kv_cache, block_table, compute)  # [R, Hkv, Kmax, D] each
    q = query[step.query_rows].transpose(1, 2)  # [R, Hq, Rmax, D]
    out = F.scaled_dot_product_attention(
        q.to(compute),
        keys,
        values,
        attn_mask=step.key_mask[:, None],
        scale=impl.scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    rows = out.transpose(1, 2)[step.row_valid]  # [rows, Hq, D]
    output.view(output.shape[0], impl.num_heads, impl.head_size)[step.query_rows[step.row_valid]] = rows.to(
        output.dtype
    )


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
