"""The draft model every draft-model strategy shares: per-request KV caches, batched forwards.

The draft model runs next to vLLM's target, outside vLLM's own cache
manager: a Hugging Face ``AutoModelForCausalLM`` whose keys and values are
kept here, in one contiguous buffer per request. Each engine step a drafter

1. calls :meth:`DraftModelRuntime.sync_many` with every request's committed
   tokens: each cache is cut back to the longest prefix it shares with them
   (which is the rollback to the accepted path: draft nodes never stay in the
   cache past a round) and only the tokens it lacks are fed, so a context is
   encoded once over the request's life, not once per step;
2. calls :meth:`DraftModelRuntime.extend_many` once per draft depth with that
   depth's nodes of every request still drafting. Nodes are appended to their
   request's *own* cache as a tree: each attends to the committed context plus
   its ancestors through a 4-D mask and sits at position
   ``context + depth - 1``. Beams therefore share the prefix by construction:
   ``W`` beams cost ``W`` cache rows per depth, never ``W`` copies of the
   context.

:meth:`~DraftModelRuntime.sync` and :meth:`~DraftModelRuntime.extend` are the
same for one request.

Why one forward for all requests: on a CPU, a forward of a few rows per
request is bound by reading the weights (Qwen2.5-0.5B: ~1 GB in bfloat16),
not by arithmetic, so ``B`` requests in one forward cost little more than
one. (Qwen2.5-0.5B, bfloat16, 2 cores, ~200-token contexts: one depth of 4
requests takes a third of the time of 4 one-request depths.) The price is a
copy: attention wants one padded ``[B, heads, rows, head size]`` tensor per
layer, so a batched forward copies each request's cached rows into a
temporary padded batch and its new rows back into its own buffer afterwards.
That is ``kv_bytes_per_token`` x context per request and forward
(Qwen2.5-0.5B in bfloat16, 200 tokens: 2.4 MB, some 400 times less than the
weights); the prefix is copied once per request, never once per beam.
Attention and this copy grow with the context while the weights do not, so
the gain shrinks for long contexts (4 requests of 1000 tokens: half the
time). A forward of one request attends to its own buffer in place and
copies nothing.

Padding: each request's new rows are right-aligned (left-padded), so its last
row is the forward's last and ``logits_to_keep=1`` serves ``sync_many``.
Padding rows attend only to themselves; cached rows past a request's length
are zeroed and no real row sees them. A long feed (a new request's whole
prompt) padded next to one-token feeds would waste compute, so feeds are
grouped: longest first, a feed starts a new group (another forward) when it
is more than ``MAX_PADDING`` rows shorter than its group's longest.
``MAX_PADDING`` is about the rows a CPU forward computes in the time it reads
the weights (Qwen2.5-0.5B, bfloat16, 2 cores: ~3 ms a row, ~85 ms the
weights), so a feed padded by fewer rows costs less than a forward of its
own. Thus a new prompt is encoded on its own while the few-token feeds of
running requests, and tree depths of different widths, share one forward.
Committed tokens are fed at most ``PREFILL_CHUNK`` per forward (a longer
prompt's first chunks run alone, its last joins the grouping), which bounds a
mask to ``PREFILL_CHUNK`` x context.

Every layer attends to the whole context: a sliding window, if the model has
one, is not applied. Drafts stay valid (the verifiers use the very ``q`` the
drafts were drawn from), only less like the model as trained past its window.

Memory: a cached token costs ``kv_bytes_per_token`` = 2 (K and V) x layers x
KV heads x head size x bytes per element (Qwen2.5-0.5B: 24 x 2 x 64 x 2 x 4 B
= 24 KiB in float32, 12 KiB in bfloat16). A buffer grows with slack (an eighth,
at least 64 rows) so that a decoding request rarely reallocates, and a batched
forward briefly holds the padded copy. ``max_tokens_per_request`` refuses to
draft (returns ``None``) for a longer context instead of growing the cache;
``max_total_tokens`` bounds the cached rows of all requests together by
dropping the caches of the least recently drafted requests outside the step
(re-encoded if they come back); a request of the step that still does not fit
goes undrafted.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

ROOT = -1
#: padding rows a feed may add to a group's forward before it gets a forward of its own
MAX_PADDING = 32
#: committed tokens fed per forward at most: bounds a mask to this many rows x the context
PREFILL_CHUNK = 512


class DraftModelError(ValueError):
    """The draft model cannot serve this target (vocabulary mismatch, bad path)."""


def placement(
    device: str, dtype: str, target_device: torch.device | str, target_dtype: torch.dtype
) -> tuple[str, torch.dtype | str]:
    """The draft's device and dtype from the ``draft_device`` / ``draft_dtype`` options.

    ``"auto"`` is the target's, as for vLLM's own draft models, so that a
    comparison with them compares methods, not precisions. ``"checkpoint"``
    keeps the checkpoint's dtype. Half precision is safe for the verifiers:
    they use the very ``q`` the drafts were drawn from, whatever its rounding.
    On a CPU with AVX512-BF16, Qwen2.5-0.5B drafts about 3x faster in
    bfloat16 than in float32; without it, float32 is the faster.
    """
    device = str(target_device) if device == "auto" else device
    if dtype == "auto":
        return device, target_dtype
    return device, dtype if dtype == "checkpoint" else getattr(torch, dtype)


def check_vocabularies(draft: str, target: str, draft_vocab: dict[str, int], target_vocab: dict[str, int]) -> None:
    """Refuse a draft model whose tokenizer maps any string to another id than the target's.

    Draft tokens are verified by id, so a draft that tokenises differently
    would have its proposals scored as unrelated tokens: silently useless, or
    worse, lossy under joint-likelihood rules.
    """
    if draft_vocab == target_vocab:
        return
    only_draft = sorted(set(draft_vocab) - set(target_vocab))
    only_target = sorted(set(target_vocab) - set(draft_vocab))
    moved = sorted(k for k in set(draft_vocab) & set(target_vocab) if draft_vocab[k] != target_vocab[k])
    examples = (only_draft[:3], only_target[:3], moved[:3])
    raise DraftModelError(
        f"draft model {draft!r} ({len(draft_vocab)} tokens) and target {target!r} ({len(target_vocab)} tokens) "
        f"do not tokenise identically: {len(only_draft)} tokens only in the draft {examples[0]}, "
        f"{len(only_target)} only in the target {examples[1]}, {len(moved)} with different ids {examples[2]}; "
        f"pick a draft model from the target's family"
    )


@dataclass
class _Sequence:
    """One request's draft cache and the tree nodes appended to it this round."""

    #: ``[layers, 2 (keys, values), KV heads, capacity, head size]``; rows from ``length`` on are unused
    kv: torch.Tensor
    length: int = 0
    #: committed tokens whose keys and values are the first rows (the tree nodes follow)
    tokens: list[int] = field(default_factory=list)
    #: ``ancestors[i, j]``: tree node ``j`` is node ``i`` or one of its ancestors
    ancestors: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))
    depths: list[int] = field(default_factory=list)
    last_used: int = 0


