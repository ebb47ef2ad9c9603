"""The tree type, its ancestor mask, and the per-step layout built from it."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_specbeam.adapter.attention.cpu import TreeStep
from vllm_specbeam.core.lookup import match_ends
from vllm_specbeam.core.tree import ROOT, DraftTree, committed_path
from vllm_specbeam.core.verifiers.greedy import GreedyTreeVerifier, greedy_path

#        root
#       /    \
#     a(0)   b(1)
#     /  \      \
#   c(2) d(3)   e(4)
#    |
#   f(5)
TREE = DraftTree(tokens=[10, 11, 12, 13, 14, 15], parents=[ROOT, ROOT, 0, 0, 1, 2])


def test_depths_children_and_paths():
    assert TREE.depths.tolist() == [1, 1, 2, 2, 2, 3]
    assert TREE.max_depth == 3
    assert TREE.children().tolist() == [0, 1]
    assert TREE.children(0).tolist() == [2, 3]
    assert TREE.path_to(5) == [0, 2, 5]
    assert TREE.path_to(4) == [1, 4]


def test_committed_path_walks_the_committed_tokens_down_the_tree():
    tokens, parents = TREE.tokens.tolist(), TREE.parents.tolist()
    assert committed_path(tokens, parents, [10, 12, 15, 99]) == [0, 2, 5]  # past the leaf: stops
    assert committed_path(tokens, parents, [11, 14]) == [1, 4]
    assert committed_path(tokens, parents, [10, 14]) == [0]  # 14 hangs from b, not a
    assert committed_path(tokens, parents, [12]) == [] and committed_path(tokens, parents, []) == []


def test_ancestor_mask_rows_see_root_ancestors_and_self_only():
    mask = TREE.ancestor_mask
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 3, 6}}
    for row, visible in expected.items():
        assert set(np.flatnonzero(mask[row])) == visible, row


def test_invalid_trees_are_refused():
    with pytest.raises(ValueError, match="topological order"):
        DraftTree(tokens=[1, 2], parents=[1, ROOT])
    with pytest.raises(ValueError, match="differ in length"):
        DraftTree(tokens=[1, 2], parents=[ROOT])


def test_is_chain():
    assert DraftTree.chain([4, 5, 6]).is_chain
    assert not TREE.is_chain and not DraftTree.empty().is_chain


def test_first_branch_is_the_leading_chain_causal_attention_verifies():
    assert DraftTree([1, 2, 3, 4], [ROOT, 0, 1, 0]).first_branch == 3
    assert DraftTree.chain([4, 5, 6]).first_branch == 3
    assert DraftTree([1, 2], [ROOT, ROOT]).first_branch == 1
    assert DraftTree.empty().first_branch == 0


def test_truncate_keeps_a_tree():
    small = TREE.truncate(4)
    assert small.tokens.tolist() == [10, 11, 12, 13]
    assert small.ancestor_mask.shape == (5, 5)


def test_from_paths_merges_prefixes_and_respects_budget():
    tree = DraftTree.from_paths([[1, 2, 3], [1, 2, 4], [5]], max_nodes=4)
    assert tree.tokens.tolist() == [1, 2, 3, 4]
    assert tree.parents.tolist() == [ROOT, 0, 1, 1]


def test_from_weighted_paths_takes_heaviest_nodes_best_first():
    paths = [[7, 8], [1, 2, 3], [1, 2, 4], [1, 5]]
    tree = DraftTree.from_weighted_paths(paths, [1, 1, 1, 1], max_nodes=4)
    # "1" is shared by three paths, then "1 2" by two; the rest weigh one each
    # and are taken in the order they were first seen ("7", then "7 8").
    # Laid out depth-first, heaviest first: 1, 1 2, then 7, 7 8.
    assert tree.tokens.tolist() == [1, 2, 7, 8]
    assert tree.parents.tolist() == [ROOT, 0, ROOT, 2]
    deeper = DraftTree.from_weighted_paths(paths, [1, 1, 1, 1], max_nodes=6)
    # kept: 1, 1 2, then (ties, first seen first) 7, 7 8, 1 2 3, 1 2 4; the
    # heaviest branch 1 2 3 is consecutive rows, 1 2 4 hangs off it, 7 8 last
    assert deeper.tokens.tolist() == [1, 2, 3, 4, 7, 8]
    assert deeper.parents.tolist() == [ROOT, 0, 1, 1, ROOT, 4]


def _prefixes(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root, in the tree's row order."""
    return [tuple(tree.tokens[tree.path_to(node)].tolist()) for node in range(tree.num_nodes)]


