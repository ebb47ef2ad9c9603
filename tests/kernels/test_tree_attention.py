"""Tree attention kernel vs the torch reference, vLLM's layout and vLLM's kernel.

Runs the Triton kernel under ``TRITON_INTERPRET=1`` on CPU (set below before
Triton is imported); on a GPU machine run with ``TRITON_INTERPRET=0`` to test
the compiled kernel instead.

Tolerances (kernel vs fp32 reference, both with fp32 accumulation):
fp16 atol = rtol = 2e-3 (P is rounded to fp16 before P @ V);
bf16 atol = rtol = 1.6e-2 (two bf16 ulps; bf16 has 8 mantissa bits).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
import torch
import triton  # noqa: F401  (in the test extra: without it these tests fail here, never skip)
from vllm_kernels import import_vllm_triton_module, vllm_reshape_and_cache

from vllm_specbeam.core.tree import DraftTree, forest_ancestor_mask
from vllm_specbeam.kernels import tree_attention as ta_mod
from vllm_specbeam.kernels.reference import (
    allowed_keys,
    build_tree_mask,
    pack_ancestor_mask,
    split_kv_cache,
    token_slots,
    tree_attention_ref,
    unpack_tree_mask,
)

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
TOL = {
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@pytest.fixture(autouse=True)
def _kernel_must_run(monkeypatch):
    """Fail instead of silently testing the reference against itself."""

    def fallback(*args, **kwargs):
        raise AssertionError("tree_attention fell back to the torch reference")

    monkeypatch.setattr(ta_mod, "tree_attention_ref", fallback)


# ------------------------------------------------------------------ batches
def random_tree(rng: np.random.Generator, num_nodes: int, kind: str) -> DraftTree:
    """chain / star / deep (mostly extends the newest node) / wide (random parent)."""
    parents = []
    for i in range(num_nodes):
        if kind == "chain":
            parents.append(i - 1)
        elif kind == "star":
            parents.append(-1)
        elif kind == "deep":
            parents.append(i - 1 if rng.random() < 0.8 else int(rng.integers(-1, i)))
        else:
            parents.append(int(rng.integers(-1, i)))
    return DraftTree(rng.integers(0, 1000, num_nodes), np.asarray(parents, np.int64))


def segment_rows(seg) -> int:
    if isinstance(seg, DraftTree):
        return seg.num_nodes + 1
    if isinstance(seg, int):
        return seg
    return len(seg)


@dataclass
class Batch:
    q: torch.Tensor
    kv_cache: torch.Tensor  # logical [num_blocks, num_kv_heads, block_size, 2 * head_size]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    tree_mask: torch.Tensor
    scale: float
    max_query_len: int
    tree_base: torch.Tensor | None = None

    def run(self, tree_mask: torch.Tensor | str | None = "same") -> torch.Tensor:
        mask = self.tree_mask if isinstance(tree_mask, str) else tree_mask
        return ta_mod.tree_attention(
            self.q, self.key_cache, self.value_cache, self.block_table, self.query_start_loc,
            self.seq_lens, mask, self.scale, self.max_query_len, tree_base=self.tree_base,
        )  # fmt: skip

    def reference(self) -> torch.Tensor:
        out = torch.zeros(self.q.shape, dtype=torch.float32, device=self.q.device)
        return tree_attention_ref(
            self.q, self.key_cache, self.value_cache, self.block_table, self.query_start_loc,
            self.seq_lens, self.tree_mask, self.scale, out, tree_base=self.tree_base,
        )  # fmt: skip


def empty_kv_cache(num_blocks, num_kv_heads, block_size, head_size, dtype, layout) -> torch.Tensor:
    """vLLM's per-layer logical [B, H, N, 2D] cache with a physical layout."""
    if layout == "LBNHC":  # vLLM's default: [block, slot, head, content] in memory
        return torch.empty(num_blocks, block_size, num_kv_heads, 2 * head_size, dtype=dtype, device=DEVICE).transpose(
            1, 2
        )
    assert layout == "LBHNC"  # [block, head, slot, content]
    return torch.empty(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype, device=DEVICE)


