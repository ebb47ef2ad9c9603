"""Speculative beam search: vLLM's beam search, several tokens per target pass.

:func:`beam_search` (and :class:`SpeculativeBeamSearch`) take
``LLM.beam_search``'s arguments and return the same beams, but a round
advances up to ``num_speculative_tokens + 1`` tokens:

1. **Draft**: the engine's ``dsbd`` draft, in its worker (:class:`WorkerForests`,
   one ``collective_rpc`` a round), runs the same beam search from the ``W``
   target beams (:func:`~vllm_specbeam.methods.dsbd.drafter.draft_forests`).
2. **Score**: every beam goes once with its tree appended
   (:mod:`vllm_specbeam.adapter.tree_prompt`), or a prompt's beams as one
   :class:`~vllm_specbeam.adapter.tree_prompt.SharedTree` when that computes
   fewer rows (the ``scoring`` option): one target pass for the whole forest.
3. **Verify**: vLLM's selection is replayed depth by depth on the target's
   logprobs until a survivor the draft missed ends the round.

Deterministic beam search only (``temperature=0``); a search with vLLM 0.33's
``allowed_token_ids`` runs ``LLM.beam_search`` itself. :class:`Selection`
holds vLLM's two selection rules (offline and server);
:mod:`vllm_specbeam.adapter.beam_search_server` runs these rounds for the
server's ``use_beam_search``. Usage and figures: docs/methods/dsbd.md.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_specbeam.adapter import tree_prompt, vllm_versions
from vllm_specbeam.adapter.engine_config import plugin_config
from vllm_specbeam.core.config import SpecbeamConfigError
from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.methods.dsbd.drafter import ForestRequest

logger = logging.getLogger(__name__)

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
    #: prompt rows the target computed to score (beams' tokens not in the prefix cache, and the trees)
    scored_rows: int = 0
    #: prompt-rounds scored as one shared tree (the others: one request per beam)
    shared_rounds: int = 0
    #: draft depths, summed over prompt-rounds (below ``num_speculative_tokens`` near ``max_tokens``)
    drafted_depths: int = 0

    @property
    def steps_per_round(self) -> float:
        """Mean tokens a prompt's beams advance per target pass (vLLM's beam search: 1)."""
        return self.steps / self.prompt_rounds if self.prompt_rounds else 0.0


@dataclass(frozen=True)
class Selection:
    """How a vLLM beam-search step picks its survivors and completes EOS beams.

    vLLM's offline search (entrypoints/generate/beam_search/offline.py) and
    its server's (online.py) differ in details that can change the returned
    beams, so each is replayed as written (the same in 0.32.0 and 0.33.0):
    offline keeps the ``W`` best candidates by the length-penalised score in a
    stable sort and keeps EOS in completed beams; online takes the ``W`` best
    cumulative logprobs through ``numpy.argpartition`` and drops EOS from
    completed beams unless ``include_stop_str_in_output``. The score and the
    EOS set are the installed release's (:mod:`~vllm_specbeam.adapter.vllm_versions`).
    """

    width: int
    #: the tokens that complete a beam (none with ``ignore_eos``)
    eos: frozenset[int]
    sort_key: Callable[[Any], float]
    online: bool = False
    include_eos: bool = True
    #: the EOS the draft's own beam search stops at: the tokenizer's (``None`` with ``ignore_eos``); a
    #: beam the draft continues past another EOS only costs draft nodes, the verification uses ``eos``
    draft_eos: int | None = None

    @classmethod
    def offline(cls, params: Any, eos_token_id: int | None, generation_config: Mapping[str, Any]) -> Selection:
        """``LLM.beam_search``'s rules; ``generation_config``: the engine's
        ``input_processor.generation_config_fields``."""
        return cls(params.beam_width, **cls._rules(params, eos_token_id, generation_config))

    @classmethod
    def server(cls, params: Any, eos_token_id: int | None, generation_config: Mapping[str, Any]) -> Selection:
        """The server's (``BeamSearchOnlineMixin.beam_search``) rules."""
        return cls(
            params.beam_width,
            **cls._rules(params, eos_token_id, generation_config),
            online=True,
            include_eos=params.include_stop_str_in_output,
        )

    @staticmethod
    def _rules(params: Any, eos_token_id: int | None, generation_config: Mapping[str, Any]) -> dict[str, Any]:
        ends = not params.ignore_eos
        return {
            "eos": vllm_versions.beam_eos_token_ids(generation_config, eos_token_id) if ends else frozenset(),
            "sort_key": vllm_versions.sort_key(params.length_penalty, eos_token_id),
            "draft_eos": eos_token_id if ends else None,
        }

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
        """The completed form of a beam that just drew an EOS token."""
        if self.online:
            eos = seq.tokens[-1]
            if not self.include_eos:
                seq.tokens = seq.tokens[:-1]
            seq.finish_reason, seq.stop_reason = "stop", eos
        return seq

    def best(self, state: Any) -> list[Any]:
        """The ``W`` best of the completed and live beams, as the search returns them."""
        return sorted(state.completed + state.beams, key=self.sort_key, reverse=True)[: self.width]


