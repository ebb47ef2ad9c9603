"""The draft model inside vLLM's worker: loaded by vLLM, its K/V in vLLM's paged cache.

Design and the facts it rests on (vLLM 0.32.0): docs/draft-runtime.md. In short:

- **Loading.** After the target, vLLM's ``get_model`` loads the draft under a draft
  ``ModelConfig`` sharing the target's ``compilation_config``, so its attention layers
  join the target's KV-cache group (found by diffing the attention layers).
- **Slots.** Committed token ``j`` sits in the request's slot ``j``; a round's tree
  nodes take scratch slots ``root + 1 + i`` (never derived from RoPE positions), one
  forward per depth with the ancestor-only mask (CPU ``TreeStep``, CUDA
  ``GpuTreeStep``); :func:`lookahead` makes the scheduler reserve those slots.
- **Accepted nodes keep their K/V.** A sync walks last round's tree along the tokens
  committed since, moves those nodes' K/V to their committed slots and feeds only the
  rest. Example: root at slot 9, nodes ``[a, b, c]`` in slots ``[10, 11, 12]``, parents
  ``[-1, -1, 1]``, committed ``b c x``: ``b``, ``c`` move to 10, 11; only ``x`` is fed.
- **Prefix caching.** A full block the draft fed is keyed by the tokens from the
  sequence's start through it; a new request trusts the leading blocks of its prefix hit
  whose keys match its tokens, and every draft write into a block drops its key.
  :meth:`WorkerDraftRuntime.sync_step` feeds after each step what the draft lacks (for
  reuse by later hits), except requests that ran no draft forward (:meth:`~WorkerDraftRuntime.defer`)
  and every request of a drafter with lookup branches: their next sync feeds them.
- **Forwards fit the compiled shapes.** A call's rows run in forwards of at most
  ``max_num_batched_tokens`` (:func:`_split`); logits reach the host once a call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_specbeam.adapter import vllm_versions
from vllm_specbeam.adapter.attention import cpu as cpu_attention
from vllm_specbeam.adapter.attention.cuda import GpuTreeStep
from vllm_specbeam.adapter.attention.step import (
    ActiveTreeStep,
    check_tree_attention,
    distinct_kv_caches,
    move_kv_slots,
    tree_step,
)
from vllm_specbeam.adapter.engine_config import plugin_config
from vllm_specbeam.adapter.tree_prompt import shared_prefix_len
from vllm_specbeam.core.config import METHODS, SpecbeamConfig, SpecbeamConfigError
from vllm_specbeam.core.tree import ROOT, committed_path
from vllm_specbeam.draft_runtime import vocab

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.worker.utils import AttentionGroup


def block_key(previous: int, tokens: Sequence[int] | np.ndarray) -> int:
    """A full block's key: the tokens from the sequence's start through it, chained from the
    key of the block before (0 for the first), as vLLM's prefix cache keys its blocks."""
    return hash((previous, *map(int, tokens)))


def uses_worker_draft(config: SpecbeamConfig | None) -> bool:
    """Whether the engine loads a draft model into its worker (the method drafts with one)."""
    return config is not None and METHODS[config.method].needs_draft_model


def _model_dtype(draft_dtype: str, target_dtype: torch.dtype) -> torch.dtype | str:
    """The draft ``ModelConfig``'s dtype from the ``draft_dtype`` option: "auto" is the target's, as
    for vLLM's own draft models (a comparison with them compares methods, not precisions);
    "checkpoint" is vLLM's "auto". The verifiers use the very ``q`` the drafts were drawn from,
    so any precision is lossless."""
    if draft_dtype == "auto":
        return target_dtype
    return "auto" if draft_dtype == "checkpoint" else getattr(torch, draft_dtype)


class _LookaheadProperty(property):
    """A property that can carry :func:`~vllm_specbeam.adapter.patches.wrap`'s marker."""


def lookahead(stock: property) -> property:
    """``VllmConfig.num_lookahead_tokens`` reserving the in-worker draft's slots.

    vLLM gives ``custom_class`` no lookahead, so scratch slots past the
    scheduled tokens would fall on block 0 (vLLM's null block), silently
    shared by all requests. A round needs the bonus token's slot plus one per
    tree node fed to the draft (the drafter's ``draft_slots``: ``max_nodes``,
    or ``mjsd``'s beams). The scheduler reads the
    property once, in the engine-core process, where ``register()`` has run.
    vLLM 0.33 also reads it when the engine's config is made, and refuses a
    ``max_num_batched_tokens`` that does not exceed it: that is raised here,
    with the fix (:func:`~vllm_specbeam.adapter.vllm_versions.lookahead_problem`).
    """
    if stock.fget is None:
        raise TypeError("VllmConfig.num_lookahead_tokens has no getter")
    getter = stock.fget

    def num_lookahead_tokens(self: VllmConfig) -> int:
        tokens = int(getter(self))
        config = plugin_config(self)
        if not uses_worker_draft(config):
            return tokens
        assert config is not None
        lookahead = max(tokens, METHODS[config.method].drafter_class().draft_slots(config.options) + 1)
        problem = vllm_versions.lookahead_problem(self.scheduler_config.max_num_batched_tokens, lookahead)
        if problem is not None:
            raise SpecbeamConfigError(problem)
        return lookahead

    return _LookaheadProperty(num_lookahead_tokens, doc=stock.__doc__)


