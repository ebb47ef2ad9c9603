"""Speculative beam search and beam sampling behind the OpenAI server's ``use_beam_search``.

vLLM 0.32.0 and 0.33.0 serve ``use_beam_search`` requests (``/v1/completions`` and
``/v1/chat/completions``) with ``BeamSearchOnlineMixin.beam_search``
(entrypoints/generate/beam_search/online.py): an async generator in the API
server's process that sends every beam as a one-token request per step. The
plugin puts its method (:func:`patch`) in its place (plugin.py, patch 6). On an
engine started with ``dsbd`` (prefix caching on), a deterministic request
(``temperature`` 0) runs :class:`~vllm_specbeam.adapter.beam_search.SpeculativeBeamSearch`
rounds and gets vLLM's own server's beams (:meth:`Selection.server`); a sampled
one runs :class:`~vllm_specbeam.adapter.beam_sampling.SpeculativeBeamSampling`
with the request's ``seed``, ``top_k`` and ``top_p`` (vLLM's own loop ignores the
temperature). ``n`` is the beam width, as in vLLM. Both answer in vLLM's shape.
vLLM's method serves the rest: prompts that are not plain tokens, vLLM 0.33's
``allowed_token_ids`` (logged), and any request on an engine that cannot
speculate (logged once, with the reason). A request's ``priority`` (vLLM 0.33)
goes with every request a search sends. The engine's own draft drafts each round
in its worker (``collective_rpc``, awaited: the event loop keeps serving).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from vllm_specbeam.adapter.beam_sampling import (
    BeamSamplingParams,
    PromptSampling,
    SpeculativeBeamSampling,
    prompt_generators,
)
from vllm_specbeam.adapter.beam_search import (
    PromptSearch,
    Selection,
    SpeculativeBeamSearch,
    allowlist_reason,
    engine_problem,
)
from vllm_specbeam.adapter.engine_config import plugin_config

logger = logging.getLogger(__name__)

_searches: dict[int, SpeculativeBeamSearch] = {}
_reported: set[str] = set()


@dataclass(frozen=True)
class ServedRequest:
    """One ``use_beam_search`` prompt as vLLM's server hands it to ``beam_search``."""

    serving: Any
    prompt: Any
    request_id: str
    lora_request: Any = None
    trace_headers: Any = None
    session_id: str | None = None
    priority: int = 0


def fallback_reason(engine_client: Any, prompt: Any, params: Any, request: Any = None) -> str | None:
    """Why this request runs vLLM's own beam search, or ``None`` to speculate; ``request``:
    the OpenAI request (:func:`openai_request`), which a sampled one needs."""
    vllm_config = engine_client.vllm_config
    if plugin_config(vllm_config) is None:
        return "no vllm-specbeam method"
    problem = engine_problem(vllm_config)
    if problem:
        if problem not in _reported:
            _reported.add(problem)
            logger.warning("use_beam_search runs vLLM's own beam search on this server: %s", problem)
        return problem
    if params.temperature != 0 and request is None:
        return "sampled beam search (temperature > 0) without the OpenAI request's seed, top_k and top_p"
    allowlist = allowlist_reason(params)
    if allowlist is not None:
        logger.info("use_beam_search runs vLLM's own beam search for this request: %s", allowlist)
        return allowlist
    if prompt.get("type") != "token":
        return f"{prompt.get('type')} prompts"
    return None


#: the attribute of vLLM's ``BeamSearchParams`` (a msgspec struct with a ``__dict__``) that holds its request
REQUEST_ATTRIBUTE = "specbeam_request"


def carrying_request(stock: Callable[..., Any]) -> Callable[..., Any]:
    """Patch 12: a completion or chat request's ``to_beam_search_params`` (vLLM 0.32.0
    entrypoints/openai/completion/protocol.py, chat_completion/protocol.py): the params carry the
    request, whose ``seed``, ``top_k`` and ``top_p`` vLLM's ``BeamSearchParams`` has no field for."""

    def to_beam_search_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = stock(self, *args, **kwargs)
        setattr(params, REQUEST_ATTRIBUTE, self)
        return params

    return to_beam_search_params


