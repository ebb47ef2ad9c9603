"""DSBD: width rule and per-depth verification by exact enumeration; greedy, drafter and batched-drafting
checks; in-engine sampling at width > 1 (support, reproducibility) and at width 1 (the target's law).

Enumerations run in float64 on joints of 2 beams x 2 tokens, small enough to
list every drafted sequence and every accept/reject branch.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
import torch
from conftest import make_prompts
from reference_draft import ReferenceDraftRuntime

from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.core.verifiers.greedy import GreedyTreeVerifier
from vllm_specbeam.draft_runtime.drafter import sampling_probs
from vllm_specbeam.methods.dsbd.drafter import DsbdDrafter, most_fed
from vllm_specbeam.methods.dsbd.maths import (
    BeamForest,
    acceptance_rates,
    choose_width,
    count_distribution,
    joint,
    residual_chain,
    verify_depth,
)
from vllm_specbeam.methods.dsbd.verifier import DsbdVerifier

TOL = 1e-9
ACCEPT, REJECT = 0.0, 1.0 - 1e-12  # uniforms that pass any positive ratio / fail any ratio below one


def joints(seed: int, zeros: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A target and a draft joint over 2 beams x 2 tokens (float64)."""
    rng = np.random.default_rng(seed)
    rows = lambda: rng.dirichlet(np.ones(2), size=2)
    p = joint(torch.tensor(rng.normal(size=2)), torch.tensor(rows())).numpy()
    q = joint(torch.tensor(rng.normal(size=2)), torch.tensor(rows())).numpy()
    if zeros:  # the draft misses a pair the target wants, the target vetoes one the draft likes
        q[0], p[3] = 0.0, 0.0
        p, q = p / p.sum(), q / q.sum()
    return p, q


CASES = [joints(0), joints(1), joints(2, zeros=True)]