@dataclasses.dataclass
class _Request:
    """One request's draft state: which slots hold valid draft K/V, and this round's tree."""

    #: slots ``[0, valid)`` hold the draft's K/V of the committed tokens
    valid: int
    #: committed tokens at the last sync (the tree's root is token ``length - 1``)
    length: int = 0
    #: per tree node fed this round: its token, parent, depth and the scratch slots it attends to
    #: (ancestors and itself; its own slot is ``length + i`` for the ``i``-th node fed)
    tokens: list[int] = dataclasses.field(default_factory=list)
    parents: list[int] = dataclasses.field(default_factory=list)
    depths: list[int] = dataclasses.field(default_factory=list)
    visible: list[list[int]] = dataclasses.field(default_factory=list)

    #: with a draft vocabulary: the request's context tokens outside it (sorted), and how many tokens were read
    own_tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    tokens_read: int = 0
    #: the keys (:func:`block_key`) of its leading full blocks, those the draft holds the K/V of
    keys: list[int] = dataclasses.field(default_factory=list)

    def new_round(self, length: int) -> None:
        """Committed tokens ``[0, length)`` are the draft's; no tree node is fed yet."""
        self.valid = self.length = length
        self.tokens, self.parents, self.depths, self.visible = [], [], [], []


@dataclasses.dataclass
class _Feed:
    """The rows one forward computes for one request."""

    blocks: torch.Tensor  # [max_blocks] the request's block ids
    tokens: list[int]
    positions: list[int]  # RoPE positions
    slots: list[int]  # slot positions in the request's blocks
    seq_len: int  # slots the forward's attention may read: ``max(slots) + 1``
    #: tree nodes: the slots each row attends to besides the committed context; ``None``: causal rows
    visible: list[list[int]] | None = None
    context: int = 0
    #: with a draft vocabulary: the request's own tokens its rows are scored on as well
    own_tokens: np.ndarray | None = None

    def part(self, start: int, end: int) -> _Feed:
        """Its rows ``[start, end)`` for a forward of their own: they read the K/V of the rows
        before them from the cache, where an earlier forward wrote it."""
        slots = self.slots[start:end]
        return dataclasses.replace(
            self,
            tokens=self.tokens[start:end],
            positions=self.positions[start:end],
            slots=slots,
            seq_len=max(slots) + 1,
            visible=None if self.visible is None else self.visible[start:end],
        )

    def window(self) -> np.ndarray:
        """``[rows, seq_len - context]``: which slots from the committed context on each tree row sees."""
        visible = np.zeros((len(self.tokens), self.seq_len - self.context), dtype=bool)
        for i, slots in enumerate(self.visible or ()):
            visible[i, np.asarray(slots) - self.context] = True
        return visible


@dataclasses.dataclass
class _Forward:
    """The rows one draft forward computes: parts of feeds (:meth:`_Feed.part`), in order."""

    feeds: list[_Feed] = dataclasses.field(default_factory=list)
    rows: int = 0
    #: the forward's rows that end a whole feed (the rows ``last_only`` answers)
    last_rows: list[int] = dataclasses.field(default_factory=list)


def _split(feeds: list[_Feed], max_rows: int) -> list[_Forward]:
    """``feeds``' rows in forwards of at most ``max_rows``, filled in order; a feed is cut where
    a forward is full, so its later rows run in the next forward, after its earlier rows' K/V
    are written. Example: feeds of 700, 300 and 100 rows, ``max_rows`` 512: forwards of
    ``[512 of the first]``, ``[188 of the first, 300, 24 of the third]``, ``[76 of the third]``.
    Everything fitting (most steps): one forward of the feeds themselves."""
    forwards = [_Forward()]
    for feed in feeds:
        start = 0
        while start < len(feed.tokens):
            if forwards[-1].rows == max_rows:
                forwards.append(_Forward())
            forward = forwards[-1]
            end = min(len(feed.tokens), start + max_rows - forward.rows)
            forward.feeds.append(feed if end - start == len(feed.tokens) else feed.part(start, end))
            forward.rows += end - start
            start = end
        forwards[-1].last_rows.append(forwards[-1].rows - 1)
    return forwards