def openai_request(params: Any) -> Any:
    """The OpenAI request ``params`` were made for (:func:`carrying_request`), or ``None``."""
    return getattr(params, REQUEST_ATTRIBUTE, None)


def sampling_params(serving: Any, request: Any, params: Any) -> BeamSamplingParams:
    """The beam sampling a sampled ``use_beam_search`` request asks for: ``params`` (vLLM's
    ``BeamSearchParams``) with the request's seed and cuts, which default as vLLM's sampling
    defaults them (vLLM 0.32.0 entrypoints/openai/completion/protocol.py ``to_sampling_params``:
    the request's, else the server's generation config's, else OpenAI's)."""
    defaults = serving.default_sampling_params or {}

    def option(name: str) -> Any:
        value = getattr(request, name)
        return value if value is not None else defaults.get(name, request._DEFAULT_SAMPLING_PARAMS[name])

    return BeamSamplingParams(
        params.beam_width,
        params.max_tokens,
        temperature=params.temperature,
        top_k=option("top_k"),
        top_p=option("top_p"),
        ignore_eos=params.ignore_eos,
        length_penalty=params.length_penalty,
        seed=request.seed,
        skip_special_tokens=params.skip_special_tokens,
    )


def patch(stock: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., AsyncGenerator[Any, None]]:
    """``BeamSearchOnlineMixin.beam_search`` speculating where it can."""

    def beam_search_method(
        self: Any, prompt: Any, request_id: str, params: Any, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        request = openai_request(params) if params.temperature != 0 else None
        if fallback_reason(self.engine_client, prompt, params, request) is not None:
            return stock(self, prompt, request_id, params, *args, **kwargs)
        if request is None:
            return beam_search(self, prompt, request_id, params, *args, **kwargs)
        served = ServedRequest(self, prompt, request_id, *args, **kwargs)
        return beam_sampling(served, params, sampling_params(self, request, params))

    beam_search_method._specbeam = True
    return beam_search_method


def _search_for(engine_client: Any) -> SpeculativeBeamSearch:
    if id(engine_client) not in _searches:  # cheap (no model to load), on the event loop
        _searches[id(engine_client)] = SpeculativeBeamSearch(engine_client)
    return _searches[id(engine_client)]


def _selection(served: ServedRequest, params: Any) -> Selection:
    """The server's rules for completing and ranking beams (``params``: vLLM's ``BeamSearchParams``)."""
    served.serving.engine_client.input_processor.resolve_watermarking(params)
    fields = served.serving.engine_client.input_processor.generation_config_fields
    return Selection.server(params, served.serving.renderer.get_tokenizer().eos_token_id, fields)


async def beam_search(
    serving: Any,
    prompt: Any,
    request_id: str,
    params: Any,
    lora_request: Any = None,
    trace_headers: Any = None,
    session_id: str | None = None,
    priority: int = 0,
) -> AsyncGenerator[Any, None]:
    """vLLM's online beam search (same arguments, same single ``RequestOutput``), speculatively."""
    from vllm.entrypoints.generate.beam_search.utils import BeamSearchInstance
    from vllm.utils import random_uuid

    served = ServedRequest(serving, prompt, request_id, lora_request, trace_headers, session_id, priority)
    selection = _selection(served, params)
    inst = PromptSearch(
        BeamSearchInstance(prompt, lora_request=lora_request), f"server-{request_id}-{random_uuid()}", priority
    )
    yield await _answer(served, _search_for(serving.engine_client), inst, params, selection)


async def beam_sampling(served: ServedRequest, params: Any, sampling: BeamSamplingParams) -> AsyncGenerator[Any, None]:
    """Beam sampling for a sampled ``use_beam_search`` request, in vLLM's response shape;
    :class:`~vllm_specbeam.adapter.beam_sampling.InexactBeamSamplingError` (HTTP 400) names the fix."""
    from vllm.entrypoints.generate.beam_search.utils import BeamSearchInstance
    from vllm.utils import random_uuid

    selection = _selection(served, params)
    sampler = SpeculativeBeamSampling(served.serving.engine_client)  # per request: it holds the request's law
    sampler.prepare(sampling, selection)
    inst = PromptSampling(
        BeamSearchInstance(served.prompt, lora_request=served.lora_request),
        f"server-{served.request_id}-{random_uuid()}",
        served.priority,
        generator=prompt_generators(sampling.seed, 1)[0],
    )
    yield await _answer(served, sampler, inst, sampling, selection)


async def _answer(
    served: ServedRequest, search: SpeculativeBeamSearch, inst: PromptSearch, params: Any, selection: Selection
) -> Any:
    """Run ``inst``'s rounds to the end; the ``RequestOutput`` vLLM's online beam search yields."""
    try:
        while active := search.active([inst], params):
            requests = await search.draft_round_async(active, params, selection.draft_eos)
            results = await _score(served, requests)
            reasons = {result.outputs[0].finish_reason for result in results}
            if "error" in reasons:
                return _error_output(served.request_id, served.prompt)
            if "abort" in reasons:
                for beam in inst.state.beams:
                    beam.finish_reason = "abort"
                break
            search.verify_round(active, results, params, selection)
    finally:
        await search.release_async([inst])
    return _final_output(served, params, selection.best(inst.state), selection.eos)


async def _score(served: ServedRequest, requests: list[tuple[Any, Any]]) -> list[Any]:
    """The target's outputs for a round's scoring requests, sent together."""
    from vllm.inputs import tokens_input
    from vllm.utils import random_uuid
    from vllm.utils.async_utils import collect_from_async_generator

    batch = f"{served.request_id}-{random_uuid()}"
    outputs = await asyncio.gather(
        *(
            collect_from_async_generator(
                served.serving.engine_client.generate(
                    tokens_input(
                        tree["prompt_token_ids"], prompt=served.prompt.get("prompt"), cache_salt=tree.get("cache_salt")
                    ),
                    sampling,
                    f"{batch}-beam-{i}",
                    lora_request=served.lora_request,
                    trace_headers=served.trace_headers,
                    session_id=served.session_id,
                    priority=served.priority,
                )
            )
            for i, (tree, sampling) in enumerate(requests)
        )
    )
    return [output[-1] for output in outputs]


def _final_output(served: ServedRequest, params: Any, best: list[Any], eos: frozenset[int]) -> Any:
    """The ``RequestOutput`` vLLM's online beam search (0.32.0, 0.33.0) yields for ``best``;
    ``eos``: the tokens that completed beams (none with ``ignore_eos``)."""
    from vllm import CompletionOutput, RequestOutput

    prompt, tokenizer = served.prompt, served.serving.renderer.get_tokenizer()
    start = len(prompt["prompt_token_ids"])
    outputs = []
    for index, beam in enumerate(best):
        ends_in_eos = beam.tokens[-1] in eos
        text = tokenizer.decode(
            beam.tokens[start:-1] if ends_in_eos else beam.tokens[start:],
            skip_special_tokens=params.skip_special_tokens,
        )
        outputs.append(
            CompletionOutput(
                index=index,
                text=text,
                token_ids=beam.tokens[start:],
                cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs,
                finish_reason=beam.finish_reason or "length",
                stop_reason=beam.stop_reason,
            )
        )
    return RequestOutput(
        request_id=served.request_id,
        prompt=prompt.get("prompt"),
        outputs=outputs,
        finished=True,
        prompt_token_ids=prompt["prompt_token_ids"],
        prompt_logprobs=None,
    )


def _error_output(request_id: str, prompt: Any) -> Any:
    """What vLLM's online beam search yields when a step's request fails."""
    from vllm import CompletionOutput, RequestOutput

    failed = CompletionOutput(
        index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason="error"
    )
    return RequestOutput(
        request_id=request_id,
        prompt=prompt.get("prompt"),
        outputs=[failed],
        finished=True,
        prompt_token_ids=prompt["prompt_token_ids"],
        prompt_logprobs=None,
    )
