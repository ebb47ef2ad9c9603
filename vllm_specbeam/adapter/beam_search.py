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
   (:class:`~vllm_specbeam.draft_runtime.hf.DraftModelRuntime`); all prompts are
   drafted together, one batched draft forward per depth, by the same beam
   search the in-engine ``dsbd`` drafter runs at temperature 0
   (:class:`~vllm_specbeam.methods.dsbd.drafter.DraftBeamSearch`).
2. **Score.** Every beam of every prompt is submitted once with its tree
   appended (:mod:`vllm_specbeam.adapter.tree_prompt`): one target pass scores the
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
:class:`Selection` holds the two ways vLLM selects (offline and server);
:mod:`vllm_specbeam.adapter.beam_search_server` runs these rounds for the OpenAI
server's ``use_beam_search``.

Use it on an engine started with the ``dsbd`` method (its ``model`` is the
draft; ``num_speculative_tokens`` the draft depth)::

    llm = LLM(target, speculative_config={"method": "dsbd", "model": draft}, enable_prefix_caching=True)
    outputs = beam_search(llm, prompts, BeamSearchParams(beam_width=4, max_tokens=64))
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_specbeam.adapter import tree_prompt
from vllm_specbeam.adapter.engine_config import plugin_config
from vllm_specbeam.core.config import SpecbeamConfigError
from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.draft_runtime.hf import DraftModelRuntime, common_prefix, placement
from vllm_specbeam.methods.dsbd.drafter import DraftBeamSearch, draft_beams

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


@dataclass(frozen=True)
class Selection:
    """How a vLLM beam-search step picks its survivors and completes EOS beams.

    vLLM 0.32.0's offline search (entrypoints/generate/beam_search/offline.py)
    and its server's (online.py) differ in details that can change the
    returned beams, so each is replayed as written: offline keeps the ``W``
    best candidates by the length-penalised score in a stable sort and keeps
    EOS in completed beams; online takes the ``W`` best cumulative logprobs
    through ``numpy.argpartition`` and drops EOS from completed beams unless
    ``include_stop_str_in_output``.
    """

    width: int
    #: the EOS token that completes a beam (``None`` with ``ignore_eos``)
    eos: int | None
    sort_key: Callable[[Any], float]
    online: bool = False
    include_eos: bool = True

    @classmethod
    def offline(cls, params: Any, eos_token_id: int | None) -> Selection:
        from vllm.entrypoints.generate.beam_search.utils import create_sort_beams_key_function

        return cls(
            params.beam_width,
            None if params.ignore_eos else eos_token_id,
            create_sort_beams_key_function(eos_token_id, params.length_penalty),
        )

    @classmethod
    def server(cls, params: Any, eos_token_id: int | None) -> Selection:
        from vllm.entrypoints.generate.beam_search.utils import create_sort_beams_key_function

        return cls(
            params.beam_width,
            None if params.ignore_eos else eos_token_id,
            create_sort_beams_key_function(eos_token_id, params.length_penalty),
            online=True,
            include_eos=params.include_stop_str_in_output,
        )

    def survivors(self, candidates: list[_Frontier]) -> list[_Frontier]:
        if not self.online:
            return sorted(candidates, key=lambda c: self.sort_key(c.seq), reverse=True)[: self.width]
        scores = np.fromiter((c.seq.cum_logprob for c in candidates), dtype=np.float64, count=len(candidates))
        if len(candidates) <= self.width:
            order = np.argsort(-scores)
        else:
            order = np.argpartition(-scores, self.width - 1)[: self.width]
            order = order[np.argsort(-scores[order])]
        return [candidates[int(i)] for i in order]

    def complete(self, seq: Any) -> Any:
        """The completed form of a beam that just drew EOS."""
        if self.online:
            if not self.include_eos:
                seq.tokens = seq.tokens[:-1]
            seq.finish_reason, seq.stop_reason = "stop", self.eos
        return seq

    def best(self, state: Any) -> list[Any]:
        """The ``W`` best of the completed and live beams, as the search returns them."""
        return sorted(state.completed + state.beams, key=self.sort_key, reverse=True)[: self.width]


