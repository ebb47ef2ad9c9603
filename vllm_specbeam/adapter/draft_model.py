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

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_specbeam.adapter import vllm_versions
from vllm_specbeam.adapter.attention import cpu as cpu_attention
from vllm_specbeam.adapter.attention.cuda import GpuTreeStep
from vllm_specbeam.adapter.attention.step import (
    ActiveTreeStep,
    check_tree_attention,
    move_kv_slots,
    tree_step,
)
from vllm_specbeam.adapter.draft_blocks import BlockPool, DraftBlocks, RequestBlocks, kv_slots
from vllm_specbeam.adapter.engine_config import plugin_config
from vllm_specbeam.adapter.tree_prompt import shared_prefix_len
from vllm_specbeam.core.config import METHODS, SpecbeamConfig, SpecbeamConfigError
from vllm_specbeam.core.tree import ROOT, committed_path
from vllm_specbeam.draft_runtime import vocab

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
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

    #: slots ``[0, kv_len)`` hold the draft's K/V of the committed tokens
    kv_len: int
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
        self.kv_len = self.length = length
        self.tokens, self.parents, self.depths, self.visible = [], [], [], []

    def add_node(self, token: int, parent: int) -> int:
        """A tree node under ``parent`` (``ROOT`` or a node fed earlier this round): its scratch slot."""
        node = len(self.depths)
        if not ROOT <= parent < node:
            raise ValueError(f"tree node {node} has parent {parent}: not an earlier node")
        slot = self.length + node  # scratch: root + 1 + node index
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        self.visible.append(([] if parent == ROOT else self.visible[parent]) + [slot])
        return slot


def _accepted_path(request: _Request, committed: Sequence[int] | np.ndarray) -> list[int] | None:
    """Last round's nodes (fed this round) that ``committed`` (the tokens after the root) walks;
    ``None`` when nothing was committed since the round, or no tree was fed."""
    if not len(committed) or not request.tokens or request.kv_len != request.length:
        return None
    return committed_path(request.tokens, request.parents, committed)


