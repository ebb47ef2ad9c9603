"""The lossless sampling verifiers keep the target distribution *exactly*.

The proof is by exact enumeration on tiny vocabularies: enumerate every draft
tree the drafting law can produce (with its probability), take the
verifier's own decision tables (:func:`acceptance_table`, :func:`block_table`:
the acceptance probabilities and residuals the samplers act on) and compose
them into the exact distribution of the committed tokens. One step commits a
variable number of tokens; completing short commits with the target itself
(what later exact steps do) must give the target's joint distribution of the
next ``L`` tokens, for every ``L`` up to depth + 1.

The tables are the samplers' only input besides uniforms, so the Monte-Carlo
tests close the loop: the real ``verify`` calls, with fixed seeds, must match
the composed distribution under a chi-square test at significance 1e-3.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from itertools import permutations, product

import numpy as np
import pytest
import torch

from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.core.verifiers import block, rejection
from vllm_specbeam.core.verifiers.base import TreeVerifier
from vllm_specbeam.core.verifiers.block import BlockVerifier
from vllm_specbeam.core.verifiers.rejection import RejectionTreeVerifier, acceptance_table, child_step

ATOL = 1e-9
SIGNIFICANCE = 1e-3

Dist = dict[tuple[int, ...], float]
Weighted = list[tuple[DraftTree, float]]


class ToyModel:
    """A fixed random next-token distribution per prefix (some entries zero, as after top-k)."""

    def __init__(self, seed: int, vocab: int, zeros: int = 1) -> None:
        self.seed, self.vocab, self.zeros = seed, vocab, zeros
        self.cache: dict[tuple[int, ...], np.ndarray] = {}

    def __call__(self, prefix: Sequence[int]) -> np.ndarray:
        key = tuple(prefix)
        if key not in self.cache:
            rng = np.random.default_rng([self.seed, len(key), *key])
            probs = rng.dirichlet(np.full(self.vocab, 0.8))
            probs[rng.choice(self.vocab, self.zeros, replace=False)] = 0.0
            self.cache[key] = probs / probs.sum()
        return self.cache[key]


# ---------------------------------------------------------------- drafting laws
def path_tokens(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(int(t) for t in tree.tokens[tree.path_to(node)]) if node != ROOT else ()


def sibling_draws(q: np.ndarray, k: int, law: str) -> list[tuple[tuple[int, ...], float]]:
    """Every ordered outcome of ``k`` draws from ``q`` with its probability."""
    if law == "iid":
        outcomes = product(range(q.size), repeat=k)
        return [(x, float(np.prod(q[list(x)]))) for x in outcomes]
    draws = []
    for x in permutations(range(q.size), k):
        left, weight = 1.0, 1.0
        for token in x:
            weight *= q[token] / left if left > 0 else 0.0
            left -= q[token]
        if weight > 0:
            draws.append((x, weight))
    return draws


def draft_rows(tree: DraftTree, q: ToyModel, conditional: bool) -> np.ndarray:
    """``q(. | path to parent)`` per node; with ``conditional``, earlier siblings removed."""
    rows = np.stack([q(path_tokens(tree, int(parent))) for parent in tree.parents])
    if conditional:
        for node, parent in enumerate(tree.parents):
            earlier = [s for s in tree.children(int(parent)) if s < node]
            rows[node, tree.tokens[earlier]] = 0.0
            rows[node] /= rows[node].sum()
    return rows


def sampled_trees(q: ToyModel, k_config: Sequence[int], law: str, conditional: bool = False) -> Weighted:
    """Every tree of shape ``k_config`` (children per depth) the law can draw, level by level."""
    partial = [([], [], 1.0)]
    level = [ROOT]
    for k in k_config:
        grown = []
        for tokens, parents, weight in partial:
            tree = DraftTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64))
            options = [sibling_draws(q(path_tokens(tree, node)), k, law) for node in level]
            for combo in product(*options):
                new_tokens, new_parents, w = list(tokens), list(parents), weight
                for node, (draw, p_draw) in zip(level, combo):
                    new_tokens += draw
                    new_parents += [node] * k
                    w *= p_draw
                grown.append((new_tokens, new_parents, w))
        start = len(partial[0][0])
        level = list(range(start, start + len(level) * k))
        partial = grown
    out = []
    for tokens, parents, weight in partial:
        tree = DraftTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64))
        out.append((DraftTree(tree.tokens, tree.parents, draft_rows(tree, q, conditional)), weight))
    return out


def independent_star(models: Sequence[ToyModel]) -> Weighted:
    """One child of the root per draft model, each drawn from its own model."""
    rows = np.stack([model(()) for model in models])
    out = []
    for x in product(range(rows.shape[1]), repeat=len(models)):
        weight = float(np.prod(rows[np.arange(len(models)), list(x)]))
        if weight > 0:
            out.append((DraftTree(np.asarray(x), np.full(len(x), ROOT), rows), weight))
    return out


def merged_path_trees(q: ToyModel, num_paths: int, depth: int) -> Weighted:
    """``num_paths`` i.i.d. draft sequences merged into a trie (siblings de-duplicated)."""
    sequences = [(s, joint(q, s)) for s in product(range(q.vocab), repeat=depth)]
    out = []
    for combo in product(sequences, repeat=num_paths):
        tree = DraftTree.from_paths([s for s, _ in combo])
        weight = float(np.prod([w for _, w in combo]))
        out.append((DraftTree(tree.tokens, tree.parents, draft_rows(tree, q, conditional=False)), weight))
    return out


# ---------------------------------------------------------------- exact composition
def target_rows(tree: DraftTree, p: ToyModel) -> torch.Tensor:
    return torch.tensor(np.stack([p(path_tokens(tree, node)) for node in range(ROOT, tree.num_nodes)]))


def rejection_commits(tree: DraftTree, p: ToyModel, without_replacement: bool) -> Dist:
    """Exact law of the committed tokens, composed from the verifier's acceptance table."""
    table = acceptance_table([tree], target_rows(tree, p), np.array([0]), without_replacement)
    accept = table.accept.tolist()
    stops = table.stop_distribution(np.arange(tree.num_nodes + 1)).numpy()
    out: Dist = defaultdict(float)

    def visit(node: int, reach: float) -> None:
        for child in tree.children(node):
            visit(int(child), reach * accept[child])
            reach *= 1.0 - accept[child]
        for token, prob in enumerate(stops[node + 1]):
            out[(*path_tokens(tree, node), token)] += reach * prob

    visit(ROOT, 1.0)
    return out


