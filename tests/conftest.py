"""Shared fixtures: one tiny model per session, engines shared by the whole
session (``engines.get(...)``), one greedy reference, and the test tiers.

Tiers (markers, ``make test-fast`` runs the first): unmarked tests need no
vLLM engine; ``engine`` tests start in-process engines (marked here, from the
fixtures they use, or by hand); ``server`` tests start servers or worker
processes; ``slow`` tests take minutes on their own.
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

import gc
import json
import random
import time
from collections import OrderedDict

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
    right after they finish (vLLM 0.32.0 vllm/v1/engine/core.py: ``run_busy_loop``,
    ``_process_input_queue``; ``step`` runs while ``scheduler.has_requests()``, finished
    ones included). An engine core in its own process serves RPCs between steps, so a
    first call may come before that step and a second one after it; one in this process
    takes the step when asked."""
    if in_process(llm):
        llm.llm_engine.step()
    else:
        llm.collective_rpc(method)
    return llm.collective_rpc(method)[0]


def in_process(llm) -> bool:
    from vllm.v1.engine.core_client import InprocClient

    return isinstance(llm.llm_engine.engine_core, InprocClient)


def release(llm) -> None:
    """Stop an engine of the pool. One in its own process is shut down. One in this process is
    only dropped: its shutdown would tear down vLLM's distributed state (the model-parallel
    groups), which every engine in this process shares, and the next step of another live
    engine would fail (``pipeline model parallel group is not initialized``)."""
    if in_process(llm):
        del llm
        gc.collect()
    else:
        llm.llm_engine.engine_core.shutdown()


def finish_like_own_process(llm) -> None:
    """After each offline call, the step an engine core in its own process runs by itself
    once requests finish (see :func:`rpc_after_finished`): the worker hears of them
    before the test's next call, as it does in a server."""
    run_engine = llm._run_engine

    def run_and_finish(*args, **kwargs):
        outputs = run_engine(*args, **kwargs)
        llm.llm_engine.step()
        return outputs

    llm._run_engine = run_and_finish


def tree_path(nodes: list[tuple[int, int]], node: int) -> list[int]:
    """Tokens from the root to ``node`` in a list of (token, parent) pairs (parent -1: the root)."""
    tokens = []
    while node != -1:
        tokens.insert(0, nodes[node][0])
        node = nodes[node][1]
    return tokens


#: most engines alive at once across the session; past it the least recently
#: used one is stopped. Each holds about a gigabyte; with the servers' processes
#: the session must fit in 24 GiB.
MAX_ENGINES = 6

MAX_TOKENS = 48


def checked_options(drafter_class, **values) -> dict:
    """A drafter's engine-wide options: every default, then ``values``, checked as at start-up."""
    from vllm_specbeam.core.config import TREE_OPTIONS

    options = {name: option.default for name, option in {**TREE_OPTIONS, **drafter_class.OPTIONS}.items()}
    options.update(values)
    drafter_class.check_options(options)
    return options


def greedy(max_tokens: int = MAX_TOKENS, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def read_stats(worker) -> dict[str, int]:
    """The runner's tree counters, read inside the worker (``collective_rpc``)."""
    return dict(worker.model_runner.tree_stats)


def runner_stats(llm) -> dict[str, int]:
    return llm.collective_rpc(read_stats)[0]


def counters_grown(before: dict, after: dict) -> dict[str, int]:
    """How much each of the runner's counters grew between two :func:`runner_stats` (fitted
    lines, which appear once measured, are not counters)."""
    return {key: after[key] - before[key] for key in before.keys() & after.keys() if isinstance(before[key], int)}


class Engines:
    """``LLM`` objects of one model shared by the whole session, keyed by their settings.

    Engine start-up costs seconds even on the tiny model, so a configuration is
    started once and reused by every module that asks for it; tests read
    counters as differences, never as totals. Engines run eagerly unless a test
    asks for ``enforce_eager=False`` (vLLM's CPU ``torch.compile`` takes longer
    than most tests); compilation is checked where it is the point. The engine
    core runs in the test's process (2-3 s a start against 17 s for a process
    that imports vLLM anew), unless a test asks for ``own_process=True``: one
    that checks what crosses the process boundary.
    """

    #: every live engine of the session, least recently used first
    alive: ClassVar[OrderedDict[tuple[str, str], object]] = OrderedDict()
    #: seconds each start-up took, in order (the session's summary prints them)
    starts: ClassVar[list[tuple[str, float]]] = []

    def __init__(self, model: str) -> None:
        self.model = model

    def _key(self, speculative_config: dict | None, own_process: bool, kwargs: dict) -> tuple[str, str]:
        return self.model, json.dumps(
            [speculative_config, kwargs, *(["own process"] if own_process else [])], sort_keys=True
        )

    def get(self, speculative_config: dict | None = None, own_process: bool = False, **kwargs: object):
        from vllm import LLM, envs

        key = self._key(speculative_config, own_process, kwargs)
        if key in Engines.alive:
            Engines.alive.move_to_end(key)
            return Engines.alive[key]
        while len(Engines.alive) >= MAX_ENGINES:
            _, oldest = Engines.alive.popitem(last=False)
            release(oldest)
        settings = {
            "dtype": "float32",
            "max_model_len": MAX_MODEL_LEN,
            "seed": 0,
            "kv_cache_memory_bytes": KV_CACHE_BYTES,
            "disable_log_stats": False,
            "enforce_eager": True,
            **kwargs,
        }
        started = time.perf_counter()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else "0"
        try:
            Engines.alive[key] = LLM(model=self.model, speculative_config=speculative_config, **settings)
        finally:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
            # An engine core caches vLLM's environment variables in its process: here, the
            # tests' process, whose later engines and tests set their own.
            envs.disable_envs_cache()
        Engines.starts.append((key[1], time.perf_counter() - started))
        if not own_process:
            finish_like_own_process(Engines.alive[key])
        return Engines.alive[key]

    def stop(self, speculative_config: dict | None = None, own_process: bool = False, **kwargs: object) -> None:
        """Stop one engine now (one whose state a test spent, or to free its memory)."""
        key = self._key(speculative_config, own_process, kwargs)
        llm = Engines.alive.pop(key, None)
        if llm is not None:
            release(llm)

    @classmethod
    def close_all(cls) -> None:
        while cls.alive:
            release(cls.alive.popitem()[1])


@pytest.fixture(scope="session")
def engines(tiny_model: str):
    yield Engines(tiny_model)
    Engines.close_all()


@pytest.fixture(scope="module")
def no_idle_engines():
    """Stops every engine before a module that starts servers of its own: the
    servers' processes and a session's worth of idle engines would not fit in
    the machine's memory."""
    Engines.close_all()


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    return make_prompts(10)


@pytest.fixture(scope="session")
def reference(engines, prompts) -> list[list[int]]:
    """vLLM without speculation, greedy, on ``prompts``: the session's one reference."""
    return token_ids(engines.get(None).generate(prompts, greedy(), use_tqdm=False))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts an engine through the shared pool is marked ``engine``."""
    for item in items:
        if {"engines", "reference", "json_engines"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)


def pytest_terminal_summary(terminalreporter) -> None:
    """How many in-process engines the session started, and what they cost."""
    if Engines.starts:
        total = sum(seconds for _, seconds in Engines.starts)
        terminalreporter.write_line(f"engines started in-process: {len(Engines.starts)}, {total:.0f} s in all")