def check_params(params: Any) -> None:
    """Refuse what the speculative search cannot replay exactly."""
    if params.temperature != 0:
        raise ValueError(
            f"speculative beam search is deterministic: BeamSearchParams.temperature must be 0, "
            f"got {params.temperature}"
        )
    if getattr(params, "structured_outputs", None) is not None:
        raise ValueError("speculative beam search does not support structured outputs; use LLM.beam_search")


def engine_problem(vllm_config: Any) -> str | None:
    """Why this engine cannot run a speculative beam search, or ``None``."""
    config = plugin_config(vllm_config)
    if config is None or config.method != "dsbd":
        return (
            "speculative beam search needs an engine started with the dsbd method and a draft model: "
            'LLM(target, speculative_config={"method": "dsbd", "model": DRAFT})'
        )
    chunking = tree_prompt.chunking_problem(vllm_config.scheduler_config)
    if chunking is not None:
        return chunking
    if not vllm_config.cache_config.enable_prefix_caching:
        return (
            "speculative beam search shares the beams' prompt through vLLM's prefix cache: "
            "start the engine with enable_prefix_caching=True (--enable-prefix-caching)"
        )
    return None


@dataclass
class _Frontier:
    """A live beam during verification: the sequence, the target beam it
    grew from this round, and its node in that beam's tree (``ROOT`` = the
    beam's own end; ``None`` = not drafted, so not scored)."""

    seq: Any
    beam: int
    node: int | None


