"""Entry point vLLM calls in every process (``vllm.general_plugins``).

This is the list of what the plugin touches in vLLM, each with the 0.32.0
source it was read from. Every symbol below is a target in
:mod:`vllm_specbeam.adapter.patches`, looked up when the plugin registers;
if one is missing, or another vLLM is installed, nothing else is installed,
the problems are logged, and requesting a plugin method fails with them.

1. ``EngineArgs.create_speculative_config`` (vllm/engine/arg_utils.py): the
   user's speculative config for a plugin method is validated here and
   replaced by the ``custom_class`` carrier vLLM accepts; the plugin's own
   settings travel in ``VllmConfig.additional_config["specbeam"]`` to every
   worker. The same patch makes the engine settings a plugin method needs
   (:func:`~vllm_specbeam.adapter.engine_config.configure_engine`).
   Installed in every process; other methods go to vLLM unchanged.
2. ``InputProcessor._validate_params`` (vllm/v1/engine/input_processor.py):
   checks per-request strategy options in ``SamplingParams.extra_args`` at
   admission, so a bad value fails that request only; tree-prompt requests
   (:mod:`vllm_specbeam.adapter.tree_prompt`) are checked here too.
3. The worker: for a plugin method, patch 1 sets ``ParallelConfig.worker_cls``
   (vLLM's extension point) to the plugin's subclass of ``CPUWorker``
   (vllm/v1/worker/cpu_worker.py) or ``Worker`` (vllm/v1/worker/gpu_worker.py),
   which builds the tree runner (:mod:`vllm_specbeam.adapter.worker`): a
   subclass of ``CPUModelRunner`` (read by name from cpu_worker.py, where the
   CPU worker builds it) or ``GPUModelRunner``
   (vllm/v1/worker/gpu_model_runner.py) overriding a handful of its methods
   (:mod:`vllm_specbeam.adapter.runner`). On CPU the runner wraps
   ``CPUAttentionBackendImpl.forward`` (vllm/v1/attention/backends/cpu_attn.py,
   :mod:`vllm_specbeam.adapter.attention.cpu`) in the worker's process.
4. On CUDA, vLLM's ``AttentionBackendEnum.CUSTOM`` attention-backend slot
   (vllm/v1/attention/backends/registry.py ``register_backend``) is pointed at
   the plugin's subclasses of ``TritonAttentionBackend``, ``TritonAttentionImpl``
   and ``TritonAttentionMetadataBuilder``
   (vllm/v1/attention/backends/triton_attn.py,
   :mod:`vllm_specbeam.adapter.attention.cuda`), in every process; it is used
   only when patch 1 selects it.
5. ``generate_block_hash_extra_keys`` (vllm/v1/core/kv_cache_utils.py):
   prefix-cache blocks holding the rows of a tree-prompt request's tree get a
   key of their own, so they never serve another request
   (:mod:`vllm_specbeam.adapter.tree_prompt`). Used in the engine-core
   process, where requests are hashed.
6. ``BeamSearchOnlineMixin.beam_search``
   (vllm/entrypoints/generate/beam_search/online.py): the OpenAI server's
   ``use_beam_search`` runs the speculative beam search on ``dsbd`` engines
   (:mod:`vllm_specbeam.adapter.beam_search_server`) and vLLM's own
   otherwise. Used in the API server's process.
7. ``VllmConfig.num_lookahead_tokens`` (vllm/config/vllm.py): for draft-model
   methods on CPU, also the KV slots the in-worker draft writes its tree nodes
   to (:func:`vllm_specbeam.adapter.draft_model.lookahead`). Read by the
   scheduler, in the engine-core process.
8. On CPU, ``GPUModelRunner.sample_tokens`` (vllm/v1/worker/gpu_model_runner.py,
   which ``CPUModelRunner`` inherits): a step samples without the generators of
   the requests whose token it discards, so vLLM's rewind of those generators,
   which CPU generators cannot do, is never needed
   (:mod:`vllm_specbeam.adapter.cpu_generators`). A fix for every CPU engine,
   plugin method or not, in the worker's process.
9. ``SamplingParams._validate_spec_decode`` (vllm/sampling_params.py) and
   ``build_logitsprocs`` as vllm/v1/worker/gpu_model_runner.py names it
   (with ``BUILTIN_LOGITS_PROCESSORS``, vllm/v1/sample/logits_processor/__init__.py):
   vLLM refuses ``min_p`` and ``logit_bias`` with any speculative config and
   builds only the min-tokens logits processor, since its rejection sampler
   cannot apply them to draft rows. The tree runner never drafts such
   requests (``request_supports_trees``) and samples their one row a step
   with vLLM's own sampler, so on a plugin engine they are admitted and the
   runner is built with all built-in processors
   (:func:`vllm_specbeam.adapter.runner.builtin_logitsprocs`; custom logits
   processors stay refused). Admission in the API server's process, the
   runner in the worker's.
10. The scheduler: for a plugin method, patch 1 sets
   ``SchedulerConfig.scheduler_cls`` (vLLM's extension point, unless the user
   set one) to the plugin's subclass of ``Scheduler``
   (vllm/v1/core/sched/scheduler.py, :mod:`vllm_specbeam.adapter.scheduler`):
   under chunked prefill it cuts a prefill chunk that would end inside a
   tree prompt's tree, through the per-chunk hook vLLM calls for Mamba
   alignment. In the engine-core process.

Patches 2, 5, 6, 7 and 9 fall through to vLLM when no plugin method is configured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_specbeam.adapter import patches
from vllm_specbeam.adapter.engine_config import (
    configure_engine,
    is_carrier,
    plugin_config,
    vllm_carrier,
    with_plugin_config,
)
from vllm_specbeam.core.config import SpecbeamConfigError, is_plugin_method, parse

if TYPE_CHECKING:
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def register() -> None:
    """Check every vLLM symbol the plugin touches, then install its hooks.

    vLLM's loader calls this in every process, with or without a plugin
    method, so it never raises: problems are logged here and raised by patch 1
    when a plugin method is requested. Calling it again changes nothing.
    """
    from vllm.platforms import current_platform

    targets = [t for t in patches.TARGETS if t.platform is None or getattr(current_platform, f"is_{t.platform}")()]
    problems = patches.check(targets)
    if patches.CREATE_SPECULATIVE_CONFIG.path not in problems:
        patches.wrap(patches.CREATE_SPECULATIVE_CONFIG, _speculative_config)
    if problems:
        logger.error("%s\nvLLM runs without vllm-specbeam's methods.", patches.report(problems.values()))
        return
    from vllm_specbeam.adapter import beam_search_server, cpu_generators, draft_model, tree_prompt

    patches.wrap(patches.VALIDATE_PARAMS, _validate_params)
    patches.wrap(patches.VALIDATE_SPEC_DECODE_PARAMS, _validate_spec_decode)
    patches.wrap(patches.NUM_LOOKAHEAD_TOKENS, draft_model.lookahead)
    patches.wrap(patches.BLOCK_HASH_EXTRA_KEYS, tree_prompt.block_hash_extra_keys)
    patches.wrap(patches.ONLINE_BEAM_SEARCH, beam_search_server.patch)
    if current_platform.is_cpu():
        patches.wrap(patches.SAMPLE_TOKENS, cpu_generators.sample_tokens)
    if current_platform.is_cuda():
        from vllm_specbeam.adapter.attention.cuda import register_tree_backend

        # Workers resolve the backend through the registry of their own process.
        try:
            register_tree_backend()
        except SpecbeamConfigError as error:  # raised again by patch 1 for plugin methods
            logger.error("%s", error)


def _speculative_config(stock: Callable[..., SpeculativeConfig | None]) -> Callable[..., SpeculativeConfig | None]:
    """Patch 1: ``EngineArgs.create_speculative_config`` knowing the plugin's methods."""

    def create_speculative_config(
        self: EngineArgs, target_model_config: ModelConfig, target_parallel_config: ParallelConfig
    ) -> SpeculativeConfig | None:
        spec = self.speculative_config
        if is_plugin_method({"method": self.spec_method}):
            raise SpecbeamConfigError(
                "pass vllm-specbeam methods through --speculative-config '{\"method\": ...}', not --spec-method"
            )
        if not is_plugin_method(spec):
            check_known_method(spec)
            return stock(self, target_model_config, target_parallel_config)

        patches.raise_problems()
        config = parse(spec, target_tokenizer=self.tokenizer or self.model, target_model=self.model)
        configure_engine(self, target_parallel_config)
        self.additional_config = with_plugin_config(self.additional_config, config)
        self.speculative_config = vllm_carrier(config)
        try:
            return stock(self, target_model_config, target_parallel_config)
        finally:
            self.speculative_config = spec  # the user's object stays as they wrote it

    return create_speculative_config


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


def _validate_params(stock: Callable[..., Any]) -> Callable[..., Any]:
    """Patch 2: a request's plugin options and tree prompt checked at admission."""
    from vllm_specbeam.adapter import tree_prompt

    def _validate_params(self: Any, params: SamplingParams, *args: Any, **kwargs: Any) -> Any:
        result = stock(self, params, *args, **kwargs)
        config = plugin_config(self.vllm_config)
        extra = getattr(params, "extra_args", None)
        if config is not None and extra:
            try:
                config.with_overrides(extra)
                tree_prompt.check_params(params, self.vllm_config.scheduler_config)
            except (SpecbeamConfigError, tree_prompt.TreePromptError) as error:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(f"vllm-specbeam: {error}") from error
        return result

    return _validate_params


def _validate_spec_decode(stock: Callable[..., None]) -> Callable[..., None]:
    """Patch 9: no ``min_p`` / ``logit_bias`` refusal on a plugin engine (the carrier config)."""

    def _validate_spec_decode(self: SamplingParams, speculative_config: SpeculativeConfig | None) -> None:
        if speculative_config is not None and is_carrier(speculative_config):
            return
        stock(self, speculative_config)

    return _validate_spec_decode
