"""``mjsd``: the joint acceptance rule, the draft's beam search, the verifier, and the method inside vLLM.

Unit tests run the drafter on test_mcsd's fake runtime (logits a fixed
function of the drafted path) and the rule on hand-made distributions; the
engine tests run the in-worker draft on tiny models (see ``tiny_model.py``).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from conftest import greedy, runner_stats, token_ids
from test_mcsd import VOCAB, FakeRuntime, path_logits, with_args
from test_sampling_engine import ALPHA, prefix_homogeneity, sample_sequences, target_samples

from vllm_specbeam.core.config import TREE_OPTIONS, SpecbeamConfigError, parse
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.methods.mjsd.drafter import MjsdDrafter
from vllm_specbeam.methods.mjsd.maths import JointDraft, beam_proposal, joint_choice
from vllm_specbeam.methods.mjsd.verifier import MjsdGreedyVerifier, MjsdVerifier


# ---------------------------------------------------------------- the joint rule
def chain(logq: list[float], threshold: float = 0.9) -> JointDraft:
    n = len(logq)
    return JointDraft(np.arange(n), np.arange(n) - 1, None, np.asarray(logq), threshold)


def test_the_longest_passing_prefix_is_accepted() -> None:
    """The module's worked example: log P = [-0.1, -2.1, -2.2]."""
    token_logp = np.asarray([-0.1, -2.0, -0.1])
    assert joint_choice(chain([-0.2, -1.0, -2.0]), token_logp) == 0
    assert joint_choice(chain([-0.2, -2.2, -2.25]), token_logp) == 2
    certain = chain([0.0, 0.0, 0.0])  # a draft sure of every token: log P - log Q = log P
    assert joint_choice(certain, token_logp) == 0  # -0.1 >= log 0.9 = -0.105
    assert joint_choice(certain, np.asarray([-0.2, -2.0, -0.1])) == ROOT


def test_a_prefix_passes_after_a_shorter_one_failed() -> None:
    """L = max{i : P/Q >= tau}: node 1 fails (-1.0), node 2 passes again (0.0)."""
    token_logp = np.asarray([-0.1, -2.0, -0.1])
    assert joint_choice(chain([-0.1, -1.1, -2.2]), token_logp) == 2
    assert joint_choice(chain([-0.1, -1.1, -1.0]), token_logp) == 0


def test_threshold_bounds_the_ratio() -> None:
    token_logp = np.log([0.5, 0.5])
    logq = np.log([0.8, 0.8 * 0.8]).tolist()  # P/Q = 0.625, then 0.39
    assert joint_choice(chain(logq, threshold=0.6), token_logp) == 0
    assert joint_choice(chain(logq, threshold=0.3), token_logp) == 1
    assert joint_choice(chain(logq, threshold=0.7), token_logp) == ROOT


def test_a_token_the_target_cannot_produce_never_passes() -> None:
    """Threshold 0 accepts any prefix, but not one with P = 0 (e.g. outside the target's top-k)."""
    assert joint_choice(chain([-5.0, -9.0, -12.0], threshold=0.0), np.asarray([-1.0, -1.0, -1.0])) == 2
    assert joint_choice(chain([-5.0, -9.0, -12.0], threshold=0.0), np.asarray([-1.0, -np.inf, -1.0])) == 0


def test_the_tree_variant_keeps_the_best_passing_beam() -> None:
    """Beams [a, b] and [a, c] (nodes 1 and 2): the deeper passing node wins;
    between passing nodes of one depth, the higher target joint."""
    tree = JointDraft(np.asarray([3, 4, 5]), np.asarray([-1, 0, 0]), None, np.log([0.5, 0.25, 0.2]), 0.9)
    assert joint_choice(tree, np.log([0.5, 0.5, 0.4])) == 1  # both pass: log P -1.39 vs -1.61
    assert joint_choice(tree, np.log([0.5, 0.3, 0.45])) == 2  # node 1 fails (0.15/0.25)
    assert joint_choice(tree, np.log([0.5, 0.1, 0.1])) == 0  # only the shared first token passes