def block_commits(tree: DraftTree, p: ToyModel) -> Dist:
    """Exact law of the committed tokens, composed from the verifier's block table."""
    table = block.block_table([tree], target_rows(tree, p), np.array([0]))
    ends, stops = table.ends[0].numpy(), table.stops[0].numpy()
    out: Dist = defaultdict(float)
    for tau in range(tree.num_nodes + 1):
        prob_tau = ends[tau] * np.prod(1.0 - ends[tau + 1 : tree.num_nodes + 1])
        for token, prob in enumerate(stops[tau]):
            out[(*tree.tokens[:tau].tolist(), token)] += prob_tau * prob
    return out


def mixture(trees: Weighted, commits: Callable[[DraftTree], Dist]) -> Dist:
    assert sum(w for _, w in trees) == pytest.approx(1.0, abs=1e-12)
    out: Dist = defaultdict(float)
    for tree, weight in trees:
        for seq, prob in commits(tree).items():
            out[seq] += weight * prob
    return out


def joint(p: ToyModel, seq: Sequence[int], start: int = 0) -> float:
    return float(np.prod([p(seq[:i])[seq[i]] for i in range(start, len(seq))]))


def next_tokens_error(commits: Dist, p: ToyModel, length: int) -> float:
    """Largest gap between the completed law of the next ``length`` tokens and the target's."""
    law: Dist = defaultdict(float)
    for seq, prob in commits.items():
        if len(seq) >= length:
            law[seq[:length]] += prob
            continue
        for tail in product(range(p.vocab), repeat=length - len(seq)):
            full = (*seq, *tail)
            law[full] += prob * joint(p, full, start=len(seq))
    return max(abs(law[s] - joint(p, s)) for s in product(range(p.vocab), repeat=length))


def assert_exact(commits: Dist, p: ToyModel, max_length: int) -> None:
    assert sum(commits.values()) == pytest.approx(1.0, abs=ATOL)
    for length in range(1, max_length + 1):
        assert next_tokens_error(commits, p, length) < ATOL, f"next {length} tokens differ from the target"


