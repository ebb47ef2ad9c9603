"""vllm-specbeam: tree- and forest-verified speculative decoding for vLLM.

The package is laid out like its architecture (docs/architecture.md):
``core`` and ``methods`` never import vLLM, ``adapter`` is the one package that
knows vLLM (0.32 and 0.33). The public Python API is re-exported here lazily, so
importing the package (as vLLM's plugin loader does) loads nothing else.
"""

from __future__ import annotations

from typing import Any

#: name -> module of the public API (the beam search and beam sampling run on a vLLM engine)
_PUBLIC = {
    "BeamSampling": "vllm_specbeam.adapter.beam_sampling",
    "BeamSamplingParams": "vllm_specbeam.adapter.beam_sampling",
    "SpeculativeBeamSampling": "vllm_specbeam.adapter.beam_sampling",
    "SpeculativeBeamSearch": "vllm_specbeam.adapter.beam_search",
    "beam_search": "vllm_specbeam.adapter.beam_search",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'vllm_specbeam' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)
