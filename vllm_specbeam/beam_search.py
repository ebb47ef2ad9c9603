"""Speculative beam search: vLLM's beam search, several tokens per target pass.

vLLM 0.32's ``LLM.beam_search`` (entrypoints/generate/beam_search/offline.py)
advances every beam one token per engine step: each beam is submitted as a
one-token request with ``logprobs=2W``, the beams' candidates are pooled per
prompt and the ``W`` best by score survive. :func:`beam_search` returns the
same thing (same arguments, same :class:`BeamSearchOutput`, the same beams)
but a round advances up to ``num_speculative_tokens + 1`` tokens:

1. **Draft.** The draft model runs the same beam search from the ``W``
   target beams for ``num_speculative_tokens`` depths, keeping the
   ``draft_width`` best (beam, token) pairs per depth jointly over all beams,
   scores starting from the target beams' own: a forest, one tree per beam.
   The draft keeps one KV cache per prompt: the beams' common prefix is
   encoded once and their differing tails are tree nodes below it
   (:class:`~vllm_specbeam.draft_model.DraftModelRuntime`).
2. **Score.** Every beam of every prompt is submitted once with its tree
   appended (:mod:`vllm_specbeam.tree_prompt`): one target pass scores the
   whole forest, and the beams share their prompt's KV blocks through vLLM's
   prefix cache.
3. **Verify.** vLLM's selection is replayed depth by depth on the target's
   logprobs. While every survivor is a drafted node, its row was scored and
   the next depth can be selected too; the first depth with a survivor the
   draft missed ends the round (the survivors themselves are exact: they
   were chosen from scored rows).

So the output is vLLM's beam search's output, computed with fewer target
passes; only the tree rows' floating-point rounding differs from a plain
prefill, which can flip exact ties. Deterministic beam search only
(``temperature=0``), as the comparison with ``LLM.beam_search`` needs.

Use it on an engine started with the ``dsbd`` method (its ``model`` is the
draft; ``num_speculative_tokens`` the draft depth)::

    llm = LLM(target, speculative_config={"method": "dsbd", "model": draft},
              enable_chunked_prefill=False, enable_prefix_caching=True)
    outputs = beam_search(llm, prompts, BeamSearchParams(beam_width=4, max_tokens=64))
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_specbeam import tree_prompt
from vllm_specbeam.config import SpecbeamConfig, SpecbeamConfigError
from vllm_specbeam.draft_model import ROOT as DRAFT_ROOT
from vllm_specbeam.draft_model import DraftModelRuntime, common_prefix
from vllm_specbeam.tree import ROOT, DraftTree

_SEARCH_IDS = itertools.count()


@dataclass
class BeamSearchStats:
    """Counts over every call of one :class:`SpeculativeBeamSearch`."""

    #: target passes (engine ``generate`` calls; one per round)
    rounds: int = 0
    #: beam-search steps done (tokens appended to every live beam), summed over prompts
    steps: int = 0
    #: prompt-rounds: rounds summed over the prompts still searching
    prompt_rounds: int = 0
    #: draft nodes sent to the target for scoring
    draft_nodes: int = 0
    #: wall time spent drafting (the draft model's beam search)
    draft_seconds: float = 0.0

    @property
    def steps_per_round(self) -> float:
        """Mean tokens a prompt's beams advance per target pass (vLLM's beam search: 1)."""
        return self.steps / self.prompt_rounds if self.prompt_rounds else 0.0


@dataclass
class _Frontier:
    """A live beam during verification: the sequence, the target beam it
    grew from this round, and its node in that beam's tree (``ROOT`` = the
    beam's own end; ``None`` = not drafted, so not scored)."""

    seq: Any
    beam: int
    node: int | None


@dataclass
class _Instance:
    """One prompt's search: vLLM's ``BeamSearchInstance`` plus the draft cache key."""

    state: Any
    key: str
    steps: int = 0
    trees: list[DraftTree] = field(default_factory=list)


