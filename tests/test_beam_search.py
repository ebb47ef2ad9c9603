"""Speculative beam search: vLLM's beam search output, fewer target passes.

Also the mechanism under it: a draft tree appended to a prompt is scored in
one prefill exactly as linear prompts would be, and its cache blocks never
serve another request.
"""

from __future__ import annotations

import itertools
import math

import pytest
from conftest import make_prompts

DEPTH = 3


def dsbd(draft: str) -> dict:
    return {"method": "dsbd", "model": draft, "num_speculative_tokens": DEPTH, "max_nodes": 16}


ENGINE = {"block_size": 32, "enable_prefix_caching": True, "enable_chunked_prefill": False}


@pytest.fixture(scope="module")
def llm(engines, near_draft):
    """Target: the session's tiny model; draft: one whose beams are often, not always, the target's."""
    return engines.get(dsbd(near_draft), **ENGINE)


def top_logprobs(output, k: int) -> dict[int, float]:
    return {t: lp.logprob for t, lp in output.items() if lp.rank <= k}


# ---------------------------------------------------------------- tree prompts
def test_tree_prompt_rows_equal_linear_prompts(llm):
    """Every row of a tree appended to a prompt has the distribution the
    target gives the linear prompt ending at that node."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specbeam.adapter import tree_prompt
    from vllm_specbeam.core.tree import ROOT, DraftTree

    k = 6
    prompt = llm.get_tokenizer().encode(make_prompts(4)[2])
    tree = DraftTree([11, 12, 13, 14, 15, 16], [ROOT, 0, ROOT, 2, 2, 1])  # two branches, a fork, depths 1-3
    scored = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt + tree.tokens.tolist())],
        SamplingParams(**tree_prompt.request_params(tree.parents, k)),
        use_tqdm=False,
    )[0]
    rows = tree_prompt.row_logprobs(scored, tree.num_nodes)
    # logprobs at the tree's rows only (vLLM's first entry, None, then root and nodes 0-4),
    # none at the prompt's other rows
    assert len(scored.prompt_logprobs) == 1 + tree.num_nodes
    paths = [[]] + [tree.tokens[tree.path_to(n)].tolist() for n in range(tree.num_nodes)]
    linear = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt + p) for p in paths],
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=k),
        use_tqdm=False,
    )
    assert len(rows) == len(paths) == 7
    for row, reference in zip(rows, linear):
        expected = top_logprobs(reference.outputs[0].logprobs[0], k)
        got = top_logprobs(row, k)
        assert set(got) == set(expected)
        for token, logprob in expected.items():
            assert got[token] == pytest.approx(logprob, abs=2e-4)


def test_tree_rows_never_serve_a_linear_prompt_from_the_cache(llm):
    """A linear prompt with the same tokens as a scored tree (flattened) must
    not reuse the tree's cache blocks: their keys have tree positions."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specbeam.adapter import tree_prompt
    from vllm_specbeam.core.tree import ROOT

    prompt = llm.get_tokenizer().encode(make_prompts(5)[3])
    # 40 tree rows: the flattened tree fills a whole cache block (block size 32)
    parents = [ROOT if i % 4 == 0 else i - 1 for i in range(40)]  # ten branches of four
    tokens = [3 + (7 * i) % 97 for i in range(40)]
    k = 4
    llm.generate(
        [TokensPrompt(prompt_token_ids=prompt + tokens)],
        SamplingParams(**tree_prompt.request_params(parents, k)),
        use_tqdm=False,
    )
    linear = TokensPrompt(prompt_token_ids=prompt + tokens)
    cached = llm.generate([linear], SamplingParams(max_tokens=1, temperature=0.0, logprobs=k), use_tqdm=False)[0]
    fresh = llm.generate(
        [linear],
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, skip_reading_prefix_cache=True),
        use_tqdm=False,
    )[0]
    expected = top_logprobs(fresh.outputs[0].logprobs[0], k)
    got = top_logprobs(cached.outputs[0].logprobs[0], k)
    assert set(got) == set(expected)
    assert all(got[t] == pytest.approx(v, abs=2e-4) for t, v in expected.items())


