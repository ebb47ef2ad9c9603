"""What the CPU and the CUDA tree attention share: the layout of a step's
draft nodes, which rows need the tree mask, and the step the attention layers
see during one forward pass.

The runner builds one step object per engine step (:class:`.cpu.TreeStep` or
:class:`.cuda.GpuTreeStep`) and makes it active around the model's forward
with :func:`tree_step`; the attention layers read it with :func:`active_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from vllm_specbeam.core.tree import DraftTree


class ActiveTreeStep(Protocol):
    """The part of a step object every attention backend and the runner use."""

    #: token rows of all draft nodes and the positions they must have
    node_rows: torch.Tensor  # [sum of nodes]
    node_positions: torch.Tensor  # [sum of nodes]: context length + depth

    @property
    def needs_attention(self) -> bool:
        """Whether any row of the step needs the tree mask (else stock attention is right)."""
        ...


def node_layout(
    first_rows: Sequence[int], context_lens: Sequence[int], trees: Sequence[DraftTree]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of all draft nodes and the positions they must have.

    Example: a tree with depths ``[1, 1, 2]`` whose root is row 5 after a
    7-token context gives rows ``[6, 7, 8]`` and positions ``[8, 8, 9]``.
    """
    node_rows = np.concatenate([first + 1 + np.arange(t.num_nodes) for first, t in zip(first_rows, trees)])
    node_positions = np.concatenate([c + t.depths for c, t in zip(context_lens, trees)])
    return torch.from_numpy(node_rows), torch.from_numpy(node_positions)


def masked_rows(tree: DraftTree) -> np.ndarray:
    """Verification rows whose ancestors are not exactly all earlier rows.

    Only those need the tree mask: causal attention is already right for a
    chain and for the first branch of a depth-first tree. Example: parents
    ``[-1, 0, -1]`` (root -> a -> b, root -> c) give rows ``[3]`` (c).
    """
    mask = tree.ancestor_mask  # lower triangular: ancestors come first
    return np.flatnonzero((mask != np.tri(*mask.shape, dtype=bool)).any(axis=1))


_ACTIVE: ActiveTreeStep | None = None


def check_tree_attention(attention_impls: Sequence[torch.nn.Module], device: torch.device) -> None:
    """At start-up: the layers' attention backend is one the plugin's tree attention extends
    (the target's layers, and an in-worker draft's)."""
    if device.type == "cpu":
        from vllm_specbeam.adapter.attention.cpu import check_cpu_attention_supported

        check_cpu_attention_supported(attention_impls)
    else:
        from vllm_specbeam.adapter.attention.cuda import check_tree_backend

        check_tree_backend(attention_impls)


def move_kv_slots(
    kv_layers: Sequence[tuple[torch.nn.Module, torch.Tensor]],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    counts: Sequence[int],
    on_cuda: bool,
    layer_pointers: torch.Tensor | None = None,
) -> None:
    """Copy K/V from ``src_slots`` to ``dst_slots`` ``[moves]`` in every layer; ``counts`` moves per
    request, each request's in root-first order (an accepted path: a move never overwrites a
    later move's source). On CPU vLLM's cache through its ISA layout; on CUDA the ``kv_move``
    kernel, one launch for all layers (they must share a shape: one model's layers)."""
    if src_slots.numel() == 0:
        return
    if not on_cuda:
        from vllm_specbeam.adapter.attention.cpu import move_kv

        move_kv(kv_layers, src_slots, dst_slots)
        return
    from vllm_specbeam.kernels import kv_move

    caches = [kv_cache for _, kv_cache in kv_layers]
    cu_moves = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))  # [requests + 1]
    pointers = kv_move.layer_pointer_table(caches) if layer_pointers is None else layer_pointers
    kv_move.kv_move(caches, src_slots, dst_slots, cu_moves.to(src_slots.device), pointers)


def distinct_kv_caches(layers: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """``(layer, its KV cache)`` once per cache tensor (layers may share one), for the accepted-K/V moves."""
    by_cache: dict[int, tuple[torch.nn.Module, torch.Tensor]] = {}
    for layer in layers:
        kv_cache = layer.kv_cache
        if isinstance(kv_cache, torch.Tensor):
            by_cache.setdefault(kv_cache.data_ptr(), (layer, kv_cache))
    return list(by_cache.values())


def active_step() -> ActiveTreeStep | None:
    """The step of the forward pass running now, or None outside tree steps."""
    return _ACTIVE


@contextlib.contextmanager
def tree_step(step: ActiveTreeStep | None) -> Iterator[None]:
    """Make ``step`` visible to the attention layers during one forward pass."""
    global _ACTIVE
    _ACTIVE = step
    try:
        yield
    finally:
        _ACTIVE = None
