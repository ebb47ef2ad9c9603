"""Shared fixtures: one tiny model per session and engines shared by tests.

Engine start-up costs tens of seconds on a CPU, so each engine configuration
is started once per test module (``engines.get(...)``) and reused by its tests.
"""

from __future__ import annotations

import os
from typing import ClassVar

# Before vLLM is imported anywhere: use both cores, and allow collective_rpc
# with test functions (to read the runner's counters). The KV cache is sized
# per engine (kv_cache_memory_bytes), so VLLM_CPU_KVCACHE_SPACE, which would
# override it, must not be set.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import random

import pytest
from tiny_model import VOCAB_WORDS, build_tiny_model, prompt_text

MAX_MODEL_LEN = 1024
#: The tiny model's KV cache holds 1 KiB a token, so 64 MiB is 64k tokens:
#: ample for every test, and small enough that the session's engines and
#: servers (a dozen processes at once) fit in the machine's memory.
KV_CACHE_BYTES = 64 << 20


@pytest.fixture(autouse=True)
def kv_cache_space_stays_unset():
    """Fail the test that leaves VLLM_CPU_KVCACHE_SPACE set: every engine
    started after it would silently get that cache size instead of its own."""
    yield
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ, "this test leaked VLLM_CPU_KVCACHE_SPACE into the environment"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Same tokenizer as ``tiny_model``, other weights: a draft model."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1))


@pytest.fixture(scope="session")
def near_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The target's weights with more attention mixing: a draft whose
    proposals are often, not always, the target's choices."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-near-draft"), seed=0, mixing=0.007))


def make_prompts(count: int = 10, seed: int = 0) -> list[str]:
    """Prompts of different lengths (4 to 300 words) with repeated phrases,
    so lookup finds earlier occurrences with differing continuations."""
    rng = random.Random(seed)
    lengths = [4, 9, 17, 33, 60, 95, 140, 200, 260, 300][:count]
    prompts = []
    for length in lengths:
        phrases = [[rng.randrange(VOCAB_WORDS) for _ in range(rng.randint(2, 6))] for _ in range(4)]
        words: list[int] = []
        while len(words) < length:
            words += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(VOCAB_WORDS)]
        prompts.append(prompt_text(words[:length]))
    return prompts


def rpc_after_finished(llm, method):
    """Rank 0's ``llm.collective_rpc(method)`` once the worker has heard of the requests
    that finished last. vLLM's engine core tells it in one more step of its own, run
    right after they finish, and serves RPCs between steps: a first call may come
    before that step, a second one comes after it. (vLLM 0.32.0
    vllm/v1/engine/core.py: ``run_busy_loop``, ``_process_input_queue``.)"""
    llm.collective_rpc(method)
    return llm.collective_rpc(method)[0]


def tree_path(nodes: list[tuple[int, int]], node: int) -> list[int]:
    """Tokens from the root to ``node`` in a list of (token, parent) pairs (parent -1: the root)."""
    tokens = []
    while node != -1:
        tokens.insert(0, nodes[node][0])
        node = nodes[node][1]
    return tokens


class Engines:
    """Lazily started ``LLM`` objects keyed by their speculative config."""

    #: every pool of the session, for :func:`stop_engines_after_module`
    started: ClassVar[list[Engines]] = []

    def __init__(self, model: str) -> None:
        self.model = model
        self._engines: dict[str, object] = {}
        Engines.started.append(self)

    def get(self, speculative_config: dict | None = None, **kwargs: object):
        from vllm import LLM

        key = json.dumps([speculative_config, kwargs], sort_keys=True)
        if key not in self._engines:
            settings = {
                "dtype": "float32",
                "max_model_len": MAX_MODEL_LEN,
                "seed": 0,
                "kv_cache_memory_bytes": KV_CACHE_BYTES,
                "disable_log_stats": False,
                **kwargs,
            }
            self._engines[key] = LLM(model=self.model, speculative_config=speculative_config, **settings)
        return self._engines[key]

    def close(self) -> None:
        for llm in self._engines.values():
            llm.llm_engine.engine_core.shutdown()
        self._engines.clear()


@pytest.fixture(scope="session")
def engines(tiny_model: str):
    pool = Engines(tiny_model)
    yield pool
    pool.close()


@pytest.fixture(scope="module", autouse=True)
def stop_engines_after_module():
    """Stop a module's engines when it ends: each holds about a gigabyte, and
    a whole session's worth of idle engines next to the server tests'
    servers would not fit in the machine's memory."""
    yield
    for pool in Engines.started:
        pool.close()
