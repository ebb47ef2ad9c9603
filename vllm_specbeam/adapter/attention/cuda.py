"""Tree attention on CUDA: an attention backend for vLLM's paged KV cache.

vLLM has no backend that takes a per-request tree mask, so this module adds
one, a subclass of vLLM's Triton backend registered in vLLM's ``CUSTOM`` slot:

* in a verification step with trees (the runner's active
  :class:`GpuTreeStep`), the impl's forward runs the plugin's
  :func:`~vllm_specbeam.kernels.tree_attention.tree_attention` kernel for the
  *whole* batch: tree rows get their ancestor words, every other row
  all-zero words, which the kernel treats as causal;
* otherwise (prefills, plain decodes, all-chain steps, CUDA graph capture)
  it is exactly vLLM's Triton path;
* the KV-cache write is always vLLM's (``do_kv_cache_update`` is inherited).

The ancestor words are built on the host once per step
(:meth:`GpuTreeStep.build`) and copied to the device once, so attention runs
outside CUDA graphs: eager or ``PIECEWISE``, never full graphs
(:func:`vllm_specbeam.adapter.engine_config.configure_engine` picks or checks
the mode; the metadata builder declares no full-graph support).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from typing_extensions import override

# vLLM 0.32.0 v1/attention/backends/triton_attn.py: the backend, its metadata
# builder and impl are subclassed; their metadata is used as is.
# vLLM 0.32.0 v1/attention/backend.py: the cudagraph-support and attention-type enums.
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from vllm_specbeam.adapter.attention.step import active_step, masked_rows, node_layout
from vllm_specbeam.core.config import SpecbeamConfigError
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.kernels.reference import BITS_PER_WORD, pack_ancestor_mask
from vllm_specbeam.kernels.tree_attention import admits, admits_head_size, tree_attention


# ------------------------------------------------------------------ the step
@dataclass(frozen=True)
class GpuTreeStep:
    """This step's trees as the CUDA backend needs them (built once per step).

    ``tree_mask`` has one row of ancestor words per scheduled token (format in
    :mod:`vllm_specbeam.kernels.reference`). As on CPU, only rows whose
    ancestors are *not* simply all earlier rows (:func:`.step.masked_rows`)
    get words; all others are zero, i.e. causal, which is already right for
    them. A step where no row needs the tree mask (all trees are chains) has
    no ``tree_mask`` and runs vLLM's stock kernel, with its split-KV decode path.
    """

    #: ``[num_tokens, W]`` int64 on the device, or None when every row is causal
    tree_mask: torch.Tensor | None
    #: token rows of all draft nodes and the positions they must have (host)
    node_rows: torch.Tensor
    node_positions: torch.Tensor
    #: ``[num_reqs]`` int32 on the device: the first key each request's mask bits count from (the
    #: kernel's ``tree_base``); None: its first scheduled row, as in a verification step
    tree_base: torch.Tensor | None = None

    @property
    def needs_attention(self) -> bool:
        return self.tree_mask is not None

    @classmethod
    def build(
        cls,
        request_starts: Sequence[int],
        first_rows: Sequence[int],
        context_lens: Sequence[int],
        trees: Sequence[DraftTree],
        num_tokens: int,
        device: torch.device,
    ) -> GpuTreeStep:
        """``request_starts[r]`` is the first token row of verifying request r,
        ``first_rows[r]`` the row of its tree's root, whose position is
        ``context_lens[r]``; ``num_tokens`` rows are scheduled in all."""
        node_rows, node_positions = node_layout(first_rows, context_lens, trees)
        words = ancestor_words(request_starts, first_rows, trees, num_tokens)
        return cls(None if words is None else _to_device(words, device), node_rows, node_positions)

    @classmethod
    def for_windows(
        cls,
        query_start_loc: np.ndarray,
        seq_lens: Sequence[int],
        windows: dict[int, tuple[int, np.ndarray]],
        device: torch.device,
    ) -> GpuTreeStep:
        """A draft model's tree depth: request ``r`` in ``windows`` has ``(context, visible)``, its rows
        seeing keys ``[0, context)`` and, of the keys from ``context`` on, those ``visible`` ``[rows, keys]``
        marks (ancestors written by earlier depths and the row itself); other requests' rows are causal.

        Example: context 10 (root in slot 9), depth-1 nodes in slots 10, 11, depth-2 nodes in slots 12,
        13 fed now: ``seq_len`` 14, the node in slot 13 under the one in slot 11 sees bits ``{1, 3}``.
        """
        num_tokens = int(query_start_loc[-1])
        query_lens = np.diff(query_start_loc)  # [num_reqs]
        base = np.asarray(seq_lens, dtype=np.int32) - query_lens.astype(np.int32)  # [num_reqs]
        num_words = _num_words(max(visible.shape[1] for _, visible in windows.values()))
        words = np.zeros((num_tokens, num_words), dtype=np.int64)
        for r, (context, visible) in windows.items():
            base[r] = context
            start = int(query_start_loc[r])
            words[start : start + visible.shape[0]] = pack_ancestor_mask(visible, num_words)
        empty = torch.zeros(0, dtype=torch.int64)
        return cls(_to_device(words, device), empty, empty, _to_device(base, device))


def ancestor_words(
    request_starts: Sequence[int], first_rows: Sequence[int], trees: Sequence[DraftTree], num_tokens: int
) -> np.ndarray | None:
    """The kernel's ``tree_mask`` for the batch, or None if every row is causal.

    Bits count the request's scheduled rows from its first one. Rows may come
    before the root (a resumed request recomputing tokens): every tree row sees
    those, then the tree's root, its ancestors and itself.
    """
    fixes = [(first - start, first, tree, rows) for start, first, tree in zip(request_starts, first_rows, trees)
             if (rows := masked_rows(tree)).size]  # fmt: skip
    if not fixes:
        return None
    num_words = _num_words(max(before + tree.num_nodes + 1 for before, _, tree, _ in fixes))
    words = np.zeros((num_tokens, num_words), dtype=np.int64)
    for before, first, tree, rows in fixes:
        visible = np.zeros((rows.size, before + tree.num_nodes + 1), dtype=bool)
        visible[:, :before] = True
        visible[:, before:] = tree.ancestor_mask[rows]
        words[first + rows] = pack_ancestor_mask(visible, num_words)
    return words


def _num_words(bits: int) -> int:
    """Mask words for ``bits`` bits a row. The word count is a compile-time constant of the
    kernel: a power of two bounds how many variants long windows can make Triton build."""
    needed = -(-bits // BITS_PER_WORD)
    return 1 << (needed - 1).bit_length()


def _to_device(words: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(words)
    if device.type != "cuda":
        return host
    # Pinned, so the copy is asynchronous and overlaps the rest of the step's
    # input preparation (the caching host allocator keeps the buffer alive).
    return host.pin_memory().to(device, non_blocking=True)


# --------------------------------------------------------------- the backend
class TreeTritonAttentionImpl(TritonAttentionImpl):
    """vLLM's Triton attention, or the tree kernel for a whole tree step."""

    @override
    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        # vLLM 0.32.0 triton_attn.py: the stock impl may fuse fp8 output
        # quantisation into attention; the tree kernel writes the model dtype.
        return False

    @override
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        step = active_step()
        if attn_metadata is None or step is None or not step.needs_attention:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        return self._tree_forward(query, kv_cache, attn_metadata, output, step.tree_mask, step.tree_base)

    def _tree_forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        tree_mask: torch.Tensor,
        tree_base: torch.Tensor | None,
    ) -> torch.Tensor:
        """All rows of the batch with the tree kernel; vLLM has already
        written this step's keys and values into the cache."""
        num_tokens = attn_metadata.num_actual_tokens
        if tree_mask.shape[0] != num_tokens:
            raise RuntimeError(
                f"vllm-specbeam: the tree mask has {tree_mask.shape[0]} rows but attention runs "
                f"{num_tokens} tokens (micro-batching and full CUDA graphs are not supported with trees)"
            )
        # vLLM 0.32.0 triton_attn.py TritonAttentionImpl.forward: the same
        # key/value views of the logical [blocks, kv_heads, block_size, 2 * head] cache.
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        tree_attention(
            query[:num_tokens], key_cache, value_cache, attn_metadata.block_table,
            attn_metadata.query_start_loc, attn_metadata.seq_lens, tree_mask, self.scale,
            attn_metadata.max_query_len, out=output[:num_tokens], tree_base=tree_base,
        )  # fmt: skip
        return output


class TreeTritonAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    """vLLM's Triton metadata, declared unusable in full CUDA graphs.

    vLLM 0.32.0 gpu_model_runner.py ``_check_and_update_cudagraph_mode``
    reads this: a full-graph mode that gets past ``engine_config.configure_engine``
    (vLLM may turn PIECEWISE into FULL itself, e.g. with empty
    ``splitting_ops``) is downgraded to PIECEWISE or refused at start-up.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER


class TreeTritonAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton backend minus what the tree kernel does not implement.

    The ``supports_*`` answers make vLLM 0.32.0's selector
    (``AttentionBackend.validate_configuration``, v1/attention/backend.py)
    refuse such models at start-up with its list of reasons, instead of tree
    steps computing the wrong attention.
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    @override
    def get_name() -> str:
        # vLLM 0.32.0 model_executor/layers/attention/attention.py maps the
        # name back to the enum (AttentionBackendEnum[name]): the slot's name.
        return "CUSTOM"

    @staticmethod
    @override
    def get_impl_cls() -> type[TreeTritonAttentionImpl]:
        return TreeTritonAttentionImpl

    @staticmethod
    @override
    def get_builder_cls() -> type[TreeTritonAttentionMetadataBuilder]:
        return TreeTritonAttentionMetadataBuilder

    @classmethod
    @override
    def supports_head_size(cls, head_size: int) -> bool:
        return admits_head_size(head_size)

    @classmethod
    @override
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    @override
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    @override
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    @override
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    @override
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    @override
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    @override
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    @override
    def supports_batch_invariance(cls) -> bool:
        return False


def check_tree_backend(attention_impls: Sequence[torch.nn.Module]) -> None:
    """At start-up: every attention layer runs this backend, with nothing the
    selector cannot see that the tree kernel lacks."""
    for impl in attention_impls:
        if not isinstance(impl, TreeTritonAttentionImpl):
            raise ValueError(
                f"vllm-specbeam tree verification on CUDA needs its attention backend in every layer, "
                f"but a layer uses {type(impl).__name__} (the model chose its own backend)"
            )
        if not admits(impl.head_size, impl.num_queries_per_kv):
            raise ValueError(
                f"vllm-specbeam's tree kernel is compiled and checked for head sizes that are multiples of 16 "
                f"from 32 to 256 and for query heads per KV head up to 64 x 128 / head size (padded to powers "
                f"of two), but the model has head size {impl.head_size} with {impl.num_queries_per_kv} query "
                f"heads per KV head; use vLLM's built-in speculative methods for this model"
            )
        problems = [name for name, used in (
            ("ALiBi", impl.alibi_slopes is not None),
            ("logit soft-capping", bool(impl.logits_soft_cap)),
            ("chunked local attention", impl.chunk_lookback > -1),
        ) if used]  # fmt: skip
        if problems:
            raise ValueError(
                f"vllm-specbeam tree verification on CUDA does not support {', '.join(problems)} "
                f"(model layer uses it); use a model without it or vLLM's built-in speculative methods"
            )


# --------------------------------------------------------------- registration
def register_tree_backend() -> None:
    """Put this backend in vLLM's ``CUSTOM`` attention-backend slot.

    vLLM 0.32.0 v1/attention/backends/registry.py: ``register_backend`` maps
    the slot to a class path, per process (the plugin calls this in every
    process on CUDA). Another package's registration is not overwritten.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = f"{TreeTritonAttentionBackend.__module__}.{TreeTritonAttentionBackend.__qualname__}"
    slot = AttentionBackendEnum.CUSTOM
    if slot.is_overridden() and slot.get_path() != path:
        raise SpecbeamConfigError(
            f"vLLM's CUSTOM attention backend slot already holds {slot.get_path()}; vllm-specbeam "
            f"needs it for tree attention on CUDA: uninstall or disable the package that registers it"
        )
    register_backend(slot, path)
