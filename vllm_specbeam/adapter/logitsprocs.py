"""The logits processors of a plugin engine's runner (patch 9, docs/patches.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import LogitsProcessors


def builtin_logitsprocs(stock: Callable[..., LogitsProcessors]) -> Callable[..., LogitsProcessors]:
    """vLLM's ``build_logitsprocs`` with all built-in processors (min-p, logit bias,
    min-tokens) although the engine speculates: requests that use them are never
    drafted here, and vLLM's sampler applies them to their one row a step (patch 9)."""

    def build(
        vllm_config: VllmConfig,
        device: torch.device,
        is_pin_memory: bool,
        is_pooling_model: bool,
        custom_logitsprocs: Sequence[Any] = (),
    ) -> LogitsProcessors:
        if is_pooling_model or custom_logitsprocs:  # vLLM's answer (custom ones are refused with speculation)
            return stock(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    return build