def expected_accepted(commits: Dist) -> float:
    return sum((len(seq) - 1) * prob for seq, prob in commits.items())


# ---------------------------------------------------------------- rejection sampling: exactness
@pytest.mark.parametrize("seed", [0, 1])
def test_star_with_replacement_is_exact(seed: int) -> None:
    """Three i.i.d. children, duplicates included (their residual update is kept)."""
    p, q = ToyModel(seed, 4), ToyModel(100 + seed, 4)
    trees = sampled_trees(q, [3], "iid")
    assert any(len(set(t.tokens.tolist())) < 3 for t, _ in trees)
    assert_exact(mixture(trees, lambda t: rejection_commits(t, p, False)), p, 2)


@pytest.mark.parametrize("conditional", [False, True], ids=["full-q-rows", "conditional-q-rows"])
def test_star_without_replacement_is_exact(conditional: bool) -> None:
    p, q = ToyModel(2, 4), ToyModel(102, 4, zeros=0)
    trees = sampled_trees(q, [3], "wor", conditional)
    assert_exact(mixture(trees, lambda t: rejection_commits(t, p, True)), p, 2)


@pytest.mark.parametrize(("law", "without_replacement"), [("iid", False), ("wor", True)])
def test_two_level_tree_is_exact(law: str, without_replacement: bool) -> None:
    """MCSD's k_config (2, 2): two children at the root, two under each."""
    p, q = ToyModel(3, 3, zeros=0), ToyModel(103, 3, zeros=0)
    trees = sampled_trees(q, [2, 2], law)
    assert_exact(mixture(trees, lambda t: rejection_commits(t, p, without_replacement)), p, 3)


def test_deep_chain_is_exact() -> None:
    p, q = ToyModel(4, 4), ToyModel(104, 4)
    trees = sampled_trees(q, [1, 1, 1], "iid")
    assert_exact(mixture(trees, lambda t: rejection_commits(t, p, True)), p, 4)


def test_merged_iid_paths_are_exact_without_replacement() -> None:
    """i.i.d. paths merged by ``from_paths`` lose their duplicates: the without-replacement rule fits."""
    p, q = ToyModel(5, 3, zeros=0), ToyModel(105, 3, zeros=0)
    trees = merged_path_trees(q, num_paths=3, depth=2)
    assert_exact(mixture(trees, lambda t: rejection_commits(t, p, True)), p, 3)


DETERMINISTIC_TREES = [
    DraftTree(np.array([2, 2, 0, 1, 0, 0, 3, 1]), np.array([-1, -1, -1, -1, 0, 0, 0, 4])),  # repeats
    DraftTree(np.array([0, 1, 2, 3, 4, 0]), np.array([-1, -1, -1, -1, -1, 4])),  # every token + one
    DraftTree.chain([3, 1, 1]),
    DraftTree.from_paths([[1, 2, 0], [1, 3], [4, 4]]),
]


@pytest.mark.parametrize("tree", DETERMINISTIC_TREES)
@pytest.mark.parametrize("without_replacement", [False, True])
def test_deterministic_children_are_exact(tree: DraftTree, without_replacement: bool) -> None:
    """Lookup / tri-gram / top-k candidates: any fixed tree, point-mass q, repeats included."""
    p = ToyModel(6, 5)
    assert_exact(rejection_commits(tree, p, without_replacement), p, tree.max_depth + 1)


def test_target_initialised_candidates_are_exact() -> None:
    """MCSD's target-initialised tree: the target's top-3 at the root (one-hot rows),
    each extended by one token sampled from the draft."""
    p, q = ToyModel(7, 4, zeros=0), ToyModel(107, 4)
    top = np.argsort(-p(()))[:3]
    trees = []
    for tails in product(range(4), repeat=3):
        weight = float(np.prod([q((int(t),))[x] for t, x in zip(top, tails)]))
        if weight > 0:
            tree = DraftTree(np.r_[top, tails], np.r_[[ROOT] * 3, [0, 1, 2]])
            rows = np.concatenate([np.eye(4)[top], draft_rows(tree, q, conditional=False)[3:]])
            trees.append((DraftTree(tree.tokens, tree.parents, rows), weight))
    assert_exact(mixture(trees, lambda t: rejection_commits(t, p, True)), p, 3)


