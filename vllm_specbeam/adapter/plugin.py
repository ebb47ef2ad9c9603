"""Entry point vLLM calls in every process (``vllm.general_plugins``).

``register`` looks up every vLLM symbol the plugin touches
(:data:`vllm_specbeam.adapter.patches.TARGETS`, each with its patch number and
why; rendered into docs/patches.md), then installs the patches. If a symbol is
missing, or another vLLM is installed, nothing else is installed, the
problems are logged, and requesting a plugin method fails with them. The
functions below are the patches, named "Patch N" as in ``TARGETS``; patches
2, 5, 6, 7, 9, 11 and 12 fall through to vLLM when no plugin method is configured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_specbeam.adapter import metrics, patches
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
    patches.wrap(patches.COMPLETION_BEAM_PARAMS, beam_search_server.carrying_request)
    patches.wrap(patches.CHAT_BEAM_PARAMS, beam_search_server.carrying_request)
    patches.wrap(patches.PROMETHEUS_STAT_LOGGER, metrics.with_controller_metrics)
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
        metrics.share_directory()  # before the engine core's processes start: they inherit it
        configure_engine(self, target_parallel_config, config)
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
