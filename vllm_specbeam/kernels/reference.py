"""Torch references for the tree-attention and KV-move kernels.

Written for clarity, not speed: what the Triton kernels are tested against
and what runs on machines without Triton or a GPU. The paged KV-cache layout
they read (vLLM's ``TRITON_ATTN`` backend: logical
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, strides from the
resolved ``KVCacheLayout``) is described in docs/kernels.md.

Tree topology ("ancestor words"): per query row an ``int64[num_words]``
bitmask, ``tree_mask[num_tokens, num_words]``. Bits index the request's
*tree window*, the keys from ``B`` (``tree_base``) on: bit ``b`` of word ``w``
is key ``B + j``, ``j = 64 * w + b``. With context ``C = seq_len - query_len``:

* a row whose words are **all zero** is causal: it sees keys ``[0, C + row]``;
* any other row is a **tree row**: it sees ``[0, B)`` plus key ``B + j`` for
  every set bit ``j < seq_len - B``.

``B`` defaults to ``C`` (bit ``j`` is query row ``j``: a verification step's
tree is its rows); ``0 <= B < C`` serves a draft drafting a tree depth by
depth, whose ancestors at earlier depths sit in the cache between the
context and the rows. The step's own keys are read from the paged cache,
like the context, because vLLM writes all scheduled rows before attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_specbeam.core.tree import DraftTree

BITS_PER_WORD = 64


# ----------------------------------------------------------------- topology
def pack_ancestor_mask(mask: np.ndarray, num_words: int) -> np.ndarray:
    """Pack a boolean ``[rows, cols]`` mask into ``int64[rows, num_words]``."""
    mask = np.asarray(mask, dtype=bool)
    rows, cols = mask.shape
    if cols > num_words * BITS_PER_WORD:
        raise ValueError(f"{cols} columns need more than {num_words} words")
    padded = np.zeros((rows, num_words * BITS_PER_WORD), dtype=bool)
    padded[:, :cols] = mask
    # The runner packs every step's trees with this, so it is vectorised:
    # column c is bit c % 8 of byte c // 8 ("little" bit order), and bytes
    # make up words little-endian, so it is bit c % 64 of word c // 64.
    return np.packbits(padded, axis=1, bitorder="little").view("<i8").astype(np.int64)


def unpack_tree_mask(words: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_ancestor_mask` for a torch ``int64[rows, W]``.

    Columns past the last word read as unset, as in the kernel, which loops
    over at most ``W`` words whatever the window's width.
    """
    cols = torch.arange(num_cols, device=words.device)
    word_idx = cols // BITS_PER_WORD  # [num_cols]
    in_words = word_idx < words.shape[1]
    word = words[:, word_idx.clamp(max=words.shape[1] - 1)]  # [rows, num_cols]
    return ((word >> (cols % BITS_PER_WORD)) & 1).bool() & in_words


