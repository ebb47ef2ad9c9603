"""``dsbd`` with lookup branches (``"lookup"``, issue #48), without an engine.

A depth whose first drafts are lookup nodes (deterministic) and whose others are the
forest's draws is verified exactly: each output beam an independent draw from the
target joint, enumerated as test_dsbd enumerates plain depths. The width never exceeds
``max_width`` (so ``max_width`` 1 stays greedy-exact and lossless when sampling). The
drafter, on test_mcsd's fake runtime, drafts no forest when the lookup fills the
budget, and otherwise a forest below the root without the lookup's first tokens.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
import torch
from conftest import checked_options
from test_dsbd import ACCEPT, CASES, REJECT, TOL, residual
from test_hybrid_lookup import REPEATS, DeferringRuntime, learnt, masked

from vllm_specbeam.core.budget import FILL_KIND
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import ROOT
from vllm_specbeam.methods.dsbd.drafter import DsbdDrafter, fill_shape
from vllm_specbeam.methods.dsbd.maths import BeamForest, verify_mixed_depth
from vllm_specbeam.methods.dsbd.verifier import DsbdGreedyVerifier, DsbdVerifier


# ---------------------------------------------------------------- one depth, enumerated
def mixed_law(p: np.ndarray, q: np.ndarray, lookups: list[int], samples: int, width: int, fixed: int) -> dict:
    """Exact law of a depth's ``width`` output beams: the ``lookups`` pairs (deterministic) then
    ``samples`` i.i.d. draws from ``q`` without them, checked by :func:`verify_mixed_depth` with
    ``fixed`` deterministic drafts; on failure one draw from its residual, then fresh draws from
    ``p``. Each branch's probability is replayed with the rule written out here."""
    drawn_from = masked(q, lookups)
    law: dict[tuple[int, ...], float] = defaultdict(float)
    for drawn in itertools.product(np.flatnonzero(drawn_from > 0), repeat=samples):
        drafts = [*lookups, *(int(x) for x in drawn)]
        seen = set()
        for decisions in itertools.product([ACCEPT, REJECT], repeat=len(drafts)):
            outcome = verify_mixed_depth(
                torch.tensor(p), torch.tensor(drawn_from), torch.tensor(drafts), torch.tensor(decisions), width, fixed
            )
            if tuple(outcome.accepted) in seen:
                continue  # same branch reached through an unchecked draft's uniform
            seen.add(tuple(outcome.accepted))
            prob, r, count = float(np.prod(drawn_from[list(drawn)])), p, 0
            for j, x in enumerate(drafts):
                if count == width:
                    break
                point = np.eye(p.size)[x] if j < len(lookups) else drawn_from
                a = min(1.0, r[x] / point[x])
                prob, r, count = (
                    (prob * a, p, count + 1) if j in outcome.accepted else (prob * (1 - a), residual(r, point), count)
                )
            kept = tuple(drafts[j] for j in outcome.accepted)
            if outcome.succeeded:
                law[kept] += prob
                continue
            for rest in itertools.product(range(p.size), repeat=width - len(kept)):
                law[kept + rest] += prob * outcome.residual.numpy()[rest[0]] * np.prod(p[list(rest[1:])])
    return law


def law_error(law: dict, p: np.ndarray, width: int) -> float:
    """Largest gap to ``width`` independent draws from ``p``."""
    return max(
        abs(law.get(beams, 0.0) - float(np.prod(p[list(beams)])))
        for beams in itertools.product(range(p.size), repeat=width)
    )


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(("lookups", "samples", "width"), [([1], 1, 1), ([1, 3], 1, 1), ([1], 2, 2), ([3, 1], 1, 2)])
def test_a_depth_with_lookup_drafts_keeps_every_beam_exact(case, lookups, samples, width) -> None:
    p, q = CASES[case]
    assert law_error(mixed_law(p, q, lookups, samples, width, len(lookups)), p, width) < TOL


def test_the_planted_lookup_as_a_draw_bug_is_caught() -> None:
    """Checking a lookup pair as if the draft had drawn it (``fixed=0``) is not the target's law."""
    p, q = CASES[0]
    assert law_error(mixed_law(p, q, [1], 1, 1, fixed=0), p, 1) > 1e-3


# ---------------------------------------------------------------- the width cap
def test_max_width_one_keeps_one_beam_below_lookup_siblings() -> None:
    """Greedy: lookup root children 2 and 5, the forest's 3; the target ranks 2 then 3, so without
    the cap the depth would keep two beams (beam search); ``max_width`` 1 is greedy decoding."""
    logits = torch.full((4, 8), -5.0)  # rows: root, then nodes 0 (2), 1 (5), 2 (3)
    logits[0, 2], logits[0, 3] = 3.0, 2.0
    logits[1, 6] = 3.0
    forest = BeamForest(
        np.array([2, 5, 3]), np.array([ROOT, ROOT, ROOT]), max_width=1, kinds=np.array([0, 0, FILL_KIND])
    )
    verdict = DsbdGreedyVerifier().verify([forest], logits, np.array([0]))
    assert verdict.tokens == [[2, 6]] and verdict.widths == [[1]]


