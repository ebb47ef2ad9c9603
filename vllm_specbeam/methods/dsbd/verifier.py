"""DSBD verification, keeping one sequence per request per round.

The engine serves one sequence per request, so this is the paper's
memory-saving variant: a round walks the forest depth by depth
(:func:`vllm_specbeam.methods.dsbd.maths.verify_depth`); while a depth accepts its width,
the accepted pairs become the target's beams. The round ends at the first
depth that fails, or after the last depth, and commits **one** output beam:
the next draw from the target's joint at that depth, i.e. the residual after
the trailing rejections on failure (the authors' ``extra_sample_cnt = 1``)
or a fresh draw from ``P`` below the last depth. That beam is a live beam
``b`` of the depth plus a token ``x`` from the target, so the step commits
``path(b) + [x]``: the accepted path and exactly one target token, like every
verifier. Output beams are independent draws from the target's joint, so
committing one of them is as good as any; the full variant's
best-length-normalised pick needs ``W`` target beams kept across rounds.

Greedy requests (``greedy=True``, raw logits in) run beam *search*: a depth
keeps the target's best pairs as far as they were drafted; the round commits
the target's best pair where it stops (one beam: greedy decoding exactly).

Sampled requests need :class:`BeamForest` drafts (an empty tree: one draw from
the target); greedy rounds read tokens and parents only. Lookup nodes (kinds below
``FILL_KIND``) are deterministic drafts (:func:`~.maths.verify_mixed_depth`); a
depth keeps at most the forest's ``max_width`` beams.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_specbeam.core.budget import FILL_KIND
from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.core.verifiers.base import TreeVerifier, Verdict
from vllm_specbeam.core.verifiers.residual import draw_uniforms, sample_rows, working_precision
from vllm_specbeam.methods.dsbd.maths import (
    BeamForest,
    acceptance_rates,
    choose_width,
    greedy_depth,
    joint,
    mixed_rates,
    residual_chain,
    verify_depth,
    verify_mixed_depth,
)


class DsbdVerifier(TreeVerifier):
    """One DSBD round per request (see the module docstring)."""

    def __init__(self, greedy: bool = False) -> None:
        self.greedy = greedy

    def verify(
        self,
        trees: Sequence[DraftTree],
        target: torch.Tensor,
        row_starts: np.ndarray,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> Verdict:
        """``target``: raw logits when greedy, else the requests' sampling
        probabilities per row. Each sampled request draws ``num_nodes + 1``
        uniforms: one per drafted pair, then one for the committed beam."""
        if not trees:
            return Verdict([], [])
        if self.greedy:
            logp = torch.log_softmax(target.float(), dim=-1)
            results = [_greedy_round(tree, logp, int(start)) for tree, start in zip(trees, row_starts)]
        else:
            probs = working_precision(target)
            uniforms = draw_uniforms([tree.num_nodes + 1 for tree in trees], generators, target.device)
            results = [_sampled_round(_forest(t), probs, int(s), u) for t, s, u in zip(trees, row_starts, uniforms)]
        paths = [np.asarray(tree.path_to(beam), np.int64) for tree, (beam, _, _) in zip(trees, results)]
        tokens = [[*tree.tokens[path].tolist(), token] for tree, path, (_, token, _) in zip(trees, paths, results)]
        return Verdict(paths, tokens, [widths for _, _, widths in results])


def _forest(tree: DraftTree) -> BeamForest:
    """The draft as the forest a sampled round walks: a :class:`BeamForest` with
    draft rows (none needed when all its nodes are lookup nodes), or an empty tree of
    any type (an empty forest: one draw from the target)."""
    rows = tree.draft_probs is not None and getattr(tree, "next_probs", None) is not None
    if isinstance(tree, BeamForest) and (rows or _lookup_nodes(tree).all()):
        return tree
    if not tree.num_nodes:
        return BeamForest(tree.tokens, tree.parents)
    raise TypeError(f"DSBD sampling verification needs a BeamForest with draft rows, got {type(tree).__name__}")


def _lookup_nodes(tree: DraftTree) -> np.ndarray:
    """``[num_nodes]``: which nodes are lookup nodes (deterministic drafts)."""
    return np.zeros(tree.num_nodes, bool) if tree.kinds is None else tree.kinds < FILL_KIND


def _width_cap(tree: DraftTree, drafted: int) -> int:
    """The most beams a depth with ``drafted`` usable pairs keeps."""
    cap = getattr(tree, "max_width", None)
    return drafted if cap is None else min(cap, drafted)


def _levels(tree: DraftTree) -> list[np.ndarray]:
    """Node indices of every depth, in draft order."""
    return [np.flatnonzero(tree.depths == d) for d in range(1, tree.max_depth + 1)]


def _usable(tree: DraftTree, level: np.ndarray, live: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """The drafted pairs of a depth whose beam is live, and their flat joint indices.

    Pairs drawn from beams the target did not keep are skipped: the others
    are still i.i.d. draws from the draft joint restricted to the live beams.
    """
    slot = {beam: i for i, beam in enumerate(live)}
    nodes = np.asarray([n for n in level if int(tree.parents[n]) in slot], np.int64)
    return nodes, torch.as_tensor([slot[int(tree.parents[n])] for n in nodes], dtype=torch.int64)


def _target_rows(target: torch.Tensor, start: int, beams: list[int]) -> torch.Tensor:
    return target[torch.as_tensor([start + 1 + b for b in beams], device=target.device)]


def _draft_rows(tree: BeamForest, beams: list[int], like: torch.Tensor) -> torch.Tensor:
    """``q(. | beam)`` per live beam: the root's from any first-level draft-model node, others
    from ``next_probs`` (zero for lookup nodes, which the draft never extends)."""
    # only empty or lookup-only forests lack draft rows (see _forest), and they draw no pairs from q
    assert tree.draft_probs is not None and tree.next_probs is not None
    if beams == [ROOT]:
        children = tree.children(ROOT)
        row = tree.draft_probs[int(children[~_lookup_nodes(tree)[children]][0])]
        return torch.as_tensor(row, device=like.device).to(like.dtype).unsqueeze(0)
    rows = np.stack([tree.next_probs[b] for b in beams])
    return torch.as_tensor(rows, device=like.device).to(like.dtype)


def _sampled_round(
    tree: BeamForest, target: torch.Tensor, start: int, uniforms: torch.Tensor
) -> tuple[int, int, list[int]]:
    """``(beam, token, widths)`` for one request: the committed beam's node
    (``ROOT`` for the root), the target's token, the beams each accepted depth kept."""
    vocab = target.shape[-1]
    lookup = _lookup_nodes(tree)  # [num_nodes]
    # a lookup beam's score is -inf under the draft: the draft drew no pair below it
    live, target_score, draft_score = [ROOT], [0.0], [0.0]
    widths: list[int] = []
    for level in _levels(tree):
        p = joint(torch.tensor(target_score), _target_rows(target, start, live))
        nodes, slots = _usable(tree, level, live)
        if nodes.size == 0:
            return *_draw(p, live, vocab, uniforms[-1]), widths
        fixed = int(lookup[nodes].sum())
        assert lookup[nodes[:fixed]].all(), "lookup nodes come first at every depth"
        # the draft's joint over its live beams (nothing to draw from when every pair is a lookup node)
        q = joint(torch.tensor(draft_score), _draft_rows(tree, live, target)) if fixed < nodes.size else 0 * p
        pairs = slots * vocab + torch.as_tensor(tree.tokens[nodes])
        drafted = uniforms[torch.as_tensor(nodes)]
        cap = _width_cap(tree, nodes.size)
        if fixed:
            width = choose_width(mixed_rates(p, q, pairs, fixed), tree.min_width, cap, tree.width_threshold)
            outcome = verify_mixed_depth(p, q, pairs, drafted, width, fixed)
        else:
            chain = residual_chain(p, q, nodes.size)
            width = choose_width(acceptance_rates(chain, q), tree.min_width, cap, tree.width_threshold)
            outcome = verify_depth(chain, q, pairs, drafted, width)
        if not outcome.succeeded:
            return *_draw(outcome.residual, live, vocab, uniforms[-1]), widths
        kept = nodes[outcome.accepted]
        parent_slot = slots[outcome.accepted].tolist()
        target_score = [
            target_score[s] + float(target[start + 1 + live[s], tree.tokens[n]].log())
            for s, n in zip(parent_slot, kept)
        ]
        draft_score = [
            -np.inf if lookup[n] else draft_score[s] + float(np.log(_draft_prob(tree, n)))
            for s, n in zip(parent_slot, kept)
        ]
        live = kept.tolist()
        widths.append(len(live))
    below_last = joint(torch.tensor(target_score), _target_rows(target, start, live))
    return *_draw(below_last, live, vocab, uniforms[-1]), widths


