"""Accepted-path KV move kernel vs the torch reference and vLLM's cache writer.

Runs under ``TRITON_INTERPRET=1`` on CPU (set below before Triton is
imported). The move copies raw bits, so every comparison is exact.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton  # noqa: F401  (in the test extra: without it these tests fail here, never skip)
from vllm_kernels import vllm_reshape_and_cache

from vllm_specbeam.kernels import kv_move as km_mod
from vllm_specbeam.kernels.reference import (
    accepted_path_moves,
    check_in_place_order,
    gather_paged,
    kv_move_ref,
    split_kv_cache,
    token_slots,
)

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
HEAD_SIZE = 64


@pytest.fixture(autouse=True)
def _kernel_must_run(monkeypatch):
    def fallback(*args, **kwargs):
        raise AssertionError("kv_move fell back to the torch reference")

    monkeypatch.setattr(km_mod, "kv_move_ref", fallback)


def make_layers(num_layers, num_blocks, num_kv_heads, block_size, dtype, layout, seed=0):
    """Per-layer logical [B, H, N, 2D] caches, as vLLM binds them to layers.

    ``LBNHC``/``LBHNC``: one allocation per layer ([block, slot, head, C] or
    [block, head, slot, C] in memory). ``BLNHC``: a single allocation with the
    layer dim *inside* the block dim, so per-layer views are strided.
    """
    gen = torch.Generator().manual_seed(seed)  # on the CPU: the same values on every device
    shape = (num_blocks, num_kv_heads, block_size, 2 * HEAD_SIZE)
    if layout == "BLNHC":
        big_shape = (num_blocks, num_layers, block_size, num_kv_heads, 2 * HEAD_SIZE)
        big = torch.randn(big_shape, generator=gen, device="cpu").to(dtype).to(DEVICE)
        return [big[:, layer].transpose(1, 2) for layer in range(num_layers)]
    layers = []
    for _ in range(num_layers):
        if layout == "LBNHC":
            cache = torch.randn(num_blocks, block_size, num_kv_heads, 2 * HEAD_SIZE, generator=gen, device="cpu")
            cache = cache.transpose(1, 2)
        else:
            cache = torch.randn(*shape, generator=gen, device="cpu")
        layers.append(cache.to(dtype).to(DEVICE))
    return layers


def block_table_for(num_reqs: int, pages_per_req: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_blocks, generator=gen, device="cpu")[: num_reqs * pages_per_req]
    return pages.view(num_reqs, pages_per_req).int().to(DEVICE)


def run_and_compare(layers, src, dst, cu):
    expected = [layer.clone() for layer in layers]
    kv_move_ref(expected, src, dst)
    km_mod.kv_move(layers, src, dst, cu)
    for got, want in zip(layers, expected, strict=True):
        assert torch.equal(got, want)
    return expected


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_reference(dtype, block_size, layout):
    num_blocks = 24
    layers = make_layers(3, num_blocks, 2, block_size, dtype, layout, seed=block_size)
    block_table = block_table_for(4, 5, num_blocks, seed=block_size)
    context_lens = [block_size - 3, 0, 2 * block_size + 5, 7]  # paths cross page boundaries
    accepted = [
        [0, 2, 3, 9, 15],  # branchy: sources far behind their targets
        [0, 1, 2, 3],  # a chain accepted in full: all moves are no-ops
        [0, 40],  # one long jump
        [0],  # only the root (nothing drafted was accepted)
    ]
    src, dst, cu = accepted_path_moves(block_table, context_lens, accepted, block_size)
    check_in_place_order(src, dst, cu)
    before = [layer.clone() for layer in layers]
    after = run_and_compare(layers, src, dst, cu)
    # The move really happened (the reference is not a no-op) ...
    for b, a in zip(before, after):
        assert not torch.equal(b, a)
    # ... and the i-th accepted row now sits at position C + i in every layer.
    for layer_before, layer_after in zip(before, after):
        for r, (ctx, rows) in enumerate(zip(context_lens, accepted)):
            old = token_slots(block_table[r], ctx + torch.tensor(rows, device=DEVICE), block_size)
            new = token_slots(block_table[r], ctx + torch.arange(len(rows), device=DEVICE), block_size)
            view_before = layer_before.transpose(1, 2)
            view_after = layer_after.transpose(1, 2)
            assert torch.equal(gather_paged(view_after, new), gather_paged(view_before, old))


def test_in_place_chain_of_overlapping_moves():
    """Each target is the previous move's source: only in-order execution is right."""
    layers = make_layers(2, 8, 1, 16, torch.float16, "LBNHC", seed=1)
    block_table = block_table_for(1, 4, 8, seed=1)
    rows = [0, 2, 3, 4, 5, 6, 30, 31, 40]
    src, dst, cu = accepted_path_moves(block_table, [5], [rows], 16)
    overlaps = sum(int(d) in src[:i].tolist() for i, d in enumerate(dst.tolist()))
    assert overlaps >= 5  # the hazard this test is about is present
    run_and_compare(layers, src, dst, cu)


def test_padding_slots_and_empty_requests_are_skipped():
    layers = make_layers(2, 10, 2, 16, torch.bfloat16, "LBHNC", seed=2)
    block_table = block_table_for(3, 3, 10, seed=2)
    src, dst, cu = accepted_path_moves(block_table, [3, 0, 20], [[0, 4], [], [0, 1, 6]], 16)
    pad = torch.tensor([-1], dtype=torch.int64, device=DEVICE)
    src = torch.cat([src[:2], pad, src[2:]])
    dst = torch.cat([dst[:2], token_slots(block_table[0], torch.tensor([1], device=DEVICE), 16), dst[2:]])
    cu = torch.tensor([0, 3, 3, 6], dtype=torch.int64, device=DEVICE)
    run_and_compare(layers, src, dst, cu)


def test_same_result_as_rewriting_through_vllm_cache_update():
    """The alternative: gather K/V at the sources, write them with vLLM's own op."""
    block_size = 16
    layers = make_layers(2, 12, 2, block_size, torch.float16, "LBNHC", seed=3)
    block_table = block_table_for(2, 4, 12, seed=3)
    src, dst, cu = accepted_path_moves(block_table, [9, 30], [[0, 3, 4, 8], [0, 2, 5]], block_size)
    via_op = [layer.clone() for layer in layers]
    for layer in via_op:
        key_cache, value_cache = split_kv_cache(layer, HEAD_SIZE)
        key = gather_paged(key_cache, src).contiguous()
        value = gather_paged(value_cache, src).contiguous()
        vllm_reshape_and_cache(key, value, key_cache, value_cache, dst)
    km_mod.kv_move(layers, src, dst, cu)
    for got, want in zip(layers, via_op):
        assert torch.equal(got, want)


def test_input_validation():
    block_table = block_table_for(1, 2, 4)
    with pytest.raises(ValueError):
        accepted_path_moves(block_table, [0], [[0, 3, 2]], 16)  # not a root-to-node path
    src, dst, cu = (torch.tensor(slots, device=DEVICE) for slots in ([12, 10], [10, 11], [0, 2]))
    with pytest.raises(ValueError):
        check_in_place_order(src, dst, cu)  # 10 written, then read
    a = make_layers(1, 4, 1, 16, torch.float16, "LBNHC")[0]
    b = make_layers(1, 4, 1, 16, torch.float16, "LBHNC")[0]
    with pytest.raises(ValueError):
        km_mod.layer_pointer_table([a, b])  # one launch needs one stride set