def check_params(params: Any) -> None:
    """Refuse what the speculative search cannot replay exactly (``allowed_token_ids``
    goes to vLLM's own search instead: :func:`allowlist_reason`)."""
    if params.temperature != 0:
        raise ValueError(
            f"speculative beam search is deterministic: BeamSearchParams.temperature must be 0, "
            f"got {params.temperature}"
        )
    if getattr(params, "structured_outputs", None) is not None:
        raise ValueError("speculative beam search does not support structured outputs; use LLM.beam_search")


def allowlist_reason(params: Any) -> str | None:
    """Why this search runs vLLM's own beam search: an ``allowed_token_ids`` allow-list (vLLM 0.33),
    scored from exact-ID logprobs the speculative search cannot replay; else ``None``."""
    if vllm_versions.beam_allowlist(params) is None:
        return None
    return "allowed_token_ids is set (scored from exact-ID logprobs, which the speculative search cannot replay)"


def priorities(priority: int | Sequence[int] | None, count: int) -> list[int]:
    """One scheduling priority per prompt, as ``LLM.beam_search`` (vLLM 0.33) takes them."""
    if priority is None or isinstance(priority, int):
        return [priority or 0] * count
    if len(priority) != count:
        raise ValueError(f"{count} prompts but {len(priority)} priorities: pass one priority or one per prompt")
    return list(priority)


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
class _Layout:
    """How one prompt's forest went to the target in a round."""

    #: per request: its tree's node count
    nodes: list[int]
    #: per beam: its request, and the rows of that request's ``row_logprobs`` at the
    #: beam's end and at its tree's nodes
    rows: list[tuple[int, list[int]]]


@dataclass
class PromptSearch:
    """One prompt's search: vLLM's ``BeamSearchInstance`` plus the draft cache key."""

    state: Any
    key: str
    #: the scheduling priority of its requests
    priority: int = 0
    steps: int = 0
    trees: list[DraftTree] = field(default_factory=list)
    layout: _Layout | None = None
    #: sequences scored as linear prompt rows (newest last), with the leading tokens each left
    #: in vLLM's prefix cache: full blocks before its root's block
    linear: list[tuple[np.ndarray, int]] = field(default_factory=list)


