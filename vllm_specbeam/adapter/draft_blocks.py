"""Where an in-worker draft runtime's KV blocks come from (:mod:`vllm_specbeam.adapter.draft_model`).

The engine's draft writes its K/V into the engine's requests' own blocks, beside the target's
(:class:`RequestBlocks`); the speculative beam search's draft, whose prompts are not engine
requests, into blocks of its own (:class:`BlockPool`). A runtime asks its source, per key
(a request id, a search's prompt key), for the block ids, the slots they hold and the caches
its K/V moves touch; both sources have the target's block size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from vllm_specbeam.adapter.attention.step import distinct_kv_caches

#: ``(attention layer, its KV cache)``, once per cache tensor
KvLayers = list[tuple[torch.nn.Module, torch.Tensor]]


def kv_slots(blocks: torch.Tensor, request_slots: Sequence[int], block_size: int) -> torch.Tensor:
    """The KV-cache slots ``[n]`` of a key's ``request_slots`` (slot ``j``: its token ``j``'s) in its ``blocks``."""
    slots = torch.tensor(request_slots, dtype=torch.int64)  # [n]
    return blocks[slots // block_size].to(torch.int64) * block_size + slots % block_size  # [n]


class DraftBlocks(Protocol):
    """A draft runtime's source of KV blocks, per key."""

    @property
    def block_size(self) -> int: ...

    def blocks(self, key: str) -> torch.Tensor:
        """The key's block ids ``[max_blocks]``, on the host."""
        ...

    def capacity(self, key: str, needed: int) -> int:
        """Slots the key's blocks hold once ``needed`` are asked for (fewer where they do not fit),
        at most ``max_model_len``."""
        ...

    def prefix_hit(self, key: str) -> int:
        """Leading slots of a new key whose target K/V its blocks hold already (its prefix-cache hit)."""
        ...

    def release(self, key: str) -> None:
        """The key is done: its blocks may go."""
        ...

    def kv_caches(self) -> KvLayers:
        """The draft's layers with the caches its K/V moves touch."""
        ...

    def bound(self) -> contextlib.AbstractContextManager[None]:
        """While open, the draft's layers read and write this source's caches."""
        ...