# ---------------------------------------------------------------- the drafter
def dsbd_options(**overrides) -> dict:
    return checked_options(DsbdDrafter, draft_model="draft", num_speculative_tokens=4, lookup="request", **overrides)


def hybrid(runtime: DeferringRuntime, **overrides) -> DsbdDrafter:
    d = DsbdDrafter(dsbd_options(**overrides))
    d.use_runtime(runtime)
    return d


def test_fill_shape_is_max_width_per_depth() -> None:
    assert fill_shape(2, 3).parents.tolist() == [ROOT, ROOT, 0, 0, 2, 2]


def lookup_chain_round(p: np.ndarray, chain: list[int], uniforms: np.ndarray) -> list[int]:
    """What a sampled round commits on a forest of one lookup chain (a point mass at every depth,
    width 1), the rule written out: node ``k`` is accepted while ``uniforms[k]`` falls below the
    target's ``p[k, chain[k]]`` (row ``k``: the row below node ``k - 1``); then one target token,
    drawn by inverting the CDF at the last uniform of the row the chain stopped at, less the
    rejected token (if any)."""
    accepted = 0
    while accepted < len(chain) and uniforms[accepted] < p[accepted, chain[accepted]]:
        accepted += 1
    row = p[accepted].copy()  # [V]
    if accepted < len(chain):
        row[chain[accepted]] = 0.0
    cdf = np.cumsum(row)  # [V]
    return [*chain[:accepted], int(np.searchsorted(cdf, uniforms[-1] * cdf[-1], side="right"))]


def test_a_lookup_that_fills_the_budget_runs_no_forest() -> None:
    """The draft never runs, and the lookup chain it leaves is verified without draft rows: each
    seeded round commits what :func:`lookup_chain_round` says."""
    runtime = DeferringRuntime()
    d = learnt(hybrid(runtime, max_nodes=8), 0.95, 0.5)
    tree = d.propose([DraftRequest("r", np.array(REPEATS), d.options, 1.0)])[0]
    assert isinstance(tree, BeamForest) and tree.max_width == 4
    assert tree.tokens.tolist() == [9, 10, 11, 12, 13, 14, 15, 16] and set(tree.kinds.tolist()) == {0}
    assert runtime.synced == [] and runtime.fed == [] and runtime.deferred == ["r"]
    noise = torch.softmax(torch.randn(9, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    p = (0.3 * noise + 0.7 * torch.eye(20, dtype=torch.float64)[[*tree.tokens, 0]]).numpy()  # [rows, V]
    lengths = set()
    for seed in range(32):
        verdict = DsbdVerifier().verify([tree], torch.tensor(p), np.array([0]), [torch.Generator().manual_seed(seed)])
        uniforms = torch.rand(tree.num_nodes + 1, generator=torch.Generator().manual_seed(seed)).double().numpy()
        expected = lookup_chain_round(p, tree.tokens.tolist(), uniforms)
        assert verdict.tokens[0] == expected and verdict.widths[0] == [1] * (len(expected) - 1)
        lengths.add(len(expected) - 1)
    assert {0, 1, 2, 3, tree.num_nodes} <= lengths  # rounds stopping at several depths, and at none


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_forest_fills_below_the_root_without_the_lookups_first_token(temperature: float) -> None:
    runtime = DeferringRuntime()
    d = learnt(hybrid(runtime, max_nodes=12, lookup_depth=3, max_width=2, prune_ratio=0.0), 0.95, 0.5)
    tree = d.propose([DraftRequest("r", np.array(REPEATS), d.options, temperature)])[0]
    assert tree.tokens[:3].tolist() == [9, 10, 11] and tree.kinds[:3].tolist() == [0, 0, 0]
    forest = tree.kinds == FILL_KIND  # [nodes]
    assert forest.sum() == 8 and runtime.synced == ["r"] and runtime.deferred == []  # width 2, depth 4
    first = tree.tokens[forest & (tree.parents == ROOT)]
    assert first.size and 9 not in first.tolist()
    if temperature:
        assert tree.next_probs is not None and not tree.next_probs[:3].any()  # the draft never extends lookup nodes
        assert np.allclose(tree.draft_probs[np.arange(3), tree.tokens[:3]], 1.0)  # point masses
        assert tree.draft_probs[np.flatnonzero(forest)[0], 9] == 0.0  # the forest's first depth: q without 9
    rows = torch.softmax(torch.randn(tree.num_nodes + 1, 16, generator=torch.Generator().manual_seed(1)), -1)
    verifier = DsbdVerifier() if temperature else DsbdGreedyVerifier()
    verdict = verifier.verify([tree], rows if temperature else rows.log(), np.array([0]))
    assert all(w <= 2 for w in verdict.widths[0])