def test_bad_tree_prompt_fails_that_request_only(llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_specbeam.adapter.tree_prompt import TREE_PARENTS_KEY

    bad = {
        "topological order": SamplingParams(
            max_tokens=1, prompt_logprobs=2, skip_reading_prefix_cache=False, extra_args={TREE_PARENTS_KEY: [0]}
        ),
        "needs prompt_logprobs": SamplingParams(max_tokens=1, extra_args={TREE_PARENTS_KEY: [-1]}),
        "must be a list of ints": SamplingParams(max_tokens=1, extra_args={TREE_PARENTS_KEY: "x"}),
    }
    for message, params in bad.items():
        with pytest.raises(VLLMValidationError, match=f"vllm-specbeam: .*{message}"):
            llm.generate(["w1 w2 w3"], params, use_tqdm=False)
    assert (
        llm.generate(["w1 w2 w3"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


# ---------------------------------------------------------------- the search
def _count_search_forwards(worker) -> None:
    """Log the rows of every forward of the worker's beam-search draft."""
    runtime = worker.model_runner.search_draft_runtime
    runtime.batches = []
    forward = type(runtime)._forward.__get__(runtime)  # the method, not an earlier test's wrapper

    def counted(feeds, last_only):
        if feeds:  # an empty call runs no forward
            runtime.batches.append(len(feeds))
        return forward(feeds, last_only)

    runtime._forward = counted


def _search_batches(worker) -> list[int]:
    return worker.model_runner.search_draft_runtime.batches


def assert_same_search(ours, theirs) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences):
            assert x.cum_logprob == pytest.approx(y.cum_logprob, abs=1e-3)
            assert x.text == y.text and len(x.logprobs) == len(y.logprobs)


@pytest.mark.parametrize("width,ignore_eos,scoring", [(2, True, "per-beam"), (3, False, "auto"), (3, True, "shared")])
def test_speculative_beam_search_equals_vllm_beam_search(llm, width, ignore_eos, scoring):
    """Each beam scored as its own request, or a prompt's beams as one tree below their common
    prefix (their tails as tree rows), or whichever computes fewer rows: vLLM's beams each time."""
    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter.beam_search import SpeculativeBeamSearch

    prompts = make_prompts(5, seed=1)  # at width 3, prompt 0 has EOS-completed beams among its best
    params = BeamSearchParams(beam_width=width, max_tokens=24, ignore_eos=ignore_eos)
    search = SpeculativeBeamSearch(llm, scoring=scoring)
    llm.collective_rpc(_count_search_forwards)
    ours = search.run(prompts, params)
    batches = llm.collective_rpc(_search_batches)[0]
    theirs = llm.beam_search(prompts, params)
    assert_same_search(ours, theirs)
    # forced: every round after a prompt's first (one beam) is shared, or none is
    shared = search.stats.shared_rounds
    if scoring == "per-beam":
        assert shared == 0
    elif scoring == "shared":
        assert shared == search.stats.prompt_rounds - len(prompts)
    else:
        assert shared > 0
    assert search.stats.steps == 24 * len(prompts) or not ignore_eos
    assert ignore_eos or any(s.tokens[-1] == llm.get_tokenizer().eos_token_id for o in theirs for s in o.sequences)
    # some drafted depths were accepted and some not: the comparison has teeth
    assert 1 < search.stats.steps_per_round < DEPTH + 1
    # every round drafts the engine's depth, less only in a prompt's last DEPTH tokens (at most
    # DEPTH rounds a prompt, each advancing at least one step)
    full_rounds = search.stats.prompt_rounds - DEPTH * len(prompts)
    assert DEPTH * full_rounds <= search.stats.drafted_depths <= DEPTH * search.stats.prompt_rounds
    # the prompts are drafted together: one draft forward per depth for all of them
    assert max(batches) == len(prompts) and len(batches) < search.stats.rounds * (DEPTH + 1) + len(prompts)


#: vLLM's default chunked prefill, with chunks of 64 tokens: every prompt but the shortest is split
CHUNKED_ENGINE = {**ENGINE, "enable_chunked_prefill": True, "max_num_batched_tokens": 64, "max_num_seqs": 16}


def test_speculative_beam_search_under_chunked_prefill_equals_vllm_beam_search(engines, near_draft):
    """The plugin's scheduler never ends a prefill chunk inside a tree, so the search is exact with
    vLLM's chunked prefill on (prompts of 9-140 words, 64-token chunks); a tree that cannot fit
    one chunk fails its request."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter import tree_prompt
    from vllm_specbeam.adapter.beam_search import SpeculativeBeamSearch

    llm = engines.get(dsbd(near_draft), **CHUNKED_ENGINE)
    assert llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill
    prompts = [make_prompts(7, seed=2)[i] for i in (1, 3, 4, 6)]
    assert max(len(llm.get_tokenizer().encode(p)) for p in prompts) > 2 * 64
    params = BeamSearchParams(beam_width=2, max_tokens=16, ignore_eos=True)
    search = SpeculativeBeamSearch(llm)
    assert_same_search(search.run(prompts, params), llm.beam_search(prompts, params))
    assert search.stats.steps_per_round > 1
    too_big = SamplingParams(**tree_prompt.request_params([-1] + list(range(64)), 2))
    with pytest.raises(VLLMValidationError, match=r"66 rows\) in one prefill chunk"):
        llm.generate([{"prompt_token_ids": list(range(3, 100))}], too_big, use_tqdm=False)


def test_shared_tree_holds_every_beam_and_its_tree_below_the_common_prefix():
    """Every row a beam reads from the shared tree is the node whose path from the root is that
    beam's tail, then its tree's path to the node; equal prefixes are one node."""
    import numpy as np

    from vllm_specbeam.adapter.tree_prompt import shared_tree
    from vllm_specbeam.core.tree import ROOT, DraftTree

    example = shared_tree([[5, 7, 8, 2], [5, 7, 9, 4]], [DraftTree.chain([1, 2, 3]), DraftTree.chain([6])])
    assert (example.prefix_len, example.tokens, example.parents) == (
        2,
        [8, 2, 1, 2, 3, 9, 4, 6],
        [-1, 0, 1, 2, 3, -1, 5, 6],
    )
    assert example.rows == [[2, 3, 4, 5], [7, 8]] and example.num_tail_nodes == 4

    def path(tree, node):
        return [int(t) for t in tree.tokens[tree.path_to(node)]]

    rng = np.random.default_rng(0)
    for _ in range(200):
        stem = rng.integers(0, 4, rng.integers(1, 6)).tolist()
        beams = [stem + rng.integers(0, 3, rng.integers(0, 4)).tolist() for _ in range(rng.integers(1, 5))]
        trees = []
        for _ in beams:
            parents = [int(rng.integers(ROOT, i)) if i else ROOT for i in range(rng.integers(0, 6))]
            trees.append(DraftTree(rng.integers(0, 3, len(parents)), parents))
        shared = shared_tree(beams, trees)
        scored = DraftTree(shared.tokens, shared.parents)
        prefix = beams[0][: shared.prefix_len]
        assert shared.prefix_len >= len(stem) and all(b[: shared.prefix_len] == prefix for b in beams)
        # the longest prefix they share: a beam ends there, or two beams differ there
        assert any(len(b) == shared.prefix_len for b in beams) or len({b[shared.prefix_len] for b in beams}) > 1
        assert all(p < i for i, p in enumerate(shared.parents))
        assert len(set(zip(shared.parents, shared.tokens))) == shared.num_nodes  # no node twice
        for beam, tree, rows in zip(beams, trees, shared.rows):
            assert len(rows) == tree.num_nodes + 1
            tail = beam[shared.prefix_len :]
            assert path(scored, rows[0] - 1) == tail
            for node, row in enumerate(rows[1:]):
                assert path(scored, row - 1) == tail + path(tree, node)


def test_prefill_chunks_end_before_a_tree_or_after_it():
    """Chunks of any size from the scheduler's budget: the chunk holding a tree's root also holds
    its last row, and the prompt is still computed in full."""
    from vllm_specbeam.adapter.tree_prompt import whole_tree_chunk

    assert [whole_tree_chunk(10, 3, 0, 8), whole_tree_chunk(10, 3, 6, 4), whole_tree_chunk(10, 3, 6, 3)] == [6, 4, 0]
    for prompt, nodes in [(10, 3), (40, 12), (7, 6), (33, 0)]:
        root = prompt - nodes - 1
        for budget in range(nodes + 1, prompt + 2):
            start, chunks = 0, []
            while start < prompt:
                take = whole_tree_chunk(prompt, nodes, start, min(budget, prompt - start))
                assert take > 0
                chunks.append((start, start + take))
                start += take
            assert any(a <= root and b == prompt for a, b in chunks), (prompt, nodes, budget, chunks)
            assert chunks[0][0] == 0 and all(b == c for (_, b), (c, _) in itertools.pairwise(chunks))


def test_shared_prefix_ends_at_the_first_block_keyed_to_the_request():
    """The engine's draft skips a scoring request's rows from ``shared_prefix_len`` on: exactly
    the full blocks :func:`block_hash_extra_keys` keys to the request, which no prefix hit reads."""
    from types import SimpleNamespace

    from vllm_specbeam.adapter.tree_prompt import TREE_PARENTS_KEY, block_hash_extra_keys, shared_prefix_len

    assert shared_prefix_len(100, 9, 32) == 64  # the docstring's example
    keys = block_hash_extra_keys(lambda request, start, end, mm: (None, mm))
    for prompt, nodes, block in [(100, 9, 32), (96, 31, 32), (97, 0, 32), (40, 7, 16), (300, 20, 128), (33, 31, 1)]:
        request = SimpleNamespace(
            request_id="r",
            num_prompt_tokens=prompt,
            sampling_params=SimpleNamespace(extra_args={TREE_PARENTS_KEY: [-1] * nodes}),
        )
        own = [keys(request, b * block, (b + 1) * block, 0)[0] is not None for b in range(prompt // block)]
        shared = shared_prefix_len(prompt, nodes, block)
        assert shared % block == 0 and own == [(b + 1) * block > shared for b in range(prompt // block)], (
            prompt,
            nodes,
            block,
        )


def test_worker_drafting_needs_no_insecure_serialization(engines, near_draft, monkeypatch):
    """The rounds' calls into the worker carry plain lists, so a default engine (vLLM refuses
    pickled objects unless VLLM_ALLOW_INSECURE_SERIALIZATION, which the other tests set) searches."""
    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter.beam_search import SpeculativeBeamSearch, WorkerForests

    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    llm = engines.get(dsbd(near_draft), own_process=True, **ENGINE)  # an engine core of its own, without it
    search = SpeculativeBeamSearch(llm)
    assert isinstance(search.forests, WorkerForests)
    prompts = make_prompts(3, seed=3)
    params = BeamSearchParams(beam_width=2, max_tokens=12, ignore_eos=True)
    assert_same_search(search.run(prompts, params), llm.beam_search(prompts, params))
    assert search.stats.steps_per_round > 1


def test_draft_equal_to_target_advances_the_whole_depth(engines, tiny_model):
    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter.beam_search import SpeculativeBeamSearch

    llm = engines.get(dsbd(tiny_model), **ENGINE)
    prompts = make_prompts(3)
    params = BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True)
    search = SpeculativeBeamSearch(llm)
    assert_same_search(search.run(prompts, params), llm.beam_search(prompts, params))
    assert search.stats.steps_per_round >= DEPTH  # (DEPTH + 1) per round but for float near-ties
    assert search.stats.rounds <= math.ceil(20 / DEPTH)


def test_speculative_beam_search_refuses_what_it_cannot_do(engines, llm):
    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter.beam_search import SpeculativeBeamSearch
    from vllm_specbeam.core.config import SpecbeamConfigError

    with pytest.raises(ValueError, match="temperature must be 0"):
        SpeculativeBeamSearch(llm).run(["w1 w2"], BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5))
    with pytest.raises(SpecbeamConfigError, match="dsbd"):
        SpeculativeBeamSearch(engines.get(None))


def test_server_path_speculates_only_where_it_is_exact():
    """Which use_beam_search requests the server's patched method sends to the
    speculative search (``None``) and which to vLLM's own loop (a reason)."""
    from types import SimpleNamespace

    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter.beam_search_server import fallback_reason
    from vllm_specbeam.adapter.engine_config import SCHEDULER, with_plugin_config
    from vllm_specbeam.core.config import SpecbeamConfig

    def client(method="dsbd", chunked=False, prefix=True, scheduler=SCHEDULER):
        options = {"num_speculative_tokens": 4, "max_nodes": 16}
        extra = {} if method is None else with_plugin_config(None, SpecbeamConfig(method, options))
        return SimpleNamespace(
            vllm_config=SimpleNamespace(
                additional_config=extra,
                scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked, scheduler_cls=scheduler),
                cache_config=SimpleNamespace(enable_prefix_caching=prefix),
            )
        )

    greedy, sampled = (
        BeamSearchParams(beam_width=2, max_tokens=4),
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=1.0),
    )
    tokens = {"type": "token", "prompt_token_ids": [1, 2]}
    assert fallback_reason(client(), tokens, greedy) is None
    assert fallback_reason(client(None), tokens, greedy) == "no vllm-specbeam method"
    assert "dsbd method" in fallback_reason(client("aded"), tokens, greedy)
    assert fallback_reason(client(chunked=True), tokens, greedy) is None  # vLLM's default
    assert "scheduler_cls=my.Scheduler" in fallback_reason(
        client(chunked=True, scheduler="my.Scheduler"), tokens, greedy
    )
    assert fallback_reason(client(scheduler="my.Scheduler"), tokens, greedy) is None
    assert "prefix cach" in fallback_reason(client(prefix=False), tokens, greedy)
    assert "temperature" in fallback_reason(client(), tokens, sampled)
    assert "embeds" in fallback_reason(client(), {"type": "embeds"}, greedy)
