"""The OpenAI-compatible server started with ``vllm-specbeam serve``.

Greedy completions with ``lookup_tree`` (request and global scope), ``aded``
and width-1 ``dsbd`` equal ``LLM(...)`` without speculation, sent
concurrently so the server batches them, then again one at a time (the
global scope drafting from the first wave); the spec-decode counters are on ``/metrics``; a bad per-request option
(``vllm_xargs``) fails that request with HTTP 400 and the server keeps
serving. The ``dsbd`` server and its beam search: test_server_beam_search.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, make_prompts
from test_lookup_tree_engine import LOOKUP, MAX_TOKENS, greedy
from test_sampling_engine import ADED

STARTUP_SECONDS = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(model: str, speculative_config: dict | None, log_path: Path, *args: str) -> Iterator[str]:
    """``vllm-specbeam serve`` in a subprocess; yields its URL once healthy."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm_specbeam.adapter.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--seed",
        "0",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        *(["--speculative-config", json.dumps(speculative_config)] if speculative_config else []),
        *args,
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_SECONDS
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"server exited with {process.returncode}; see {log_path}")
                try:
                    if requests.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server did not start in {STARTUP_SECONDS} s; see {log_path}")
                time.sleep(2)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(
    scope="module",
    params=[LOOKUP, {**LOOKUP, "scope": "global"}, ADED],
    ids=lambda spec: "-".join([spec["method"], *([spec["scope"]] if "scope" in spec else [])]),
)
def server(request, tiny_model, tmp_path_factory):
    with running_server(tiny_model, request.param, tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url


def complete(url: str, model: str, prompt: str, **extra) -> requests.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **extra}
    return requests.post(f"{url}/v1/completions", json=body, timeout=120)


def test_server_greedy_equals_no_speculation(server, engines, tiny_model):
    assert_greedy_equals_no_speculation(server, engines, tiny_model)


def assert_greedy_equals_no_speculation(server: str, engines, tiny_model: str) -> None:
    """Ten concurrent greedy completions, then the same ten one at a time, equal LLM(...)
    without speculation; drafts were accepted."""
    prompts = make_prompts(10)
    expected = [o.outputs[0].text for o in engines.get(None).generate(prompts, greedy())]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        responses = list(pool.map(lambda p: complete(server, tiny_model, p), prompts))
    responses += [complete(server, tiny_model, p) for p in prompts]
    assert [r.status_code for r in responses] == [200] * 2 * len(prompts)
    assert [r.json()["choices"][0]["text"] for r in responses] == expected * 2

    metrics = requests.get(f"{server}/metrics", timeout=10).text
    drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
    accepted = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_server_rejects_bad_per_request_option(server, tiny_model):
    bad = complete(server, tiny_model, "w1 w2 w3", vllm_xargs={"max_nodes": 64})
    assert bad.status_code == 400
    assert "max_nodes=64 exceeds the engine's max_nodes=12" in bad.text
    good = complete(server, tiny_model, "w1 w2 w3", vllm_xargs={"max_nodes": 4, "num_speculative_tokens": 2})
    assert good.status_code == 200
