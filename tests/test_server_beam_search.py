"""``use_beam_search`` on a ``dsbd`` server started with ``vllm-specbeam serve``.

In a module of its own so that test_server.py's servers have stopped before
these two start. Width-1 ``dsbd`` greedy completions equal ``LLM(...)``
without speculation; the server's beam search is the speculative beam search
and answers what vLLM's server without speculation answers, with fewer
engine requests; sampled beam search is the speculative beam sampling, seeded.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import make_prompts
from test_server import assert_greedy_equals_no_speculation, running_server

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("no_idle_engines")]

#: what the speculative beam search needs (prefix caching); chunked prefill stays on, vLLM's default
BEAM_ENGINE = ("--block-size", "32", "--enable-prefix-caching")


@pytest.fixture(scope="module")
def dsbd_server(tiny_model, near_draft, tmp_path_factory):
    """In-engine dsbd at width 1 (lossless), on an engine that can also run the speculative beam search;
    the one test server that runs vLLM's compiled graph (target and in-worker draft), as users do."""
    spec = {"method": "dsbd", "model": near_draft, "num_speculative_tokens": 3, "max_nodes": 12, "max_width": 1}
    log = tmp_path_factory.mktemp("dsbd") / "server.log"
    with running_server(tiny_model, spec, log, *BEAM_ENGINE, compiled=True) as url:
        yield url


@pytest.fixture(scope="module")
def plain_server(tiny_model, tmp_path_factory):
    """vLLM without speculation: the reference for the server's beam search."""
    with running_server(tiny_model, None, tmp_path_factory.mktemp("plain") / "server.log", *BEAM_ENGINE) as url:
        yield url


def test_dsbd_server_width_one_greedy_equals_no_speculation(dsbd_server, engines, tiny_model):
    assert_greedy_equals_no_speculation(dsbd_server, engines, tiny_model)


def beam_search(url: str, model: str, prompt: str, **fields) -> dict:
    body = {"model": model, "prompt": prompt, "use_beam_search": True, "temperature": 0.0, **fields}
    response = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def finished_requests(url: str) -> float:
    metrics = requests.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:request_success_total")
    )


def test_server_beam_search_equals_vllm_server(dsbd_server, plain_server, tiny_model):
    """use_beam_search on a dsbd server returns vLLM's server beams (texts,
    order, finish reasons) with fewer engine requests: several tokens per pass."""
    prompts = make_prompts(4, seed=1)  # the first one's best beams at width 3 include EOS-completed ones
    cases = [
        {"n": 2, "max_tokens": 20, "ignore_eos": True},
        {"n": 3, "max_tokens": 24, "include_stop_str_in_output": True},
        {"n": 3, "max_tokens": 24},
    ]
    counts = {}
    answers = {}
    for url in (dsbd_server, plain_server):
        before = finished_requests(url)
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            answers[url] = [
                list(pool.map(lambda p: beam_search(url, tiny_model, p, **case), prompts)) for case in cases
            ]
        counts[url] = finished_requests(url) - before
    for ours, theirs in zip(answers[dsbd_server], answers[plain_server]):
        for a, b in zip(ours, theirs):
            assert [(c["text"], c["finish_reason"]) for c in a["choices"]] == [
                (c["text"], c["finish_reason"]) for c in b["choices"]
            ]
    reasons = {c["finish_reason"] for case in answers[plain_server] for a in case for c in a["choices"]}
    assert reasons == {"length", "stop"}  # EOS-completed beams are part of the comparison
    assert counts[dsbd_server] < 0.7 * counts[plain_server]


def completion(url: str, model: str, prompt: str, **fields) -> requests.Response:
    body = {"model": model, "prompt": prompt, "use_beam_search": True, **fields}
    return requests.post(f"{url}/v1/completions", json=body, timeout=300)


def shape(answer: dict) -> tuple:
    """A response's keys, its choices' keys and their count: what clients parse."""
    return sorted(answer), sorted(answer["usage"]), [sorted(choice) for choice in answer["choices"]]


SAMPLED = {"n": 3, "max_tokens": 12, "temperature": 0.8, "top_k": 8, "ignore_eos": True}


def test_server_beam_sampling_is_seeded_and_keeps_vllms_shape(dsbd_server, plain_server, tiny_model):
    """Temperature > 0 is the speculative beam sampling: a seed gives the same beams again,
    other seeds other beams; the answer has the shape of vLLM's own server's."""
    beams = {}
    for seed in (5, 5, 6, 7, 8):
        response = completion(dsbd_server, tiny_model, "w1 w2 w3", seed=seed, **SAMPLED)
        assert response.status_code == 200, response.text
        answer = response.json()
        texts = [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]]
        assert len(texts) == SAMPLED["n"] and beams.setdefault(seed, texts) == texts
    assert len({tuple(texts) for texts in beams.values()}) > 1
    theirs = completion(plain_server, tiny_model, "w1 w2 w3", seed=5, **SAMPLED)
    assert shape(answer) == shape(theirs.json())


def test_server_beam_sampling_that_cannot_be_exact_answers_400(dsbd_server, tiny_model):
    """No top_k or top_p keeps whole rows: the server's 20 logprobs a row cannot decide them."""
    response = completion(dsbd_server, tiny_model, "w1 w2 w3", n=2, max_tokens=4, temperature=0.8)
    assert response.status_code == 400
    assert "max_logprobs=-1" in response.json()["error"]["message"]