class WorkerDraftRuntime:
    """A draft model loaded by vLLM in the runner's process; the API of
    :class:`~vllm_specbeam.draft_runtime.base.DraftRuntime` (see the module docstring)."""

    def __init__(self, runner: Any, draft_model: str) -> None:
        """Load the draft next to ``runner``'s target (from the runner's ``load_model``, after the target)."""
        from vllm.compilation.backends import set_model_tag
        from vllm.config import ModelConfig, get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.model_loader import get_model

        config, target = runner.vllm_config, runner.vllm_config.model_config
        draft_config = ModelConfig(
            model=draft_model,
            runner="draft",
            tokenizer=target.tokenizer,
            tokenizer_mode=target.tokenizer_mode,
            trust_remote_code=target.trust_remote_code,
            dtype=_model_dtype(runner.tree_config.options["draft_dtype"], target.dtype),
            seed=target.seed,
            max_model_len=target.max_model_len,
            enforce_eager=target.enforce_eager,
        )
        before = set(get_layers_from_vllm_config(config, Attention))
        # The draft shares the target's compilation_config, as vLLM's DraftModelProposer's does:
        # its static_forward_context puts the draft's layers into the runner's KV-cache spec, and
        # the draft is compiled like the target (under its own model tag), at start-up by warm_up.
        problem = vllm_versions.draft_kv_cache_problem(config.cache_config.cache_dtype, draft_config.dtype)
        if problem is not None:
            raise SpecbeamConfigError(f"vllm-specbeam: {problem}")
        self.vllm_config = dataclasses.replace(config, model_config=draft_config, quant_config=None)
        with set_model_tag("draft_model"):
            self.model = get_model(vllm_config=self.vllm_config, prefix="draft_model")
        layers = get_layers_from_vllm_config(config, Attention)
        #: the draft's attention layers, by name
        self.layers = sorted(set(layers) - before)
        if not self.layers:
            raise RuntimeError(
                f"vllm-specbeam: draft model {draft_model!r} registered no attention layer in the target's "
                f"forward context; the in-worker draft needs a decoder with vLLM's Attention layers"
            )
        self.device: torch.device = runner.device
        #: rows per draft forward: vLLM compiles the draft for at most the target's batch of tokens
        #: (its piecewise backend asserts past it) and profiles the memory of no larger activation
        self.max_rows = config.scheduler_config.max_num_batched_tokens
        #: the plugin's CUDA tree backend and kernels serve the draft's layers (else the CPU tree attention)
        self.on_cuda = self.device.type != "cpu"
        check_tree_attention([layers[name].impl for name in self.layers], self.device)
        self._attention = [layers[name] for name in self.layers]
        #: (layer, its KV cache) once per cache tensor, for moving accepted nodes' K/V (set by bind)
        self._kv_layers: list[tuple[torch.nn.Module, torch.Tensor]] = []
        self.runner = runner
        self.vocab_size = target.get_vocab_size()
        path = runner.tree_config.options["draft_vocab"]
        self._head = _VocabularyHead(self.model, vocab.load(path).ids, self.vocab_size, path) if path else None
        self._group: AttentionGroup | None = None
        self._requests: dict[str, _Request] = {}
        #: requests that run no draft forward this step (:meth:`defer`), until its :meth:`sync_step`
        self._deferred: set[str] = set()
        #: block id -> the key (:func:`block_key`) of the tokens whose draft K/V the whole block holds
        self._fed_blocks: dict[int, int] = {}
        #: feed a request's committed tokens only at its drafter's syncs, never after a step
        #: (:meth:`sync_step`): with lookup branches most steps run no draft, and a request the
        #: lookup serves throughout never feeds its prompt
        self.feeds_at_syncs_only = runner.tree_config.options.get("lookup", "off") != "off"

    def bind(self) -> None:
        """Find the attention group holding the draft's layers (after the runner's ``initialize_kv_cache``).

        A draft whose K/V shape differs from the target's gets a group of its
        own; one of the same shape shares the target's (same spec, same builder).
        """
        groups = [g for g in self.runner.attn_groups[0] if set(self.layers) <= set(g.layer_names)]
        if len(groups) != 1:
            found = [g.layer_names for g in self.runner.attn_groups[0]]
            raise RuntimeError(
                f"vllm-specbeam: the draft's attention layers {self.layers} are not in one attention group "
                f"of the target's KV-cache group (groups: {found}); the draft needs one attention backend and "
                f"the target's block size"
            )
        self._group = groups[0]
        self._kv_layers = distinct_kv_caches(self._attention)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the draft at start-up (the worker's warm-up), as vLLM's warm-up compiles the target.

        Compiled lazily instead, the first request's step would pay the compile
        (26.7 s for a tiny draft in docs/draft-runtime.md's spike, minutes on a
        loaded machine). vLLM compiles one graph for the engine's range of token
        counts, so a few dummy tokens compile what every later forward uses.
        Without attention metadata and with no slot mapping, vLLM's CPU
        attention returns at once and writes no K/V, as in its own warm-up.
        """
        from vllm.config import CompilationMode
        from vllm.forward_context import set_forward_context

        if self.vllm_config.compilation_config.mode == CompilationMode.NONE:
            return
        num_tokens = 16
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens, slot_mapping={}):
            self.model(
                input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
                positions=torch.arange(num_tokens, device=self.device),
            )  # [num_tokens, hidden], discarded

    # ------------------------------------------------------------ the DraftRuntime API
    @property
    def live_requests(self) -> int:
        return len(self._requests)

    def sync_many(self, requests: Sequence[tuple[str, Sequence[int] | np.ndarray, int]]) -> list[torch.Tensor | None]:
        results: list[torch.Tensor | None] = [None] * len(requests)
        admitted, feeds = [], []
        for k, (req_id, token_ids, reserve) in enumerate(requests):
            tokens = [int(t) for t in token_ids]
            if not tokens:
                raise ValueError(f"request {req_id!r} has no committed token to draft from")
            if len(tokens) + reserve > self._capacity(req_id, len(tokens) + reserve):
                continue  # no slots for the tree: undrafted (sync_step still feeds its tokens)
            blocks = self._blocks(req_id)
            request = self._request(req_id, blocks, tokens)
            self._keep_accepted(request, blocks, tokens[request.length :])
            start = min(request.valid, len(tokens) - 1)  # the last token's logits are the answer
            feeds.append(self._committed_feed(blocks, tokens, start))
            if self._head is not None:
                request.own_tokens = self._head.own_tokens(request.own_tokens, tokens[request.tokens_read :])
                request.tokens_read = len(tokens)
                feeds[-1].own_tokens = request.own_tokens
            request.new_round(len(tokens))
            admitted.append((k, request, blocks, tokens))
        for (k, *_), logits in zip(admitted, self._forward(feeds, last_only=True)):
            results[k] = logits[0]
        for _, request, blocks, tokens in admitted:
            self._key_fed_blocks(request, blocks, tokens)
        return results

    def extend_many(self, nodes: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        feeds = []
        for req_id, tokens, parents in nodes:
            request = self._requests[req_id]
            first = len(request.depths)
            if len(parents) != len(tokens):
                raise ValueError(f"{len(tokens)} tree nodes but {len(parents)} parents")
            slots, positions, visible = [], [], []
            for i, parent in enumerate(int(p) for p in parents):
                if not ROOT <= parent < first + i:
                    raise ValueError(f"tree node {first + i} has parent {parent}: not an earlier node")
                slot = request.length + len(request.depths)  # scratch: root + 1 + node index
                request.tokens.append(int(tokens[i]))
                request.parents.append(parent)
                request.depths.append(1 if parent == ROOT else request.depths[parent] + 1)
                request.visible.append(([] if parent == ROOT else request.visible[parent]) + [slot])
                slots.append(slot)
                positions.append(request.length - 1 + request.depths[-1])
                visible.append(request.visible[-1])
            capacity = self._capacity(req_id, slots[-1] + 1) if slots else 0
            if slots and slots[-1] >= capacity:
                raise ValueError(
                    f"request {req_id!r}: tree node slot {slots[-1]} is past its {capacity} slots "
                    "(sync_many's reserve counts the nodes a round may feed)"
                )
            # A row that sees every scratch slot before its own is plain causal attention (a chain,
            # e.g. max_width 1: node slots [L, L+1, L+2] at depths [1, 2, 3]): no tree mask needed.
            causal = all(v == list(range(request.length, s + 1)) for v, s in zip(visible, slots))
            feeds.append(
                _Feed(
                    self._blocks(req_id),
                    [int(t) for t in tokens],
                    positions,
                    slots,
                    slots[-1] + 1,
                    None if causal and slots == list(range(slots[0], slots[-1] + 1)) else visible,
                    request.length,
                    request.own_tokens,
                )
            )
        return self._forward(feeds, last_only=False)

    def defer(self, req_ids: Iterable[str]) -> None:
        deferred = set(req_ids)
        self._deferred |= deferred
        self.runner.tree_counts.record_draft(deferred=len(deferred))

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)

    # ------------------------------------------------------------ every step
    def sync_step(self) -> None:
        """Feed every scheduled request's committed tokens the draft lacks (no logits).

        Runs after each step's sampling, drafting or not, so that a block the target
        computed holds the draft's K/V too when a later request's prefix hit reuses
        it (a block the draft never fed is not trusted: :meth:`_request`).
        """
        batch = self.runner.input_batch
        feeds, fed = [], []
        deferred, self._deferred = self._deferred, set()
        for index, req_id in enumerate(batch.req_ids):
            blocks = self._blocks(req_id)
            request = self._request(req_id, blocks, batch.token_ids_cpu[index])
            if req_id in deferred or self.feeds_at_syncs_only:  # its next sync feeds what the draft lacks
                continue
            end = min(int(batch.num_tokens_no_spec[index]), self._capacity(req_id, 0))
            tree = self.runner.prompt_tree(req_id)
            if tree is not None:
                # a beam search's scoring request: only the blocks before its tree's root can serve
                # a later prefix hit; the draft K/V of the rest would never be read
                end = min(end, shared_prefix_len(int(batch.num_prompt_tokens[index]), tree.num_nodes, self.block_size))
            if request.valid >= end:  # most steps: sync_many already fed it (no copy of the context then)
                continue
            tokens = batch.token_ids_cpu[index, :end].tolist()
            self._keep_accepted(request, blocks, tokens[request.length :])
            if request.valid < end:  # the kept nodes may cover the rest
                feeds.append(self._committed_feed(blocks, tokens, request.valid))
                request.new_round(end)
            fed.append((request, blocks, tokens))
        if feeds:
            self._forward(feeds, last_only=None)
        for request, blocks, tokens in fed:
            self._key_fed_blocks(request, blocks, tokens)

    def _request(self, req_id: str, blocks: torch.Tensor, tokens: Sequence[int] | np.ndarray) -> _Request:
        """The request's state; a new one trusts the leading blocks of its prefix hit
        (:meth:`_prefix_hit`) whose draft K/V were fed for its own tokens (``tokens``: from its start)."""
        request = self._requests.get(req_id)
        if request is None:
            size, keys = self.block_size, []
            for i in range(self._prefix_hit(req_id) // size):
                key = block_key(keys[-1] if keys else 0, tokens[i * size : (i + 1) * size])
                if self._fed_blocks.get(int(blocks[i])) != key:
                    break
                keys.append(key)
            request = self._requests[req_id] = _Request(valid=len(keys) * size, keys=keys)
        return request

    def _key_fed_blocks(self, request: _Request, blocks: torch.Tensor, tokens: Sequence[int]) -> None:
        """Key the request's full blocks the draft now holds the K/V of (slots ``[0, valid)``)."""
        size = self.block_size
        for i in range(len(request.keys), request.valid // size):
            request.keys.append(block_key(request.keys[-1] if request.keys else 0, tokens[i * size : (i + 1) * size]))
            self._fed_blocks[int(blocks[i])] = request.keys[-1]

    def _written(self, blocks: torch.Tensor, slots: Sequence[int]) -> None:
        """The draft writes ``slots`` of these blocks: their keys no longer describe them."""
        for index in {slot // self.block_size for slot in slots}:
            self._fed_blocks.pop(int(blocks[index]), None)

    # ------------------------------------------------------------ whose blocks (the engine's requests')
    def _blocks(self, req_id: str) -> torch.Tensor:
        """The request's block ids ``[max_blocks]``: its row of the runner's block table."""
        table = self.runner.input_batch.block_table[0]
        return table.block_table.cpu[self.runner.input_batch.req_id_to_index[req_id]]

    def _capacity(self, req_id: str, needed: int) -> int:
        """Slots the request's blocks hold now (the scheduler reserved ``needed`` or fewer), at most
        ``max_model_len``."""
        table = self.runner.input_batch.block_table[0]
        allocated = int(table.num_blocks_per_row[self.runner.input_batch.req_id_to_index[req_id]]) * table.block_size
        return min(allocated, self.runner.vllm_config.model_config.max_model_len)

    def _prefix_hit(self, req_id: str) -> int:
        """Leading tokens of a new request whose target K/V are in its blocks: its prefix-cache hit."""
        return int(self.runner.input_batch.num_computed_tokens_cpu[self.runner.input_batch.req_id_to_index[req_id]])

    def _moved_caches(self) -> list[tuple[torch.nn.Module, torch.Tensor]]:
        """``(layer, KV cache)`` pairs :meth:`_keep_accepted` moves K/V in."""
        return self._kv_layers

    @property
    def block_size(self) -> int:
        return int(self.runner.input_batch.block_table[0].block_size)

    # ------------------------------------------------------------ internals
    def _keep_accepted(self, request: _Request, blocks: torch.Tensor, committed: Sequence[int]) -> None:
        """Make the K/V of last round's nodes that ``committed`` (the tokens after the root) walks
        the draft's K/V of those tokens (the module docstring's example); ``request.valid`` then counts them."""
        if not len(committed) or not request.tokens or request.valid != request.length:
            return  # nothing committed since the round, or no tree fed
        path = committed_path(request.tokens, request.parents, committed)  # nodes fed this round
        moved = [(node, depth) for depth, node in enumerate(path) if node != depth]
        if moved:
            targets = [request.length + depth for _, depth in moved]
            self._written(blocks, targets)
            src = self._slots(blocks, [request.length + node for node, _ in moved])  # [moves]
            dst = self._slots(blocks, targets)  # [moves]
            device = self.device
            move_kv_slots(self._moved_caches(), src.to(device), dst.to(device), [len(moved)], self.on_cuda)
        self.runner.tree_counts.record_draft(kv_kept=len(path), kv_moves=len(moved))
        request.new_round(request.length)
        request.valid += len(path)

    def _slots(self, blocks: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """The KV-cache slots of ``positions`` in a request's ``blocks``."""
        size = self.block_size
        positions_t = torch.tensor(positions, dtype=torch.int64)  # [n]
        return blocks[positions_t // size].to(torch.int64) * size + positions_t % size  # [n]

    @staticmethod
    def _committed_feed(blocks: torch.Tensor, tokens: list[int], start: int) -> _Feed:
        span = list(range(start, len(tokens)))
        return _Feed(blocks, tokens[start:], span, span, len(tokens))

    @torch.inference_mode()
    def _forward(self, feeds: list[_Feed], last_only: bool | None) -> list[torch.Tensor]:
        """Draft forwards over all feeds, of at most ``max_rows`` rows each (:func:`_split`):
        logits at each feed's rows, its last row only with ``last_only``, none with ``None``
        (the K/V writes are the point)."""
        if not feeds:
            return []
        if self._group is None:
            raise RuntimeError("WorkerDraftRuntime.bind must run after the runner's initialize_kv_cache")
        answered: list[torch.Tensor] = []  # per forward: [rows the call answers, hidden]
        for forward in _split(feeds, self.max_rows):
            hidden = self._timed_run(forward.feeds)  # [forward.rows, hidden]
            if last_only:
                ends = torch.tensor(forward.last_rows, dtype=torch.int64, device=self.device)  # [feeds it ends]
                hidden = hidden[ends]  # [feeds it ends, hidden]
            if last_only is not None:
                answered.append(hidden)
        if last_only is None:
            return []
        hidden = answered[0] if len(answered) == 1 else torch.cat(answered)  # [sum(counts), hidden]
        counts = [1 if last_only else len(f.tokens) for f in feeds]
        if self._head is not None:
            logits = self._head.logits(hidden, [f.own_tokens for f in feeds], counts)
        else:
            logits = self._vocab_logits(self.model.compute_logits(hidden))
        return list(logits.cpu().split(counts))  # host sync off CPU: the drafters sample on the host

    def _timed_run(self, feeds: list[_Feed]) -> torch.Tensor:
        """:meth:`_run`, its seconds and rows reported to the runner (what prices a draft forward)."""
        start = time.perf_counter()
        hidden = self._run(feeds)
        if self.on_cuda:
            torch.cuda.synchronize(self.device)  # host sync: the forward's time (its logits are read next)
        self.runner.record_draft_forward(int(hidden.shape[0]), time.perf_counter() - start)
        return hidden

    def _run(self, feeds: list[_Feed]) -> torch.Tensor:
        """One draft forward over the feeds' rows, writing their K/V: the hidden states ``[T, hidden]``."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        for feed in feeds:
            self._written(feed.blocks, feed.slots)
        device = self.device
        rows = torch.stack([f.blocks for f in feeds]).to(device)  # [R, max_blocks]
        counts = [len(f.tokens) for f in feeds]
        starts = np.concatenate([[0], np.cumsum(counts)])  # [R + 1]
        slots = torch.cat([self._slots(f.blocks, f.slots) for f in feeds]).to(device)  # [T]
        query_start = torch.from_numpy(starts.astype(np.int32))  # [R + 1]
        seq_lens = torch.tensor([f.seq_len for f in feeds], dtype=torch.int32)  # [R]
        common = CommonAttentionMetadata(
            query_start_loc=query_start.to(device),
            query_start_loc_cpu=query_start,
            seq_lens=seq_lens.to(device),
            num_reqs=len(feeds),
            num_actual_tokens=int(starts[-1]),
            max_query_len=max(counts),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=rows,
            slot_mapping=slots,
            causal=True,
        )
        assert self._group is not None
        metadata = self._group.get_metadata_builder().build(0, common)
        tokens = torch.tensor([t for f in feeds for t in f.tokens], dtype=torch.int64).to(device)  # [T]
        positions = torch.tensor([p for f in feeds for p in f.positions], dtype=torch.int64).to(device)  # [T]
        with (
            tree_step(self._tree_step(feeds, starts)),
            set_forward_context(
                {name: metadata for name in self.layers},
                self.vllm_config,
                num_tokens=int(starts[-1]),
                slot_mapping={name: slots for name in self.layers},
            ),
        ):
            return self.model(input_ids=tokens, positions=positions)  # [T, hidden]

    def _tree_step(self, feeds: list[_Feed], starts: np.ndarray) -> ActiveTreeStep | None:
        """The ancestor-only mask for tree rows: each sees the committed context and its visible slots."""
        trees = [(r, f) for r, f in enumerate(feeds) if f.visible is not None]
        if not trees:
            return None
        if self.on_cuda:
            windows = {r: (f.context, f.window()) for r, f in trees}
            return GpuTreeStep.for_windows(starts, [f.seq_len for f in feeds], windows, self.device)
        num_rows = max(len(f.tokens) for _, f in trees)
        num_keys = max(f.seq_len for _, f in trees)
        query_rows = torch.zeros(len(trees), num_rows, dtype=torch.int64)  # [R, Qmax]
        row_valid = torch.zeros(len(trees), num_rows, dtype=torch.bool)  # [R, Qmax]
        key_mask = torch.zeros(len(trees), num_rows, num_keys, dtype=torch.bool)  # [R, Qmax, Kmax]
        for t, (r, feed) in enumerate(trees):
            n = len(feed.tokens)
            query_rows[t, :n] = torch.arange(int(starts[r]), int(starts[r]) + n)
            row_valid[t, :n] = True
            key_mask[t, :n, : feed.context] = True
            key_mask[t, :n, feed.context : feed.seq_len] = torch.from_numpy(feed.window())
        empty = torch.zeros(0, dtype=torch.int64)
        return cpu_attention.TreeStep(
            torch.tensor([r for r, _ in trees], dtype=torch.int64), query_rows, row_valid, key_mask, empty, empty
        )

    def _vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits as float32 over the target's vocabulary (-inf where the draft has no column)."""
        logits = logits[:, : self.vocab_size].float()
        missing = self.vocab_size - logits.shape[-1]
        return torch.nn.functional.pad(logits, (0, missing), value=float("-inf")) if missing else logits


class SearchDraftRuntime(WorkerDraftRuntime):
    """The engine's draft for speculative beam searches (:mod:`vllm_specbeam.adapter.beam_search`),
    run between engine steps through ``collective_rpc``, its K/V in blocks of its own.

    A search's draft state is one per prompt (the beams' common prefix, their
    tails as tree nodes below it), and prompts are not engine requests: vLLM's
    pool has no blocks for them. This runtime shares the engine's loaded draft
    (model, attention layers, metadata builder, vocabulary head) and keeps a
    :class:`_BlockPool` of the draft's layers only, bound to those layers for
    its forwards. Its keys are the searches' prompt keys; :meth:`remove`
    returns their blocks.
    """

    def __init__(self, engine: WorkerDraftRuntime) -> None:
        # the engine's loaded draft, none of its requests
        self.__dict__.update({k: v for k, v in vars(engine).items() if k != "_requests"})
        self._requests = {}
        self._deferred = set()
        self._fed_blocks = {}  # keys of its pool's blocks (it trusts none: _prefix_hit)
        max_len = self.runner.vllm_config.model_config.max_model_len
        self.pool = _BlockPool(self._attention, self.block_size, -(-max_len // self.block_size))

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)
            self.pool.release(req_id)

    def _blocks(self, req_id: str) -> torch.Tensor:
        return self.pool.row(req_id)

    def _capacity(self, req_id: str, needed: int) -> int:
        return min(self.pool.reserve(req_id, needed), self.runner.vllm_config.model_config.max_model_len)

    def _prefix_hit(self, req_id: str) -> int:
        return 0

    def _moved_caches(self) -> list[tuple[torch.nn.Module, torch.Tensor]]:
        return self.pool.caches()

    def _forward(self, feeds: list[_Feed], last_only: bool | None) -> list[torch.Tensor]:
        with self.pool.bound():
            return super()._forward(feeds, last_only)


class _BlockPool:
    """KV blocks for the draft's attention layers alone, outside vLLM's pool.

    Block ``b`` is row ``b`` of one tensor per layer, shaped like the layer's
    own cache (vLLM 0.32.0 CPU layout: ``[num_blocks, kv_heads, block_size,
    2 * head_size]``). Blocks are handed out per key as it grows; the tensors
    double when the free list runs dry (block ids stay valid) and are dropped
    when no key holds a block, so an idle engine keeps no memory here.
    """

    def __init__(self, layers: list[torch.nn.Module], block_size: int, row_blocks: int) -> None:
        self.layers = layers
        self.block_size = block_size
        self.row_blocks = row_blocks
        self.tensors: list[torch.Tensor] = []  # per layer [num_blocks, ...]
        self.free: list[int] = []
        self.rows: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.tensors[0].shape[0] if self.tensors else 0

    def reserve(self, key: str, slots: int) -> int:
        """Give ``key`` blocks for ``slots`` slots (at most a row's); the slots it holds."""
        row = self.rows.setdefault(key, [])
        missing = min(-(-slots // self.block_size), self.row_blocks) - len(row)
        if missing > len(self.free):
            self._grow(missing - len(self.free))
        for _ in range(max(missing, 0)):
            row.append(self.free.pop())
        return len(row) * self.block_size

    def row(self, key: str) -> torch.Tensor:
        """``key``'s block ids ``[row_blocks]`` (zeros past its own, never read)."""
        row = torch.zeros(self.row_blocks, dtype=torch.int32)
        held = self.rows.get(key, [])
        row[: len(held)] = torch.tensor(held, dtype=torch.int32)
        return row

    def release(self, key: str) -> None:
        self.free += self.rows.pop(key, [])
        if not self.rows:
            self.tensors, self.free = [], []

    def caches(self) -> list[tuple[torch.nn.Module, torch.Tensor]]:
        return list(zip(self.layers, self.tensors))

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The layers read and write this pool's tensors (vLLM reads ``layer.kv_cache`` at each call)."""
        engine = [layer.kv_cache for layer in self.layers]
        for layer, tensor in zip(self.layers, self.tensors):
            layer.kv_cache = tensor
        try:
            yield
        finally:
            for layer, kv_cache in zip(self.layers, engine):
                layer.kv_cache = kv_cache

    def _grow(self, at_least: int) -> None:
        old = self.num_blocks
        new = max(2 * old, old + at_least, 16)
        grown = []
        for layer, tensor in zip(self.layers, self.tensors or [None] * len(self.layers)):
            bigger = _blocks_like(layer.kv_cache if tensor is None else tensor, new)
            if tensor is not None:
                bigger[:old] = tensor
            grown.append(bigger)
        self.tensors = grown
        self.free = list(range(new - 1, old - 1, -1)) + self.free


def _blocks_like(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Zeros for ``num_blocks`` blocks laid out in memory as ``cache`` is (vLLM's CUDA caches are
    permuted views, e.g. ``LBNHC``; kernels read strides, the CPU attention its own layout)."""
    order = sorted(range(cache.dim()), key=lambda d: -cache.stride(d))  # dims, outermost in memory first
    shape = [num_blocks if d == 0 else cache.shape[d] for d in order]
    blocks = torch.zeros(shape, dtype=cache.dtype, device=cache.device)  # [dims in memory order]
    return blocks.permute([order.index(d) for d in range(cache.dim())])


class _VocabularyHead:
    """The draft's logits over a draft vocabulary and each request's own tokens, ``-inf`` elsewhere
    (:mod:`vllm_specbeam.draft_runtime.vocab`).

    The vocabulary's rows of the output layer are copied once, contiguous, so
    one product reads only them; a request's context tokens outside the
    vocabulary are scored from the layer's own rows, gathered per forward.
    Example: vocabulary ``[0, 5, 9]``, a prompt holding token 7: that
    request's rows get logits at ``[0, 5, 7, 9]`` and ``-inf`` at every other id.
    """

    def __init__(self, model: Any, ids: np.ndarray, vocab_size: int, path: str) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        lm_head, processor = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
        if processor is None or not isinstance(getattr(lm_head, "quant_method", None), UnquantizedEmbeddingMethod):
            raise SpecbeamConfigError(
                f"draft_vocab {path}: the draft model has no plain (unquantized) lm_head and logits processor "
                "to take rows from; remove draft_vocab"
            )
        assert lm_head is not None
        if lm_head.tp_size > 1:
            raise SpecbeamConfigError(
                "draft_vocab is not supported with tensor parallelism (each rank holds a slice of the draft's "
                "output layer): remove draft_vocab or run with tensor_parallel_size=1"
            )
        if int(ids[-1]) >= vocab_size:
            raise SpecbeamConfigError(
                f"draft_vocab {path} holds token id {int(ids[-1])}, past the target's vocabulary ({vocab_size}); "
                "rebuild it with the target's tokenizer"
            )
        self.weight = lm_head.weight  # [padded vocab, hidden]
        self.bias = getattr(lm_head, "bias", None)
        self.ids = torch.from_numpy(ids).to(self.weight.device)  # [K]
        self.kept = self.weight[self.ids].contiguous()  # [K, hidden]
        self.kept_bias = None if self.bias is None else self.bias[self.ids].contiguous()  # [K]
        self.processor = processor
        self.vocab_size = vocab_size
        self.in_vocabulary = np.zeros(vocab_size, dtype=bool)  # [V]
        self.in_vocabulary[ids] = True

    def own_tokens(self, known: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        """``known`` with the tokens of ``tokens`` outside the vocabulary added (sorted, distinct)."""
        new = np.unique(np.asarray(tokens, dtype=np.int64))
        return np.union1d(known, new[~self.in_vocabulary[new]])

    def logits(self, hidden: torch.Tensor, own: Sequence[np.ndarray | None], counts: Sequence[int]) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` for ``hidden`` ``[T, hidden]``, whose rows go ``counts`` per request."""
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), device=hidden.device)  # [T, V]
        out.index_copy_(1, self.ids, self._project(hidden, self.kept, self.kept_bias))
        start = 0
        for tokens, count in zip(own, counts):
            if tokens is not None and tokens.size:
                columns = torch.from_numpy(tokens).to(hidden.device)
                bias = None if self.bias is None else self.bias[columns]
                rows = self._project(hidden[start : start + count], self.weight[columns], bias)  # [count, own]
                out[start : start + count].index_copy_(1, columns, rows)
            start += count
        return out

    def _project(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The output layer on some of its rows, then vLLM's ``LogitsProcessor`` soft cap and scale."""
        logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
        if self.processor.soft_cap is not None:
            logits = torch.tanh(logits / self.processor.soft_cap) * self.processor.soft_cap
        if self.processor.scale != 1.0:
            logits = logits * self.processor.scale
        return logits