class SpeculativeBeamSearch:
    """Draft model and options for :func:`beam_search` on one engine.

    The draft model is loaded once, in this process (the engine's workers
    hold their own copy for in-engine ``dsbd`` requests).
    """

    def __init__(self, llm: Any, num_speculative_tokens: int | None = None, draft_width: int | None = None) -> None:
        config_data = (llm.llm_engine.vllm_config.additional_config or {}).get("specbeam")
        config = None if config_data is None else SpecbeamConfig.from_dict(config_data)
        if config is None or config.method != "dsbd":
            raise SpecbeamConfigError(
                "speculative beam search needs an engine started with the dsbd method and a draft model: "
                "LLM(target, speculative_config={\"method\": \"dsbd\", \"model\": DRAFT})"
            )
        if llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill:
            raise SpecbeamConfigError(tree_prompt.CHUNKED_PREFILL)
        if not llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
            raise SpecbeamConfigError(
                "speculative beam search shares the beams' prompt through vLLM's prefix cache: "
                "start the engine with enable_prefix_caching=True"
            )
        options = config.options
        self.llm = llm
        self.depth = num_speculative_tokens or options["num_speculative_tokens"]
        self.draft_width = draft_width
        if self.depth < 1 or (draft_width is not None and draft_width < 1):
            raise ValueError("num_speculative_tokens and draft_width must be at least 1")
        self.runtime = DraftModelRuntime(
            options["draft_model"],
            target_vocab_size=llm.llm_engine.vllm_config.model_config.get_vocab_size(),
            device=options["draft_device"],
            dtype=options["draft_dtype"],
        )
        self.stats = BeamSearchStats()

    # ------------------------------------------------------------ the search
    def run(self, prompts: Sequence[Any], params: Any) -> list[Any]:
        """What ``LLM.beam_search(prompts, params)`` returns (see the module docstring)."""
        from vllm.entrypoints.generate.beam_search.utils import (
            BeamSearchInstance,
            BeamSearchOutput,
            create_sort_beams_key_function,
        )

        if params.temperature != 0:
            raise ValueError(
                f"speculative beam search is deterministic: BeamSearchParams.temperature must be 0, "
                f"got {params.temperature}"
            )
        if params.structured_outputs is not None:
            raise ValueError("speculative beam search does not support structured outputs; use LLM.beam_search")
        tokenizer = self.llm.get_tokenizer()
        eos = None if params.ignore_eos else tokenizer.eos_token_id
        sort_key = create_sort_beams_key_function(tokenizer.eos_token_id, params.length_penalty)
        # vLLM 0.32.0 entrypoints/generate/beam_search/offline.py: the same
        # prompt preprocessing as LLM.beam_search.
        inputs = self.llm._preprocess_cmpl(list(prompts))
        search = next(_SEARCH_IDS)
        instances = [_Instance(BeamSearchInstance(prompt), f"beam-search-{search}-{i}") for i, prompt in enumerate(inputs)]
        try:
            while True:
                active = [inst for inst in instances if inst.state.beams and inst.steps < params.max_tokens]
                if not active:
                    break
                self._round(active, params, eos, sort_key)
        finally:
            self.runtime.remove(inst.key for inst in instances)

        outputs = []
        for inst in instances:
            best = sorted(inst.state.completed + inst.state.beams, key=sort_key, reverse=True)[: params.beam_width]
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens)
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs

    def _round(self, active: list[_Instance], params: Any, eos: int | None, sort_key: Any) -> None:
        """Draft, score and verify one round for every active prompt."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        num_logprobs = 2 * params.beam_width
        requests = []
        for inst in active:
            depth = min(self.depth, params.max_tokens - inst.steps - 1)
            start = time.perf_counter()
            inst.trees = self._draft(inst, depth, self.draft_width or num_logprobs, eos)
            self.stats.draft_seconds += time.perf_counter() - start
            for beam, tree in zip(inst.state.beams, inst.trees):
                prompt = TokensPrompt(prompt_token_ids=list(beam.tokens) + tree.tokens.tolist())
                if beam.orig_prompt.get("cache_salt"):
                    prompt["cache_salt"] = beam.orig_prompt["cache_salt"]
                requests.append((prompt, SamplingParams(**tree_prompt.request_params(tree.parents, num_logprobs))))
                self.stats.draft_nodes += tree.num_nodes
        results = self.llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        self.stats.rounds += 1
        position = 0
        for inst in active:
            rows = []
            for tree in inst.trees:
                rows.append(tree_prompt.row_logprobs(results[position], tree.num_nodes))
                position += 1
            done = self._verify(inst, rows, params, eos, sort_key)
            inst.steps += done
            self.stats.steps += done
            self.stats.prompt_rounds += 1

    # ------------------------------------------------------------ draft
    @torch.inference_mode()
    def _draft(self, inst: _Instance, depth: int, width: int, eos: int | None) -> list[DraftTree]:
        """One tree per live beam: the draft's beam search, ``width`` pairs per depth."""
        beams = inst.state.beams
        if depth < 1:
            return [DraftTree.empty() for _ in beams]
        tokens = [list(b.tokens) for b in beams]
        common = _common_prefix_len(tokens)
        logits = self.runtime.sync(inst.key, tokens[0][:common])
        tails = DraftTree.from_paths(t[common:] for t in tokens)
        ends = [_walk(tails, t[common:]) for t in tokens]
        if tails.num_nodes:
            tail_logits = self.runtime.extend(inst.key, tails.tokens.tolist(), tails.parents.tolist())
            logits = torch.stack([logits if end == ROOT else tail_logits[end] for end in ends])
        else:
            logits = logits.unsqueeze(0).expand(len(beams), -1)
        # live draft beams: (target beam, path below it, draft cache node)
        live = [(b, (), DRAFT_ROOT if end == ROOT else end) for b, end in enumerate(ends)]
        scores = torch.tensor([b.cum_logprob for b in beams], dtype=torch.float32)
        cache_nodes = tails.num_nodes
        drafted: list[list[tuple[tuple[int, ...], float]]] = [[] for _ in beams]
        vocab = logits.shape[-1]
        for level in range(depth):
            joint = scores[:, None] + torch.log_softmax(logits, dim=-1)
            if eos is not None:
                joint[:, eos] = float("-inf")  # an EOS candidate ends its beam, it is never extended
            best = torch.topk(joint.reshape(-1), min(width, int(torch.isfinite(joint).sum()))).indices
            if not best.numel():
                break
            parents, chosen = best // vocab, best % vocab
            live = [(live[p][0], live[p][1] + (int(x),), live[p][2]) for p, x in zip(parents.tolist(), chosen.tolist())]
            scores = joint.reshape(-1)[best]
            for (beam, path, _), score in zip(live, scores.tolist()):
                drafted[beam].append((path, score))
            if level + 1 < depth:
                logits = self.runtime.extend(inst.key, chosen.tolist(), [node for *_, node in live])
                live = [(beam, path, cache_nodes + i) for i, (beam, path, _) in enumerate(live)]
                cache_nodes += len(live)
        top = max((s for nodes in drafted for _, s in nodes), default=0.0)
        return [
            DraftTree.from_weighted_paths([p for p, _ in nodes], [np.exp(s - top) for _, s in nodes], len(nodes))
            for nodes in drafted
        ]

    # ------------------------------------------------------------ verify
    def _verify(self, inst: _Instance, rows: list[list[dict[int, Any]]], params: Any, eos: int | None,
                sort_key: Any) -> int:
        """Replay vLLM's beam-search steps on the scored rows; returns the steps done.

        ``rows[b]`` holds target beam ``b``'s logprob dicts at its root and
        tree nodes. vLLM 0.32.0 ``_beam_search_step``: candidates are each
        beam's returned top ``2W`` tokens, EOS candidates complete, the ``W``
        best others (stable sort by ``sort_key``) live on.
        """
        from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

        children = [{(int(p), int(t)): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
                    for tree in inst.trees]
        frontier = [_Frontier(seq, b, ROOT) for b, seq in enumerate(inst.state.beams)]
        num_candidates = 2 * params.beam_width
        steps = 0
        while frontier and inst.steps + steps < params.max_tokens and all(f.node is not None for f in frontier):
            candidates = []
            for f in frontier:
                # The top 2W in rank order, as vLLM's logprobs dict holds them
                # (a prompt-logprob row also holds the next prompt token).
                row = dict(sorted(((t, lp) for t, lp in rows[f.beam][f.node + 1].items()
                                   if lp.rank <= num_candidates), key=lambda item: item[1].rank))
                for token, logprob in row.items():
                    seq = BeamSearchSequence(
                        f.seq.orig_prompt,
                        tokens=f.seq.tokens + [token],
                        logprobs=f.seq.logprobs + [row],
                        lora_request=f.seq.lora_request,
                        cum_logprob=f.seq.cum_logprob + logprob.logprob,
                    )
                    if token == eos:
                        inst.state.completed.append(seq)
                    else:
                        candidates.append(_Frontier(seq, f.beam, children[f.beam].get((f.node, token))))
            frontier = sorted(candidates, key=lambda c: sort_key(c.seq), reverse=True)[: params.beam_width]
            steps += 1
        inst.state.beams = [f.seq for f in frontier]
        return steps


def beam_search(llm: Any, prompts: Sequence[Any], params: Any, num_speculative_tokens: int | None = None,
                draft_width: int | None = None) -> list[Any]:
    """``LLM.beam_search(prompts, params)``, speculatively (see the module docstring).

    ``num_speculative_tokens`` (draft depth) defaults to the engine's ``dsbd``
    setting; ``draft_width`` (pairs drafted per depth) to ``2 * beam_width``.
    The draft model is loaded on every call: keep a
    :class:`SpeculativeBeamSearch` to search repeatedly.
    """
    return SpeculativeBeamSearch(llm, num_speculative_tokens, draft_width).run(prompts, params)


def _common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the tokens every sequence starts with (at least the prompt)."""
    first = list(sequences[0])
    return min(common_prefix(first, list(s)) for s in sequences)


def _walk(tree: DraftTree, path: Sequence[int]) -> int:
    """The node a token path from the root ends at (``ROOT`` for an empty path)."""
    node = ROOT
    for token in path:
        node = next(int(c) for c in tree.children(node) if tree.tokens[c] == token)
    return node