# ---------------------------------------------------------------- the proposal
def test_beams_merge_into_one_tree_best_first() -> None:
    """The docstring's example, plus a beam sampled twice counted once."""
    tree = beam_proposal([5, 7, 8], [-1, 0, 0], [-0.1, -0.3, -0.9], 2, 16, 0.9)
    assert tree.tokens.tolist() == [5, 7, 8] and tree.parents.tolist() == [-1, 0, 0]
    assert tree.joint_logq.tolist() == [-0.1, -0.3, -0.9]
    twice = beam_proposal([5, 7, 7, 8], [-1, 0, 0, 0], [-0.1, -0.3, -0.3, -0.9], 2, 16, 0.9)
    assert twice.tokens.tolist() == [5, 7, 8]
    worse_first = beam_proposal([5, 6, 7, 8], [-1, -1, 0, 1], [-0.5, -0.2, -2.0, -0.4], 1, 16, 0.9)
    assert worse_first.tokens.tolist() == [6, 8] and worse_first.joint_logq.tolist() == [-0.2, -0.4]
    assert beam_proposal([5, 6, 7, 8], [-1, -1, 0, 1], [-0.5, -0.2, -2.0, -0.4], 2, 3, 0.9).num_nodes == 3


def options(**overrides) -> dict:
    values = {name: option.default for name, option in {**TREE_OPTIONS, **MjsdDrafter.OPTIONS}.items()}
    values.update({"draft_model": "draft", "num_speculative_tokens": 3, "max_nodes": 16, **overrides})
    MjsdDrafter.check_options(values)
    return values


def propose(runtime: FakeRuntime, temperature: float = 0.0, **overrides) -> DraftTree:
    drafter = MjsdDrafter(options(**overrides))
    drafter.use_runtime(runtime)
    return drafter.propose([DraftRequest("r", np.asarray([5, 6]), drafter.options, temperature)])[0]


def joint_logq(path: tuple[int, ...]) -> float:
    """The draft's joint log-probability of ``path`` (temperature 1), by definition."""
    return sum(float(torch.log_softmax(path_logits(path[:i], 99), -1)[path[i]]) for i in range(len(path)))


def test_beam_search_scores_are_the_drafts_joint_and_an_exhaustive_search_finds_the_best() -> None:
    """With VOCAB² beams the search keeps every prefix of depth 2, so its best
    depth-3 beam is the brute-force argmax over all VOCAB³ sequences."""
    best = max(itertools.product(range(VOCAB), repeat=3), key=joint_logq)
    tree = propose(FakeRuntime(), beam_width=VOCAB**2)
    assert isinstance(tree, JointDraft) and tree.is_chain
    assert tuple(tree.tokens.tolist()) == best
    for node in range(3):
        assert tree.joint_logq[node] == pytest.approx(joint_logq(best[: node + 1]), abs=1e-5)
    narrow = propose(FakeRuntime(), beam_width=2, num_beams_verified=2)
    assert narrow.max_depth == 3 and 3 < narrow.num_nodes <= 6
    for node in range(narrow.num_nodes):
        path = tuple(int(narrow.tokens[n]) for n in narrow.path_to(node))
        assert narrow.joint_logq[node] == pytest.approx(joint_logq(path), abs=1e-5)
    first = tuple(narrow.tokens[:3].tolist())  # the best beam is the first branch
    leaves = [n for n in range(narrow.num_nodes) if narrow.depths[n] == 3]
    assert joint_logq(first) == max(joint_logq(tuple(narrow.tokens[narrow.path_to(n)].tolist())) for n in leaves)


def test_a_beam_is_fed_at_every_depth_but_the_last() -> None:
    runtime = FakeRuntime()
    propose(runtime, beam_width=4, num_speculative_tokens=4)
    assert runtime.fed == [4, 4, 4]
    assert MjsdDrafter.draft_slots(options(beam_width=4, num_speculative_tokens=4, max_nodes=4)) == 12