@pytest.mark.parametrize("seed", range(40))
def test_from_weighted_paths_keeps_the_heaviest_prefixes_laid_out_heaviest_child_first(seed):
    # brute force: every prefix weighs its paths' weights; with non-negative weights a prefix
    # is never lighter than its extensions and is seen first, so the max_nodes first of all
    # prefixes by (weight desc, first seen) are a connected tree, the one best-first must keep
    rng = np.random.default_rng(seed)
    paths = [rng.integers(0, 3, rng.integers(0, 6)).tolist() for _ in range(rng.integers(1, 12))]
    weights = rng.choice([0.5, 1.0, 2.0], len(paths))
    max_nodes = int(rng.integers(1, 20))
    weight: dict[tuple[int, ...], float] = {}
    for path, w in zip(paths, weights):
        for depth in range(1, len(path) + 1):
            weight[tuple(path[:depth])] = weight.get(tuple(path[:depth]), 0.0) + w
    seen = list(weight)
    rank = sorted(seen, key=lambda prefix: (-weight[prefix], seen.index(prefix)))
    kept = set(rank[:max_nodes])

    def depth_first(prefix: tuple[int, ...]) -> list[tuple[int, ...]]:
        below = [c for c in rank if c in kept and c[:-1] == prefix and len(c) == len(prefix) + 1]
        return [row for c in below for row in [c, *depth_first(c)]]

    tree = DraftTree.from_weighted_paths(paths, weights, max_nodes)
    assert _prefixes(tree) == depth_first(())


def test_greedy_path_follows_argmax_through_non_first_branch():
    argmax_rows = np.zeros(TREE.num_nodes + 1, np.int64)
    argmax_rows[0] = 11  # root -> b (the second child)
    argmax_rows[2] = 14  # b -> e
    argmax_rows[5] = 99  # e -> bonus 99
    assert greedy_path(TREE, argmax_rows).tolist() == [1, 4]


def test_greedy_verifier_batches_requests_and_adds_target_token():
    import torch

    vocab = 100
    chain = DraftTree.chain([3, 4])
    logits = torch.zeros(TREE.num_nodes + 1 + chain.num_nodes + 1, vocab)
    for row, token in [(0, 10), (1, 12), (3, 15), (4, 42), (7, 3), (8, 9)]:
        logits[row, token] = 1.0
    verdict = GreedyTreeVerifier().verify([TREE, chain], logits, np.array([0, 7]))
    assert [p.tolist() for p in verdict.accepted] == [[0, 2, 5], [0]]
    assert verdict.tokens == [[10, 12, 15, 0], [3, 9]]


def test_tree_step_positions_are_context_plus_depth():
    chain = DraftTree.chain([1, 2])
    step = TreeStep.build(req_indices=[2, 0], first_rows=[5, 40], context_lens=[100, 7], trees=[TREE, chain])
    assert step.node_rows.tolist() == [6, 7, 8, 9, 10, 11, 41, 42]
    assert step.node_positions.tolist() == [101, 101, 102, 102, 102, 103, 8, 9]


def test_tree_step_recomputes_only_rows_the_causal_kernel_gets_wrong():
    chain = DraftTree.chain([1, 2])
    step = TreeStep.build(req_indices=[2, 0], first_rows=[5, 40], context_lens=[100, 7], trees=[TREE, chain])
    # TREE rows 0 (root) and 1 (node a) see exactly the rows before them; the chain is all causal.
    assert step.req_indices.tolist() == [2]
    assert step.query_rows[0][step.row_valid[0]].tolist() == [5 + r for r in (2, 3, 4, 5, 6)]
    assert step.key_mask[0, 0, :100].all()  # row 2 (node b): whole context...
    assert step.key_mask[0, 0, 100:107].tolist() == TREE.ancestor_mask[2].tolist()  # ...then root and itself
    assert not TreeStep.build([0], [0], [10], [chain]).needs_attention


def test_match_ends_finds_every_earlier_occurrence_of_longest_suffix():
    tokens = np.array([5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2])
    # the suffix "1 2" occurs ending at 2 and 6; "7 1 2" never earlier
    assert match_ends(tokens[:-1], tokens, 1, 3).ends.tolist() == [6, 2]
    assert match_ends(tokens[:-1], tokens, 1, 3).length == 2
    assert match_ends(tokens[:-1], tokens, 3, 3).ends.tolist() == []