def make_batch(
    requests: list[tuple[int, object]],
    *,
    num_kv_heads: int = 2,
    group: int = 4,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    layout: str = "LBNHC",
    num_words: int | None = None,
    extra_q_rows: int = 0,
) -> Batch:
    """``requests``: ``(context_len, segment)``, segments as in build_tree_mask."""
    gen = torch.Generator().manual_seed(seed)  # on the CPU: the same values on every device
    query_lens = [segment_rows(seg) for _, seg in requests]
    seq_lens = [ctx + n for (ctx, _), n in zip(requests, query_lens)]
    need = [max(1, -(-s // block_size)) for s in seq_lens]
    num_blocks = sum(need) + 3
    width = max(need) + 2
    perm = torch.randperm(num_blocks, generator=gen, device="cpu")
    # Unused table entries hold real (wrong) block ids: reading them would show.
    block_table = torch.randint(0, num_blocks, (len(requests), width), generator=gen, dtype=torch.int32, device="cpu")
    used = 0
    for r, n in enumerate(need):
        block_table[r, :n] = perm[used : used + n].int()
        used += n
    kv_cache = empty_kv_cache(num_blocks, num_kv_heads, block_size, head_size, dtype, layout)
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen, device="cpu").to(dtype))
    key_cache, value_cache = split_kv_cache(kv_cache, head_size)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens + extra_q_rows, num_kv_heads * group, head_size, generator=gen, device="cpu").to(dtype)
    tree_mask = build_tree_mask([seg for _, seg in requests], num_words=num_words, device=DEVICE)
    padding = torch.zeros(extra_q_rows, tree_mask.shape[1], dtype=torch.int64, device=DEVICE)
    return Batch(
        q=q.to(DEVICE),
        kv_cache=kv_cache,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(DEVICE),
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        tree_mask=torch.cat([tree_mask, padding]),
        scale=head_size**-0.5,
        max_query_len=max(query_lens),
    )


