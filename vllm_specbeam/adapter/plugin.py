"""Entry point vLLM calls in every process (``vllm.general_plugins``).

All the places where the plugin reaches into vLLM are installed from here, so
this file is the list of what the plugin touches. Each patch names the vLLM
0.32.0 source it was read from:

1. ``EngineArgs.create_speculative_config`` (engine/arg_utils.py): the user's
   speculative config for a plugin method is validated here and replaced by the
   ``custom_class`` carrier vLLM accepts; the plugin's own settings travel in
   ``VllmConfig.additional_config["specbeam"]`` to every worker. On CUDA the
   same patch selects the plugin's attention backend and a cudagraph mode
   that keeps attention outside CUDA graphs (``attention_config`` and
   ``compilation_config``, read later in ``create_engine_config``).
2. ``InputProcessor._validate_params`` (v1/engine/input_processor.py): checks
   per-request strategy options in ``SamplingParams.extra_args`` at admission,
   so a bad value fails that request only; tree-prompt requests
   (:mod:`vllm_specbeam.adapter.tree_prompt`) are checked here too.
3. The model runner class the workers build (``cpu_worker.CPUModelRunner`` on
   CPU, ``Worker._make_model_runner`` on GPU): replaced by a subclass that
   verifies trees (:mod:`vllm_specbeam.adapter.runner`). Done in every process; the
   subclass only changes behaviour when a plugin method is configured.
4. On CUDA, vLLM's ``CUSTOM`` attention-backend slot
   (v1/attention/backends/registry.py ``register_backend``) is pointed at the
   plugin's Triton backend (:mod:`vllm_specbeam.adapter.attention.cuda`), in every
   process; it is used only when patch 1 selects it.
5. ``generate_block_hash_extra_keys`` (v1/core/kv_cache_utils.py): prefix-cache
   blocks holding the rows of a tree-prompt request's tree get a key of their
   own, so they never serve another request (:mod:`vllm_specbeam.adapter.tree_prompt`).
   Done in the engine-core process, where requests are hashed.
6. ``BeamSearchOnlineMixin.beam_search`` (entrypoints/generate/beam_search/
   online.py): the OpenAI server's ``use_beam_search`` runs the speculative
   beam search on ``dsbd`` engines (:mod:`vllm_specbeam.adapter.beam_search_server`)
   and vLLM's own otherwise. Used in the API server's process.

The runner in turn wraps ``CPUAttentionBackendImpl.forward``
(v1/attention/backends/cpu_attn.py, see :mod:`vllm_specbeam.adapter.attention.cpu`) and
overrides a handful of runner methods, each naming its 0.32.0 source.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_specbeam.adapter.engine_config import (
    ADDITIONAL_CONFIG_KEY,
    plugin_config,
    vllm_carrier,
    vllm_version_problem,
    with_plugin_config,
)
from vllm_specbeam.core.config import SpecbeamConfigError, is_plugin_method, parse

logger = logging.getLogger(__name__)


def register() -> None:
    """Install the plugin's hooks; safe to call more than once per process."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_specbeam_patched", False):
        return
    EngineArgs._specbeam_patched = True
    problem = vllm_version_problem()
    _patch_speculative_config(EngineArgs, problem)
    if problem:
        # vLLM swallows exceptions raised by plugins at load time, so the
        # error is raised where a plugin method is requested (patch 1).
        logger.warning(problem)
        return
    _patch_runner_classes()
    _patch_request_validation()
    _patch_block_hashing()
    _patch_online_beam_search()
    _register_attention_backend()


def _patch_speculative_config(engine_args_cls: type, version_problem: str | None) -> None:
    stock = engine_args_cls.create_speculative_config

    def create_speculative_config(self: Any, *args: Any, **kwargs: Any):
        spec = self.speculative_config
        if is_plugin_method({"method": getattr(self, "spec_method", None)}):
            raise SpecbeamConfigError(
                "pass vllm-specbeam methods through --speculative-config '{\"method\": ...}', not --spec-method"
            )
        if not is_plugin_method(spec):
            check_known_method(spec)
            return stock(self, *args, **kwargs)
        if version_problem:
            raise SpecbeamConfigError(version_problem)
        config = parse(spec, target_tokenizer=self.tokenizer or self.model)
        from vllm_specbeam.adapter.attention.cuda import configure_engine_args

        configure_engine_args(self)
        self.additional_config = with_plugin_config(self.additional_config, config)
        self.speculative_config = vllm_carrier(config)
        try:
            return stock(self, *args, **kwargs)
        finally:
            self.speculative_config = spec  # the user's object stays as they wrote it

    engine_args_cls.create_speculative_config = create_speculative_config