def _draft_prob(tree: BeamForest, node: int) -> float:
    """The draft's probability of a draft-model node's token (only lookup-only forests lack draft rows)."""
    assert tree.draft_probs is not None
    return float(tree.draft_probs[node, tree.tokens[node]])


def _draw(joint_probs: torch.Tensor, live: list[int], vocab: int, uniform: torch.Tensor) -> tuple[int, int]:
    """One pair from a joint over ``live`` beams x vocabulary."""
    pair = int(sample_rows(joint_probs.unsqueeze(0), uniform.reshape(1))[0])
    return live[pair // vocab], pair % vocab


def _greedy_round(tree: DraftTree, logp: torch.Tensor, start: int) -> tuple[int, int, list[int]]:
    """Beam search with the width the drafts cover; the best pair where it stops
    (returned as :func:`_sampled_round` does)."""
    vocab = logp.shape[-1]
    live, score = [ROOT], torch.zeros(1)
    widths: list[int] = []
    for level in _levels(tree):
        scores = (score.unsqueeze(-1) + _target_rows(logp, start, live)).reshape(-1)
        nodes, slots = _usable(tree, level, live)
        pairs = slots * vocab + torch.as_tensor(tree.tokens[nodes])
        accepted = greedy_depth(scores, pairs)[: _width_cap(tree, nodes.size)] if nodes.size else []
        if not accepted:
            best = int(scores.argmax())
            return live[best // vocab], best % vocab, widths
        kept = nodes[accepted]
        score = scores[slots[accepted] * vocab + torch.as_tensor(tree.tokens[kept])]
        live = kept.tolist()
        widths.append(len(live))
    best = int((score.unsqueeze(-1) + _target_rows(logp, start, live)).reshape(-1).argmax())
    return live[best // vocab], best % vocab, widths


class DsbdGreedyVerifier(DsbdVerifier):
    """DSBD at temperature 0: beam search over the drafted pairs (a beam
    decoder, so not token-equal to greedy decoding unless ``max_width=1``)."""

    def __init__(self) -> None:
        super().__init__(greedy=True)
