"""Features off the tree path, in one batch with plain requests on a tree engine.

Penalties, min-p, logit bias, min-tokens and structured output depend on the tokens before each
row, which a tree does not have in one sequence: the runner decodes such
requests without speculation (``request_supports_trees``). Here they share one
``generate`` call with plain greedy requests, which must still be drafted and
accepted, and every request's tokens must equal the engine's without
speculation. A spy on the drafter (installed in the worker) records the
requests it was asked for, so the test also sees that the off-tree requests
were never drafted (with ``request_supports_trees`` planted to say yes, the
presence-penalty request is drafted and the test fails). ``logprobs`` and
``n > 1`` are no reason to leave the tree path: they are drafted, with the
same tokens and log-probs (``n > 1`` needs sampling: top-k 1 makes it
deterministic; it also covers steps where no request drafts, which vLLM's
rejection sampler cannot take with a top-k request).

The model is the tiny random llama with JSON's characters added to its
vocabulary, so structured output can use a JSON schema.

``min_p`` and ``logit_bias``, which vLLM 0.32 refuses with any speculative
config (sampling_params.py ``_validate_spec_decode``), are allowed on plugin
engines (patch 9 in adapter/plugin.py) and tested here like the others.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Engines, make_prompts, runner_stats
from specs import ADED, LOOKUP
from tiny_model import VOCAB_WORDS, build_tiny_model

JSON_TOKENS = ["{", "}", '"', ":", ",", "a", "b", *"0123456789"]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
MAX_TOKENS = 32
#: prompt tokens the spy keeps per drafted request (enough to tell the test's prompts apart)
PREFIX = 24
LOGPROB_TOLERANCE = 1e-3


def build_json_model(path: Path) -> Path:
    """The tiny model (its ``w`` words) plus one token per JSON character, ids after the words."""
    build_tiny_model(path, vocab_size=VOCAB_WORDS + 3 + len(JSON_TOKENS))
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for token in JSON_TOKENS:
        vocab[token] = len(vocab)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


@pytest.fixture(scope="module")
def json_engines(tmp_path_factory: pytest.TempPathFactory) -> Engines:
    """Its own pool (the session's ``engines`` serve the plain tiny model); closed with the module."""
    return Engines(str(build_json_model(tmp_path_factory.mktemp("tiny-json"))))


def mixed_batch() -> list[tuple[str, object]]:
    """(name, SamplingParams) of every request in the batch; names starting with
    ``plain`` or ``tree`` are on the tree path, the others are not."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def greedy(**kwargs: object) -> SamplingParams:
        return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kwargs})

    return [
        ("plain 0", greedy()),
        ("plain 1", greedy()),
        ("plain 2", greedy()),
        ("tree logprobs", greedy(logprobs=3)),
        # n > 1 needs sampling; top-k 1 makes it deterministic, through the sampling verifier
        ("tree n=2 top_k=1", greedy(n=2, temperature=1.0, top_k=1, seed=3)),
        ("presence penalty", greedy(presence_penalty=1.5)),
        ("frequency penalty", greedy(frequency_penalty=0.8)),
        ("repetition penalty", greedy(repetition_penalty=1.5)),
        ("seeded repetition penalty", greedy(temperature=1.0, seed=7, repetition_penalty=1.2)),
        ("min_tokens", greedy(min_tokens=MAX_TOKENS // 2, ignore_eos=False)),
        # vLLM refuses these two with speculation; the plugin allows them off the tree (patch 9)
        ("min_p", greedy(temperature=1.0, seed=5, min_p=0.05)),
        ("logit_bias", greedy(logit_bias={10: 4.0})),
        ("n=2 seeded penalty", greedy(n=2, temperature=0.8, seed=11, repetition_penalty=1.2)),
        # stops at EOS once the object is closed (ignore_eos would sample past the grammar's end)
        ("json schema", greedy(ignore_eos=False, structured_outputs=StructuredOutputsParams(json=SCHEMA))),
    ]


def on_tree(name: str) -> bool:
    return name.startswith(("plain", "tree"))


@pytest.fixture(scope="module")
def batch() -> tuple[list[str], list[str], list[object]]:
    names, params = zip(*mixed_batch())
    prompts = (make_prompts(10, seed=0) + make_prompts(10, seed=1))[: len(names)]
    return list(names), prompts, list(params)


@pytest.fixture(scope="module")
def reference(json_engines, batch):
    _, prompts, params = batch
    return json_engines.get(None).generate(prompts, params, use_tqdm=False)


def _spy_on_drafter(worker) -> None:
    """Wrap the drafter's ``propose`` to record the requests it is asked to draft for."""
    runner = worker.model_runner
    drafter = runner.tree_drafter
    stock = type(drafter).propose
    runner.specbeam_asked = {}

    def propose(requests):
        for request in requests:
            runner.specbeam_asked.setdefault(request.req_id, tuple(request.token_ids[:PREFIX].tolist()))
        return stock(drafter, requests)

    drafter.propose = propose


def _asked(worker) -> list[tuple[int, ...]]:
    return list(worker.model_runner.specbeam_asked.values())


def _stop_spying(worker) -> None:
    del worker.model_runner.tree_drafter.propose


def completions(output) -> list[list[int]]:
    return [list(c.token_ids) for c in output.outputs]


def drafted(output, asked: list[tuple[int, ...]]) -> int:
    """How many of ``output``'s sequences the drafter was asked for (by their prompt's first tokens)."""
    prompt = tuple(output.prompt_token_ids[:PREFIX])
    return sum(tokens[: len(prompt)] == prompt for tokens in asked)


@pytest.mark.parametrize("spec", [LOOKUP, ADED], ids=["lookup_tree", "aded"])
def test_off_tree_requests_decode_exactly_without_drafts(json_engines, batch, reference, spec):
    names, prompts, params = batch
    prefixes = [p.prompt_token_ids[:PREFIX] for p in reference]
    assert all(a[: len(b)] != b for i, a in enumerate(prefixes) for b in prefixes[i + 1 :]), "prompts must differ"
    llm = json_engines.get(spec)
    llm.collective_rpc(_spy_on_drafter)
    try:
        before = runner_stats(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        after = runner_stats(llm)
        asked = llm.collective_rpc(_asked)[0]
    finally:
        llm.collective_rpc(_stop_spying)
    assert after["accepted"] > before["accepted"], "the plain requests were not sped up: the test proves nothing"
    for name, ours, theirs in zip(names, outputs, reference):
        assert completions(ours) == completions(theirs), name
        if on_tree(name):
            assert drafted(ours, asked) == len(ours.outputs), f"{name}: not drafted"
        else:
            assert drafted(ours, asked) == 0, f"{name}: drafted"
        if ours.outputs[0].logprobs:
            for mine, expected in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
                assert mine.keys() == expected.keys(), name
                for token, logprob in mine.items():
                    assert logprob.logprob == pytest.approx(expected[token].logprob, abs=LOGPROB_TOLERANCE), name
    by_name = dict(zip(names, outputs))
    assert len(by_name["tree logprobs"].outputs[0].logprobs) == MAX_TOKENS
    text = by_name["json schema"].outputs[0].text.replace(" ", "")
    assert text.startswith('{"a":'), text  # the grammar ran (the whole object may not fit in MAX_TOKENS)
    assert len(set(map(tuple, completions(by_name["n=2 seeded penalty"])))) == 2, "the two samples are equal"