def check_known_method(spec: dict | None) -> None:
    """Name both vLLM's and the plugin's methods when a method is unknown
    (vLLM's own validator would list only its own)."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    from vllm_specbeam.core.config import METHODS

    method = (spec or {}).get("method")
    if method is None:
        return

    def names(literal: Any) -> list[str]:
        args = get_args(literal)
        return [n for a in args for n in (names(a) if get_args(a) else [a])]

    if method not in names(SpeculativeMethod):
        raise SpecbeamConfigError(
            f"unknown speculative method {method!r}; vLLM's methods: {sorted(names(SpeculativeMethod))}; "
            f"vllm-specbeam's: {sorted(METHODS)}"
        )


def _patch_runner_classes() -> None:
    from vllm.v1.worker import cpu_worker, gpu_worker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_specbeam.adapter.runner import tree_runner_class

    # vLLM 0.32.0 v1/worker/cpu_worker.py: CPUWorker.init_device builds
    # ``CPUModelRunner(...)`` from this module global. The subclass behaves
    # exactly like the stock runner unless a plugin method is configured.
    cpu_worker.CPUModelRunner = tree_runner_class(cpu_worker.CPUModelRunner)

    # vLLM 0.32.0 v1/worker/gpu_worker.py: Worker._make_model_runner is the
    # documented override point for the GPU runner (V1 runner only: the
    # custom_class carrier makes vLLM choose it).
    stock_make = gpu_worker.Worker._make_model_runner

    def _make_model_runner(self: Any):
        if ADDITIONAL_CONFIG_KEY in (self.vllm_config.additional_config or {}):
            return tree_runner_class(GPUModelRunner)(self.vllm_config, self.device)
        return stock_make(self)

    gpu_worker.Worker._make_model_runner = _make_model_runner


def _patch_request_validation() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_specbeam.adapter import tree_prompt

    stock = InputProcessor._validate_params

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = stock(self, params, *args, **kwargs)
        config = plugin_config(self.vllm_config)
        extra = getattr(params, "extra_args", None)
        if config is not None and extra:
            try:
                config.with_overrides(extra)
                tree_prompt.check_params(params, self.vllm_config.scheduler_config.enable_chunked_prefill)
            except (SpecbeamConfigError, tree_prompt.TreePromptError) as error:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(f"vllm-specbeam: {error}") from error
        return result

    InputProcessor._validate_params = _validate_params


def _register_attention_backend() -> None:
    """Workers resolve the selected backend through the registry of their own
    process; other platforms never select it, so their registry is left alone."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        from vllm_specbeam.adapter.attention.cuda import register_tree_backend

        register_tree_backend()


def _patch_block_hashing() -> None:
    from vllm.v1.core import kv_cache_utils

    from vllm_specbeam.adapter import tree_prompt

    # vLLM 0.32.0 v1/core/kv_cache_utils.py: the request block hasher looks
    # this module global up at every call.
    stock = kv_cache_utils.generate_block_hash_extra_keys
    if not getattr(stock, "_specbeam", False):
        patched = tree_prompt.block_hash_extra_keys(stock)
        patched._specbeam = True
        kv_cache_utils.generate_block_hash_extra_keys = patched


def _patch_online_beam_search() -> None:
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin

    from vllm_specbeam.adapter import beam_search_server

    # vLLM 0.32.0: the completion and chat serving classes inherit this
    # method (GenerateBaseServing) and call it for every use_beam_search request.
    stock = BeamSearchOnlineMixin.beam_search
    if not getattr(stock, "_specbeam", False):
        BeamSearchOnlineMixin.beam_search = beam_search_server.patch(stock)
