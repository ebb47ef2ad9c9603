"""DSBD drafting: beam sampling with the draft model, drafted as a forest.

Per request and step: :meth:`DraftModelRuntime.sync` feeds the tokens
committed since the last step and gives ``q(. | context)``; then for every
depth the draft joint over (beam, token) pairs is formed from the beams'
scores and their ``q`` rows, ``max_width`` pairs are drawn i.i.d. from it
(with replacement, as beam sampling does), and the new beams are fed to the
draft model as one level of a tree (:meth:`DraftModelRuntime.extend`) to get
their own ``q`` rows. ``max_width`` pairs are drawn at every depth because the
target decides how many it keeps (:func:`vllm_specbeam.dsbd.choose_width`
needs the target's joint); ``max_nodes`` cuts the last depths short.

Greedy requests (temperature 0 and no ``draft_temperature``) run beam
*search* instead: the ``max_width`` best pairs of the joint log-score, all
distinct, without draft rows (the greedy verifier reads tokens only).

Draft randomness comes from one generator per drafter, seeded once: drafts
must be fresh draws for each round, never a function of the context, or
repeated runs of one prompt would all see the same drafts and the output law
would be the target's conditioned on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from vllm_specbeam.config import Option, SpecbeamConfigError
from vllm_specbeam.draft_model import DraftModelError, DraftModelRuntime, check_vocabularies
from vllm_specbeam.drafters.base import DraftRequest, TreeDrafter
from vllm_specbeam.dsbd import BeamForest, joint
from vllm_specbeam.tree import ROOT, DraftTree

GREEDY_EPS = 1e-5  # vLLM's sampler treats temperatures below this as greedy


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


def level_widths(depth: int, max_width: int, max_nodes: int) -> list[int]:
    """Pairs drafted per depth: ``max_width`` each until ``max_nodes`` runs out."""
    widths: list[int] = []
    while len(widths) < depth and sum(widths) < max_nodes:
        widths.append(min(max_width, max_nodes - sum(widths)))
    return widths


def check_draft_tokenizer(draft_model: str, target_tokenizer: str) -> None:
    """Refuse a missing draft model or one whose vocabulary differs from the target's."""
    from transformers import AutoTokenizer

    try:
        draft = AutoTokenizer.from_pretrained(draft_model)
    except (OSError, ValueError) as error:
        raise SpecbeamConfigError(
            f"cannot load the draft model's tokenizer from {draft_model!r} ({error}); "
            f"pass a local model directory or a hub name as \"model\" in the speculative config"
        ) from error
    target = AutoTokenizer.from_pretrained(target_tokenizer)
    try:
        check_vocabularies(draft_model, target_tokenizer, draft.get_vocab(), target.get_vocab())
    except DraftModelError as error:
        raise SpecbeamConfigError(str(error)) from error