@dataclass
class PromptSearch:
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

    def __init__(self, engine: Any, num_speculative_tokens: int | None = None, draft_width: int | None = None) -> None:
        """``engine``: an ``LLM`` (for :meth:`run`) or the server's engine client
        (an ``AsyncLLM``, for :mod:`vllm_specbeam.adapter.beam_search_server`)."""
        vllm_config = getattr(engine, "llm_engine", engine).vllm_config
        problem = engine_problem(vllm_config)
        if problem:
            raise SpecbeamConfigError(problem)
        options = plugin_config(vllm_config).options
        self.engine = engine
        self.depth = num_speculative_tokens or options["num_speculative_tokens"]
        self.draft_width = draft_width
        if self.depth < 1 or (draft_width is not None and draft_width < 1):
            raise ValueError("num_speculative_tokens and draft_width must be at least 1")
        device, dtype = placement(
            options["draft_device"],
            options["draft_dtype"],
            vllm_config.device_config.device,
            vllm_config.model_config.dtype,
        )
        self.runtime = DraftModelRuntime(
            options["draft_model"],
            target_vocab_size=vllm_config.model_config.get_vocab_size(),
            device=device,
            dtype=dtype,
        )
        self.stats = BeamSearchStats()
        #: one search drafts at a time: the server runs concurrent searches' drafts in threads
        self._draft_lock = threading.Lock()

    # ------------------------------------------------------------ the search
    def run(self, prompts: Sequence[Any], params: Any) -> list[Any]:
        """What ``LLM.beam_search(prompts, params)`` returns (see the module docstring)."""
        from vllm.entrypoints.generate.beam_search.utils import BeamSearchInstance, BeamSearchOutput

        check_params(params)
        tokenizer = self.engine.get_tokenizer()
        selection = Selection.offline(params, tokenizer.eos_token_id)
        # vLLM 0.32.0 entrypoints/generate/beam_search/offline.py: the same
        # prompt preprocessing as LLM.beam_search.
        inputs = self.engine._preprocess_cmpl(list(prompts))
        search = next(_SEARCH_IDS)
        instances = [
            PromptSearch(BeamSearchInstance(prompt), f"beam-search-{search}-{i}") for i, prompt in enumerate(inputs)
        ]
        try:
            while active := self.active(instances, params):
                requests = self.draft_round(active, params, selection.eos)
                prompts_, sampling = zip(*requests)
                self.verify_round(
                    active, self.engine.generate(list(prompts_), list(sampling), use_tqdm=False), params, selection
                )
        finally:
            self.release(instances)

        outputs = []
        for inst in instances:
            best = selection.best(inst.state)
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens)
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs

    # ------------------------------------------------------------ rounds
    @staticmethod
    def active(instances: Sequence[PromptSearch], params: Any) -> list[PromptSearch]:
        """The prompts still searching: live beams and tokens left."""
        return [inst for inst in instances if inst.state.beams and inst.steps < params.max_tokens]

    def release(self, instances: Sequence[PromptSearch]) -> None:
        """Free the draft caches of finished (or abandoned) searches."""
        with self._draft_lock:
            self.runtime.remove(inst.key for inst in instances)

    def draft_round(self, active: list[PromptSearch], params: Any, eos: int | None) -> list[tuple[Any, Any]]:
        """Draft every active prompt's forest; one (prompt, ``SamplingParams``)
        per target beam: the beam with its tree appended."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        num_logprobs = 2 * params.beam_width
        requests = []
        start = time.perf_counter()
        with self._draft_lock:
            depths = [min(self.depth, params.max_tokens - inst.steps - 1) for inst in active]
            self._draft(active, depths, self.draft_width or num_logprobs, eos)
        self.stats.draft_seconds += time.perf_counter() - start
        for inst in active:
            for beam, tree in zip(inst.state.beams, inst.trees):
                prompt = TokensPrompt(prompt_token_ids=list(beam.tokens) + tree.tokens.tolist())
                if beam.orig_prompt.get("cache_salt"):
                    prompt["cache_salt"] = beam.orig_prompt["cache_salt"]
                requests.append((prompt, SamplingParams(**tree_prompt.request_params(tree.parents, num_logprobs))))
                self.stats.draft_nodes += tree.num_nodes
        return requests

    def verify_round(
        self, active: list[PromptSearch], results: Sequence[Any], params: Any, selection: Selection
    ) -> None:
        """Advance every active prompt by the steps its scored forest settles;
        ``results`` are the target's outputs for :meth:`draft_round`'s requests, in order."""
        self.stats.rounds += 1
        position = 0
        for inst in active:
            rows = []
            for tree in inst.trees:
                rows.append(tree_prompt.row_logprobs(results[position], tree.num_nodes))
                position += 1
            done = self._verify(inst, rows, params, selection)
            inst.steps += done
            self.stats.steps += done
            self.stats.prompt_rounds += 1

    # ------------------------------------------------------------ draft
    @torch.inference_mode()
    def _draft(self, active: list[PromptSearch], depths: list[int], width: int, eos: int | None) -> None:
        """Set every prompt's ``trees``: one per live beam, from the draft's beam
        search over all the prompt's beams, ``width`` pairs per depth. All
        prompts are drafted together: one batched draft forward per depth."""
        starts = []
        for inst in active:
            tokens = [list(b.tokens) for b in inst.state.beams]
            common = _common_prefix_len(tokens)
            tails = DraftTree.from_paths(t[common:] for t in tokens)
            starts.append((tokens[0][:common], tails, [_walk(tails, t[common:]) for t in tokens]))
        at_prefix = self.runtime.sync_many([(inst.key, prefix, 0) for inst, (prefix, _, _) in zip(active, starts)])
        with_tails = [i for i, (_, tails, _) in enumerate(starts) if tails.num_nodes]
        at_tails = dict(
            zip(
                with_tails,
                self.runtime.extend_many(
                    [(active[i].key, starts[i][1].tokens.tolist(), starts[i][1].parents.tolist()) for i in with_tails]
                ),
            )
        )
        searches = []
        for i, (inst, (_, tails, ends), depth) in enumerate(zip(active, starts, depths)):
            rows = torch.stack([at_prefix[i] if end == ROOT else at_tails[i][end] for end in ends])
            scores = torch.tensor([b.cum_logprob for b in inst.state.beams], dtype=torch.float32)
            # an EOS candidate ends its beam, it is never extended
            searches.append(
                DraftBeamSearch(inst.key, [width] * max(depth, 0), rows, ends, scores, tails.num_nodes, eos)
            )
        draft_beams(self.runtime, [s for s in searches if s.widths], None)
        for inst, (_, tails, ends), search in zip(active, starts, searches):
            inst.trees = _beam_trees(search, ends, tails.num_nodes)

    # ------------------------------------------------------------ verify
    def _verify(self, inst: PromptSearch, rows: list[list[dict[int, Any]]], params: Any, selection: Selection) -> int:
        """Replay vLLM's beam-search steps on the scored rows; returns the steps done.

        ``rows[b]`` holds target beam ``b``'s logprob dicts at its root and
        tree nodes. vLLM 0.32.0 ``_beam_search_step`` / online ``beam_search``:
        candidates are each beam's returned top ``2W`` tokens, EOS candidates
        complete, the ``W`` best others live on (:class:`Selection`).
        """
        from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

        children = [
            {(int(p), int(t)): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))} for tree in inst.trees
        ]
        frontier = [_Frontier(seq, b, ROOT) for b, seq in enumerate(inst.state.beams)]
        num_candidates = 2 * params.beam_width
        steps = 0
        while frontier and inst.steps + steps < params.max_tokens and all(f.node is not None for f in frontier):
            candidates = []
            for f in frontier:
                # The top 2W in rank order, as vLLM's logprobs dict holds them
                # (a prompt-logprob row also holds the next prompt token).
                row = dict(
                    sorted(
                        ((t, lp) for t, lp in rows[f.beam][f.node + 1].items() if lp.rank <= num_candidates),
                        key=lambda item: item[1].rank,
                    )
                )
                for token, logprob in row.items():
                    seq = BeamSearchSequence(
                        f.seq.orig_prompt,
                        tokens=f.seq.tokens + [token],
                        logprobs=f.seq.logprobs + [row],
                        lora_request=f.seq.lora_request,
                        cum_logprob=f.seq.cum_logprob + logprob.logprob,
                    )
                    if token == selection.eos:
                        inst.state.completed.append(selection.complete(seq))
                    else:
                        candidates.append(_Frontier(seq, f.beam, children[f.beam].get((f.node, token))))
            frontier = selection.survivors(candidates)
            steps += 1
        inst.state.beams = [f.seq for f in frontier]
        return steps


def beam_search(
    llm: Any,
    prompts: Sequence[Any],
    params: Any,
    num_speculative_tokens: int | None = None,
    draft_width: int | None = None,
) -> list[Any]:
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


def _beam_trees(search: DraftBeamSearch, ends: list[int], first_node: int) -> list[DraftTree]:
    """The draft's search split into one tree per target beam (the beam whose
    end its first node hangs below), nodes weighted by their joint score."""
    beam_of_end = {end: b for b, end in enumerate(ends)}
    beam_of: list[int] = []
    path_of: list[tuple[int, ...]] = []
    for token, parent in zip(search.tokens, search.parents):
        own = parent - first_node  # an earlier drafted node, or negative: a target beam's end
        beam_of.append(beam_of[own] if own >= 0 else beam_of_end[parent])
        path_of.append((path_of[own] if own >= 0 else ()) + (token,))
    top = max(search.node_scores, default=0.0)
    drafted: list[list[int]] = [[] for _ in ends]
    for node, beam in enumerate(beam_of):
        drafted[beam].append(node)
    return [
        DraftTree.from_weighted_paths(
            [path_of[n] for n in nodes], [np.exp(search.node_scores[n] - top) for n in nodes], len(nodes)
        )
        for nodes in drafted
    ]