def test_repeated_sibling_is_skipped_or_never_accepted() -> None:
    """Without replacement a repeat has no draft mass: skipped. With replacement it is tried,
    never accepted (its first copy's rejection zeroed ``r`` there), and still updates ``r``."""
    r = torch.tensor([[0.1, 0.5, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    accept, after = child_step(r, q, torch.tensor([0]))
    assert accept.item() == pytest.approx(0.1 / 0.5)
    assert after[0, 0] == 0.0
    q_left = rejection.without(q, torch.tensor([[True, False, False]]))
    skipped_accept, skipped = child_step(after, q_left, torch.tensor([0]))
    assert skipped_accept.item() == 0.0 and torch.equal(skipped, after)
    again_accept, again = child_step(after, q, torch.tensor([0]))
    assert again_accept.item() == 0.0 and not torch.allclose(again, after)


# ---------------------------------------------------------------- the check has teeth
def no_residual_update(residual: torch.Tensor, draft: torch.Tensor, tokens: torch.Tensor):
    """Planted bug: after a rejection the next sibling and the target's token still see ``p``."""
    accept, _ = child_step(residual, draft, tokens)
    return accept, residual


def accept_with_r(residual: torch.Tensor, draft: torch.Tensor, tokens: torch.Tensor):
    """Planted bug: accept with ``r(x)`` instead of ``min(1, r(x) / q(x))`` (right for point masses only)."""
    _, after = child_step(residual, draft, tokens)
    drawable = draft.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) > 0
    return residual.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * drawable, after


@pytest.mark.parametrize(
    ("bug", "law", "without_replacement"),
    [
        (no_residual_update, "iid", False),
        (no_residual_update, "wor", True),
        (accept_with_r, "iid", False),
        (accept_with_r, "wor", True),
    ],
)
def test_planted_bug_is_detected(monkeypatch: pytest.MonkeyPatch, bug, law: str, without_replacement: bool) -> None:
    """Variants that forget the residual update, or accept drafts at the wrong rate, fail the
    same enumeration by far more than its tolerance."""
    p, q = ToyModel(8, 4), ToyModel(108, 4, zeros=0)
    trees = sampled_trees(q, [2], law)
    assert_exact(mixture(trees, lambda t: rejection_commits(t, p, without_replacement)), p, 2)
    monkeypatch.setattr(rejection, "child_step", bug)
    buggy = mixture(trees, lambda t: rejection_commits(t, p, without_replacement))
    assert next_tokens_error(buggy, p, 1) > 1e-2


def test_planted_block_residual_bug_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block verification drawing the target's token from ``p`` instead of its residual."""
    p, q = ToyModel(12, 4), ToyModel(112, 4)
    trees = sampled_trees(q, [1, 1], "iid")
    assert_exact(mixture(trees, lambda t: block_commits(t, p)), p, 3)
    honest = block.block_table

    def stops_from_p(trees, target, row_starts):
        table = honest(trees, target, row_starts)
        rows = np.minimum(np.arange(table.stops.shape[1]), trees[0].num_nodes)
        return block.BlockTable(table.ends, target[torch.as_tensor(rows)].unsqueeze(0).to(table.stops.dtype))

    monkeypatch.setattr(block, "block_table", stops_from_p)
    assert next_tokens_error(mixture(trees, lambda t: block_commits(t, p)), p, 1) > 1e-2


@pytest.mark.parametrize("law", ["iid", "independent-models"])
def test_without_replacement_rule_is_exact_on_independent_draws_too(law: str) -> None:
    """A repeat is skipped, and a child that is new is distributed as its row restricted to
    the untried tokens whether or not the siblings were drawn independently: so the default
    rule is exact for i.i.d. draws and for one child per draft model (SpecInfer) as well."""
    p = ToyModel(9, 4)
    if law == "iid":
        trees = sampled_trees(ToyModel(109, 4), [3], "iid")
    else:
        trees = independent_star([ToyModel(114, 4, zeros=0), ToyModel(115, 4), ToyModel(116, 4, zeros=0)])
    assert_exact(mixture(trees, lambda t: rejection_commits(t, p, True)), p, 2)
    assert_exact(mixture(trees, lambda t: rejection_commits(t, p, False)), p, 2)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_with_replacement_rule_accepts_more_on_iid_draws(seed: int) -> None:
    """Why the option exists at all: on i.i.d. siblings a repeat still narrows the residual."""
    p, q = ToyModel(seed, 4, zeros=0), ToyModel(100 + seed, 4, zeros=0)
    trees = sampled_trees(q, [3], "iid")
    with_replacement = expected_accepted(mixture(trees, lambda t: rejection_commits(t, p, False)))
    without = expected_accepted(mixture(trees, lambda t: rejection_commits(t, p, True)))
    assert with_replacement > without + 1e-4


@pytest.mark.parametrize("law", ["wor", "merged-paths"])
def test_with_replacement_rule_is_not_exact_on_distinct_siblings(law: str) -> None:
    """The option is not cosmetic: the with-replacement update misreads siblings that
    were drawn (or de-duplicated) to be distinct. (On 3 tokens it happens to be exact.)"""
    p, q = ToyModel(9, 4, zeros=0), ToyModel(109, 4, zeros=0)
    trees = sampled_trees(q, [3], "wor") if law == "wor" else merged_path_trees(q, num_paths=3, depth=1)
    assert next_tokens_error(mixture(trees, lambda t: rejection_commits(t, p, False)), p, 1) > 1e-3


# ---------------------------------------------------------------- block verification
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_block_verification_is_exact(depth: int) -> None:
    p, q = ToyModel(10 + depth, 4), ToyModel(110 + depth, 4)
    trees = sampled_trees(q, [1] * depth, "iid")
    assert_exact(mixture(trees, lambda t: block_commits(t, p)), p, depth + 1)


@pytest.mark.parametrize("chain", [[3, 1, 1], [0, 0], [4, 2, 0, 1]])
def test_block_verification_of_deterministic_chains_is_exact(chain: list[int]) -> None:
    """No draft probabilities: point-mass q, as vLLM's reference does for one-hot drafts."""
    p = ToyModel(13, 5)
    assert_exact(block_commits(DraftTree.chain(chain), p), p, len(chain) + 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_accepts_at_least_token_by_token(seed: int) -> None:
    p, q = ToyModel(20 + seed, 4, zeros=0), ToyModel(120 + seed, 4, zeros=0)
    trees = sampled_trees(q, [1, 1, 1], "iid")
    block = expected_accepted(mixture(trees, lambda t: block_commits(t, p)))
    token = expected_accepted(mixture(trees, lambda t: rejection_commits(t, p, True)))
    assert block >= token - ATOL
    assert block > token + 1e-4  # strictly better on these models: the rule is really different


def test_draft_probs_must_cover_the_vocabulary() -> None:
    tree = DraftTree(np.array([1]), np.array([ROOT]), np.full((1, 3), 1 / 3))
    with pytest.raises(ValueError, match="one row per node"):
        RejectionTreeVerifier().verify([tree], torch.full((2, 4), 0.25), np.array([0]))


def test_block_verification_rejects_trees() -> None:
    tree = DraftTree(np.array([1, 2]), np.array([-1, -1]))
    with pytest.raises(ValueError, match="chain"):
        BlockVerifier().verify([tree], torch.full((3, 4), 0.25), np.array([0]))


# ---------------------------------------------------------------- Monte Carlo on the samplers
def chi_square_p_value(counts: dict[tuple[int, ...], int], law: Dist, draws: int) -> float:
    """Pearson's test; outcomes expected fewer than 5 times are pooled into one bin."""
    observed, expected = [], []
    pooled_obs, pooled_exp = 0.0, 0.0
    assert set(counts) <= {s for s, prob in law.items() if prob > 0}, "sampled an impossible commit"
    for seq, prob in law.items():
        if prob * draws >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(prob * draws)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += prob * draws
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    obs, exp = np.asarray(observed, float), np.asarray(expected, float)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    half = torch.tensor([dof / 2, stat / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))  # chi-square survival function


def sample_commits(
    verifier: TreeVerifier, tree: DraftTree, p: ToyModel, draws: int, seed: int
) -> dict[tuple[int, ...], int]:
    """Run the real ``verify`` on ``draws`` copies of ``tree`` in one batch, one seeded generator,
    in float32 as the engine would (the exact laws are float64)."""
    rows = target_rows(tree, p).float()
    target = rows.repeat(draws, 1)
    starts = np.arange(draws) * rows.shape[0]
    generator = torch.Generator().manual_seed(seed)
    verdict = verifier.verify([tree] * draws, target, starts, [generator] * draws)
    counts: dict[tuple[int, ...], int] = defaultdict(int)
    for path, tokens in zip(verdict.accepted, verdict.tokens):
        assert tokens[:-1] == tree.tokens[path].tolist()
        if path.size:
            assert path.tolist() == tree.path_to(int(path[-1]))
        counts[tuple(tokens)] += 1
    return counts


def test_rejection_sampler_matches_its_exact_law() -> None:
    """A tree with a repeated sibling where every other node is accepted with probability
    strictly between 0 and 1 and the two options differ, so every branch of the sampler runs."""
    p, q = ToyModel(45, 4), ToyModel(145, 4, zeros=0)
    tree = DraftTree(np.array([2, 0, 2, 3, 1]), np.array([-1, -1, -1, 0, 0]))
    tree = DraftTree(tree.tokens, tree.parents, draft_rows(tree, q, conditional=False))
    for without_replacement in (False, True):
        counts = sample_commits(RejectionTreeVerifier(without_replacement), tree, p, 20000, seed=1)
        law = rejection_commits(tree, p, without_replacement)
        assert chi_square_p_value(counts, law, 20000) > SIGNIFICANCE


def test_block_sampler_matches_its_exact_law() -> None:
    p, q = ToyModel(31, 4), ToyModel(131, 4)
    chain = DraftTree.chain([2, 0, 3])
    chain = DraftTree(chain.tokens, chain.parents, draft_rows(chain, q, conditional=False))
    counts = sample_commits(BlockVerifier(), chain, p, 20000, seed=2)
    assert chi_square_p_value(counts, block_commits(chain, p), 20000) > SIGNIFICANCE


@pytest.mark.parametrize("module", [rejection, block], ids=["rejection", "block"])
def test_sampler_check_catches_a_reused_uniform(monkeypatch: pytest.MonkeyPatch, module) -> None:
    """Planted bug the tables cannot show: the target's token drawn with the uniform that
    already decided the first draft. The sampler's chi-square test fails by far."""
    p, q = ToyModel(45, 4, zeros=0), ToyModel(145, 4, zeros=0)
    chain = DraftTree.chain([1, 0])  # every accept/end probability well inside (0, 1)
    chain = DraftTree(chain.tokens, chain.parents, draft_rows(chain, q, conditional=False))
    draw = module.draw_uniforms

    def one_too_few(counts, generators, device):
        out = draw(counts, generators, device)
        for u in out:
            u[-1] = u[0]
        return out

    monkeypatch.setattr(module, "draw_uniforms", one_too_few)
    if module is rejection:
        verifier, law = RejectionTreeVerifier(), rejection_commits(chain, p, True)
    else:
        verifier, law = BlockVerifier(), block_commits(chain, p)
    counts = sample_commits(verifier, chain, p, 20000, seed=2)
    assert chi_square_p_value(counts, law, 20000) < 1e-8


@pytest.mark.parametrize("verifier", [RejectionTreeVerifier(), BlockVerifier()], ids=["rejection", "block"])
def test_seeded_request_replays_whatever_the_batch(verifier: TreeVerifier) -> None:
    """A request's outcome depends on its own generator only, not on its neighbours."""
    p, q = ToyModel(32, 6), ToyModel(132, 6)
    chain = DraftTree.chain([1, 4, 2])
    chain = DraftTree(chain.tokens, chain.parents, draft_rows(chain, q, conditional=False))
    other = DraftTree.chain([5])
    rows = target_rows(chain, p)
    alone, batched = [], []
    for s in range(30):
        alone.append(verifier.verify([chain], rows, [0], [torch.Generator().manual_seed(s)]).tokens[0])
        target = torch.cat([target_rows(other, p), rows])
        gens = [None, torch.Generator().manual_seed(s)]
        batched.append(verifier.verify([other, chain], target, np.array([0, 2]), gens).tokens[1])
    assert alone == batched
    assert len({tuple(t) for t in alone}) > 1  # the seed matters