class DsbdDrafter(TreeDrafter):
    """Beam-sampling forests from a draft model (see the module docstring)."""

    OPTIONS: dict[str, Option] = {
        "draft_model": Option("", "directory or hub name of the draft model; filled in from the speculative "
                                  "config's \"model\"", per_request=False),
        "tokenizer": Option("", "the target's tokenizer (name or path), checked to tokenise like the draft; "
                                "filled in from the target model", per_request=False),
        "min_width": Option(1, "fewest beams a depth keeps", 1, 32),
        "max_width": Option(4, "pairs drafted per depth: the most beams a depth can keep", 1, 32),
        "width_threshold": Option(0.7, "tau_w: a depth keeps the most beams n it accepts with probability >= tau_w",
                                  0.0, 1.0),
        "top_k": Option(0, "draft top-k per beam (0 = off)", 0, 1 << 20),
        "top_p": Option(1.0, "draft top-p per beam (1 = off)", 0.0, 1.0),
        "draft_temperature": Option(0.0, "draft temperature (0 = the request's)", 0.0, 100.0),
        "draft_dtype": Option("auto", "draft weights' dtype (auto: the checkpoint's)",
                              choices=("auto", "float32", "bfloat16", "float16"), per_request=False),
        "draft_device": Option("cpu", "device of the draft model", per_request=False),
        "max_cache_tokens_per_request": Option(0, "longest context the draft caches (longer requests go undrafted; "
                                                  "0 = no cap)", 0, 1 << 30, per_request=False),
        "max_cache_tokens_total": Option(0, "draft cache rows over all requests (least recently drafted requests "
                                            "are dropped and re-encoded later; 0 = no cap)", 0, 1 << 30,
                                         per_request=False),
        "seed": Option(0, "seed of the draft sampling generator", 0, 2**31 - 1, per_request=False),
    }

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> None:
        if options["min_width"] > options["max_width"]:
            raise SpecbeamConfigError(
                f"dsbd: min_width={options['min_width']} exceeds max_width={options['max_width']}"
            )

    @staticmethod
    def check_startup(options: Mapping[str, Any]) -> None:
        """The draft model's tokenizer loads and tokenises exactly like the target's."""
        if options["draft_model"] and options["tokenizer"]:
            check_draft_tokenizer(options["draft_model"], options["tokenizer"])

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.runtime: DraftModelRuntime | None = None
        self.generator = torch.Generator().manual_seed(self.options.get("seed", 0))

    def load_model(self, target_model: Any) -> None:
        path = self.options.get("draft_model", "")
        if not path:
            raise SpecbeamConfigError("dsbd needs a draft model: add \"model\" to the speculative config")
        tokenizer = self.options.get("tokenizer") or None
        self.runtime = DraftModelRuntime(
            path,
            target_tokenizer=tokenizer,
            target_vocab_size=_vocab_size(target_model, tokenizer),
            device=self.options.get("draft_device", "cpu"),
            dtype=self.options.get("draft_dtype", "auto"),
            max_tokens_per_request=self.options.get("max_cache_tokens_per_request", 0),
            max_total_tokens=self.options.get("max_cache_tokens_total", 0),
        )

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        if self.runtime is None:
            raise RuntimeError("DsbdDrafter.load_model must run before propose")
        return [self._propose_one(request) for request in requests]

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        if self.runtime is not None:
            self.runtime.remove(req_ids)

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        options = request.options
        widths = level_widths(options["num_speculative_tokens"], options["max_width"], options["max_nodes"])
        logits = self.runtime.sync(request.req_id, request.token_ids, reserve=sum(widths[:-1]))
        if logits is None or not widths:
            return DraftTree.empty()
        temperature = options["draft_temperature"] or request.temperature
        if temperature < GREEDY_EPS:
            return self._beam_search(request.req_id, logits, widths)
        return self._beam_sample(request.req_id, logits, widths, temperature, options)

    def _beam_sample(
        self, req_id: str, logits: torch.Tensor, widths: list[int], temperature: float, options: Mapping[str, Any]
    ) -> BeamForest:
        """Draw each depth's pairs i.i.d. from the draft joint; record every beam's ``q`` row."""
        vocab = logits.shape[-1]
        rows = sampling_probs(logits.unsqueeze(0), temperature, options["top_k"], options["top_p"])
        live, scores = [ROOT], torch.zeros(1)
        tokens, parents, draft_rows, next_rows = [], [], [], []
        for depth, width in enumerate(widths):
            pairs = torch.multinomial(joint(scores, rows), width, replacement=True, generator=self.generator)
            beam, token = pairs // vocab, pairs % vocab
            first = len(tokens)
            tokens += token.tolist()
            parents += [live[b] for b in beam.tolist()]
            draft_rows.append(rows[beam])
            scores = scores[beam] + rows[beam, token].log()
            live = list(range(first, len(tokens)))
            if depth + 1 < len(widths):
                logits = self.runtime.extend(req_id, token.tolist(), parents[first:])
                rows = sampling_probs(logits, temperature, options["top_k"], options["top_p"])
            else:
                rows = torch.zeros(width, vocab)  # the last depth is never extended
            next_rows.append(rows)
        return BeamForest(
            np.asarray(tokens),
            np.asarray(parents),
            torch.cat(draft_rows).numpy(),
            torch.cat(next_rows).numpy(),
            min_width=options["min_width"],
            width_threshold=options["width_threshold"],
        )

    def _beam_search(self, req_id: str, logits: torch.Tensor, widths: list[int]) -> BeamForest:
        """Each depth's best pairs by joint log-score (distinct, deterministic)."""
        vocab = logits.shape[-1]
        live, scores = [ROOT], torch.zeros(1)
        logp = torch.log_softmax(logits, dim=-1).unsqueeze(0)
        tokens: list[int] = []
        parents: list[int] = []
        for depth, width in enumerate(widths):
            joint_scores = (scores.unsqueeze(-1) + logp).reshape(-1)
            best = torch.topk(joint_scores, min(width, joint_scores.numel())).indices
            beam, token = best // vocab, best % vocab
            first = len(tokens)
            tokens += token.tolist()
            parents += [live[b] for b in beam.tolist()]
            scores = joint_scores[best]
            live = list(range(first, len(tokens)))
            if depth + 1 < len(widths):
                logp = torch.log_softmax(self.runtime.extend(req_id, token.tolist(), parents[first:]), dim=-1)
        return BeamForest(np.asarray(tokens), np.asarray(parents))


def _vocab_size(target_model: Any, tokenizer: str | None) -> int | None:
    """Width of the target's logits: from the loaded target if it says, else its config on disk."""
    config = getattr(target_model, "config", None)
    if getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    if tokenizer is None:
        return None
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(tokenizer).get_text_config().vocab_size)
    except (OSError, ValueError):
        return None