def test_block_mode_drafts_one_chain_with_its_q_rows() -> None:
    sampled = propose(FakeRuntime(), temperature=1.0, verify="block")
    assert not isinstance(sampled, JointDraft) and sampled.is_chain and sampled.num_nodes == 3
    for node in range(3):
        parent_path = tuple(int(t) for t in sampled.tokens[:node])
        expected = torch.softmax(path_logits(parent_path, 99), -1)
        np.testing.assert_allclose(sampled.draft_probs[node], expected, rtol=1e-6)
    greedy_chain = propose(FakeRuntime(), verify="block")
    assert greedy_chain.draft_probs is None
    assert greedy_chain.tokens[0] == int(path_logits((), 99).argmax())


def test_sampled_requests_score_beams_at_their_temperature() -> None:
    hot = propose(FakeRuntime(), temperature=2.0, beam_width=1)
    path = tuple(hot.tokens.tolist())
    expected = sum(float(torch.log_softmax(path_logits(path[:i], 99) / 2.0, -1)[path[i]]) for i in range(3))
    assert hot.joint_logq[-1] == pytest.approx(expected, abs=1e-5)
    sampled = propose(FakeRuntime(), temperature=1.0, draft_sampling=True, num_beams_verified=2)
    assert isinstance(sampled, JointDraft) and sampled.max_depth == 3


# ---------------------------------------------------------------- the verifier
def test_greedy_verifier_commits_the_accepted_prefix_and_the_argmax_after_it() -> None:
    """Node 0 (token 1) is the target's second choice but passes the joint rule; node 1 fails."""
    logits = torch.full((3, 4), -10.0)
    logits[0, :2] = torch.tensor([math.log(0.55), math.log(0.45)])  # root: token 0 slightly ahead
    logits[1, 2] = 5.0  # after token 1: token 2 almost surely, the draft said 3
    logits[2, 0] = 5.0
    tree = JointDraft(np.asarray([1, 3]), np.asarray([-1, 0]), None, np.log([0.45, 0.45 * 0.9]), 0.9)
    verdict = MjsdGreedyVerifier().verify([tree], logits, np.asarray([0]))
    assert verdict.accepted[0].tolist() == [0] and verdict.tokens[0] == [1, 2]
    assert verdict.off_argmax == [1]  # token 1 was not the argmax at the root


def test_block_drafts_and_empty_drafts_get_the_exact_rules() -> None:
    """In one batch: a joint draft, a plain chain (greedy matching), an empty draft."""
    logits = torch.zeros(6, 4)
    for row, best in enumerate([2, 3, 1, 0, 1, 3]):
        logits[row, best] = 9.0
    joint = JointDraft(np.asarray([2]), np.asarray([-1]), None, np.asarray([0.0]), 0.9)
    exact = DraftTree.chain([0, 1])  # rows 2-4: the argmax is 1, so node 0 is rejected
    verdict = MjsdGreedyVerifier().verify([joint, exact, DraftTree.empty()], logits, np.asarray([0, 2, 5]))
    assert [a.tolist() for a in verdict.accepted] == [[0], [], []]
    assert verdict.tokens == [[2, 3], [1], [3]]