def mixed_requests(seed: int) -> list[tuple[int, object]]:
    """Trees, a forest, decodes, a prefill chunk, an empty tree, a 0-row request."""
    rng = np.random.default_rng(seed)
    forest = forest_ancestor_mask([-1, 0, -1, 2, 2, -1, 1])
    return [
        (37, random_tree(rng, 6, "chain")),  # context crosses a page, tree crosses the next
        (0, random_tree(rng, 7, "star")),  # no context at all
        (70, random_tree(rng, 19, "wide")),
        (16, 1),  # plain decode, context ends exactly on a page boundary
        (5, 12),  # prefill chunk: causal rows
        (31, DraftTree.empty()),  # only the root
        (9, 0),  # scheduled but no rows this step
        (44, random_tree(rng, 15, "deep")),
        (3, forest),
    ]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def draft_depth_rows(rng: np.random.Generator, level_sizes: list[int]) -> np.ndarray:
    """Window bits ``[level_sizes[-1], sum(level_sizes)]`` of a draft's last-depth forward.

    The window holds the nodes of depths 1, 2, ... in order (the root is the
    last committed token, before the window); the rows are the deepest nodes,
    each seeing its ancestors and itself.
    """
    starts = np.cumsum([0, *level_sizes])
    parents = [-1] * level_sizes[0]
    for d in range(1, len(level_sizes)):
        parents += [int(rng.integers(starts[d - 1], starts[d])) for _ in range(level_sizes[d])]
    window = int(starts[-1])
    mask = np.eye(window, dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    return mask[window - level_sizes[-1] :]


def tree_base_batch(dtype: torch.dtype, seed: int) -> tuple[Batch, list[list[list[int]]]]:
    """A mixed batch with tree windows starting before the context end.

    Returns it with, per request and row, the explicit list of key positions
    the row may see, built from the rule directly (not from the packed words).
    """
    rng = np.random.default_rng(seed)
    depth3 = draft_depth_rows(rng, [3, 4, 5])  # window 12 keys, 5 rows
    wide = draft_depth_rows(rng, [8, 24, 30, 6])  # window 68 keys: two words
    # A depth's rows plus a causal row in one program: they share a dense prefix.
    with_causal = np.zeros((4, 8), dtype=bool)
    with_causal[:3, :7] = draft_depth_rows(rng, [4, 3])
    tree = random_tree(rng, 6, "wide")
    # (committed context, window rows or segment, tree_base); context_len = seq_len - query_len.
    specs = [
        (21, depth3, 21),  # base crosses a page; the window crosses the next
        (16, 3, 5),  # plain causal rows: tree_base must not matter
        (37, tree, 37),  # tree_base = context_len: the old rule
        (40, wide, 40),
        (9, with_causal, 9),
        (9, 0, 3),  # scheduled but no rows this step
    ]
    requests, bases, windows = [], [], []
    for committed, seg, base in specs:
        if isinstance(seg, np.ndarray):
            windows.append(seg)
            requests.append((committed + seg.shape[1] - len(seg), len(seg)))
        else:
            windows.append(None if isinstance(seg, int) else seg.ancestor_mask)
            requests.append((committed, seg))
        bases.append(base)
    batch = make_batch(requests, num_kv_heads=2, group=2, dtype=dtype, seed=seed, num_words=2)
    batch.tree_base = torch.tensor(bases, dtype=torch.int32, device=DEVICE)
    starts = batch.query_start_loc.tolist()
    visible = []
    for r, ((context_len, _), base, window) in enumerate(zip(requests, bases, windows)):
        if window is not None:
            batch.tree_mask[starts[r] : starts[r + 1]] = torch.as_tensor(pack_ancestor_mask(window, 2), device=DEVICE)
        rows = []
        for row in range(starts[r + 1] - starts[r]):
            if window is None or not window[row].any():
                rows.append(list(range(context_len + row + 1)))
            else:
                rows.append(list(range(base)) + [base + j for j in np.flatnonzero(window[row])])
        visible.append(rows)
    assert bool((batch.tree_mask[:, 1] != 0).any()) and bool((batch.tree_mask[:, 0] < 0).any())
    return batch, visible


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_batch_matches_reference(dtype, group, block_size):
    batch = make_batch(mixed_requests(seed=group), group=group, block_size=block_size, dtype=dtype, seed=group)
    assert_close(batch.run(), batch.reference(), dtype)


@pytest.mark.parametrize("head_size", [128, 256, 80])
def test_head_sizes(head_size):
    rng = np.random.default_rng(head_size)
    requests = [(21, random_tree(rng, 9, "wide")), (40, 1), (0, random_tree(rng, 4, "chain"))]
    batch = make_batch(requests, head_size=head_size, num_kv_heads=1, group=4, seed=head_size)
    assert_close(batch.run(), batch.reference(), torch.float16)


def test_large_trees_and_arbitrary_bit_patterns():
    """64-node tree (65 rows, 2 words), spare words, bit 63, non-ancestral masks."""
    rng = np.random.default_rng(7)
    big = random_tree(rng, 64, "wide")
    masked = rng.random((100, 100)) < 0.3  # any pattern, e.g. pruned nodes
    np.fill_diagonal(masked, True)
    masked[:, 63] = True  # every row uses the sign bit of word 0
    requests = [(50, big), (17, masked), (33, 2)]
    batch = make_batch(requests, num_kv_heads=1, group=1, num_words=3, seed=7)
    assert batch.tree_mask.shape[1] == 3 and bool((batch.tree_mask[:, 0] < 0).any())
    assert_close(batch.run(), batch.reference(), torch.float16)


def test_tree_rows_read_only_their_ancestors():
    """Independent of the reference: poke the cache and watch which rows react."""
    tree = DraftTree.from_paths([[1, 2, 3], [1, 4], [5, 6]])  # rows: 0 root, 1..6 nodes
    context = 20
    batch = make_batch([(context, tree), (11, 3)], num_kv_heads=1, group=1, block_size=16, seed=3)
    before = batch.run().clone()
    node = 3  # node index 3 = row 4 ("1, 4" branch); visible to row 4 only
    row = node + 1
    slot = token_slots(batch.block_table[0], torch.tensor([context + row], device=DEVICE), 16)
    batch.value_cache[slot // 16, slot % 16] += 5.0
    after = batch.run()
    changed = (after - before).abs().amax(dim=(1, 2)) > 0
    expected = torch.zeros(len(changed), dtype=torch.bool, device=DEVICE)
    expected[row] = True  # nobody descends from row 4; the causal request is untouched
    assert changed.tolist() == expected.tolist()
    # and the root (ancestor of all) is seen by every tree row, not by the other request
    root_slot = token_slots(batch.block_table[0], torch.tensor([context], device=DEVICE), 16)
    batch.value_cache[root_slot // 16, root_slot % 16] += 5.0
    changed = (batch.run() - after).abs().amax(dim=(1, 2)) > 0
    assert changed.tolist() == [True] * 7 + [False] * 3


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # inside vLLM's kernel
def test_causal_rows_match_vllm_unified_attention():
    """Non-tree requests and chains must equal vLLM's stock kernel; real trees must not."""
    ops = import_vllm_triton_module("vllm.v1.attention.ops.triton_unified_attention")
    rng = np.random.default_rng(11)
    requests = [(18, 1), (30, random_tree(rng, 5, "chain")), (0, 9), (25, random_tree(rng, 6, "star")), (47, 1)]
    batch = make_batch(requests, num_kv_heads=2, group=4, seed=11)
    ours = batch.run()
    stock = torch.zeros_like(batch.q)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        ops.unified_attention(
            q=batch.q, k=batch.key_cache, v=batch.value_cache, out=stock,
            cu_seqlens_q=batch.query_start_loc, max_seqlen_q=batch.max_query_len,
            seqused_k=batch.seq_lens, max_seqlen_k=int(batch.seq_lens.max()),
            softmax_scale=batch.scale, causal=True, window_size=(-1, -1), block_table=batch.block_table,
            softcap=0, q_descale=None, k_descale=None, v_descale=None,
        )  # fmt: skip
    star = slice(1 + 6 + 9, 1 + 6 + 9 + 7)
    causal_rows = torch.ones(len(ours), dtype=torch.bool, device=DEVICE)
    causal_rows[star] = False
    assert_close(ours[causal_rows], stock[causal_rows], torch.float16)
    # A star's siblings do not see each other: row 2 onwards must differ from causal.
    assert (ours[star][2:].float() - stock[star][2:].float()).abs().amax() > 0.05
    assert_close(ours[star][:2], stock[star][:2], torch.float16)  # root and first child are causal


def test_non_tree_requests_are_bitwise_unaffected_by_trees_in_the_batch():
    rng = np.random.default_rng(5)
    trees = [(40, random_tree(rng, 12, "wide")), (0, random_tree(rng, 30, "deep"))]
    plain = [(33, 1), (8, 10)]
    mixed = make_batch(trees[:1] + plain + trees[1:], seed=5)
    alone = make_batch(plain, seed=5)
    # Same cache contents for the plain requests: copy their pages over.
    for r_alone, r_mixed in ((0, 1), (1, 2)):
        num_pages = -(-int(alone.seq_lens[r_alone]) // 16)
        pages = alone.block_table[r_alone, :num_pages].long()
        mixed.kv_cache[mixed.block_table[r_mixed, :num_pages].long()] = alone.kv_cache[pages]
        q_alone = alone.q[alone.query_start_loc[r_alone] : alone.query_start_loc[r_alone + 1]]
        mixed.q[mixed.query_start_loc[r_mixed] : mixed.query_start_loc[r_mixed + 1]] = q_alone
    alone.max_query_len = mixed.max_query_len  # same tiling, so results must match bit for bit
    out_mixed = mixed.run()
    out_alone = alone.run(tree_mask=None)
    start, end = int(mixed.query_start_loc[1]), int(mixed.query_start_loc[3])
    assert torch.equal(out_mixed[start:end], out_alone)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_layout_matches_vllm_cache_writer(layout):
    """Write K/V with vLLM's own reshape_and_cache op; compare with dense math on the raw K/V."""
    rng = np.random.default_rng(2)
    requests = [(29, random_tree(rng, 8, "wide")), (16, 1), (0, random_tree(rng, 3, "chain"))]
    batch = make_batch(requests, num_kv_heads=2, group=4, block_size=16, layout=layout, seed=2)
    batch.kv_cache.zero_()
    gen = torch.Generator().manual_seed(9)
    expected = torch.empty(batch.q.shape, dtype=torch.float32, device=DEVICE)
    starts = batch.query_start_loc.tolist()
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        k = torch.randn(seq_len, 2, 64, generator=gen, device="cpu").half().to(DEVICE)
        v = torch.randn(seq_len, 2, 64, generator=gen, device="cpu").half().to(DEVICE)
        slots = token_slots(batch.block_table[r], torch.arange(seq_len, device=DEVICE), 16)
        vllm_reshape_and_cache(k, v, batch.key_cache, batch.value_cache, slots)
        # Dense attention straight from k/v, no cache involved.
        q = batch.q[starts[r] : starts[r + 1]].float()
        allowed = allowed_keys(batch.tree_mask[starts[r] : starts[r + 1]], seq_len - len(q))
        scores = torch.einsum("qhd,khd->hqk", q, k.float().repeat_interleave(4, 1)) * batch.scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        expected[starts[r] : starts[r + 1]] = torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(4, 1))
    assert_close(batch.run(), expected, torch.float16)


def test_padding_rows_and_empty_batches():
    batch = make_batch([(12, DraftTree.chain([1, 2])), (0, 0)], extra_q_rows=5, seed=4)
    out = torch.full_like(batch.q, 7.0)
    ta_mod.tree_attention(
        batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, batch.tree_mask, batch.scale, batch.max_query_len, out=out,
    )  # fmt: skip
    assert bool((out[3:] == 7.0).all()), "rows past query_start_loc[-1] must not be written"
    assert_close(out[:3], batch.reference()[:3], torch.float16)
    none = make_batch([(4, 0), (10, 0)], seed=4)
    out = torch.full((0, 8, 64), 1.0, dtype=torch.float16, device=DEVICE)
    ta_mod.tree_attention(
        none.q, none.key_cache, none.value_cache, none.block_table, none.query_start_loc,
        none.seq_lens, none.tree_mask, none.scale, out=out,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_base_matches_reference(dtype):
    batch, _ = tree_base_batch(dtype, seed=21)
    assert_close(batch.run(), batch.reference(), dtype)


def test_tree_base_matches_explicit_key_lists():
    """Independent of allowed_keys: gather each row's listed keys by hand, softmax."""
    batch, visible = tree_base_batch(torch.float16, seed=22)
    group = batch.q.shape[1] // batch.key_cache.shape[2]
    starts = batch.query_start_loc.tolist()
    expected = torch.zeros(batch.q.shape, dtype=torch.float32, device=DEVICE)
    for r, rows in enumerate(visible):
        for row, keys in enumerate(rows):
            pos = torch.tensor(keys, device=DEVICE)
            blocks = batch.block_table[r, pos // 16].long()
            k = batch.key_cache[blocks, pos % 16].float().repeat_interleave(group, dim=1)  # [n, heads, D]
            v = batch.value_cache[blocks, pos % 16].float().repeat_interleave(group, dim=1)
            q = batch.q[starts[r] + row].float()  # [heads, D]
            probs = (torch.einsum("hd,nhd->hn", q, k) * batch.scale).softmax(-1)
            expected[starts[r] + row] = torch.einsum("hn,nhd->hd", probs, v)
    assert_close(batch.run(), expected, torch.float16)
    assert_close(batch.reference(), expected, torch.float16)


def test_tree_base_none_is_bitwise_the_context_end():
    batch = make_batch(mixed_requests(seed=3), group=2, seed=3)
    default = batch.run()
    batch.tree_base = batch.seq_lens - (batch.query_start_loc[1:] - batch.query_start_loc[:-1])
    assert batch.tree_base.dtype == torch.int32
    assert torch.equal(batch.run(), default)


def test_topology_format():
    tree = DraftTree(np.array([5, 6, 7, 8]), np.array([-1, 0, -1, 1]))  # rows 1..4
    words = build_tree_mask([tree, 3, forest_ancestor_mask([-1, -1, 0])], device=DEVICE)
    expected_tree = [0b1, 0b11, 0b111, 0b1001, 0b10111]  # row r: itself + ancestors + root
    assert words[:5, 0].tolist() == expected_tree
    assert words[5:8].eq(0).all()  # causal rows
    assert words[8:, 0].tolist() == [0b1, 0b10, 0b101]  # a forest: two roots
    big = np.tril(np.ones((130, 130), dtype=bool))
    packed = torch.as_tensor(pack_ancestor_mask(big, 3), device=DEVICE)
    assert torch.equal(unpack_tree_mask(packed, 130), torch.as_tensor(big, device=DEVICE))
    assert packed[63, 0].item() == -1  # all 64 bits set, sign bit included
    with pytest.raises(ValueError):
        build_tree_mask([np.zeros((2, 2), dtype=bool)])  # a tree row must see something
    # reference.py's example: a draft's depth-2 forward, nodes in slots 12, 13
    # (parents in 10 and 11), tree_base 10.
    depth2 = torch.tensor([[0b101], [0b1010]], device=DEVICE)
    seen = allowed_keys(depth2, context_len=12, tree_base=10)
    assert seen[1].nonzero().flatten().tolist() == [*range(10), 11, 13]
    assert seen[0].nonzero().flatten().tolist() == [*range(10), 10, 12]
    with pytest.raises(ValueError):
        allowed_keys(depth2, context_len=12, tree_base=13)  # the rows' own keys must be in the window