@dataclass
class _Feed:
    """The rows one forward appends to one request's cache."""

    seq: _Sequence
    tokens: list[int]
    positions: list[int]
    #: tree nodes: ``tree[i, j]``, new row ``i`` attends to row ``context + j`` (this round's earlier
    #: nodes, then the new ones); ``None``: committed tokens, each attending to every row before it
    tree: torch.Tensor | None = None


class _StepCache:
    """What the attention layers see as ``past_key_values`` during one forward.

    ``rows`` is ``[layers, 2, batch, KV heads, past + new, head size]`` with the
    cached rows in place; each layer's ``update`` writes its new keys and values
    after ``past`` and attends to the whole. ``update`` is the only cache method
    the model calls when it is given ``position_ids`` and a 4-D mask.
    """

    def __init__(self, rows: torch.Tensor, past: int) -> None:
        self.rows = rows
        self.past = past

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.rows[layer_idx]
        layer[0, :, :, self.past :] = keys
        layer[1, :, :, self.past :] = values
        return layer[0], layer[1]


class DraftModelRuntime:
    """A draft model with a KV cache per request, run batched (see the module docstring)."""

    def __init__(
        self,
        model: str,
        target_tokenizer: str | None = None,
        target_vocab_size: int | None = None,
        device: str = "cpu",
        dtype: torch.dtype | str = "checkpoint",
        max_tokens_per_request: int = 0,
        max_total_tokens: int = 0,
    ) -> None:
        """``model``: directory or hub name of the draft; ``target_tokenizer``: the
        target's tokenizer, checked to match the draft's (skipped when ``None``);
        ``target_vocab_size``: width of the target's logits, which the draft's
        distributions are cut or padded to (default: the draft's own width);
        ``dtype``: a torch dtype or ``"checkpoint"`` (see :func:`placement`);
        ``max_*_tokens``: cache caps, 0 = unbounded."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # denormal floats are far slower on x86 CPUs
        tokenizer = AutoTokenizer.from_pretrained(model)
        if target_tokenizer is not None:
            target = AutoTokenizer.from_pretrained(target_tokenizer)
            check_vocabularies(model, target_tokenizer, tokenizer.get_vocab(), target.get_vocab())
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                model, dtype="auto" if dtype == "checkpoint" else dtype, attn_implementation="sdpa"
            )
            # transformers declares PreTrainedModel.to with @functools.wraps, typed by
            # typeshed as a _Wrapped object without __get__: mypy then misses the bound self
            .to(self.device)  # type: ignore[arg-type]
            .eval()
        )
        config = self.model.config.get_text_config()
        rows = self.model.get_output_embeddings().weight.shape[0]
        self.vocab_size = target_vocab_size or rows
        num_real = len(tokenizer)
        if num_real > self.vocab_size:
            raise DraftModelError(
                f"target logits have {self.vocab_size} columns but draft tokenizer {model!r} has {num_real} tokens"
            )
        #: added to the draft's logits: -inf on padding rows (no token) and columns the draft lacks
        self._logit_mask = torch.full((self.vocab_size,), float("-inf"), device=self.device)
        self._logit_mask[: min(rows, num_real)] = 0
        self._rows = min(rows, self.vocab_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        #: a request's buffer is ``[*_kv_shape[:3], capacity, _kv_shape[3]]``
        self._kv_shape = (config.num_hidden_layers, 2, kv_heads, head_dim)
        element = torch.finfo(self.model.dtype).bits // 8
        self.kv_bytes_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * element
        self.max_tokens_per_request = max_tokens_per_request
        self.max_total_tokens = max_total_tokens
        self._sequences: dict[str, _Sequence] = {}
        self._clock = itertools.count(1)

    # ------------------------------------------------------------ queries
    @property
    def live_requests(self) -> int:
        return len(self._sequences)

    def cached_tokens(self, req_id: str) -> int:
        """Cache rows the request holds now (committed context plus this round's tree)."""
        seq = self._sequences.get(req_id)
        return 0 if seq is None else seq.length

    # ------------------------------------------------------------ drafting
    def sync(self, req_id: str, token_ids: Sequence[int] | np.ndarray, reserve: int = 0) -> torch.Tensor | None:
        """Logits (float32, ``[vocab_size]``) after the request's last committed token.

        Feeds only the tokens the cache lacks. ``reserve`` tree nodes are about
        to be appended; ``None`` means the context plus them exceeds
        ``max_tokens_per_request`` (or does not fit ``max_total_tokens``) and
        the request should go undrafted.
        """
        return self.sync_many([(req_id, token_ids, reserve)])[0]

    def sync_many(self, requests: Sequence[tuple[str, Sequence[int] | np.ndarray, int]]) -> list[torch.Tensor | None]:
        """:meth:`sync` for ``(req_id, committed tokens, reserve)`` triples, in one
        forward (more only for feeds the grouping sets apart)."""
        step = _distinct(req_id for req_id, _, _ in requests)
        results: list[torch.Tensor | None] = [None] * len(requests)
        admitted: list[tuple[int, list[int], _Feed]] = []
        incoming = 0  # rows the admitted requests are about to add
        for index, (req_id, token_ids, reserve) in enumerate(requests):
            tokens = [int(t) for t in token_ids]
            if not tokens:
                raise ValueError(f"request {req_id!r} has no committed token to draft from")
            if self.max_tokens_per_request and len(tokens) + reserve > self.max_tokens_per_request:
                self.remove([req_id])
                continue
            seq = self._sequences.get(req_id)
            if seq is None:
                seq = self._sequences[req_id] = _Sequence(self._empty_kv())
            keep = min(common_prefix(seq.tokens, tokens), len(tokens) - 1)  # the last token's logits are the answer
            self._crop(seq, keep)
            new = len(tokens) - keep
            if not self._make_room(incoming + new + reserve, step):
                self.remove([req_id])
                continue
            incoming += new + reserve
            self._reserve(seq, len(tokens) + reserve)
            seq.last_used = next(self._clock)
            admitted.append((index, tokens, _Feed(seq, tokens[keep:], list(range(keep, len(tokens))))))
        logits = self._run([feed for *_, feed in admitted], last_only=True)
        for (index, tokens, feed), rows in zip(admitted, logits):
            feed.seq.tokens = tokens
            results[index] = rows[-1]
        return results

    def extend(self, req_id: str, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append tree nodes after :meth:`sync`; logits ``[len(tokens), vocab_size]`` at them.

        ``parents`` index this round's earlier nodes (all calls since
        :meth:`sync` count, in order, and earlier entries of this call) or are
        ``ROOT`` (-1) for children of the last committed token.
        """
        return self.extend_many([(req_id, tokens, parents)])[0]

    def extend_many(self, nodes: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        """:meth:`extend` for ``(req_id, tokens, parents)`` triples of distinct
        requests, in one forward (more only for feeds the grouping sets apart)."""
        _distinct(req_id for req_id, _, _ in nodes)
        feeds = [self._tree_feed(self._sequences[req_id], tokens, parents) for req_id, tokens, parents in nodes]
        return self._run(feeds, last_only=False)

    def remove(self, req_ids: Iterable[str]) -> None:
        """Free the caches of finished, aborted or preempted requests (unknown ids are ignored)."""
        for req_id in req_ids:
            self._sequences.pop(req_id, None)

    # ------------------------------------------------------------ internals
    def _empty_kv(self) -> torch.Tensor:
        layers, kv, heads, head_dim = self._kv_shape
        return torch.empty(layers, kv, heads, 0, head_dim, dtype=self.model.dtype, device=self.device)

    def _reserve(self, seq: _Sequence, rows: int) -> None:
        """Let the buffer hold ``rows`` rows; it grows with slack so decoding reallocates rarely."""
        if seq.kv.shape[3] >= rows:
            return
        layers, kv, heads, head_dim = self._kv_shape
        grown = seq.kv.new_empty(layers, kv, heads, rows + max(64, rows // 8), head_dim)
        grown[:, :, :, : seq.length] = seq.kv[:, :, :, : seq.length]
        seq.kv = grown

    def _crop(self, seq: _Sequence, keep: int) -> None:
        """Drop every cache row after the first ``keep`` committed tokens (and the tree)."""
        seq.length = keep
        seq.tokens = seq.tokens[:keep]
        seq.ancestors = torch.zeros(0, 0, dtype=torch.bool)
        seq.depths = []

    def _make_room(self, incoming: int, step: set[str]) -> bool:
        """Evict the least recently drafted requests outside ``step`` until ``incoming``
        more rows fit the total cap; ``False`` if they cannot."""
        if not self.max_total_tokens:
            return True
        total = sum(s.length for s in self._sequences.values()) + incoming
        for _, victim in sorted((s.last_used, r) for r, s in self._sequences.items() if r not in step):
            if total <= self.max_total_tokens:
                break
            total -= self._sequences.pop(victim).length
        return total <= self.max_total_tokens

    def _tree_feed(self, seq: _Sequence, tokens: Sequence[int], parents: Sequence[int]) -> _Feed:
        """Record one depth of tree nodes on ``seq`` and say what each attends to."""
        context, first, n = len(seq.tokens), len(seq.depths), len(tokens)
        if len(parents) != n:
            raise ValueError(f"{n} tree nodes but {len(parents)} parents")
        ancestors = torch.zeros(first + n, first + n, dtype=torch.bool)
        ancestors[:first, :first] = seq.ancestors
        depths = list(seq.depths)
        for i, parent in enumerate(int(p) for p in parents):
            if not ROOT <= parent < first + i:
                raise ValueError(f"tree node {first + i} has parent {parent}: not an earlier node")
            if parent != ROOT:
                ancestors[first + i] = ancestors[parent]
            ancestors[first + i, first + i] = True
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        seq.ancestors, seq.depths = ancestors, depths
        self._reserve(seq, seq.length + n)
        seq.last_used = next(self._clock)
        return _Feed(seq, [int(t) for t in tokens], [context - 1 + d for d in depths[first:]], ancestors[first:])

    def _run(self, feeds: list[_Feed], last_only: bool) -> list[torch.Tensor]:
        """Logits at each feed's new rows (its last row only, with ``last_only``),
        one forward per group of the grouping rule (see the module docstring)."""
        for feed in feeds:
            while len(feed.tokens) > PREFILL_CHUNK:  # its own forwards, one chunk at a time
                self._forward([_Feed(feed.seq, feed.tokens[:PREFILL_CHUNK], feed.positions[:PREFILL_CHUNK])], True)
                feed.tokens, feed.positions = feed.tokens[PREFILL_CHUNK:], feed.positions[PREFILL_CHUNK:]
        order = sorted(range(len(feeds)), key=lambda i: -len(feeds[i].tokens))
        groups: list[list[int]] = []
        for i in order:
            if groups and len(feeds[groups[-1][0]].tokens) - len(feeds[i].tokens) <= MAX_PADDING:
                groups[-1].append(i)
            else:
                groups.append([i])
        results: dict[int, torch.Tensor] = {}
        for group in groups:
            results.update(zip(group, self._forward([feeds[i] for i in group], last_only)))
        return [results[i] for i in range(len(feeds))]

    @torch.inference_mode()
    def _forward(self, feeds: list[_Feed], last_only: bool) -> list[torch.Tensor]:
        """One forward appending every feed's rows to its request's cache (see the module docstring)."""
        batch, new, past = len(feeds), max(len(f.tokens) for f in feeds), max(f.seq.length for f in feeds)
        ids = torch.zeros(batch, new, dtype=torch.long)
        positions = torch.zeros(batch, new, dtype=torch.long)
        visible = torch.zeros(batch, 1, new, past + new, dtype=torch.bool)
        visible[:, 0, torch.arange(new), past + torch.arange(new)] = True  # padding rows see themselves
        for b, feed in enumerate(feeds):
            n, length = len(feed.tokens), feed.seq.length
            ids[b, new - n :] = torch.tensor(feed.tokens)
            positions[b, new - n :] = torch.tensor(feed.positions)
            seen = length if feed.tree is None else len(feed.seq.tokens)  # committed rows, seen by all
            own = torch.ones(n, n, dtype=torch.bool).tril_() if feed.tree is None else feed.tree
            visible[b, 0, new - n :, :seen] = True
            visible[b, 0, new - n :, seen:length] = own[:, : length - seen]
            visible[b, 0, new - n :, past + new - n :] = own[:, length - seen :]
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        if batch == 1:  # the request's own buffer: nothing to copy in or out
            rows = feeds[0].seq.kv[:, :, :, : past + new].unsqueeze(2)
        else:
            layers, kv, heads, head_dim = self._kv_shape
            rows = torch.empty(layers, kv, batch, heads, past + new, head_dim, dtype=dtype, device=self.device)
            for b, feed in enumerate(feeds):
                rows[:, :, b, :, : feed.seq.length] = feed.seq.kv[:, :, :, : feed.seq.length]
                rows[:, :, b, :, feed.seq.length : past].zero_()  # masked, but NaN garbage would poison the sum
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask.to(self.device),
            past_key_values=_StepCache(rows, past),
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        logits = []
        for b, feed in enumerate(feeds):
            n, length = len(feed.tokens), feed.seq.length
            if batch > 1:
                feed.seq.kv[:, :, :, length : length + n] = rows[:, :, b, :, past + new - n :]
            feed.seq.length += n
            logits.append(out.logits[b, -1:] if last_only else out.logits[b, new - n :])
        return list(self._vocab_logits(torch.cat(logits)).split([1 if last_only else len(f.tokens) for f in feeds]))

    def _vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits as float32 over the target's vocabulary."""
        logits = logits[:, : self._rows].float()
        if self._rows < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - self._rows))
        return logits + self._logit_mask


def _distinct(req_ids: Iterable[str]) -> set[str]:
    """The ids as a set, refusing repeats: two feeds of one request in a forward would write the same rows."""
    ids = list(req_ids)
    if len(set(ids)) < len(ids):
        raise ValueError(f"a request appears twice in one batch: {sorted(r for r in set(ids) if ids.count(r) > 1)}")
    return set(ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix; the usual case (``b`` extends ``a``) is one C-level compare."""
    if len(a) <= len(b) and a == b[: len(a)]:
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