def residual(r: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The rule written out independently of the package."""
    mass = np.maximum(r - q, 0)
    return mass / mass.sum() if mass.sum() > 1e-12 else r


def brute_force_counts(p: np.ndarray, q: np.ndarray, m: int) -> np.ndarray:
    """Law of the number of accepted drafts: every draft sequence, every branch."""
    law = np.zeros(m + 1)

    def walk(r: np.ndarray, left: int, accepted: int, prob: float) -> None:
        if left == 0:
            law[accepted] += prob
            return
        for x in np.flatnonzero(q > 0):
            a = min(1.0, r[x] / q[x])
            walk(p, left - 1, accepted + 1, prob * q[x] * a)
            walk(residual(r, q), left - 1, accepted, prob * q[x] * (1 - a))

    walk(p, m, 0, 1.0)
    return law


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("m", [1, 2, 4])
def test_width_rule_matches_brute_force(case: int, m: int) -> None:
    p, q = CASES[case]
    alphas = acceptance_rates(residual_chain(torch.tensor(p), torch.tensor(q), m), torch.tensor(q))
    law = count_distribution(alphas)
    np.testing.assert_allclose(law, brute_force_counts(p, q, m), atol=TOL)
    tail = np.cumsum(law[::-1])[::-1]
    for tau, min_w in itertools.product([0.1, 0.5, 0.9], [1, 2]):
        expected = min(max(min_w, max(n for n in range(m + 1) if tail[n] >= tau)), m)
        assert choose_width(alphas, min_w, m, tau) == expected


def test_width_is_full_when_draft_equals_target() -> None:
    p, _ = CASES[0]
    alphas = acceptance_rates(residual_chain(torch.tensor(p), torch.tensor(p), 4), torch.tensor(p))
    assert choose_width(alphas, 1, 4, 0.99) == 4


def output_law(p: np.ndarray, q: np.ndarray, m: int, width: int) -> dict[tuple[int, ...], float]:
    """Exact law of a depth's ``width`` output beams: accepted pairs, then (on failure)
    one draw from the returned residual, then fresh draws from the target."""
    pt, qt = torch.tensor(p), torch.tensor(q)
    chain = residual_chain(pt, qt, m)
    law: dict[tuple[int, ...], float] = defaultdict(float)
    for drafts in itertools.product(np.flatnonzero(q > 0), repeat=m):
        seen = set()
        for decisions in itertools.product([ACCEPT, REJECT], repeat=m):
            outcome = verify_depth(chain, qt, torch.tensor(drafts), torch.tensor(decisions), width)
            if tuple(outcome.accepted) in seen:
                continue  # same branch reached through an unchecked draft's uniform
            seen.add(tuple(outcome.accepted))
            prob, r, count = np.prod(q[list(drafts)]), p, 0
            for j, x in enumerate(drafts):  # replay the branch with the independent rule
                if count == width:
                    break
                a = min(1.0, r[x] / q[x])
                if j in outcome.accepted:
                    prob, r, count = prob * a, p, count + 1
                else:
                    prob, r = prob * (1 - a), residual(r, q)
            kept = tuple(int(drafts[j]) for j in outcome.accepted)
            if outcome.succeeded:
                law[kept] += prob
                continue
            np.testing.assert_allclose(outcome.residual.numpy(), r, atol=TOL)
            for rest in itertools.product(range(p.size), repeat=width - len(kept)):
                extra = outcome.residual.numpy()[rest[0]] * np.prod(p[list(rest[1:])])
                law[kept + rest] += prob * extra
    return law


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(("m", "width"), [(1, 1), (2, 1), (3, 2), (3, 3)])
def test_depth_outputs_are_independent_target_draws(case: int, m: int, width: int) -> None:
    """The heart of DSBD: whatever the drafts, the output beams are i.i.d. from the target's joint."""
    p, q = CASES[case]
    law = output_law(p, q, m, width)
    for beams in itertools.product(range(p.size), repeat=width):
        assert law.get(beams, 0.0) == pytest.approx(np.prod(p[list(beams)]), abs=TOL)


# ---------------------------------------------------------------- greedy
def test_greedy_width_one_equals_greedy_tree_verifier() -> None:
    gen = torch.Generator().manual_seed(0)
    trees, rows = [], []
    for k in range(6):
        logits = torch.randn(5, 11, generator=gen)
        matches = k % 5  # the first ``matches`` drafts are the target's argmax
        tokens = [int(logits[i].argmax()) if i < matches else (int(logits[i].argmax()) + 1) % 11 for i in range(4)]
        trees.append(DraftTree.chain(tokens))
        rows.append(logits)
    starts = np.cumsum([0] + [5] * 5)
    target = torch.cat(rows)
    ours = DsbdVerifier(greedy=True).verify(trees, target, starts)
    reference = GreedyTreeVerifier().verify(trees, target, starts)
    assert ours.tokens == reference.tokens
    assert [a.tolist() for a in ours.accepted] == [a.tolist() for a in reference.accepted]


def target_rows(model: torch.nn.Module, context: list[int], tree: DraftTree) -> torch.Tensor:
    """Target logits at the root and every node, each from its own full sequence."""
    seqs = [context] + [context + tree.tokens[tree.path_to(n)].tolist() for n in range(tree.num_nodes)]
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([s])).logits[0, -1] for s in seqs]).float()


def make_drafter(draft: str, **options: object) -> DsbdDrafter:
    defaults = {name: option.default for name, option in DsbdDrafter.OPTIONS.items()}
    # unpruned greedy forests (max_width pairs a depth) unless a test prunes
    full = {**defaults, "num_speculative_tokens": 3, "max_nodes": 12, "prune_ratio": 0.0, "draft_model": draft}
    full.update(options)
    drafter = DsbdDrafter(full)
    drafter.use_runtime(ReferenceDraftRuntime(draft))
    return drafter


def decode(
    drafter: DsbdDrafter,
    verifier: DsbdVerifier,
    target: torch.nn.Module,
    prompt: list[int],
    steps: int,
    temperature: float = 0.0,
) -> tuple[list[int], list[int]]:
    """Run rounds of draft + verify; the committed tokens and tokens committed per round."""
    tokens, per_round = list(prompt), []
    for _ in range(steps):
        request = DraftRequest("r", np.asarray(tokens), drafter.options, temperature=temperature)
        tree = drafter.propose([request])[0]
        rows = target_rows(target, tokens, tree)
        if temperature:
            rows = torch.softmax(rows / temperature, dim=-1)
        verdict = verifier.verify([tree], rows, np.array([0]), [torch.Generator().manual_seed(len(tokens))])
        tokens += verdict.tokens[0]
        per_round.append(len(verdict.tokens[0]))
    return tokens[len(prompt) :], per_round