def test_sampled_verifier_draws_the_next_token_from_p_at_the_accepted_node() -> None:
    probs = torch.tensor([[0.1, 0.9, 0.0], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    tree = JointDraft(np.asarray([1]), np.asarray([-1]), None, np.log([0.95]), 0.9)
    draws = [
        MjsdVerifier().verify([tree], probs, np.asarray([0]), [torch.Generator().manual_seed(s)]).tokens[0]
        for s in range(200)
    ]
    assert all(d[0] == 1 for d in draws)
    share = sum(d[1] == 2 for d in draws) / len(draws)
    assert 0.35 < share < 0.65  # p at the accepted node is (0, 0.5, 0.5)


# ---------------------------------------------------------------- options
def test_bad_options_name_the_fix() -> None:
    config = parse({"method": "mjsd", "model": "/d", "beam_width": 4, "num_speculative_tokens": 3, "max_nodes": 6})
    assert config.with_overrides({"threshold": 0.5, "beam_width": 2})["beam_width"] == 2
    with pytest.raises(SpecbeamConfigError, match="per-request beam_width=8 exceeds the engine's beam_width=4"):
        config.with_overrides({"beam_width": 8})
    with pytest.raises(SpecbeamConfigError, match="num_beams_verified=3 exceeds beam_width=2"):
        config.with_overrides({"beam_width": 2, "num_beams_verified": 3})
    with pytest.raises(SpecbeamConfigError, match=r"option 'threshold' must be in \[0.0, 1.0\], got 1.5"):
        config.with_overrides({"threshold": 1.5})


# ---------------------------------------------------------------- inside vLLM
MJSD = {"method": "mjsd", "num_speculative_tokens": 4, "max_nodes": 8, "beam_width": 4}


def test_draft_equal_to_target_with_one_beam_is_greedy_decoding(engines, tiny_model, prompts, reference) -> None:
    """P = Q on every prefix: the joint rule accepts the whole greedy chain, token for token greedy decoding."""
    llm = engines.get({**MJSD, "model": tiny_model, "beam_width": 1})
    before = runner_stats(llm)
    assert token_ids(llm.generate(prompts, greedy())) == reference
    assert [token_ids(llm.generate([p], greedy()))[0] for p in prompts[:2]] == reference[:2]
    after = runner_stats(llm)
    assert after["trees"] > before["trees"]
    assert after["accepted"] - before["accepted"] == after["nodes"] - before["nodes"]  # every drafted node
    assert after["accepted_off_argmax"] == before["accepted_off_argmax"]


@pytest.fixture(scope="module")
def mjsd(engines, near_draft):
    return engines.get({**MJSD, "model": near_draft})


def off_argmax_tokens(llm, outputs) -> int:
    """How many of the outputs' tokens are not the target's argmax after the tokens before them:
    the target scores each output as a prompt (``prompt_logprobs``), rank 1 is its argmax."""
    from vllm import SamplingParams, TokensPrompt

    scored = [TokensPrompt(prompt_token_ids=[*o.prompt_token_ids, *o.outputs[0].token_ids]) for o in outputs]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    count = 0
    for out, row in zip(outputs, llm.generate(scored, params, use_tqdm=False)):
        tokens, start = row.prompt_token_ids, len(out.prompt_token_ids)
        count += sum(row.prompt_logprobs[i][tokens[i]].rank != 1 for i in range(start, len(tokens)))
    return count


def test_joint_rule_accepts_what_greedy_matching_would_not(engines, mjsd, prompts, reference) -> None:
    """Beams of 4 with the tree variant: outputs leave greedy decoding where the joint rule
    accepted a non-argmax token, and the counters say how often: every committed token that is
    not the target's argmax is one the joint rule accepted (the bonus token is the argmax)."""
    before = runner_stats(mjsd)
    outputs = mjsd.generate(prompts, with_args(greedy(), {"num_beams_verified": 2}))
    after = runner_stats(mjsd)
    assert after["accepted"] > before["accepted"] and after["accepted_off_first_branch"] > 0
    off_argmax = after["accepted_off_argmax"] - before["accepted_off_argmax"]
    assert off_argmax > 0 and token_ids(outputs) != reference
    assert off_argmax_tokens(engines.get(None), outputs) == off_argmax


def test_block_mode_is_greedy_exact_and_samples_the_target(engines, mjsd, prompts, reference) -> None:
    block = {"verify": "block"}
    assert token_ids(mjsd.generate(prompts, with_args(greedy(), block))) == reference
    prompt = prompts[6]
    before = runner_stats(mjsd)
    ours = sample_sequences(mjsd, prompt, 1.0, extra_args=block)
    after = runner_stats(mjsd)
    assert after["accepted"] > before["accepted"]
    assert after["accepted_off_argmax"] == before["accepted_off_argmax"]  # no joint rule ran
    # test_sampling_engine's per-position statistic against the session's samples without speculation
    assert prefix_homogeneity(ours, target_samples(engines, prompt, 1.0)) > ALPHA
