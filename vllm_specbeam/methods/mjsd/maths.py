"""MJSD's proposal and its joint-likelihood acceptance rule (Qin et al., arXiv 2407.09722).

**Proposal** (:func:`beam_proposal`): the draft's beam search (or beam
sampling) leaves ``B`` beams at the last depth, each with its joint draft
log-probability ``log Q(x_1..x_γ)``; the best ``count`` of them (by that score)
are merged into one tree, best first, so the best beam is the first branch.
Every node carries ``log Q`` of the prefix ending at it.

**Acceptance** (:func:`joint_choice`, lossy by design): with the target's
``log P(x_1..x_i) = Σ_{j≤i} log p(x_j | x_<j)`` of the prefix ending at each
node, a node passes when ``log P − log Q ≥ log τ``. The accepted node is the
deepest passing one, ties to the higher ``log P``; a shorter prefix need not
pass for a longer one to (the rule's ``L = max{i : P/Q ≥ τ}``). The caller then
commits one token from ``p`` at the accepted node (argmax at temperature 0).
A node the target cannot produce (``P = 0``, e.g. outside its top-k) never
passes, whatever ``τ``.

Worked example (chain of 3, τ = 0.9, log τ = -0.105): per-node target
log-probabilities ``[-0.1, -2.0, -0.1]`` give ``log P = [-0.1, -2.1, -2.2]``;
with ``log Q = [-0.2, -1.0, -2.0]`` the differences are ``[0.1, -1.1, -0.2]``:
node 0 passes, node 1 and node 2 fail, so one draft token is accepted. With
``log Q = [-0.2, -2.2, -2.25]`` all three pass and the whole chain is accepted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_specbeam.core.tree import ROOT, DraftTree


@dataclass(frozen=True)
class JointDraft(DraftTree):
    """An MJSD proposal: draft beams merged into a tree, with ``log Q`` of every node's prefix.

    ``joint_logq[i]`` is the draft's log-probability of the tokens from the
    root down to node ``i``; ``threshold`` is the request's ``τ``, travelling
    with its draft to the verifier.
    """

    joint_logq: np.ndarray | None = None
    threshold: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.joint_logq is None or len(self.joint_logq) != self.num_nodes:
            raise ValueError("joint_logq needs one entry per node")

    def truncate(self, num_nodes: int) -> JointDraft:
        """The first ``num_nodes`` nodes (the scheduler may cut a draft short)."""
        assert self.joint_logq is not None  # checked in __post_init__
        return JointDraft(
            self.tokens[:num_nodes], self.parents[:num_nodes], None, self.joint_logq[:num_nodes], self.threshold
        )


def beam_proposal(
    tokens: Sequence[int],
    parents: Sequence[int],
    scores: Sequence[float],
    count: int,
    max_nodes: int,
    threshold: float,
) -> JointDraft:
    """The best ``count`` distinct beams of a drafted beam forest, merged into one tree.

    ``tokens``, ``parents`` and ``scores`` describe every node the draft's
    beam search drafted (parents index these nodes; ``ROOT`` below the
    committed context), ``scores`` being each node's joint ``log Q``. Beams are
    the nodes of the deepest level, best score first; ``max_nodes`` keeps the
    best beams whole and cuts the others.
    Example: beams ``[5, 7]`` (-0.3) and ``[5, 8]`` (-0.9) with ``count`` 2
    give tokens ``[5, 7, 8]``, parents ``[-1, 0, 0]``.
    """
    forest = DraftTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64))
    logq = np.asarray(scores, np.float64)
    if forest.num_nodes == 0:
        return JointDraft(forest.tokens, forest.parents, None, np.zeros(0), threshold)
    last = np.flatnonzero(forest.depths == forest.max_depth)
    beams: list[tuple[int, ...]] = []
    prefix_logq: dict[tuple[int, ...], float] = {}
    for leaf in last[np.argsort(-logq[last], kind="stable")]:
        path = forest.path_to(int(leaf))
        beam = tuple(int(t) for t in forest.tokens[path])
        if beam in prefix_logq:
            continue  # a beam sampled twice
        for depth, node in enumerate(path, start=1):
            prefix_logq[beam[:depth]] = float(logq[node])
        beams.append(beam)
        if len(beams) == count:
            break
    tree = DraftTree.from_paths(beams, max_nodes)
    joint = [prefix_logq[tuple(int(t) for t in tree.tokens[tree.path_to(n)])] for n in range(tree.num_nodes)]
    return JointDraft(tree.tokens, tree.parents, None, np.asarray(joint, np.float64), threshold)


def joint_choice(tree: JointDraft, token_logp: np.ndarray) -> int:
    """The accepted node (``ROOT``: none), given ``log p`` of every node's token at its parent's row ``[nodes]``."""
    assert tree.joint_logq is not None  # checked in JointDraft.__post_init__
    if tree.num_nodes == 0:
        return ROOT
    joint_logp = np.zeros(tree.num_nodes)
    for node, parent in enumerate(tree.parents):
        joint_logp[node] = token_logp[node] + (0.0 if parent == ROOT else joint_logp[parent])
    log_threshold = math.log(tree.threshold) if tree.threshold > 0 else -math.inf
    passes = np.isfinite(joint_logp) & (joint_logp - tree.joint_logq >= log_threshold)
    if not passes.any():
        return ROOT
    # deepest passing node, then the higher log P (lexsort: last key first)
    order = np.lexsort((np.where(passes, joint_logp, -np.inf), np.where(passes, tree.depths, -1)))
    return int(order[-1])