@pytest.fixture(scope="module")
def models(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    """A draft (the session's tiny model) and a target that mostly agrees with it (same
    weights, more attention mixing), with the same tokenizer."""
    from tiny_model import build_tiny_model
    from transformers import AutoModelForCausalLM

    target = build_tiny_model(tmp_path_factory.mktemp("tiny-target"), seed=0, mixing=0.007)
    return tiny_model, AutoModelForCausalLM.from_pretrained(target).eval()


PROMPT = [5, 17, 42, 8, 99, 23, 5, 17]


def test_greedy_width_one_decodes_like_the_target(models: tuple[str, torch.nn.Module]) -> None:
    draft, target = models
    ours, per_round = decode(make_drafter(draft, max_width=1), DsbdVerifier(greedy=True), target, PROMPT, 8)
    assert sum(per_round) > len(per_round)  # drafts were accepted: the comparison has teeth
    with torch.inference_mode():
        reference = target.generate(torch.tensor([PROMPT]), max_new_tokens=len(ours), do_sample=False)
    assert ours == reference[0, len(PROMPT) :].tolist()


def test_draft_equal_to_target_accepts_every_depth(tiny_model: str) -> None:
    """Draft = target: every pair passes at full width, greedy (beam search) and sampled alike."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for greedy, temperature in [(True, 0.0), (False, 1.0)]:
        drafter = make_drafter(tiny_model, max_width=3, width_threshold=0.9)
        _, per_round = decode(drafter, DsbdVerifier(greedy=greedy), target, PROMPT, 3, temperature)
        assert per_round == [4, 4, 4]


# ---------------------------------------------------------------- drafter
def test_drafter_forests_are_valid(models: tuple[str, torch.nn.Module]) -> None:
    draft, _ = models
    drafter = make_drafter(draft, max_width=4, top_k=20, num_speculative_tokens=4, max_nodes=14)
    request = DraftRequest("f", np.asarray(PROMPT), drafter.options, temperature=0.8)
    forest = drafter.propose([request])[0]
    assert isinstance(forest, BeamForest)
    assert forest.num_nodes == 14 and forest.max_depth == 4
    assert np.bincount(forest.depths).tolist() == [0, 4, 4, 4, 2]
    np.testing.assert_allclose(forest.draft_probs.sum(axis=1), 1, atol=1e-5)
    assert (forest.draft_probs[np.arange(14), forest.tokens] > 0).all()
    assert ((forest.draft_probs > 0).sum(axis=1) <= 20).all()
    inner = np.flatnonzero(forest.parents >= 0)
    np.testing.assert_array_equal(forest.draft_probs[inner], forest.next_probs[forest.parents[inner]])
    cut = forest.truncate(6)
    assert isinstance(cut, BeamForest) and cut.next_probs.shape[0] == 6
    greedy = drafter.propose([DraftRequest("g", np.asarray(PROMPT), drafter.options, temperature=0.0)])[0]
    assert greedy.draft_probs is None and greedy.num_nodes == 14
    for depth in range(1, 5):  # beam search: distinct pairs per depth
        level = np.flatnonzero(greedy.depths == depth)
        assert len(set(zip(greedy.parents[level], greedy.tokens[level]))) == level.size
    assert drafter.runtime.live_requests == 2
    drafter.remove_requests(["f", "g"])
    assert drafter.runtime.live_requests == 0


def test_sampling_probs_top_p_keeps_the_smallest_sufficient_prefix() -> None:
    probs = sampling_probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), 1.0, 0, 0.7)
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


# ---------------------------------------------------------------- batched drafting
CONTEXTS = {"x": PROMPT, "y": PROMPT[2:] + [61, 7, 33, 12, 90, 4], "z": [9, 9, 40] + PROMPT * 3}
OVERRIDES = {  # per-request options: widths, depths and nodes differ
    "x": {"max_width": 3, "num_speculative_tokens": 3, "max_nodes": 9},
    "y": {"max_width": 2, "num_speculative_tokens": 2, "max_nodes": 12},
    "z": {"max_width": 4, "num_speculative_tokens": 4, "max_nodes": 14, "top_k": 20},
}


def batch(drafter: DsbdDrafter, temperatures: dict[str, float], extra: int = 0) -> list[DraftRequest]:
    """One request per context (with ``extra`` more committed tokens), each with its own options."""
    return [
        DraftRequest(r, np.asarray(CONTEXTS[r] + PROMPT[:extra]), {**drafter.options, **OVERRIDES[r]}, temperature=t)
        for r, t in temperatures.items()
    ]


def path_tokens(forest: BeamForest, node: int) -> list[int]:
    """Tokens from the root to ``node`` (none for the root)."""
    return forest.tokens[forest.path_to(node)].tolist()


def draft_row(model: torch.nn.Module, request: DraftRequest, tokens: list[int]) -> np.ndarray:
    """The request's draft distribution after ``tokens``, encoded from scratch."""
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, -1:].float()
    options = request.options
    return sampling_probs(logits, request.temperature, options["top_k"], options["top_p"])[0].numpy()


