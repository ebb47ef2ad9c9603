"""The one tree type every strategy drafts into and every verifier reads.

A draft tree hangs below the request's last committed token (the *root*, which
is not stored: it is already known to the engine). Nodes are kept as flat
arrays in topological order (``parents[i] < i``) so that

* any prefix of the arrays is itself a valid tree (vLLM's scheduler may cut
  the draft list short when the token budget runs out),
* the accepted path can be moved into place in increasing order without
  overwriting a node that is still to be read, and
* the verification rows of a request are simply ``[root, node 0, node 1, ...]``.

Row 0 of every per-row array below is the root; node ``i`` is row ``i + 1``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

ROOT = -1


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens with their parents (``ROOT`` for children of the root).

    ``draft_probs`` is optional: for node ``i`` it holds ``q(. | path to its
    parent)``, the distribution the drafter drew node ``i`` from, which the
    stochastic verifiers need. Deterministic drafters (lookup, tri-grams) leave
    it ``None``.

    ``kinds`` is optional too: a small integer per node that the step budget
    (:mod:`vllm_specbeam.core.budget`) calibrates acceptance by, apart from the
    other kinds: what the drafter knows makes some nodes likelier than others
    at the same depth and rank (a long prompt-lookup match, a search's guess).
    ``None`` is kind 0 for every node.

    ``from_index`` marks the nodes that continue other requests' text (a
    drafter's cross-request index: :func:`~vllm_specbeam.core.lookup.match_tree`),
    so the runner counts what one request's text drafts for another's apart;
    ``None``: no node does.
    """

    tokens: np.ndarray
    parents: np.ndarray
    draft_probs: np.ndarray | None = None
    kinds: np.ndarray | None = field(default=None, kw_only=True)  # keyword-only: subclasses add fields
    from_index: np.ndarray | None = field(default=None, kw_only=True)  # [num_nodes] bool

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        if tokens.shape != parents.shape:
            raise ValueError(f"tokens ({tokens.size}) and parents ({parents.size}) differ in length")
        if parents.size and not np.all((parents >= ROOT) & (parents < np.arange(parents.size))):
            raise ValueError("parents must be ROOT (-1) or an earlier node index (topological order)")
        if self.draft_probs is not None and len(self.draft_probs) != tokens.size:
            raise ValueError("draft_probs needs one row per node")
        if self.kinds is not None:
            kinds = np.asarray(self.kinds, dtype=np.int64).reshape(-1)
            if kinds.shape != tokens.shape or np.any(kinds < 0):
                raise ValueError("kinds needs one non-negative integer per node")
            object.__setattr__(self, "kinds", kinds)
        if self.from_index is not None:
            from_index = np.asarray(self.from_index, dtype=bool).reshape(-1)
            if from_index.shape != tokens.shape:
                raise ValueError("from_index needs one flag per node")
            object.__setattr__(self, "from_index", from_index)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)

    # ------------------------------------------------------------ builders
    @classmethod
    def empty(cls) -> DraftTree:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """A single branch: what vLLM's chain methods draft."""
        return cls(np.asarray(tokens, np.int64), np.arange(len(tokens)) - 1)

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int] | np.ndarray], max_nodes: int | None = None) -> DraftTree:
        """Merge token paths into a trie, in the order given.

        Earlier paths win when ``max_nodes`` runs out, so callers pass their
        most promising continuation first. A path is kept as far as the budget
        allows (its prefix), never with a gap.
        """
        trie = _Trie.of(paths, itertools.repeat(1.0), max_nodes)  # nodes in the order first seen
        return cls(np.asarray(trie.tokens, np.int64), np.asarray(trie.parents, np.int64))

    @classmethod
    def from_weighted_paths(
        cls,
        paths: Sequence[Sequence[int] | np.ndarray],
        weights: Sequence[float] | np.ndarray,
        max_nodes: int,
    ) -> DraftTree:
        """Merge paths into a trie and keep the ``max_nodes`` heaviest nodes.

        A node weighs the sum of the weights of the paths through it, so it is
        never heavier than its parent: taking nodes best-first from the
        frontier keeps the tree connected. Ties go to the node first seen in
        ``paths``. The kept nodes are laid out depth-first, heaviest child
        first, so the most likely branch is one run of consecutive rows: the
        stock causal attention is already right for it.
        """
        trie = _Trie.of(paths, weights)
        frontier = [(-trie.weight[c], c) for c in trie.children.get(ROOT, ())]  # heaviest first; ties: first seen
        heapq.heapify(frontier)
        kept: dict[int, list[int]] = {ROOT: []}  # each kept node's kept children, heaviest first
        while frontier and len(kept) <= max_nodes:
            _, node = heapq.heappop(frontier)
            kept[trie.parents[node]].append(node)
            kept[node] = []
            for c in trie.children.get(node, ()):
                heapq.heappush(frontier, (-trie.weight[c], c))
        tokens: list[int] = []
        parents: list[int] = []
        stack = [(c, ROOT) for c in reversed(kept[ROOT])]
        while stack:
            node, parent = stack.pop()
            tokens.append(trie.tokens[node])
            parents.append(parent)
            stack.extend((c, len(tokens) - 1) for c in reversed(kept[node]))
        return cls(np.asarray(tokens, np.int64), np.asarray(parents, np.int64))

    # ------------------------------------------------------------ queries
    @property
    def num_nodes(self) -> int:
        return int(self.tokens.size)

    def __len__(self) -> int:
        return self.num_nodes

    @cached_property
    def depths(self) -> np.ndarray:
        """Depth of every node (children of the root have depth 1)."""
        depth = np.zeros(self.num_nodes, np.int64)
        for i, parent in enumerate(self.parents):
            depth[i] = 1 if parent == ROOT else depth[parent] + 1
        return depth

    @property
    def is_chain(self) -> bool:
        """Non-empty and a single branch."""
        return self.num_nodes > 0 and bool(np.all(self.parents == np.arange(self.num_nodes) - 1))

    @property
    def max_depth(self) -> int:
        return int(self.depths.max(initial=0))

    @property
    def first_branch(self) -> int:
        """How many leading nodes form one chain from the root (each the child of the one
        before): causal attention alone verifies them, the rest need the tree mask. Example:
        parents ``[-1, 0, 1, 0]``: 3."""
        steps = self.parents == np.arange(self.num_nodes) - 1  # [num_nodes]
        return int(steps.size if steps.all() else np.argmin(steps))

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """``mask[r, c]``: row ``c`` is row ``r`` itself or one of its ancestors.

        Rows and columns are verification rows (0 = root). This is exactly the
        attention pattern of the tree rows among themselves; every row also
        sees the whole committed context.
        """
        # Row parents: the root (row 0) has none, node i (row i + 1) has row parent + 1.
        return forest_ancestor_mask(np.concatenate([[-1], self.parents + 1]))

    def children(self, node: int = ROOT) -> np.ndarray:
        """Indices of ``node``'s children, in draft order."""
        return np.flatnonzero(self.parents == node)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first level down to ``node``."""
        path: list[int] = []
        while node != ROOT:
            path.append(int(node))
            node = int(self.parents[node])
        return path[::-1]

    def leaf_paths(self) -> list[np.ndarray]:
        """Token paths from the first level to every leaf, leaves in node order:
        :meth:`from_paths` of them holds the same nodes. Example: tokens
        ``[5, 6, 7]``, parents ``[-1, 0, 0]``: ``[[5, 6], [5, 7]]``."""
        inner = np.zeros(self.num_nodes, bool)  # [num_nodes]
        inner[self.parents[self.parents != ROOT]] = True
        return [self.tokens[self.path_to(int(leaf))] for leaf in np.flatnonzero(~inner)]

    def with_tokens(self, tokens: np.ndarray, draft_probs: np.ndarray | None = None) -> DraftTree:
        """A tree shaped like this one's first ``len(tokens)`` nodes, holding ``tokens``.

        Its depths and ancestor mask are slices of this tree's, so a drafter
        whose trees are all prefixes of one largest shape builds them once.
        Example: the shape with parents ``[-1, -1, 0, 1]`` and tokens
        ``[7, 9]`` give parents ``[-1, -1]`` and the mask's top-left 3 x 3.
        """
        n = len(tokens)
        tree = DraftTree(tokens, self.parents[:n], draft_probs, kinds=None if self.kinds is None else self.kinds[:n])
        tree.__dict__["depths"] = self.depths[:n]  # the cached properties, precomputed
        tree.__dict__["ancestor_mask"] = self.ancestor_mask[: n + 1, : n + 1]
        return tree

    def keep(self, mask: np.ndarray) -> DraftTree:
        """The nodes where ``mask`` holds, in their order, renumbered; the parent
        of every kept node must be kept too.

        Example: parents ``[-1, -1, 0, 1]`` and mask ``[1, 1, 0, 1]`` give
        parents ``[-1, -1, 1]`` (old node 3 hangs from old node 1, now node 1).
        A mask keeping every node gives the tree itself.
        """
        mask = np.asarray(mask, bool)  # [num_nodes]
        if mask.all():
            return self
        if not mask.any():
            return DraftTree.empty()
        parents = self.parents[mask]
        if np.any(parents != ROOT) and not np.all(mask[parents[parents != ROOT]]):
            raise ValueError("a kept node's parent must be kept")
        new_index = np.cumsum(mask) - 1  # [num_nodes]: old node -> new node, where kept
        new_parents = np.where(parents == ROOT, ROOT, new_index[np.maximum(parents, 0)])
        probs = None if self.draft_probs is None else self.draft_probs[mask]
        kinds = None if self.kinds is None else self.kinds[mask]
        from_index = None if self.from_index is None else self.from_index[mask]
        return DraftTree(self.tokens[mask], new_parents, probs, kinds=kinds, from_index=from_index)

    def truncate(self, num_nodes: int) -> DraftTree:
        """The first ``num_nodes`` nodes (still a tree: order is topological)."""
        probs = None if self.draft_probs is None else self.draft_probs[:num_nodes]
        kinds = None if self.kinds is None else self.kinds[:num_nodes]
        from_index = None if self.from_index is None else self.from_index[:num_nodes]
        return DraftTree(self.tokens[:num_nodes], self.parents[:num_nodes], probs, kinds=kinds, from_index=from_index)

    def with_kinds(self, kinds: np.ndarray | int) -> DraftTree:
        """This tree with its nodes' kinds set (one integer for all of them, or one per node)."""
        per_node = np.broadcast_to(np.asarray(kinds, np.int64), self.tokens.shape).copy()  # [num_nodes]
        return DraftTree(self.tokens, self.parents, self.draft_probs, kinds=per_node, from_index=self.from_index)

    def walks(self, paths: Iterable[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """The nodes each of ``paths`` (token sequences from the root) walks down, as far as the
        tree goes. Example: tokens ``[5, 6, 7]``, parents ``[-1, 0, 0]``, paths ``[5, 7, 9]`` and
        ``[6]``: ``[[0, 2], []]``."""
        child = {key: node for node, key in enumerate(zip(self.parents.tolist(), self.tokens.tolist()))}
        walked: list[list[int]] = []
        for path in paths:
            nodes: list[int] = []
            for token in np.asarray(path).tolist():
                below = child.get((nodes[-1] if nodes else ROOT, token))
                if below is None:
                    break
                nodes.append(below)
            walked.append(nodes)
        return walked


@dataclass
class _Trie:
    """Paths merged by their prefixes: node ids in the order first seen, each node's summed weight;
    with ``max_nodes``, a path stops where it would add a node past it (its prefix is kept)."""

    tokens: list[int]
    parents: list[int]
    weight: list[float]
    children: dict[int, list[int]]  # by parent node (ROOT: the first level), first seen first

    @classmethod
    def of(
        cls,
        paths: Iterable[Sequence[int] | np.ndarray],
        weights: Iterable[float],
        max_nodes: int | None = None,
    ) -> _Trie:
        trie = cls([], [], [], {})
        node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for path, w in zip(paths, weights):
            parent = ROOT
            for token in np.asarray(path).tolist():
                node = node_of.get((parent, token))
                if node is None:
                    if max_nodes is not None and len(trie.tokens) >= max_nodes:
                        break
                    node = node_of[parent, token] = len(trie.tokens)
                    trie.tokens.append(token)
                    trie.parents.append(parent)
                    trie.weight.append(0.0)
                    trie.children.setdefault(parent, []).append(node)
                trie.weight[node] += float(w)
                parent = node
        return trie


def committed_path(tokens: Sequence[int], parents: Sequence[int], committed: Sequence[int]) -> list[int]:
    """The nodes the ``committed`` tokens (those after the root) walk down a tree, first level first.

    Plain lists, for trees walked on the host every step. Example: tokens
    ``[5, 6, 8]``, parents ``[-1, -1, 0]``, committed ``[5, 8, 2]``: ``[0, 2]``
    (``2`` has no node below node 2).
    """
    path: list[int] = []
    for token in committed:
        parent = path[-1] if path else ROOT
        child = next(
            (i for i in range(parent + 1, len(tokens)) if parents[i] == parent and tokens[i] == token), None
        )  # children come after their parent
        if child is None:
            break
        path.append(child)
    return path


def forest_ancestor_mask(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """``mask[r, c]``: row ``c`` is row ``r`` or an ancestor of it.

    ``parents`` is indexed by *row*; ``-1`` marks a root, so several roots make
    a forest (a ``DraftTree``'s verification rows are the case with one root at
    row 0). Example: row parents ``[-1, 0, 0, 1]`` give rows ``{0}``,
    ``{0, 1}``, ``{0, 2}``, ``{0, 1, 3}``.
    """
    parents = np.asarray(parents, dtype=np.int64).reshape(-1)
    n = parents.size
    if n and not np.all((parents >= -1) & (parents < np.arange(n))):
        raise ValueError("row parents must be -1 or an earlier row (topological order)")
    mask = np.zeros((n, n), dtype=bool)
    for row, parent in enumerate(parents):
        if parent >= 0:
            mask[row] = mask[parent]
        mask[row, row] = True
    return mask