@dataclasses.dataclass(kw_only=True)
class _Feed:
    """The rows one forward computes for one request."""

    blocks: torch.Tensor  # [max_blocks] the request's block ids
    tokens: list[int]
    rope_positions: list[int]
    #: the rows' slots in the request's blocks (slot ``j`` holds its token ``j``'s K/V)
    slots: list[int]
    seq_len: int  # slots the forward's attention may read: ``max(slots) + 1``
    #: tree nodes: the slots each row attends to besides the committed context; ``None``: causal rows
    visible: list[list[int]] | None = None
    context: int = 0
    #: with a draft vocabulary: the request's own tokens its rows are scored on as well
    own_tokens: np.ndarray | None = None

    @classmethod
    def committed(cls, blocks: torch.Tensor, tokens: list[int], start: int) -> _Feed:
        """Committed tokens ``[start, len(tokens))``, causal, each at its own slot and position."""
        span = list(range(start, len(tokens)))
        return cls(blocks=blocks, tokens=tokens[start:], rope_positions=span, slots=span, seq_len=len(tokens))

    def part(self, start: int, end: int) -> _Feed:
        """Its rows ``[start, end)`` for a forward of their own: they read the K/V of the rows
        before them from the cache, where an earlier forward wrote it."""
        slots = self.slots[start:end]
        return dataclasses.replace(
            self,
            tokens=self.tokens[start:end],
            rope_positions=self.rope_positions[start:end],
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
    num_rows: int = 0
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
            if forwards[-1].num_rows == max_rows:
                forwards.append(_Forward())
            forward = forwards[-1]
            end = min(len(feed.tokens), start + max_rows - forward.num_rows)
            forward.feeds.append(feed if end - start == len(feed.tokens) else feed.part(start, end))
            forward.num_rows += end - start
            start = end
        forwards[-1].last_rows.append(forwards[-1].num_rows - 1)
    return forwards


def _tree_step(feeds: list[_Feed], starts: np.ndarray, on_cuda: bool, device: torch.device) -> ActiveTreeStep | None:
    """The ancestor-only mask for a forward's tree rows (``starts``: each feed's first row), for the
    CUDA tree backend or the CPU tree attention: each row sees the committed context and its
    visible slots; ``None`` where every row is causal."""
    windows = {r: (f.context, f.window()) for r, f in enumerate(feeds) if f.visible is not None}
    if not windows:
        return None
    if on_cuda:
        return GpuTreeStep.for_windows(starts, [f.seq_len for f in feeds], windows, device)
    return cpu_attention.TreeStep.for_windows(
        list(windows),
        [np.arange(int(starts[r]), int(starts[r]) + len(feeds[r].tokens)) for r in windows],
        list(windows.values()),
    )


def _draft_model_config(runner: Any, draft_model: str) -> ModelConfig:
    """The draft's ``ModelConfig``: the target's tokenizer, seed and length, the ``draft_dtype`` option's dtype."""
    from vllm.config import ModelConfig

    target = runner.vllm_config.model_config
    return ModelConfig(
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


def _load(config: VllmConfig, draft_config: ModelConfig) -> tuple[VllmConfig, torch.nn.Module]:
    """The draft's ``VllmConfig`` and the draft, loaded by vLLM's ``get_model``."""
    from vllm.compilation.backends import set_model_tag
    from vllm.model_executor.model_loader import get_model

    # The draft shares the target's compilation_config, as vLLM's DraftModelProposer's does:
    # its static_forward_context puts the draft's layers into the runner's KV-cache spec, and
    # the draft is compiled like the target (under its own model tag), at start-up by warm_up.
    problem = vllm_versions.draft_kv_cache_problem(config.cache_config.cache_dtype, draft_config.dtype)
    if problem is not None:
        raise SpecbeamConfigError(f"vllm-specbeam: {problem}")
    vllm_config = dataclasses.replace(config, model_config=draft_config, quant_config=None)
    with set_model_tag("draft_model"):
        return vllm_config, get_model(vllm_config=vllm_config, prefix="draft_model")


class LoadedDraft:
    """The draft model vLLM loaded next to the target, and what every runtime on it shares: its
    attention layers (in the target's KV-cache group), their metadata builder, its dtype (its
    ``vllm_config``) and its vocabulary head. It holds no request state and no blocks: a runtime
    runs it on rows in the blocks of its own block source (:mod:`.draft_blocks`)."""

    def __init__(self, runner: Any, draft_model: str) -> None:
        """Load the draft next to ``runner``'s target (from the runner's ``load_model``, after the target)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        config = runner.vllm_config
        draft_config = _draft_model_config(runner, draft_model)
        before = set(get_layers_from_vllm_config(config, Attention))
        self.vllm_config, self.model = _load(config, draft_config)
        layers = get_layers_from_vllm_config(config, Attention)
        #: the draft's attention layers, by name
        self.layer_names = sorted(set(layers) - before)
        if not self.layer_names:
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
        check_tree_attention([layers[name].impl for name in self.layer_names], self.device)
        #: the attention layers themselves, in the order of their names
        self.attention_layers: list[torch.nn.Module] = [layers[name] for name in self.layer_names]
        self.vocab_size = config.model_config.get_vocab_size()
        path = runner.tree_config.options["draft_vocab"]
        self.head = _VocabularyHead(self.model, vocab.load(path).ids, self.vocab_size, path) if path else None
        #: the attention group holding the draft's layers (set by :meth:`bind`)
        self.group: AttentionGroup | None = None

    def bind(self, attention_groups: Sequence[AttentionGroup]) -> None:
        """Find the attention group holding the draft's layers (after the runner's ``initialize_kv_cache``).

        A draft whose K/V shape differs from the target's gets a group of its
        own; one of the same shape shares the target's (same spec, same builder).
        """
        groups = [g for g in attention_groups if set(self.layer_names) <= set(g.layer_names)]
        if len(groups) != 1:
            found = [g.layer_names for g in attention_groups]
            raise RuntimeError(
                f"vllm-specbeam: the draft's attention layers {self.layer_names} are not in one attention group "
                f"of the target's KV-cache group (groups: {found}); the draft needs one attention backend and "
                f"the target's block size"
            )
        self.group = groups[0]

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

    def run(self, feeds: list[_Feed], block_size: int) -> torch.Tensor:
        """One draft forward over the feeds' rows, writing their K/V: the hidden states ``[T, hidden]``."""
        from vllm.forward_context import set_forward_context

        counts = [len(f.tokens) for f in feeds]
        starts = np.concatenate([[0], np.cumsum(counts)])  # [R + 1]
        slot_mapping = torch.cat([kv_slots(f.blocks, f.slots, block_size) for f in feeds]).to(self.device)  # [T]
        metadata = self._metadata(feeds, starts, slot_mapping)
        tokens = torch.tensor([t for f in feeds for t in f.tokens], dtype=torch.int64).to(self.device)  # [T]
        positions = torch.tensor([p for f in feeds for p in f.rope_positions], dtype=torch.int64).to(self.device)  # [T]
        with (
            tree_step(_tree_step(feeds, starts, self.on_cuda, self.device)),
            set_forward_context(
                {name: metadata for name in self.layer_names},
                self.vllm_config,
                num_tokens=int(starts[-1]),
                slot_mapping={name: slot_mapping for name in self.layer_names},
            ),
        ):
            return self.model(input_ids=tokens, positions=positions)  # [T, hidden]

    def _metadata(self, feeds: list[_Feed], starts: np.ndarray, slot_mapping: torch.Tensor) -> Any:
        """One forward's attention metadata, from the draft's builder (feed ``r``'s rows start at ``starts[r]``)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        device = self.device
        query_start = torch.from_numpy(starts.astype(np.int32))  # [R + 1]
        seq_lens = torch.tensor([f.seq_len for f in feeds], dtype=torch.int32)  # [R]
        common = CommonAttentionMetadata(
            query_start_loc=query_start.to(device),
            query_start_loc_cpu=query_start,
            seq_lens=seq_lens.to(device),
            num_reqs=len(feeds),
            num_actual_tokens=int(starts[-1]),
            max_query_len=int(np.diff(starts).max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=torch.stack([f.blocks for f in feeds]).to(device),  # [R, max_blocks]
            slot_mapping=slot_mapping,
            causal=True,
        )
        assert self.group is not None
        return self.group.get_metadata_builder().build(0, common)

    def logits(self, hidden: torch.Tensor, feeds: list[_Feed], counts: list[int]) -> torch.Tensor:
        """Float32 logits ``[T, target vocab]`` for ``hidden`` ``[T, hidden]``, ``counts`` rows per feed
        (``-inf`` where the draft has no column, or outside a draft vocabulary and the feed's own tokens)."""
        if self.head is not None:
            return self.head.logits(hidden, [f.own_tokens for f in feeds], counts)
        logits = self.model.compute_logits(hidden)[:, : self.vocab_size].float()
        missing = self.vocab_size - logits.shape[-1]
        return torch.nn.functional.pad(logits, (0, missing), value=float("-inf")) if missing else logits


class PagedDraftRuntime:
    """A loaded draft's state per key (request or prompt), its K/V in the blocks of a block source:
    the API of :class:`~vllm_specbeam.draft_runtime.base.DraftRuntime` (see the module docstring).
    Its counters go to the runner (``tree_counts``, ``record_draft_forward``)."""

    def __init__(self, runner: Any, draft: LoadedDraft, block_source: DraftBlocks) -> None:
        self.runner = runner
        self.draft = draft
        self.block_source = block_source
        self._requests: dict[str, _Request] = {}
        #: block id -> the key (:func:`block_key`) of the tokens whose draft K/V the whole block holds
        self._fed_blocks: dict[int, int] = {}

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
            if len(tokens) + reserve > self.block_source.capacity(req_id, len(tokens) + reserve):
                continue  # no slots for the tree: undrafted (sync_step still feeds its tokens)
            blocks = self.block_source.blocks(req_id)
            request = self._request(req_id, blocks, tokens)
            feeds.append(self._sync_feed(request, blocks, tokens))
            admitted.append((k, request, blocks, tokens))
        for (k, *_), logits in zip(admitted, self._forward(feeds, last_only=True)):
            results[k] = logits[0]
        for _, request, blocks, tokens in admitted:
            self._key_fed_blocks(request, blocks, tokens)
        return results

    def sync_rows(self, req_id: str, token_ids: Sequence[int] | np.ndarray) -> int:
        request, length = self._requests.get(req_id), len(token_ids)
        if request is None:
            return length  # a prefix hit may hold some of them: priced as none (it reads nothing here)
        kept = _accepted_path(request, token_ids[request.length :]) or []
        return length - min(request.kv_len + len(kept), length - 1)

    def extend_many(self, nodes: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        return self._forward([self._tree_feed(req_id, tokens, parents) for req_id, tokens, parents in nodes], False)

    def defer(self, req_ids: Iterable[str]) -> None:
        self.runner.tree_counts.record_draft(deferred=len(set(req_ids)))

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)
            self.block_source.release(req_id)

    def _sync_feed(self, request: _Request, blocks: torch.Tensor, tokens: list[int]) -> _Feed:
        """A sync's rows: the committed tokens the draft lacks once last round's accepted nodes are
        kept, and the last token at least (its logits are the answer); a new round then starts."""
        self._keep_accepted(request, blocks, tokens[request.length :])
        feed = _Feed.committed(blocks, tokens, min(request.kv_len, len(tokens) - 1))
        if self.draft.head is not None:
            request.own_tokens = self.draft.head.own_tokens(request.own_tokens, tokens[request.tokens_read :])
            request.tokens_read = len(tokens)
            feed.own_tokens = request.own_tokens
        request.new_round(len(tokens))
        return feed

    def _tree_feed(self, req_id: str, tokens: Sequence[int], parents: Sequence[int]) -> _Feed:
        """One tree depth of a request: its nodes join the round's tree, each in its scratch slot."""
        request = self._requests[req_id]
        first = len(request.depths)
        if len(parents) != len(tokens):
            raise ValueError(f"{len(tokens)} tree nodes but {len(parents)} parents")
        slots = [request.add_node(int(token), int(parent)) for token, parent in zip(tokens, parents)]
        capacity = self.block_source.capacity(req_id, slots[-1] + 1) if slots else 0
        if slots and slots[-1] >= capacity:
            raise ValueError(
                f"request {req_id!r}: tree node slot {slots[-1]} is past its {capacity} slots "
                "(sync_many's reserve counts the nodes a round may feed)"
            )
        visible = request.visible[first:]
        # A row that sees every scratch slot before its own is plain causal attention (a chain,
        # e.g. max_width 1: node slots [L, L+1, L+2] at depths [1, 2, 3]): no tree mask needed.
        causal = all(v == list(range(request.length, s + 1)) for v, s in zip(visible, slots))
        return _Feed(
            blocks=self.block_source.blocks(req_id),
            tokens=[int(t) for t in tokens],
            rope_positions=[request.length - 1 + depth for depth in request.depths[first:]],
            slots=slots,
            seq_len=slots[-1] + 1,
            visible=None if causal and slots == list(range(slots[0], slots[-1] + 1)) else visible,
            context=request.length,
            own_tokens=request.own_tokens,
        )

    def _request(self, req_id: str, blocks: torch.Tensor, tokens: Sequence[int] | np.ndarray) -> _Request:
        """The request's state; a new one trusts the leading blocks of its prefix hit
        (``prefix_hit``) whose draft K/V were fed for its own tokens (``tokens``: from its start)."""
        request = self._requests.get(req_id)
        if request is None:
            size, keys = self.block_source.block_size, []
            for i in range(self.block_source.prefix_hit(req_id) // size):
                key = block_key(keys[-1] if keys else 0, tokens[i * size : (i + 1) * size])
                if self._fed_blocks.get(int(blocks[i])) != key:
                    break
                keys.append(key)
            request = self._requests[req_id] = _Request(kv_len=len(keys) * size, keys=keys)
        return request

    def _key_fed_blocks(self, request: _Request, blocks: torch.Tensor, tokens: Sequence[int]) -> None:
        """Key the request's full blocks the draft now holds the K/V of (slots ``[0, kv_len)``)."""
        size = self.block_source.block_size
        for i in range(len(request.keys), request.kv_len // size):
            request.keys.append(block_key(request.keys[-1] if request.keys else 0, tokens[i * size : (i + 1) * size]))
            self._fed_blocks[int(blocks[i])] = request.keys[-1]

    def _unkey_written(self, blocks: torch.Tensor, slots: Sequence[int]) -> None:
        """The draft writes ``slots`` of these blocks: their keys no longer describe them."""
        for index in {slot // self.block_source.block_size for slot in slots}:
            self._fed_blocks.pop(int(blocks[index]), None)

    def _keep_accepted(self, request: _Request, blocks: torch.Tensor, committed: Sequence[int]) -> None:
        """Make the K/V of last round's nodes that ``committed`` (the tokens after the root) walks
        the draft's K/V of those tokens (the module docstring's example); ``request.kv_len`` then counts them."""
        path = _accepted_path(request, committed)
        if path is None:
            return
        moved = [(node, depth) for depth, node in enumerate(path) if node != depth]
        if moved:
            targets = [request.length + depth for _, depth in moved]
            self._unkey_written(blocks, targets)
            size, device = self.block_source.block_size, self.draft.device
            src = kv_slots(blocks, [request.length + node for node, _ in moved], size)  # [moves]
            dst = kv_slots(blocks, targets, size)  # [moves]
            caches = self.block_source.kv_caches()
            move_kv_slots(caches, src.to(device), dst.to(device), [len(moved)], self.draft.on_cuda)
        self.runner.tree_counts.record_draft(kv_kept=len(path), kv_moves=len(moved))
        request.new_round(request.length)
        request.kv_len += len(path)

    @torch.inference_mode()
    def _forward(self, feeds: list[_Feed], last_only: bool | None) -> list[torch.Tensor]:
        """Draft forwards over all feeds, of at most ``max_rows`` rows each (:func:`_split`):
        logits at each feed's rows, its last row only with ``last_only``, none with ``None``
        (the K/V writes are the point)."""
        if not feeds:
            return []
        if self.draft.group is None:
            raise RuntimeError("WorkerDraftRuntime.bind must run after the runner's initialize_kv_cache")
        with self.block_source.bound():
            hidden = self._hidden(feeds, last_only)  # [sum(counts), hidden]
            if hidden is None:
                return []
            counts = [1 if last_only else len(f.tokens) for f in feeds]
            logits = self.draft.logits(hidden, feeds, counts)
            return list(logits.cpu().split(counts))  # host sync off CPU: the drafters sample on the host

    def _hidden(self, feeds: list[_Feed], last_only: bool | None) -> torch.Tensor | None:
        """The hidden states the call answers, over its forwards: every row, each feed's last with
        ``last_only``, none with ``None``."""
        answered: list[torch.Tensor] = []  # per forward: [rows the call answers, hidden]
        for forward in _split(feeds, self.draft.max_rows):
            hidden = self._timed_run(forward.feeds)  # [forward.num_rows, hidden]
            if last_only:
                ends = torch.tensor(forward.last_rows, dtype=torch.int64, device=self.draft.device)  # [feeds it ends]
                hidden = hidden[ends]  # [feeds it ends, hidden]
            if last_only is not None:
                answered.append(hidden)
        if last_only is None:
            return None
        return answered[0] if len(answered) == 1 else torch.cat(answered)

    def _timed_run(self, feeds: list[_Feed]) -> torch.Tensor:
        """One forward (:meth:`LoadedDraft.run`), its seconds and rows reported to the runner (what
        prices a draft forward)."""
        start = time.perf_counter()
        for feed in feeds:
            self._unkey_written(feed.blocks, feed.slots)
        hidden = self.draft.run(feeds, self.block_source.block_size)
        if self.draft.on_cuda:
            torch.cuda.synchronize(self.draft.device)  # host sync: the forward's time (its logits are read next)
        self.runner.record_draft_forward(int(hidden.shape[0]), time.perf_counter() - start)
        return hidden


class WorkerDraftRuntime(PagedDraftRuntime):
    """The engine's draft: its requests' K/V in their own blocks, beside the target's; fed after
    each step (:meth:`sync_step`) so that a later prefix hit finds the draft's K/V too."""

    def __init__(self, runner: Any, draft_model: str) -> None:
        """Load the draft next to ``runner``'s target (from the runner's ``load_model``, after the target)."""
        draft = LoadedDraft(runner, draft_model)
        self.request_blocks = RequestBlocks(runner, draft.attention_layers)
        super().__init__(runner, draft, self.request_blocks)
        #: requests that run no draft forward this step (:meth:`defer`), until its :meth:`sync_step`
        self._deferred: set[str] = set()
        #: feed a request's committed tokens only at its drafter's syncs, never after a step
        #: (:meth:`sync_step`): with lookup branches most steps run no draft, and a request the
        #: lookup serves throughout never feeds its prompt
        self.feeds_at_syncs_only = runner.tree_config.options.get("lookup", "off") != "off"

    @property
    def layers(self) -> list[str]:
        """The draft's attention layers, by name (the runner's KV moves leave them to this runtime)."""
        return self.draft.layer_names

    def bind(self) -> None:
        """Find the draft's attention group and caches (after the runner's ``initialize_kv_cache``)."""
        self.draft.bind(self.runner.attn_groups[0])
        self.request_blocks.bind()

    def warm_up(self) -> None:
        self.draft.warm_up()

    def defer(self, req_ids: Iterable[str]) -> None:
        deferred = set(req_ids)
        self._deferred |= deferred
        super().defer(deferred)

    def sync_step(self) -> None:
        """Feed every scheduled request's committed tokens the draft lacks (no logits), but for
        those the step deferred (:meth:`defer`: it ran no draft for them).

        Runs after each step's sampling, drafting or not, so that a block the target
        computed holds the draft's K/V too when a later request's prefix hit reuses
        it (a block the draft never fed is not trusted: :meth:`_request`).
        """
        batch = self.runner.input_batch
        feeds, fed = [], []
        deferred, self._deferred = self._deferred, set()
        for index, req_id in enumerate(batch.req_ids):
            blocks = self.request_blocks.blocks(req_id)
            request = self._request(req_id, blocks, batch.token_ids_cpu[index])
            if req_id in deferred or self.feeds_at_syncs_only:  # its next sync feeds what the draft lacks
                continue
            end = self._sync_end(index, req_id)
            if request.kv_len >= end:  # most steps: sync_many already fed it (no copy of the context then)
                continue
            tokens = batch.token_ids_cpu[index, :end].tolist()
            self._keep_accepted(request, blocks, tokens[request.length :])
            if request.kv_len < end:  # the kept nodes may cover the rest
                feeds.append(_Feed.committed(blocks, tokens, request.kv_len))
                request.new_round(end)
            fed.append((request, blocks, tokens))
        if feeds:
            self._forward(feeds, last_only=None)
        for request, blocks, tokens in fed:
            self._key_fed_blocks(request, blocks, tokens)

    def _sync_end(self, index: int, req_id: str) -> int:
        """Committed tokens of the batch's request ``index`` whose draft K/V :meth:`sync_step` feeds."""
        batch = self.runner.input_batch
        end = min(int(batch.num_tokens_no_spec[index]), self.request_blocks.capacity(req_id, 0))
        tree = self.runner.prompt_tree(req_id)
        if tree is not None:
            # a beam search's scoring request: only the blocks before its tree's root can serve
            # a later prefix hit; the draft K/V of the rest would never be read
            block_size = self.request_blocks.block_size
            end = min(end, shared_prefix_len(int(batch.num_prompt_tokens[index]), tree.num_nodes, block_size))
        return end


class SearchDraftRuntime(PagedDraftRuntime):
    """The engine's draft for speculative beam searches (:mod:`vllm_specbeam.adapter.beam_search`),
    run between engine steps through ``collective_rpc``, its K/V in blocks of its own.

    A search's draft state is one per prompt (the beams' common prefix, their
    tails as tree nodes below it), and prompts are not engine requests: vLLM's
    pool has no blocks for them. This runtime holds the engine's loaded draft
    (model, attention layers, metadata builder, vocabulary head) and a
    :class:`~vllm_specbeam.adapter.draft_blocks.BlockPool` of the draft's layers
    only, bound to those layers for its forwards. Its keys are the searches'
    prompt keys; :meth:`remove` returns their blocks.
    """

    def __init__(self, engine: WorkerDraftRuntime) -> None:
        max_model_len = engine.runner.vllm_config.model_config.max_model_len
        self.pool = BlockPool(engine.draft.attention_layers, engine.request_blocks.block_size, max_model_len)
        super().__init__(engine.runner, engine.draft, self.pool)


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