class RequestBlocks:
    """The engine's requests' blocks: their rows of the runner's block table. The draft's layers
    are in the target's KV-cache group, so vLLM binds their caches and gives every request slots
    in them (:func:`~vllm_specbeam.adapter.draft_model.lookahead` reserves the tree's)."""

    def __init__(self, runner: Any, layers: list[torch.nn.Module]) -> None:
        self.runner = runner
        self.layers = layers
        #: the draft's layers' caches, once per cache tensor (set by :meth:`bind`)
        self._kv_layers: KvLayers = []

    def bind(self) -> None:
        """Take the caches vLLM bound to the draft's layers (after the runner's ``initialize_kv_cache``)."""
        self._kv_layers = distinct_kv_caches(self.layers)

    @property
    def block_size(self) -> int:
        return int(self.runner.input_batch.block_table[0].block_size)

    def blocks(self, key: str) -> torch.Tensor:
        return self.runner.input_batch.block_table[0].block_table.cpu[self._batch_index(key)]

    def capacity(self, key: str, needed: int) -> int:
        """The slots of the blocks the scheduler gave the request (it reserved ``needed`` or fewer)."""
        table = self.runner.input_batch.block_table[0]
        allocated = int(table.num_blocks_per_row[self._batch_index(key)]) * table.block_size
        return min(allocated, self.runner.vllm_config.model_config.max_model_len)

    def prefix_hit(self, key: str) -> int:
        return int(self.runner.input_batch.num_computed_tokens_cpu[self._batch_index(key)])

    def release(self, key: str) -> None:
        """Nothing to free: vLLM frees a finished request's blocks."""

    def kv_caches(self) -> KvLayers:
        return self._kv_layers

    def bound(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # vLLM bound the layers to these caches

    def _batch_index(self, key: str) -> int:
        return self.runner.input_batch.req_id_to_index[key]


class BlockPool:
    """KV blocks for the draft's attention layers alone, outside vLLM's pool.

    Block ``b`` is row ``b`` of one tensor per layer, shaped like the layer's
    own cache (vLLM 0.32.0 CPU layout: ``[num_blocks, kv_heads, block_size,
    2 * head_size]``). Blocks are handed out per key as it grows; the tensors
    double when the free list runs dry (block ids stay valid) and are dropped
    when no key holds a block, so an idle engine keeps no memory here.
    """

    def __init__(self, layers: list[torch.nn.Module], block_size: int, max_model_len: int) -> None:
        self.layers = layers
        self.block_size = block_size
        self.max_model_len = max_model_len
        #: blocks a key may hold: enough for ``max_model_len`` slots
        self.row_blocks = -(-max_model_len // block_size)
        self.caches: list[torch.Tensor] = []  # per layer [num_blocks, ...]
        self.free: list[int] = []
        #: each key's block ids, in slot order
        self.key_blocks: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.caches[0].shape[0] if self.caches else 0

    def capacity(self, key: str, needed: int) -> int:
        """Give ``key`` blocks for ``needed`` slots (at most a row's)."""
        held = self.key_blocks.setdefault(key, [])
        missing = min(-(-needed // self.block_size), self.row_blocks) - len(held)
        if missing > len(self.free):
            self._grow(missing - len(self.free))
        for _ in range(max(missing, 0)):
            held.append(self.free.pop())
        return min(len(held) * self.block_size, self.max_model_len)

    def blocks(self, key: str) -> torch.Tensor:
        """``key``'s block ids ``[row_blocks]`` (zeros past its own, never read)."""
        row = torch.zeros(self.row_blocks, dtype=torch.int32)
        held = self.key_blocks.get(key, [])
        row[: len(held)] = torch.tensor(held, dtype=torch.int32)
        return row

    def prefix_hit(self, key: str) -> int:
        """None: a search's prompt is not an engine request, its blocks hold nothing yet."""
        return 0

    def release(self, key: str) -> None:
        self.free += self.key_blocks.pop(key, [])
        if not self.key_blocks:
            self.caches, self.free = [], []

    def kv_caches(self) -> KvLayers:
        return list(zip(self.layers, self.caches))

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The layers read and write this pool's tensors (vLLM reads ``layer.kv_cache`` at each call)."""
        engine_caches = [layer.kv_cache for layer in self.layers]
        for layer, cache in zip(self.layers, self.caches):
            layer.kv_cache = cache
        try:
            yield
        finally:
            for layer, engine_cache in zip(self.layers, engine_caches):
                layer.kv_cache = engine_cache

    def _grow(self, at_least: int) -> None:
        old_blocks = self.num_blocks
        new_blocks = max(2 * old_blocks, old_blocks + at_least, 16)
        grown = []
        for layer, cache in zip(self.layers, self.caches or [None] * len(self.layers)):
            bigger = _blocks_like(layer.kv_cache if cache is None else cache, new_blocks)
            if cache is not None:
                bigger[:old_blocks] = cache
            grown.append(bigger)
        self.caches = grown
        self.free = list(range(new_blocks - 1, old_blocks - 1, -1)) + self.free


def _blocks_like(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Zeros for ``num_blocks`` blocks laid out in memory as ``cache`` is (vLLM's CUDA caches are
    permuted views, e.g. ``LBNHC``; kernels read strides, the CPU attention its own layout)."""
    order = sorted(range(cache.dim()), key=lambda d: -cache.stride(d))  # dims, outermost in memory first
    shape = [num_blocks if d == 0 else cache.shape[d] for d in order]
    blocks = torch.zeros(shape, dtype=cache.dtype, device=cache.device)  # [dims in memory order]
    return blocks.permute([order.index(d) for d in range(cache.dim())])