def unpruned_widths(depth: int, max_width: int, max_nodes: int) -> list[int]:
    """Pairs per depth without pruning: ``max_width`` each until ``max_nodes`` runs out."""
    widths: list[int] = []
    while len(widths) < depth and sum(widths) < max_nodes:
        widths.append(min(max_width, max_nodes - sum(widths)))
    return widths


def test_pruned_greedy_forest_is_the_draft_beam_search_within_the_ratio(
    models: tuple[str, torch.nn.Module],
) -> None:
    """Every depth holds the draft's best pairs by joint log-probability (scored from
    scratch here) that are within ``prune_ratio`` of the best, at most ``max_width``,
    ``max_nodes`` in all; what pruning saves goes to deeper depths."""
    draft, _ = models
    sizes = {"max_width": 4, "num_speculative_tokens": 6, "max_nodes": 14}
    ratio = 0.3
    drafter = make_drafter(draft, **sizes, prune_ratio=ratio)
    forest = drafter.propose([DraftRequest("p", np.asarray(PROMPT), drafter.options, temperature=0.0)])[0]
    model = drafter.runtime.model
    live, scores, widths, node = [-1], [0.0], [], 0
    while len(widths) < sizes["num_speculative_tokens"] and node < sizes["max_nodes"]:
        with torch.inference_mode():
            logp = [
                torch.log_softmax(model(torch.tensor([PROMPT + path_tokens(forest, b)])).logits[0, -1].float(), -1)
                for b in live
            ]
        joint_scores = (torch.tensor(scores).unsqueeze(-1) + torch.stack(logp)).reshape(-1)
        width = min(sizes["max_width"], sizes["max_nodes"] - node)
        top, pairs = torch.topk(joint_scores, width)
        keep = top >= top[0] + np.log(ratio)
        level = np.flatnonzero(forest.depths == len(widths) + 1)
        vocab = len(logp[0])
        assert forest.tokens[level].tolist() == (pairs[keep] % vocab).tolist()
        assert forest.parents[level].tolist() == [live[int(b)] for b in pairs[keep] // vocab]
        live, scores = level.tolist(), top[keep].tolist()
        widths.append(len(level))
        node += len(level)
    assert forest.num_nodes == node and forest.max_depth == len(widths)
    unpruned = unpruned_widths(sizes["num_speculative_tokens"], sizes["max_width"], sizes["max_nodes"])
    assert min(widths) < sizes["max_width"] and len(widths) > len(unpruned)  # pruning took effect
    assert sum(widths[:-1]) <= most_fed(sizes["num_speculative_tokens"], sizes["max_width"], sizes["max_nodes"])


def test_most_fed_bounds_every_forest_of_its_sizes() -> None:
    """Brute force over every width pattern a forest of these sizes can have."""
    for depth, max_width, max_nodes in [(1, 4, 16), (3, 2, 5), (4, 3, 8), (5, 4, 16), (2, 1, 1)]:
        fed = 0
        for d in range(1, depth + 1):
            for widths in itertools.product(range(1, max_width + 1), repeat=d):
                if sum(widths) <= max_nodes:
                    fed = max(fed, sum(widths[:-1]))
        assert most_fed(depth, max_width, max_nodes) == fed


def test_greedy_forests_of_a_batch_equal_one_at_a_time(models: tuple[str, torch.nn.Module]) -> None:
    draft, _ = models
    together, alone = make_drafter(draft), make_drafter(draft)
    forwards = together.runtime.batches  # requests per draft call (one forward each in the engine)
    greedy = {"x": 0.0, "y": 0.0, "z": 0.0}
    for extra in (0, 3):  # a second step: caches rolled back and extended
        del forwards[:]
        batched = together.propose(batch(together, greedy, extra))
        # one forward for the sync, then one per depth over the requests still drafting
        assert forwards == [3, 3, 2, 1]
        for request, forest in zip(batch(alone, greedy, extra), batched):
            single = alone.propose([request])[0]
            np.testing.assert_array_equal(forest.tokens, single.tokens)
            np.testing.assert_array_equal(forest.parents, single.parents)
            assert forest.max_depth == request.options["num_speculative_tokens"]


def test_sampled_forests_of_a_batch_draw_from_the_draft_model(models: tuple[str, torch.nn.Module]) -> None:
    """Mixed sampled and greedy requests in one batch: every draft row is the
    draft model's distribution at the node's parent, encoded from scratch."""
    draft, _ = models
    temperatures = {"x": 0.7, "y": 0.0, "z": 1.3}
    drafter = make_drafter(draft, seed=5)
    forwards = drafter.runtime.batches
    forests = dict(zip(temperatures, drafter.propose(batch(drafter, temperatures))))
    assert forwards == [3, 3, 2, 1]
    model = drafter.runtime.model
    for request in batch(drafter, temperatures):
        forest, options = forests[request.req_id], request.options
        context = request.token_ids.tolist()
        widths = unpruned_widths(options["num_speculative_tokens"], options["max_width"], options["max_nodes"])
        assert forest.num_nodes == sum(widths) and forest.max_depth == len(widths)
        if not request.temperature:
            assert forest.draft_probs is None
            continue
        assert (forest.draft_probs[np.arange(forest.num_nodes), forest.tokens] > 0).all()
        for node, parent in enumerate(forest.parents):
            expected = draft_row(model, request, context + path_tokens(forest, int(parent)))
            np.testing.assert_allclose(forest.draft_probs[node], expected, atol=1e-5)
            if forest.depths[node] < forest.max_depth:
                expected = draft_row(model, request, context + path_tokens(forest, node))
                np.testing.assert_allclose(forest.next_probs[node], expected, atol=1e-5)
    again = make_drafter(draft, seed=5).propose(batch(drafter, temperatures))  # the seed fixes every draw
    for forest, repeat in zip(forests.values(), again):
        np.testing.assert_array_equal(forest.tokens, repeat.tokens)
        np.testing.assert_array_equal(forest.parents, repeat.parents)


# ---------------------------------------------------------------- in the engine, sampled, width > 1
DSBD_WIDE = {"method": "dsbd", "num_speculative_tokens": 3, "max_nodes": 12, "min_width": 1, "max_width": 3}
TEMPERATURE, TOP_P = 0.8, 0.8


def sampled(seed: int, max_tokens: int = 12):
    from vllm import SamplingParams

    return SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def _reseed_drafter(worker, seed: int) -> None:
    worker.model_runner.tree_drafter.generator.manual_seed(seed)


def test_in_engine_sampled_beams_run_reproducibly_within_the_targets_support(
    engines, tiny_model: str, near_draft: str
) -> None:
    """In-engine DSBD at temperature > 0 with up to 3 beams per depth.

    Lossy by design at width > 1 (the committed beam is drawn from the target's
    beam-sampling joint, not from the target's sequence law), so what is asserted
    is what the rule guarantees at any width: every committed token has mass in
    the target's sampling distribution at its row (here: inside the target's
    top-p nucleus, which the draft, sampling its whole vocabulary, often is
    not), and a seeded request replays token for token once the drafter is reseeded.
    """
    from conftest import counters_grown, runner_stats, token_ids
    from transformers import AutoModelForCausalLM

    llm = engines.get({**DSBD_WIDE, "model": near_draft})
    prompts = [make_prompts(10)[i] for i in (1, 4, 6, 8)]
    requests = [prompts[s % len(prompts)] for s in range(24)]
    before = runner_stats(llm)
    outputs = llm.generate(requests, [sampled(s) for s in range(24)], use_tqdm=False)
    after = runner_stats(llm)
    delta = counters_grown(before, after)
    assert delta["trees"] > 0 and delta["accepted"] > 0 and delta["nodes"] > delta["accepted"]
    assert delta["beam_width_sum"] > delta["beam_depths"] > 0  # some depth kept more than one beam

    # Reproducible: the drafts come from the drafter's one generator (its ``seed``
    # option), the target's draws from each request's seed; with the drafter
    # reseeded, a seeded request replays token for token. (A request's seed alone
    # does not fix its output: which draws its drafts get depends on the batch.)
    first = token_ids(outputs)
    for seed in range(3):
        replays = []
        for _ in range(2):
            llm.collective_rpc(_reseed_drafter, args=(11,))
            replays += token_ids(llm.generate(requests[seed : seed + 1], sampled(seed), use_tqdm=False))
        assert replays[0] == replays[1]
    assert len({tuple(t) for t, r in zip(first, requests) if r == prompts[0]}) > 1  # the seed matters

    # Every committed token is in the target's nucleus after its own prefix: the
    # tokens more likely than it hold less than TOP_P (vLLM's top-p rule).
    target = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    outside = 0
    for out in outputs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        with torch.inference_mode():
            logits = target(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1 : -1]
        probs = torch.softmax(logits / TEMPERATURE, dim=-1)
        chosen = probs.gather(-1, torch.tensor(out.outputs[0].token_ids).unsqueeze(-1))
        above = (probs * (probs > chosen)).sum(-1)
        outside += int((above >= TOP_P + 1e-4).sum())
    assert outside == 0


def test_in_engine_sampled_width_one_keeps_the_targets_distribution(engines, near_draft: str) -> None:
    """With one beam, beam sampling is ancestral sampling: the exact end-to-end test of
    ``test_sampling_engine`` applies (per-request ``max_width: 1`` on the wide engine)."""
    from conftest import runner_stats
    from test_sampling_engine import ALPHA, prefix_homogeneity, sample_sequences

    llm = engines.get({**DSBD_WIDE, "model": near_draft})
    prompt = make_prompts(10)[6]
    before = runner_stats(llm)
    ours = sample_sequences(llm, prompt, 0.8, extra_args={"max_width": 1}, num_samples=600)
    after = runner_stats(llm)
    assert after["accepted"] > before["accepted"]
    assert after["beam_width_sum"] - before["beam_width_sum"] == after["beam_depths"] - before["beam_depths"] > 0
    reference = sample_sequences(engines.get(None), prompt, 0.8, num_samples=600)
    assert prefix_homogeneity(ours, reference) > ALPHA


class _PromptTooLong:
    """A draft runtime whose first prompt does not fit (``sync_many`` gives None), the others do."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def sync_many(self, requests):
        return [None if k == 0 else torch.arange(self.vocab, dtype=torch.float32) for k in range(len(requests))]

    def extend_many(self, nodes):
        return [torch.arange(self.vocab, dtype=torch.float32).repeat(len(tokens), 1) for _, tokens, _ in nodes]

    def remove(self, req_ids):
        pass


def test_forests_skip_a_prompt_that_does_not_fit_and_draft_the_others():
    """The speculative beam search's drafting: a prompt the runtime cannot hold gets empty trees,
    and the next prompt still drafts from its own logits (greedy: the top token, vocab - 1)."""
    from vllm_specbeam.methods.dsbd.drafter import ForestRequest, draft_forests

    requests = [
        ForestRequest("a", [[1, 2, 3], [1, 2, 4]], [0.0, -1.0], 2),
        ForestRequest("b", [[5, 6]], [0.0], 2),
    ]
    forests = draft_forests(_PromptTooLong(8), requests, 1, None)
    assert [t.num_nodes for t in forests[0]] == [0, 0]
    assert forests[1][0].tokens.tolist() == [7, 7] and forests[1][0].parents.tolist() == [-1, 0]
