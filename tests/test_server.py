"""The OpenAI-compatible server started with ``vllm-specbeam serve``.

Per kind of drafter (``lookup_tree`` in the global scope with the per-step
budget: drafting on the host; ``mcsd``: a draft model inside the worker), on a KV
cache small enough to preempt: ten greedy completions sent concurrently, then one at a time (the
global scope drafting from the first wave), equal ``LLM(...)`` without
speculation; a request body's ``cache_salt`` picks the global index's
partition; then the load test of benchmarks/load_test.py: 200 mixed
requests at once (completions and chat, streamed and not, logprobs, stop
strings, EOS allowed, per-request options, seeded ``n=2``), every greedy
answer identical to a server without speculation, then dropped streams,
abandoned requests and bad input beside a second wave that is still exact,
and afterwards no request, KV block or drafter state left. The ``dsbd``
server and its beam search: test_server_beam_search.py. ``aded`` drafts on the
host as ``lookup_tree`` does; its preemption, chunked prefill and aborted
requests are tested in-process (test_batch_robustness.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, MAX_TOKENS, greedy, make_prompts
from specs import MCSD
from test_metrics import expected_metrics, page_samples, specbeam_samples

from benchmarks import processes
from benchmarks.load import (
    LOGPROB_TOLERANCE,
    Answer,
    Call,
    ServerReport,
    bad_requests,
    finishes,
    plugin_stats,
    reference_answers,
    run_plugin_server,
    workload,
)
from benchmarks.serve_client import prometheus
from vllm_specbeam.core.config import METHODS, parse

STARTUP_SECONDS = 300
#: The tree servers' KV cache: 2k tokens in blocks of 32, far fewer than the load
#: test's 200 requests hold at once, so vLLM preempts some of them whatever their
#: drafts (in the CPU build's blocks of 128 each short request fits one block, and
#: only trees crossing a block's end preempted). The tiny model's K/V take 1 KiB a
#: token, and as much again for a draft in the same cache.
SMALL_KV_TOKENS = 2048
SMALL_KV_BLOCK = 32
#: per-request options some of the load test's requests send (valid for every method above)
XARGS = {"num_speculative_tokens": 2, "max_nodes": 6}
LOAD_REQUESTS = 200
FAULTS = 8


pytestmark = [pytest.mark.server, pytest.mark.usefixtures("no_idle_engines")]


@contextmanager
def running_server(
    model: str, speculative_config: dict | None, log_path: Path, *args: str, compiled: bool = False
) -> Iterator[str]:
    """A test server (float32, the tests' context length and KV cache, unless ``args``
    say otherwise; eager unless ``compiled``); yields its URL."""
    common = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"]
    common += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *([] if compiled else ["--enforce-eager"])]
    with processes.running_server(
        model, speculative_config, log_path, *common, *args, startup_seconds=STARTUP_SECONDS
    ) as server:
        yield server.url


@pytest.fixture(
    scope="module",
    # The global scope at its defaults: the per-step budget ("max_nodes": "auto") under load, and
    # the request scope's drafter plus the index (the request scope's server was merged into it).
    params=[{"method": "lookup_tree", "prompt_lookup_min": 1, "scope": "global"}, MCSD],
    ids=lambda spec: "-".join([spec["method"], *([spec["scope"]] if "scope" in spec else [])]),
)
def spec(request, near_draft) -> dict:
    return {**request.param, "model": near_draft} if request.param["method"] == "mcsd" else request.param


@pytest.fixture(scope="module")
def server(spec, tiny_model, tmp_path_factory):
    small_kv_bytes = SMALL_KV_TOKENS * 1024 * (2 if "model" in spec else 1)
    small_kv = ("--kv-cache-memory-bytes", str(small_kv_bytes), "--block-size", str(SMALL_KV_BLOCK))
    # eager: test_server_beam_search.py's dsbd server runs vLLM's compiled graph
    with running_server(tiny_model, spec, tmp_path_factory.mktemp("server") / "server.log", *small_kv) as url:
        yield url


def complete(url: str, model: str, prompt: str, **extra) -> requests.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **extra}
    return requests.post(f"{url}/v1/completions", json=body, timeout=120)


def test_server_greedy_equals_no_speculation(server, engines, tiny_model):
    assert_greedy_equals_no_speculation(server, engines, tiny_model)


def assert_greedy_equals_no_speculation(server: str, engines, tiny_model: str) -> None:
    """Ten concurrent greedy completions, then the same ten one at a time, equal LLM(...)
    without speculation; drafts were accepted, and ``/metrics`` counts what the runner counted:
    the accepted tokens, per position (= per depth: each accepted path is one node a depth)."""
    prompts = make_prompts(10)
    expected = [o.outputs[0].text for o in engines.get(None).generate(prompts, greedy())]
    runner_before, metrics_before = plugin_stats(server), accepted_metrics(server)
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        responses = list(pool.map(lambda p: complete(server, tiny_model, p), prompts))
    responses += [complete(server, tiny_model, p) for p in prompts]
    assert [r.status_code for r in responses] == [200] * 2 * len(prompts)
    assert [r.json()["choices"][0]["text"] for r in responses] == expected * 2

    runner, metrics = plugin_stats(server), accepted_metrics(server)
    accepted = runner["accepted"] - runner_before["accepted"]
    per_position = [after - before for after, before in zip(metrics["per_position"], metrics_before["per_position"])]
    assert runner["trees"] > runner_before["trees"] and accepted > 0
    assert metrics["accepted"] - metrics_before["accepted"] == accepted
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True), "a deeper position accepted more than a shallower one"


def accepted_metrics(url: str) -> dict:
    """vLLM's accepted-token counters on ``/metrics``: the total, and per position (0 first)."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{"):
            position = int(line.split('position="')[1].split('"')[0])
            per_position[position] = per_position.get(position, 0.0) + float(line.split()[-1])
    return {
        "accepted": prometheus(url, "vllm:spec_decode_num_accepted_tokens_total"),
        "per_position": [per_position[p] for p in sorted(per_position)],
    }


