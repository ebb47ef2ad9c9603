"""The draft model every draft-model strategy shares, with per-request KV caches.

The draft model runs next to vLLM's target, outside vLLM's own cache
manager: a Hugging Face ``AutoModelForCausalLM`` with one transformers
``DynamicCache`` per request. Each engine step a drafter

1. calls :meth:`DraftModelRuntime.sync` with the request's committed tokens:
   the cache is cut back to the longest prefix it shares with them (which is
   the rollback to the accepted path: draft nodes never stay in the cache
   past a round) and only the tokens it lacks are fed, so the context is
   encoded once over the request's life, not once per step;
2. calls :meth:`DraftModelRuntime.extend` once per draft depth with that
   depth's nodes. Nodes are appended to the request's *own* cache as a tree:
   each attends to the committed context plus its ancestors through a 4-D
   mask and sits at position ``context + depth - 1``. Beams therefore share
   the prefix by construction: ``W`` beams cost ``W`` cache rows per depth,
   never ``W`` copies of the context (no ``expand``/``repeat`` of the past,
   no batch dimension above one).

Requests are run one after another, not batched: a batched forward needs the
caches of all requests in one padded tensor, which with transformers' caches
means concatenating (copying) every request's context each step. On a CPU the
forward of a few tree nodes is bound by reading the weights, which batching
would share, but the per-request copy grows with the context; a paged cache
is what would make batching pay, and that is vLLM's job, not this module's.

Memory: a cached token costs ``kv_bytes_per_token`` = 2 (K and V) x layers x
KV heads x head size x bytes per element (Qwen2.5-0.5B: 24 x 2 x 64 x 2 x 4 B
= 24 KiB in float32, 12 KiB in bfloat16). ``max_tokens_per_request`` refuses
to draft (returns ``None``) for a longer context instead of growing the cache;
``max_total_tokens`` bounds all requests together by dropping the least
recently drafted requests' caches, which are re-encoded if they come back.
``transformers``' cache grows by concatenation, so a step briefly holds an
extra copy of the request's cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

ROOT = -1


class DraftModelError(ValueError):
    """The draft model cannot serve this target (vocabulary mismatch, bad path)."""


def _dtype(name: str) -> torch.dtype | str:
    """``"auto"`` keeps the checkpoint's dtype, as vLLM does. Half precision is
    safe for the verifiers: they use the very ``q`` the drafts were drawn from,
    whatever its rounding. On a CPU with AVX512-BF16, Qwen2.5-0.5B drafts about
    3x faster in bfloat16 than in float32; without it, pick float32."""
    return name if name == "auto" else getattr(torch, name)


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

    cache: object
    #: committed tokens whose keys and values are in ``cache`` (before the tree nodes)
    tokens: list[int] = field(default_factory=list)
    #: ``ancestors[i, j]``: tree node ``j`` is node ``i`` or one of its ancestors
    ancestors: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))
    depths: list[int] = field(default_factory=list)
    last_used: int = 0


class DraftModelRuntime:
    """A draft model with a KV cache per request (see the module docstring)."""

    def __init__(
        self,
        model: str,
        target_tokenizer: str | None = None,
        target_vocab_size: int | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        max_tokens_per_request: int = 0,
        max_total_tokens: int = 0,
    ) -> None:
        """``model``: directory or hub name of the draft; ``target_tokenizer``: the
        target's tokenizer, checked to match the draft's (skipped when ``None``);
        ``target_vocab_size``: width of the target's logits, which the draft's
        distributions are cut or padded to (default: the draft's own width);
        ``max_*_tokens``: cache caps, 0 = unbounded."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # denormal floats are far slower on x86 CPUs
        tokenizer = AutoTokenizer.from_pretrained(model)
        if target_tokenizer is not None:
            target = AutoTokenizer.from_pretrained(target_tokenizer)
            check_vocabularies(model, target_tokenizer, tokenizer.get_vocab(), target.get_vocab())
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=_dtype(dtype), attn_implementation="sdpa"
        ).to(self.device).eval()
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
        return 0 if seq is None else seq.cache.get_seq_length()

    # ------------------------------------------------------------ per request
    def sync(self, req_id: str, token_ids: Sequence[int], reserve: int = 0) -> torch.Tensor | None:
        """Logits (float32, ``[vocab_size]``) after the request's last committed token.

        Feeds only the tokens the cache lacks. ``reserve`` tree nodes are about
        to be appended; ``None`` means the context plus them exceeds
        ``max_tokens_per_request`` and the request should go undrafted.
        """
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError(f"request {req_id!r} has no committed token to draft from")
        if self.max_tokens_per_request and len(tokens) + reserve > self.max_tokens_per_request:
            self.remove([req_id])
            return None
        seq = self._sequences.get(req_id)
        keep = 0 if seq is None else common_prefix(seq.tokens, tokens)
        keep = min(keep, len(tokens) - 1)  # the last token is always fed: its logits are the answer
        if seq is None or keep == 0:
            seq = self._sequences[req_id] = _Sequence(self._new_cache())
        self._crop(seq, keep)
        self._make_room(req_id, len(tokens) - keep + reserve)
        seq.last_used = next(self._clock)
        new = torch.tensor([tokens[keep:]], device=self.device)
        positions = torch.arange(keep, len(tokens), device=self.device).unsqueeze(0)
        logits = self._forward(seq, new, positions, mask=None, keep_last=1)
        seq.tokens = tokens
        return logits[-1]

    def extend(self, req_id: str, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append tree nodes after :meth:`sync`; logits ``[len(tokens), vocab_size]`` at them.

        ``parents`` index this round's earlier nodes (all calls since
        :meth:`sync` count, in order, and earlier entries of this call) or are
        ``ROOT`` (-1) for children of the last committed token.
        """
        seq = self._sequences[req_id]
        context = len(seq.tokens)
        first = len(seq.depths)
        n = len(tokens)
        ancestors = torch.zeros(first + n, first + n, dtype=torch.bool)
        ancestors[:first, :first] = seq.ancestors
        for i, parent in enumerate(parents):
            if not ROOT <= parent < first + i:
                raise ValueError(f"tree node {first + i} has parent {parent}: not an earlier node")
            if parent != ROOT:
                ancestors[first + i] = ancestors[parent]
            ancestors[first + i, first + i] = True
            seq.depths.append(1 if parent == ROOT else seq.depths[parent] + 1)
        seq.ancestors = ancestors
        visible = torch.cat([torch.ones(n, context, dtype=torch.bool), ancestors[first:]], dim=1)
        mask = torch.zeros(visible.shape, dtype=self.model.dtype).masked_fill_(~visible, torch.finfo(self.model.dtype).min)
        positions = torch.tensor([[context - 1 + d for d in seq.depths[first:]]], device=self.device)
        ids = torch.tensor([list(tokens)], device=self.device)
        seq.last_used = next(self._clock)
        return self._forward(seq, ids, positions, mask[None, None].to(self.device), keep_last=0)

    def remove(self, req_ids: Iterable[str]) -> None:
        """Free the caches of finished, aborted or preempted requests (unknown ids are ignored)."""
        for req_id in req_ids:
            self._sequences.pop(req_id, None)

    # ------------------------------------------------------------ internals
    def _new_cache(self) -> object:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _crop(self, seq: _Sequence, keep: int) -> None:
        """Drop every cache row after the first ``keep`` committed tokens (and the tree)."""
        extra = seq.cache.get_seq_length() - keep
        if extra > 0:
            seq.cache.crop(-extra)
        seq.tokens = seq.tokens[:keep]
        seq.ancestors = torch.zeros(0, 0, dtype=torch.bool)
        seq.depths = []

    def _make_room(self, req_id: str, incoming: int) -> None:
        """Evict least recently drafted requests until ``incoming`` more rows fit the total cap."""
        if not self.max_total_tokens:
            return
        others = sorted((s.last_used, r) for r, s in self._sequences.items() if r != req_id)
        total = sum(s.cache.get_seq_length() for s in self._sequences.values()) + incoming
        for _, victim in others:
            if total <= self.max_total_tokens:
                break
            total -= self._sequences.pop(victim).cache.get_seq_length()

    @torch.inference_mode()
    def _forward(
        self, seq: _Sequence, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, keep_last: int
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=seq.cache,
            use_cache=True,
            logits_to_keep=keep_last,
        )
        logits = out.logits[0, :, : self._rows].float()
        if self._rows < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - self._rows))
        return logits + self._logit_mask


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix; the usual case (``b`` extends ``a``) is one C-level compare."""
    if len(a) <= len(b) and a == b[: len(a)]:
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
