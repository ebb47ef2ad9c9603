"""What every drafter with a draft model shares (``dsbd``, ``mcsd``, ``mjsd``).

Their common options, the start-up check that the draft tokenises like the
target, the :class:`~vllm_specbeam.draft_runtime.base.DraftRuntime` they draft
through, the per-drafter random generator, and the draft's sampling
distribution. Each method's own drafter adds its options and ``propose``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vllm_specbeam.core.config import Option, SpecbeamConfigError
from vllm_specbeam.core.corpus import load_tokenizer
from vllm_specbeam.core.drafter import TreeDrafter
from vllm_specbeam.draft_runtime import vocab
from vllm_specbeam.draft_runtime.base import DraftRuntime

GREEDY_EPS = 1e-5  # vLLM's sampler treats temperatures below this as greedy

#: Options of every draft-model method.
DRAFT_MODEL_OPTIONS: dict[str, Option] = {
    "draft_model": Option(
        "",
        'directory or hub name of the draft model; filled in from the speculative config\'s "model"',
        per_request=False,
    ),
    "tokenizer": Option(
        "",
        "the target's tokenizer (name or path), checked to tokenise like the draft; filled in from the target model",
        per_request=False,
    ),
    "top_k": Option(0, "draft top-k per beam (0 = off)", 0, 1 << 20),
    "top_p": Option(1.0, "draft top-p per beam (1 = off)", 0.0, 1.0),
    "draft_temperature": Option(0.0, "draft temperature (0 = the request's)", 0.0, 100.0),
    "draft_dtype": Option(
        "auto",
        "draft weights' dtype (auto: the target's; checkpoint: the checkpoint's)",
        choices=("auto", "checkpoint", "float32", "bfloat16", "float16"),
        per_request=False,
    ),
    "seed": Option(0, "seed of the draft sampling generator", 0, 2**31 - 1, per_request=False),
    "draft_vocab": Option(
        "",
        "directory from `vllm-specbeam draft-vocab build`: the draft scores only its tokens and each request's "
        "own context tokens (cheaper draft forwards, still lossless); empty: the whole vocabulary",
        per_request=False,
    ),
}


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Per-row next-token probabilities after temperature, top-k and top-p (as vLLM orders them)."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p  # keep the smallest prefix reaching top_p
        probs = probs.masked_fill(drop.scatter(-1, order, drop), 0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draft_temperature(options: Mapping[str, Any], request_temperature: float) -> float:
    """The temperature the draft samples at; below :data:`GREEDY_EPS` it searches (top-k, no randomness)."""
    return options["draft_temperature"] or request_temperature


class DraftModelError(ValueError):
    """The draft model cannot serve this target (vocabulary mismatch, bad path)."""


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


def check_draft_tokenizer(draft_model: str, target_tokenizer: str) -> None:
    """Refuse a missing draft model or one whose vocabulary differs from the target's."""
    from transformers import AutoTokenizer

    try:
        draft = AutoTokenizer.from_pretrained(draft_model)
    except (OSError, ValueError) as error:
        raise SpecbeamConfigError(
            f"cannot load the draft model's tokenizer from {draft_model!r} ({error}); "
            f'pass a local model directory or a hub name as "model" in the speculative config'
        ) from error
    target = AutoTokenizer.from_pretrained(target_tokenizer)
    try:
        check_vocabularies(draft_model, target_tokenizer, draft.get_vocab(), target.get_vocab())
    except DraftModelError as error:
        raise SpecbeamConfigError(str(error)) from error


class DraftModelDrafter(TreeDrafter):
    """A drafter that drafts through a :class:`DraftRuntime`.

    Draft randomness comes from one generator per drafter, seeded once:
    drafts must be fresh draws for each round, never a function of the
    context, or repeated runs of one prompt would all see the same drafts and
    the output law would be the target's conditioned on them.
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.runtime: DraftRuntime | None = None
        self.generator = torch.Generator().manual_seed(self.options.get("seed", 0))

    @staticmethod
    def check_startup(options: Mapping[str, Any]) -> None:
        """The draft model's tokenizer loads and tokenises exactly like the target's;
        a draft vocabulary opens and was counted with the target's tokenizer."""
        if options["draft_model"] and options["tokenizer"]:
            check_draft_tokenizer(options["draft_model"], options["tokenizer"])
        if options["draft_vocab"]:
            try:
                vocabulary = vocab.load(options["draft_vocab"])
                if options["tokenizer"]:
                    vocabulary.check_tokenizer(load_tokenizer(options["tokenizer"]), options["draft_vocab"])
            except vocab.DraftVocabularyError as error:
                raise SpecbeamConfigError(str(error)) from error

    @staticmethod
    def draft_slots(options: Mapping[str, Any]) -> int:
        """Most tree nodes one step feeds to the draft model (the in-worker
        draft's scratch KV slots): the verified tree's, unless the method
        drafts more than it proposes."""
        return int(options["max_nodes"])

    def use_runtime(self, runtime: DraftRuntime) -> None:
        """Draft with a draft model the engine loaded itself (inside vLLM's worker)."""
        self.runtime = runtime

    def ready_runtime(self) -> DraftRuntime:
        if self.runtime is None:
            raise RuntimeError(f"{type(self).__name__}: no draft runtime; the runner gives one before drafting")
        return self.runtime

    @property
    def live_requests(self) -> int:
        return 0 if self.runtime is None else self.runtime.live_requests

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        if self.runtime is not None:
            self.runtime.remove(req_ids)