class WorkerForests:
    """Forests drafted by the engine's own draft, in its worker.

    Each round is one ``collective_rpc`` (``specbeam_draft_forests``, run
    between engine steps) with plain data both ways; the draft's state per
    prompt stays in the worker
    (:class:`~vllm_specbeam.adapter.draft_model.SearchDraftRuntime`) until
    :meth:`release`. No copy of the draft in this process.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @staticmethod
    def _args(requests: list[ForestRequest], width: int, eos: int | None) -> tuple[Any, ...]:
        return ([[r.key, r.beams, r.scores, r.depth] for r in requests], width, eos)

    @staticmethod
    def _trees(forests: list[list[tuple[list[int], list[int]]]]) -> list[list[DraftTree]]:
        return [[DraftTree(np.asarray(t, np.int64), np.asarray(p, np.int64)) for t, p in trees] for trees in forests]

    def draft(self, requests: list[ForestRequest], width: int, eos: int | None) -> list[list[DraftTree]]:
        forests = self.engine.collective_rpc("specbeam_draft_forests", args=self._args(requests, width, eos))
        return self._trees(forests[0])

    async def draft_async(self, requests: list[ForestRequest], width: int, eos: int | None) -> list[list[DraftTree]]:
        forests = await self.engine.collective_rpc("specbeam_draft_forests", args=self._args(requests, width, eos))
        return self._trees(forests[0])

    def release(self, keys: list[str]) -> None:
        self.engine.collective_rpc("specbeam_release_forests", args=(keys,))

    async def release_async(self, keys: list[str]) -> None:
        await self.engine.collective_rpc("specbeam_release_forests", args=(keys,))


class SpeculativeBeamSearch:
    """Draft and options for :func:`beam_search` on one engine (the engine's own draft drafts,
    in its worker: :class:`WorkerForests`)."""

    #: ``scoring``: per prompt and round, whichever leaves the target fewer rows (``auto``),
    #: always one request per beam, or always one shared tree (when it fits a prefill chunk)
    SCORING = ("auto", "per-beam", "shared")

    def __init__(
        self,
        engine: Any,
        num_speculative_tokens: int | None = None,
        draft_width: int | None = None,
        scoring: str = "auto",
    ) -> None:
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
        if scoring not in self.SCORING:
            raise ValueError(f"scoring must be one of {self.SCORING}, got {scoring!r}")
        self.scoring = scoring
        self.block_size = vllm_config.cache_config.block_size
        self.row_limit = tree_prompt.tree_row_limit(vllm_config.scheduler_config)
        self.forests = WorkerForests(engine)
        self.stats = BeamSearchStats()
        #: prompt keys unique across searches and processes (the worker holds their drafts' state)
        self._keys = f"beam-search-{uuid.uuid4().hex[:12]}"

    # ------------------------------------------------------------ the search
    def run(self, prompts: Sequence[Any], params: Any, priority: int | Sequence[int] | None = None) -> list[Any]:
        """What ``LLM.beam_search(prompts, params, priority=priority)`` returns (see the module docstring)."""
        from vllm.entrypoints.generate.beam_search.utils import BeamSearchInstance, BeamSearchOutput

        reason = allowlist_reason(params)
        if reason is not None:
            logger.info("beam search runs vLLM's own LLM.beam_search: %s", reason)
            return self.engine.beam_search(list(prompts), params, priority=priority)
        check_params(params)
        tokenizer = self.engine.get_tokenizer()
        selection = Selection.offline(
            params, tokenizer.eos_token_id, self.engine.llm_engine.input_processor.generation_config_fields
        )
        # vLLM 0.32.0 and 0.33.0 entrypoints/generate/beam_search/offline.py: the same
        # prompt preprocessing as LLM.beam_search.
        inputs = self.engine._preprocess_cmpl(list(prompts))
        search = next(_SEARCH_IDS)
        instances = [
            PromptSearch(BeamSearchInstance(prompt), f"{self._keys}-{search}-{i}", p)
            for i, (prompt, p) in enumerate(zip(inputs, priorities(priority, len(inputs))))
        ]
        try:
            while active := self.active(instances, params):
                requests = self.draft_round(active, params, selection.draft_eos)
                prompts_, sampling = zip(*requests)
                results = self.engine.generate(
                    list(prompts_), list(sampling), use_tqdm=False, priority=self.request_priorities(active)
                )
                self.verify_round(active, results, params, selection)
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

    @staticmethod
    def request_priorities(active: list[PromptSearch]) -> list[int]:
        """The priority of each of :meth:`draft_round`'s requests: its prompt's."""
        assert all(inst.layout is not None for inst in active)
        return [inst.priority for inst in active for _ in inst.layout.nodes]  # type: ignore[union-attr]

    def release(self, instances: Sequence[PromptSearch]) -> None:
        """Free the draft state of finished (or abandoned) searches."""
        self.forests.release([inst.key for inst in instances])

    async def release_async(self, instances: Sequence[PromptSearch]) -> None:
        await self.forests.release_async([inst.key for inst in instances])

    def draft_round(self, active: list[PromptSearch], params: Any, eos: int | None) -> list[tuple[Any, Any]]:
        """Draft every active prompt's forest; one (prompt, ``SamplingParams``)
        per target beam: the beam with its tree appended."""
        start = time.perf_counter()
        forests = self.forests.draft(self._forest_requests(active, params), self._width(params), eos)
        self.stats.draft_seconds += time.perf_counter() - start
        return self._scoring_requests(active, params, forests)

    async def draft_round_async(
        self, active: list[PromptSearch], params: Any, eos: int | None
    ) -> list[tuple[Any, Any]]:
        """:meth:`draft_round` for the server's event loop."""
        start = time.perf_counter()
        forests = await self.forests.draft_async(self._forest_requests(active, params), self._width(params), eos)
        self.stats.draft_seconds += time.perf_counter() - start
        return self._scoring_requests(active, params, forests)

    def _width(self, params: Any) -> int:
        return self.draft_width or 2 * params.beam_width

    def _forest_requests(self, active: list[PromptSearch], params: Any) -> list[ForestRequest]:
        depths = [min(self.depth, params.max_tokens - inst.steps - 1) for inst in active]
        self.stats.drafted_depths += sum(depths)
        return [
            ForestRequest(
                inst.key,
                [list(b.tokens) for b in inst.state.beams],
                [float(b.cum_logprob) for b in inst.state.beams],
                depth,
            )
            for inst, depth in zip(active, depths)
        ]

    def _scoring_requests(
        self, active: list[PromptSearch], params: Any, forests: list[list[DraftTree]]
    ) -> list[tuple[Any, Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        num_logprobs = self._num_logprobs(params)
        requests = []
        for inst, trees in zip(active, forests):
            inst.trees = trees
            salt = inst.state.beams[0].orig_prompt.get("cache_salt")
            for tokens, parents in self._layout(inst, trees):
                prompt = TokensPrompt(prompt_token_ids=tokens)
                if salt:
                    prompt["cache_salt"] = salt
                requests.append((prompt, SamplingParams(**tree_prompt.request_params(parents, num_logprobs))))
            self.stats.draft_nodes += sum(tree.num_nodes for tree in trees)
        return requests

    def _num_logprobs(self, params: Any) -> int:
        """The top tokens the target returns per scored row: vLLM's beam search reads ``2W``."""
        return 2 * params.beam_width

    def _layout(self, inst: PromptSearch, trees: list[DraftTree]) -> list[tuple[list[int], list[int]]]:
        """One prompt's scoring requests (prompt tokens, tree parents): a request per beam, or
        one :class:`~vllm_specbeam.adapter.tree_prompt.SharedTree` (``scoring``). Sets ``inst.layout``.

        Example (blocks of 32): four beams of 131 tokens sharing 119, scored last round as
        requests of 126 tokens each: each recomputes its rows 96-130 (35 rows, 140 in all);
        one shared tree recomputes the prefix's rows 96-118 once (23) plus the tails' 4 x 12
        nodes (fewer when tails share tokens): 71 rows.
        """
        beams = [np.asarray(beam.tokens, np.int64) for beam in inst.state.beams]
        shared = None
        if self.scoring != "per-beam" and len(beams) > 1:
            shared = tree_prompt.shared_tree(beams, trees)
            if self.row_limit is not None and shared.num_nodes + 1 > self.row_limit:
                shared = None  # its rows would not fit one prefill chunk
            elif self.scoring == "auto":
                prefix = beams[0][: shared.prefix_len]
                shared_rows = len(prefix) - self._cached(inst, prefix) + shared.num_tail_nodes
                if shared_rows >= sum(len(beam) - self._cached(inst, beam) for beam in beams):
                    shared = None
        if shared is None:
            inst.layout = _Layout(
                [t.num_nodes for t in trees], [(b, list(range(t.num_nodes + 1))) for b, t in enumerate(trees)]
            )
            linear = beams
            requests = [
                (beam.tolist() + tree.tokens.tolist(), tree.parents.tolist()) for beam, tree in zip(beams, trees)
            ]
        else:
            inst.layout = _Layout([shared.num_nodes], [(0, rows) for rows in shared.rows])
            linear = [beams[0][: shared.prefix_len]]
            requests = [(linear[0].tolist() + shared.tokens, shared.parents)]
            self.stats.shared_rounds += 1
        block = self.block_size
        # about the last three rounds: this round's beams descend from theirs
        inst.linear = (inst.linear + [(seq, (len(seq) - 1) // block * block) for seq in linear])[-3 * len(beams) :]
        return requests

    def _cached(self, inst: PromptSearch, seq: np.ndarray) -> int:
        """How many leading tokens of ``seq`` vLLM's prefix cache holds, as far as this
        search knows: full blocks earlier rounds computed as linear prompt rows (blocks
        with tree rows never serve another request, ``tree_prompt.block_hash_extra_keys``).
        An estimate: eviction and other requests' blocks are not seen."""
        hit = 0
        for earlier, cached in inst.linear:
            n = min(len(seq), cached)
            differ = np.flatnonzero(seq[:n] != earlier[:n])
            hit = max(hit, int(differ[0]) if differ.size else n)
        return min(hit, len(seq) - 1) // self.block_size * self.block_size

    def verify_round(
        self, active: list[PromptSearch], results: Sequence[Any], params: Any, selection: Selection
    ) -> None:
        """Advance every active prompt by the steps its scored forest settles;
        ``results`` are the target's outputs for :meth:`draft_round`'s requests, in order."""
        self.stats.rounds += 1
        position = 0
        for inst in active:
            assert inst.layout is not None
            scored = results[position : position + len(inst.layout.nodes)]
            position += len(scored)
            request_rows = [tree_prompt.row_logprobs(result, n) for result, n in zip(scored, inst.layout.nodes)]
            rows = [[request_rows[request][i] for i in indices] for request, indices in inst.layout.rows]
            self.stats.scored_rows += sum(len(r.prompt_token_ids) - (r.num_cached_tokens or 0) for r in scored)
            done = self._verify(inst, rows, params, selection)
            inst.steps += done
            self.stats.steps += done
            self.stats.prompt_rounds += 1

    # ------------------------------------------------------------ verify
    def _verify(self, inst: PromptSearch, rows: list[list[dict[int, Any]]], params: Any, selection: Selection) -> int:
        """Replay vLLM's beam-search steps on the scored rows; returns the steps done.

        ``rows[b]`` holds target beam ``b``'s logprob dicts at its root and
        tree nodes. vLLM 0.32.0 and 0.33.0 ``_beam_search_step`` / online ``beam_search``:
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
                    if token in selection.eos:
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
    priority: int | Sequence[int] | None = None,
) -> list[Any]:
    """``LLM.beam_search(prompts, params, priority=priority)``, speculatively (see the module docstring).

    ``num_speculative_tokens`` (draft depth) defaults to the engine's ``dsbd``
    setting; ``draft_width`` (pairs drafted per depth) to ``2 * beam_width``;
    ``priority``: one for all prompts or one per prompt. Keep a
    :class:`SpeculativeBeamSearch` to search repeatedly.
    """
    return SpeculativeBeamSearch(llm, num_speculative_tokens, draft_width).run(prompts, params, priority)
