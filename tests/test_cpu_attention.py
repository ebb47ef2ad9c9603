"""Tree attention and the KV move on vLLM's real CPU cache layout.

K/V are written with vLLM's own ``cpu_attn_reshape_and_cache`` for the ISA
vLLM picks on this machine; the plugin must read and move them correctly
whatever that layout is (the ``vec`` ISA stores keys transposed).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vllm_specbeam.adapter.attention import cpu
from vllm_specbeam.adapter.attention.cpu import TreeStep, _split_kv, block_layout, move_kv, recompute_tree_rows
from vllm_specbeam.core.tree import ROOT, DraftTree

HEADS, KV_HEADS, HEAD, BLOCK = 6, 2, 32, 32  # 3 query heads a kv head: a head-order mistake shows


def isa_for(dtype: torch.dtype) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, BLOCK, HEAD)


def write(cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    from vllm import _custom_ops as ops

    key_cache, value_cache = _split_kv(cache)
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )


def read_kv(layer, cache: torch.Tensor, block_table: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, num_keys), [R, heads, keys, head], read
    through the learned layout the way the plugin's element-wise gather does."""
    empty = torch.zeros(0, dtype=torch.int64)
    step = TreeStep(
        req_indices=torch.arange(block_table.shape[0]),
        query_rows=empty,
        row_valid=empty.bool(),
        valid_flat=empty,
        valid_rows=empty,
        key_mask=torch.zeros(block_table.shape[0], 1, num_keys, dtype=torch.bool),
        node_rows=empty,
        node_positions=empty,
    )
    key_index, value_index = step.gather_index(layer, cache, block_table)
    return cache.view(-1)[key_index], cache.view(-1)[value_index]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_round_trip(dtype):
    isa = isa_for(dtype)
    key_index, value_index = block_layout(isa, dtype, KV_HEADS, BLOCK, HEAD)
    assert torch.cat([key_index.flatten(), value_index.flatten()]).unique().numel() == 2 * BLOCK * KV_HEADS * HEAD
    cache = torch.zeros(4, KV_HEADS, BLOCK, 2 * HEAD, dtype=dtype)
    keys, values = torch.randn(2, 50, KV_HEADS, HEAD).to(dtype)
    block_table = torch.tensor([[3, 1]])
    slots = torch.cat([3 * BLOCK + torch.arange(BLOCK), BLOCK + torch.arange(50 - BLOCK)])
    write(cache, keys, values, slots, isa)
    layer = SimpleNamespace(isa=isa)
    read_k, read_v = read_kv(layer, cache, block_table, 50)
    assert torch.equal(read_k[0], keys.transpose(0, 1))
    assert torch.equal(read_v[0], values.transpose(0, 1))


@pytest.mark.parametrize("layout", ["strided", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_matches_dense_masked_attention(dtype, layout, monkeypatch):
    """The tree rows, read block by block through the layout's strides (the ``vec`` ISA) or
    element by element (a packed layout), equal dense masked attention over the visible keys."""
    torch.manual_seed(0)
    isa = isa_for(dtype)
    assert (cpu.block_strides(isa, dtype, KV_HEADS, BLOCK, HEAD) is not None) == (isa == "vec")
    if layout == "packed":
        monkeypatch.setattr(cpu, "block_strides", lambda *args: None)
    tree = DraftTree(tokens=[0] * 5, parents=[ROOT, ROOT, 0, 0, 2])  # rows 2..5 need the tree mask
    contexts = [7, 40, 70]  # the second crosses a block boundary, the third spans three blocks
    trees = [DraftTree.chain([0, 0, 0]), tree, DraftTree(tokens=[0] * 3, parents=[ROOT, ROOT, 1])]
    cache = torch.zeros(12, KV_HEADS, BLOCK, 2 * HEAD, dtype=dtype)
    block_table = torch.tensor([[5, 2, 6], [0, 7, 4], [9, 3, 11]])
    rows = [c + t.num_nodes + 1 for c, t in zip(contexts, trees)]
    keys = [torch.randn(n, KV_HEADS, HEAD).to(dtype) for n in rows]
    values = [torch.randn(n, KV_HEADS, HEAD).to(dtype) for n in rows]
    for r, n in enumerate(rows):
        pos = torch.arange(n)
        write(cache, keys[r], values[r], block_table[r, pos // BLOCK] * BLOCK + pos % BLOCK, isa)
    num_tokens = sum(t.num_nodes + 1 for t in trees) + 3  # three rows of another request stay untouched
    query = torch.randn(num_tokens, HEADS, HEAD).to(dtype)
    output = torch.full((num_tokens, HEADS * HEAD), 7.0, dtype=dtype)
    first_rows = [3, 3 + trees[0].num_nodes + 1, 3 + trees[0].num_nodes + trees[1].num_nodes + 2]
    step = TreeStep.build([0, 1, 2], first_rows, contexts, trees)
    assert step.req_indices.tolist() == [1, 2]
    recomputed = {1: (2, 3, 4, 5), 2: (2, 3)}
    assert step.query_rows[step.row_valid].tolist() == [first_rows[r] + i for r in (1, 2) for i in recomputed[r]]
    impl = SimpleNamespace(scale=1 / math.sqrt(HEAD), num_heads=HEADS, head_size=HEAD)
    recompute_tree_rows(impl, SimpleNamespace(isa=isa), query, cache, block_table, output, step)

    assert (output[:3] == 7.0).all() and (output[first_rows[0] : first_rows[1] + 2] == 7.0).all()
    assert (output[first_rows[2] : first_rows[2] + 2] == 7.0).all()
    for r in (1, 2):
        ctx, t, first = contexts[r], trees[r], first_rows[r]
        for i in recomputed[r]:
            visible = list(range(ctx)) + [ctx + j for j in range(t.num_nodes + 1) if t.ancestor_mask[i, j]]
            k = keys[r][visible].float().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [keys, H, D]
            v = values[r][visible].float().repeat_interleave(HEADS // KV_HEADS, dim=1)
            q = query[first + i].float()  # [H, D]
            weights = torch.softmax(torch.einsum("hd,khd->hk", q, k) / math.sqrt(HEAD), dim=-1)
            expected = torch.einsum("hk,khd->hd", weights, v).reshape(-1).to(dtype)
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(output[first + i], expected, atol=tolerance, rtol=tolerance)


def test_move_kv_handles_overlapping_moves_in_every_layer():
    dtype = torch.float32
    isa = isa_for(dtype)
    caches = [torch.zeros(3, KV_HEADS, BLOCK, 2 * HEAD, dtype=dtype) for _ in range(2)]
    keys, values = torch.randn(2, 3 * BLOCK, KV_HEADS, HEAD)
    for cache in caches:
        write(cache, keys, values, torch.arange(3 * BLOCK), isa)
    # accepted nodes at rows 2 and 3 of a tree rooted at slot 30 move to depths 1, 2:
    # slot 32 -> 31 and 33 -> 32 (the second destination is the first source).
    src, dst = torch.tensor([32, 33]), torch.tensor([31, 32])
    layer = SimpleNamespace(isa=isa)
    move_kv([(layer, c) for c in caches], src, dst)
    for cache in caches:
        read_k, read_v = read_kv(layer, cache, torch.tensor([[0, 1, 2]]), 3 * BLOCK)
        expected_k = keys.clone()
        expected_k[[31, 32]] = keys[[32, 33]]
        assert torch.equal(read_k[0], expected_k.transpose(0, 1))
        assert torch.equal(read_v[0, :, 31], values[32].to(dtype))
