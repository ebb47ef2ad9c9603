"""The in-worker draft's pure parts (adapter/draft_model.py, adapter/draft_blocks.py): a request's
tree, the rows fed per forward, the CPU tree mask, and the beam search's block pool. No engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_specbeam.adapter.draft_blocks import BlockPool, kv_slots
from vllm_specbeam.adapter.draft_model import _Feed, _Request, _split, _tree_step
from vllm_specbeam.core.tree import ROOT

CPU = torch.device("cpu")


def test_tree_nodes_take_scratch_slots_and_see_their_ancestors():
    # root at slot 9 (10 committed tokens); a, b under the root, c under b
    request = _Request(kv_len=10, length=10)
    assert [request.add_node(t, p) for t, p in [(7, ROOT), (8, ROOT), (9, 1)]] == [10, 11, 12]
    assert request.depths == [1, 1, 2] and request.visible == [[10], [11], [11, 12]]
    with pytest.raises(ValueError, match="tree node 3 has parent 3"):
        request.add_node(5, 3)
    request.new_round(13)
    assert (request.kv_len, request.length, request.tokens, request.visible) == (13, 13, [], [])


def test_a_feed_is_cut_into_forwards_of_at_most_max_rows():
    def committed(rows: int) -> _Feed:
        return _Feed.committed(torch.zeros(8, dtype=torch.int32), list(range(rows)), 0)

    forwards = _split([committed(700), committed(300), committed(100)], 512)
    assert [[len(f.tokens) for f in forward.feeds] for forward in forwards] == [[512], [188, 300, 24], [76]]
    assert [forward.last_rows for forward in forwards] == [[], [187, 487], [75]]
    second = forwards[1].feeds[0]  # the first feed's later rows read the earlier rows' K/V from the cache
    assert second.slots[0] == second.rope_positions[0] == 512 and second.seq_len == 700
    assert len(_split([committed(3)], 512)) == 1


def test_committed_rows_start_where_the_draft_lacks_k_v():
    feed = _Feed.committed(torch.zeros(8, dtype=torch.int32), [5, 6, 7, 8], 2)
    assert (feed.tokens, feed.rope_positions, feed.slots) == ([7, 8], [2, 3], [2, 3])
    assert feed.seq_len == 4 and feed.visible is None


def test_the_cpu_tree_mask_shows_each_row_its_context_and_visible_slots():
    blocks = torch.zeros(8, dtype=torch.int32)
    causal = _Feed.committed(blocks, [1, 2, 3], 1)  # rows 0, 1
    # depth 2 after a 4-token context: nodes in slots 6 (under 4) and 7 (under 5)
    tree = _Feed(blocks=blocks, tokens=[1, 2], rope_positions=[5, 5], slots=[6, 7], seq_len=8,
                 visible=[[4, 6], [5, 7]], context=4)  # fmt: skip
    starts = np.array([0, 2, 4])
    step = _tree_step([causal, tree], starts, False, CPU)
    assert step.req_indices.tolist() == [1] and step.query_rows.tolist() == [[2, 3]]
    assert step.row_valid.tolist() == [[True, True]]
    assert step.key_mask[0].int().tolist() == [[1, 1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1, 0, 1]]
    assert _tree_step([causal], starts[:2], False, CPU) is None


def test_kv_slots_follow_the_block_row():
    blocks = torch.tensor([3, 0, 2], dtype=torch.int32)
    assert kv_slots(blocks, [0, 5, 9], 4).tolist() == [12, 1, 9]  # slot 5: block 0, offset 1


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kv_cache = torch.zeros(2, 1, 4, 6)  # the engine's: [blocks, kv_heads, block_size, 2 * head_size]


def test_the_search_pool_grows_binds_its_layers_and_empties():
    layer = _Layer()
    pool = BlockPool([layer], block_size=4, max_model_len=10)  # rows of 3 blocks, 12 slots capped at 10
    assert pool.capacity("a", 5) == 8 and pool.num_blocks == 16
    assert pool.capacity("b", 100) == 10  # a row's blocks at most
    assert pool.blocks("a").tolist()[:2] == pool.key_blocks["a"] and pool.blocks("a").tolist()[2] == 0
    assert pool.prefix_hit("a") == 0
    engine_cache = layer.kv_cache
    with pool.bound():
        assert layer.kv_cache is pool.caches[0] and layer.kv_cache.shape == (16, 1, 4, 6)
    assert layer.kv_cache is engine_cache
    pool.release("a")
    assert pool.num_blocks == 16 and len(pool.free) == 16 - 3
    pool.release("b")
    assert pool.num_blocks == 0 and pool.kv_caches() == []
