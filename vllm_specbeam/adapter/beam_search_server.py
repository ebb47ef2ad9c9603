"""Speculative beam search behind the OpenAI server's ``use_beam_search``.

vLLM 0.32.0 and 0.33.0 serve ``use_beam_search`` requests (``/v1/completions`` and
``/v1/chat/completions``) with ``BeamSearchOnlineMixin.beam_search``
(entrypoints/generate/beam_search/online.py): an async generator in the API
server's process that sends every beam as a one-token request per step. The
plugin puts :func:`beam_search` in its place (plugin.py, patch 6). On an
engine started with ``dsbd`` (prefix caching on) a
deterministic request (``temperature`` 0) runs
:class:`~vllm_specbeam.adapter.beam_search.SpeculativeBeamSearch` rounds instead,
several tokens per target pass, and gets the response vLLM's own server gives,
beam for beam (:meth:`Selection.server` replays the server's selection rules).
Every other request runs vLLM's method unchanged: sampled beam search (note
that the server's default temperature is 1), prompts that are not plain
tokens (embeddings, multimodal, encoder-decoder), vLLM 0.33's
``allowed_token_ids`` (logged), and any request on an engine that cannot run
the speculative search (logged once, with the reason). A request's
``priority`` (vLLM 0.33) goes with every request a search sends.

The engine's own draft drafts each round in its worker (``collective_rpc``,
awaited: the event loop keeps serving); the API server holds no draft.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

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


def fallback_reason(engine_client: Any, prompt: Any, params: Any) -> str | None:
    """Why this request runs vLLM's own beam search, or ``None`` to speculate."""
    vllm_config = engine_client.vllm_config
    if plugin_config(vllm_config) is None:
        return "no vllm-specbeam method"
    problem = engine_problem(vllm_config)
    if problem:
        if problem not in _reported:
            _reported.add(problem)
            logger.warning("use_beam_search runs vLLM's own beam search on this server: %s", problem)
        return problem
    if params.temperature != 0:
        return "sampled beam search (temperature > 0)"
    allowlist = allowlist_reason(params)
    if allowlist is not None:
        logger.info("use_beam_search runs vLLM's own beam search for this request: %s", allowlist)
        return allowlist
    if prompt.get("type") != "token":
        return f"{prompt.get('type')} prompts"
    return None


def patch(stock: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., AsyncGenerator[Any, None]]:
    """``BeamSearchOnlineMixin.beam_search`` speculating where it can."""

    def beam_search_method(
        self: Any, prompt: Any, request_id: str, params: Any, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        if fallback_reason(self.engine_client, prompt, params) is not None:
            return stock(self, prompt, request_id, params, *args, **kwargs)
        return beam_search(self, prompt, request_id, params, *args, **kwargs)

    beam_search_method._specbeam = True
    return beam_search_method


def _search_for(engine_client: Any) -> SpeculativeBeamSearch:
    if id(engine_client) not in _searches:  # cheap (no model to load), on the event loop
        _searches[id(engine_client)] = SpeculativeBeamSearch(engine_client)
    return _searches[id(engine_client)]


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
    from vllm.inputs import tokens_input
    from vllm.utils import random_uuid
    from vllm.utils.async_utils import collect_from_async_generator

    engine = serving.engine_client
    engine.input_processor.resolve_watermarking(params)
    search = _search_for(engine)
    selection = Selection.server(
        params, serving.renderer.get_tokenizer().eos_token_id, engine.input_processor.generation_config_fields
    )
    inst = PromptSearch(
        BeamSearchInstance(prompt, lora_request=lora_request), f"server-{request_id}-{random_uuid()}", priority
    )
    try:
        while active := search.active([inst], params):
            requests = await search.draft_round_async(active, params, selection.draft_eos)
            batch = f"{request_id}-{random_uuid()}"
            results = [
                outputs[-1]
                for outputs in await asyncio.gather(
                    *(
                        collect_from_async_generator(
                            engine.generate(
                                tokens_input(
                                    tree["prompt_token_ids"],
                                    prompt=prompt.get("prompt"),
                                    cache_salt=tree.get("cache_salt"),
                                ),
                                sampling,
                                f"{batch}-beam-{i}",
                                lora_request=lora_request,
                                trace_headers=trace_headers,
                                session_id=session_id,
                                priority=priority,
                            )
                        )
                        for i, (tree, sampling) in enumerate(requests)
                    )
                )
            ]
            reasons = {result.outputs[0].finish_reason for result in results}
            if "error" in reasons:
                yield _error_output(request_id, prompt)
                return
            if "abort" in reasons:
                for beam in inst.state.beams:
                    beam.finish_reason = "abort"
                break
            search.verify_round(active, results, params, selection)
    finally:
        await search.release_async([inst])
    yield _final_output(serving, request_id, prompt, params, selection.best(inst.state), selection.eos)


def _final_output(serving: Any, request_id: str, prompt: Any, params: Any, best: list[Any], eos: frozenset[int]) -> Any:
    """The ``RequestOutput`` vLLM's online beam search (0.32.0, 0.33.0) yields for ``best``;
    ``eos``: the tokens that completed beams (none with ``ignore_eos``)."""
    from vllm import CompletionOutput, RequestOutput

    tokenizer = serving.renderer.get_tokenizer()
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
        request_id=request_id,
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