def build_tree_mask(
    segments: Sequence[DraftTree | np.ndarray | int],
    num_words: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The ``tree_mask`` input for a batch, one segment per request, in order.

    * ``DraftTree``: its verification rows ``[root, node 0, ...]``;
    * ``int n``: ``n`` plain causal rows (a non-tree request, or a prefill);
    * boolean ``ndarray [n, n]``: any row pattern, e.g. from
      :func:`forest_ancestor_mask` (rows must not be all-false).
    """
    masks: list[np.ndarray] = []
    for seg in segments:
        if isinstance(seg, DraftTree):
            masks.append(seg.ancestor_mask)
        elif isinstance(seg, (int, np.integer)):
            masks.append(np.zeros((int(seg), 0), dtype=bool))
        else:
            seg = np.asarray(seg, dtype=bool)
            if seg.ndim != 2 or (seg.shape[0] and not seg.any(axis=1).all()):
                raise ValueError("a tree segment needs a [n, n] mask with no empty row")
            masks.append(seg)
    widest = max((m.shape[1] for m in masks), default=0)
    if num_words is None:
        num_words = max(1, -(-widest // BITS_PER_WORD))
    packed = [pack_ancestor_mask(m, num_words) for m in masks]
    out = np.concatenate(packed) if packed else np.zeros((0, num_words), np.int64)
    return torch.from_numpy(out).to(device)


def allowed_keys(words: torch.Tensor, context_len: int, tree_base: int | None = None) -> torch.Tensor:
    """Boolean ``[query_len, context_len + query_len]``: which key each row sees.

    ``words`` are the request's rows of ``tree_mask``, ``tree_base`` where its
    tree window starts (``None``: at ``context_len``); see the module
    docstring for the rule. Shared by the reference and the dense baseline.
    """
    query_len = words.shape[0]
    seq_len = context_len + query_len
    base = context_len if tree_base is None else tree_base
    if not 0 <= base <= context_len:
        raise ValueError(f"tree_base {base} outside [0, {context_len}]: the window must hold the rows' own keys")
    key_pos = torch.arange(seq_len, device=words.device)
    row = torch.arange(query_len, device=words.device)
    causal = key_pos[None, :] <= context_len + row[:, None]
    in_tree = unpack_tree_mask(words, seq_len - base)  # [q, seq_len - base]
    tree = torch.cat([torch.ones(query_len, base, dtype=torch.bool, device=words.device), in_tree], dim=1)
    is_tree = (words != 0).any(dim=1, keepdim=True)
    return torch.where(is_tree, tree, causal)


# ---------------------------------------------------------------- paged I/O
def token_slots(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot ids (``block * block_size + offset``) of a request's positions."""
    blocks = block_table_row[positions // block_size].to(torch.int64)
    return blocks * block_size + positions % block_size


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's view: logical ``[B, H, N, 2D]`` -> key/value ``[B, N, H, D]``."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def gather_paged(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a ``[num_blocks, block_size, heads, dim]`` cache at ``slots``."""
    block_size = cache.shape[1]
    return cache[slots // block_size, slots % block_size]


# ---------------------------------------------------------- tree attention
def tree_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    *,
    tree_base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-request masked attention over the paged cache, in fp32.

    Shapes: ``q/out [num_tokens, num_heads, head_size]``; caches ``[num_blocks,
    block_size, num_kv_heads, head_size]``; ``block_table [num_reqs,
    max_blocks]``; ``query_start_loc [num_reqs + 1]``; ``seq_lens [num_reqs]``
    (context + this step's rows); ``tree_mask [num_tokens, W]`` or ``None``
    (all rows causal); ``tree_base [num_reqs]`` or ``None`` (every window
    starts at the context end). Rows past ``query_start_loc[-1]`` are left
    untouched.
    """
    if out is None:
        out = torch.zeros_like(q)
    num_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    bases = [None] * len(seq_lens) if tree_base is None else tree_base.tolist()
    for req, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[req], starts[req + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        context_len = seq_len - query_len
        slots = token_slots(block_table[req], torch.arange(seq_len, device=q.device), block_size)
        keys = gather_paged(key_cache, slots).float().repeat_interleave(group, dim=1)
        values = gather_paged(value_cache, slots).float().repeat_interleave(group, dim=1)
        if tree_mask is None:
            words = torch.zeros(query_len, 1, dtype=torch.int64, device=q.device)
        else:
            words = tree_mask[q_start:q_end]
        allowed = allowed_keys(words, context_len, bases[req])  # [q, k]
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), keys) * softmax_scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
    return out


# ----------------------------------------------------------------- KV move
def accepted_path_moves(
    block_table: torch.Tensor,
    context_lens: Sequence[int],
    accepted_rows: Sequence[Sequence[int]],
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src_slots, dst_slots, cu_moves)`` to compact each accepted path.

    Request ``r`` verified its rows at positions ``context_lens[r] + row``;
    ``accepted_rows[r]`` lists the accepted rows root-first (increasing, as
    any root-to-node path of a topologically ordered tree is). The ``i``-th
    accepted row must end up at position ``context_lens[r] + i``. Moves whose
    source already is the target are kept (the kernel skips them).
    """
    src, dst, cu = [], [], [0]
    for req, (context_len, rows) in enumerate(zip(context_lens, accepted_rows, strict=True)):
        rows_t = torch.as_tensor(list(rows), dtype=torch.int64, device=block_table.device)
        if rows_t.numel() and not bool((rows_t[1:] > rows_t[:-1]).all()):
            raise ValueError("accepted rows must be strictly increasing")
        targets = torch.arange(rows_t.numel(), device=block_table.device)
        src.append(token_slots(block_table[req], context_len + rows_t, block_size))
        dst.append(token_slots(block_table[req], context_len + targets, block_size))
        cu.append(cu[-1] + rows_t.numel())
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)
    return cat(src), cat(dst), torch.tensor(cu, dtype=torch.int64, device=block_table.device)


def check_in_place_order(src_slots: torch.Tensor, dst_slots: torch.Tensor, cu_moves: torch.Tensor) -> None:
    """Raise unless applying each request's moves in order is safe in place.

    Safe means no move writes a slot that a *later* move of the same request
    still has to read. Accepted paths of topologically ordered trees always
    qualify: target ``C + i`` <= source ``C + row_i`` < ``C + row_j`` (j > i).
    """
    bounds = cu_moves.tolist()
    for req in range(len(bounds) - 1):
        srcs = src_slots[bounds[req] : bounds[req + 1]].tolist()
        dsts = dst_slots[bounds[req] : bounds[req + 1]].tolist()
        for i, d in enumerate(dsts):
            if d in srcs[i + 1 :]:
                raise ValueError(f"request {req}: move {i} overwrites slot {d} before it is read")


def kv_move_ref(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Copy every slot ``src_slots[i]`` to ``dst_slots[i]`` in every layer.

    ``kv_caches`` are per-layer tensors in vLLM's logical ``[num_blocks,
    num_kv_heads, block_size, content]`` order (content = K|V packed). The
    semantics are "all sources are read, then all targets written", i.e. what
    a correct in-place move must reproduce. Negative slots are padding.
    """
    keep = (src_slots >= 0) & (dst_slots >= 0)
    src, dst = src_slots[keep].long(), dst_slots[keep].long()
    for cache in kv_caches:
        block_size = cache.shape[2]
        snapshot = cache[src // block_size, :, src % block_size].clone()  # [n, H, content]
        cache[dst // block_size, :, dst % block_size] = snapshot