def test_server_metrics_show_the_controller(server, tiny_model):
    """The goodput controller's ``vllm:specbeam_*`` metrics on ``/metrics`` equal the runner's own
    stats after a few requests (read twice first: tests/conftest.py ``rpc_after_finished``)."""
    for prompt in make_prompts(4, seed=3):
        assert complete(server, tiny_model, prompt).status_code == 200
    plugin_stats(server)
    stats = plugin_stats(server)
    shown = specbeam_samples(page_samples(requests.get(f"{server}/metrics", timeout=10).text), tiny_model)
    assert plugin_stats(server) == stats, "the runner stepped between the reads"
    assert stats["steps"] > 0 and stats["nodes"] > 0
    assert shown == expected_metrics(stats)


def test_server_rejects_bad_per_request_option(server, spec, tiny_model):
    too_many = parse(spec, tiny_model, tiny_model).max_nodes + 1  # the engine's largest tree, plus one
    bad = complete(server, tiny_model, "w1 w2 w3", vllm_xargs={"max_nodes": too_many})
    assert bad.status_code == 400
    assert f"max_nodes={too_many} exceeds the engine's max_nodes=" in bad.text
    good = complete(server, tiny_model, "w1 w2 w3", vllm_xargs=XARGS)
    assert good.status_code == 200


def test_server_cache_salt_reaches_the_index(server, spec, engines, tiny_model):
    """A completion's ``cache_salt`` (in the request body, as vLLM's server takes it) picks the
    partition of the global index: tenant A's answer drafts A's repeat, and none of tenant B's
    identical request, whose answer is still vLLM's without speculation."""
    if not METHODS[spec["method"]].drafter_class().salted_index(parse(spec, tiny_model, tiny_model).options):
        pytest.skip(f"this {spec['method']} server keeps no cross-request index")
    prompt = make_prompts(10, seed=7)[6]  # text no other test sends
    expected = engines.get(None).generate([prompt], greedy())[0].outputs[0].text
    counters = ("index_partitions", "nodes_from_index", "accepted_from_index")

    def send(salt: str) -> dict[str, float]:
        """The counters' growth over one request; the stats are read twice after it, as the worker
        hears of a finished request in one more engine step (tests/conftest.py rpc_after_finished)."""
        before = plugin_stats(server)
        response = complete(server, tiny_model, prompt, cache_salt=salt)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected, response.text
        plugin_stats(server)
        after = plugin_stats(server)
        return {key: after[key] - before[key] for key in counters}

    assert send("tenant-a")["index_partitions"] == 1
    other = send("tenant-b")
    assert other["index_partitions"] == 1 and other["nodes_from_index"] == 0, other
    again = send("tenant-a")
    assert again["index_partitions"] == 0 and again["accepted_from_index"] >= MAX_TOKENS // 2, again


@pytest.fixture(scope="module")
def load(tiny_model, tmp_path_factory) -> tuple[list[Call], list[Answer]]:
    """The load test's workload and what a server without speculation answers (started once)."""
    calls = workload(make_prompts(10), LOAD_REQUESTS, stops=["w5", "w17", "w42"], xargs=XARGS)
    with running_server(tiny_model, None, tmp_path_factory.mktemp("plain") / "server.log") as url:
        return calls, reference_answers(url, calls)


def test_server_under_load_with_faults_and_bad_input_stays_exact(server, spec, load, tiny_model):
    calls, reference = load
    eos, stop = finishes(calls, reference)
    assert eos > 0 and stop > 0, "the workload must end some greedy requests on EOS and some on a stop string"
    report = ServerReport(spec["method"], spec)
    bad = bad_requests(tiny_model, parse(spec, tiny_model, tiny_model).max_nodes, MAX_MODEL_LEN, prompt_word="w1")
    problems = run_plugin_server(server, report, calls, reference, bad, make_prompts(10), 1, FAULTS)
    assert problems == []
    sampled = sum(not call.greedy for call in calls)
    assert report.requests == 2 * LOAD_REQUESTS and report.failures == 0
    assert report.greedy_identical == report.greedy_total == 2 * (LOAD_REQUESTS - sampled)
    assert report.logprob_gap <= LOGPROB_TOLERANCE  # float32: the same logprobs up to the last bits
    assert report.sampled_ok == 2 * sampled > 0
    assert sorted(report.bad_handled) == sorted(b.name for b in bad)
    assert report.faults.dropped_streams == report.faults.abandoned == FAULTS
    assert report.preemptions > 0, "the small KV cache should have preempted requests"
    assert report.accepted_off_first_branch > 0, "no node off a first branch was accepted: trees gained nothing"
