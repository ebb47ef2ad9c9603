"""vLLM's own Triton kernels, for checking the plugin's kernels against them
under ``TRITON_INTERPRET=1`` (tests and ``benchmarks/bench_kernels.py``)."""

from __future__ import annotations

import torch


def import_vllm_triton_module(name: str):
    """Import a vLLM Triton-kernel module with the real Triton.

    vLLM's CPU build swaps ``vllm.triton_utils.triton`` for a placeholder when
    it finds no GPU driver, which turns its kernels into plain functions. For
    checking against vLLM's kernels under ``TRITON_INTERPRET=1`` we point the
    placeholders at the real modules and (re)import. On GPU builds this is a
    plain import.
    """
    import importlib
    import sys

    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    if not triton_utils.HAS_TRITON and triton_utils.triton is not triton:
        triton_utils.triton, triton_utils.tl = triton, tl
        for mod in [m for m in sys.modules if m.startswith("vllm.v1.attention.ops.")]:
            del sys.modules[mod]
    return importlib.import_module(name)


def vllm_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V exactly as vLLM's TRITON_ATTN backend does (``do_kv_cache_update``)."""
    from unittest import mock

    ops = import_vllm_triton_module("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    scale = torch.ones(1, dtype=torch.float32, device=key.device)
    if key.is_cuda:
        ops.triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "auto", scale, scale)
        return
    # The launcher asks CUDA for the SM version only to pick a tile size.
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        ops.triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "auto", scale, scale)
