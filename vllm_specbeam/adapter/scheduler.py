"""The plugin's scheduler: vLLM 0.32's, with prefill chunks that never end inside a tree prompt's tree,
and each request's ``cache_salt`` handed to the workers.

A tree-prompt request (:mod:`vllm_specbeam.adapter.tree_prompt`) is scored
only when its tree's root row and every tree row are computed in one step.
Under chunked prefill vLLM may end a chunk anywhere in the prompt; this
scheduler cuts a chunk that would end inside a tree back to the row before
the root, so the next chunk holds the whole tree (or waits for a step with
room for it). The prefix before the root may be split anywhere: it is causal.

vLLM 0.32.0 v1/core/sched/scheduler.py calls ``_mamba_block_aligned_split``
on every prefill chunk it sizes, running and waiting requests alike, when
``need_mamba_block_aligned_split`` is set (the only per-request hook on a
chunk's size): this subclass sets it under chunked prefill and keeps vLLM's
own Mamba alignment where the model needs it. Plugin engines name it in
``SchedulerConfig.scheduler_cls`` (:func:`vllm_specbeam.adapter.engine_config.configure_engine`).

A cross-request index partitioned by ``cache_salt`` (``lookup_tree``'s global scope,
the global lookup of draft-model methods) needs each request's salt in the worker,
but vLLM 0.32.0 keeps it on the engine core's ``Request`` only (v1/request.py; the
workers get ``NewRequestData``, v1/core/sched/output.py, without it). ``add_request``
copies it into the sampling params' ``extra_args`` (:data:`CACHE_SALT_KEY`), which
travel to every worker, and removes the key from requests without a salt: a value
sent in ``vllm_xargs`` never poses as another tenant's salt.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_specbeam.adapter import tree_prompt
from vllm_specbeam.adapter.engine_config import CACHE_SALT_KEY


class TreePromptScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._align_mamba = self.need_mamba_block_aligned_split
        self.need_mamba_block_aligned_split = self._align_mamba or self.scheduler_config.enable_chunked_prefill

    @override
    def add_request(self, request: Any) -> None:
        params = request.sampling_params
        if params is not None and (request.cache_salt is not None or CACHE_SALT_KEY in (params.extra_args or {})):
            # a new dict: the front end's copy of the params may share the user's (SamplingParams.skip_clone)
            extra = {key: value for key, value in (params.extra_args or {}).items() if key != CACHE_SALT_KEY}
            params.extra_args = extra if request.cache_salt is None else {**extra, CACHE_SALT_KEY: request.cache_salt}
        super().add_request(request)

    @override
    def _mamba_block_aligned_split(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        if self._align_mamba:
            num_new_tokens = super()._mamba_block_aligned_split(
                request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
            )
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        params = request.sampling_params
        if start >= request.num_prompt_tokens or params is None:  # decoding (vLLM calls this every step)
            return num_new_tokens
        parents = tree_prompt.tree_parents(params.extra_args)
        if not parents:
            return num_new_tokens
        return tree_prompt.whole_tree_chunk(request.num_prompt_tokens, len(parents), start, num_new_tokens)
