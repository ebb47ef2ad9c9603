"""DSBD drafting: beam sampling with the draft model, drafted as a forest.

All requests of a step are drafted together, one draft forward per depth:
:meth:`~vllm_specbeam.draft_runtime.base.DraftRuntime.sync_many` gives each
request ``q(. | context)``; at every depth, per request, ``max_width`` (beam,
token) pairs are drawn i.i.d. from the draft joint over the beams' scores and
``q`` rows (with replacement, as beam sampling does), and all requests' new
beams go to the draft as one level
(:meth:`~vllm_specbeam.draft_runtime.base.DraftRuntime.extend_many`).
``max_width`` pairs are drawn at every depth because the target decides how
many it keeps (:func:`vllm_specbeam.methods.dsbd.maths.choose_width`);
``max_nodes`` cuts the last depths short. Requests differ in widths, depths
and temperatures; one out of depths leaves the batch.

Greedy requests (temperature 0, no ``draft_temperature``) run beam *search*:
the ``max_width`` best distinct pairs of the joint log-score, without draft
rows, keeping those within ``prune_ratio`` of the depth's best.

Draws come from the drafter's one generator, depth by depth (a seed fixes them).

**Lookup branches** (``"lookup": "request" | "global"``): the forest starts below
``lookup_tree``'s branches, its first depth without their first tokens, and drafts
only the nodes they leave, or does not run (:mod:`vllm_specbeam.methods.lookup_tree.branches`);
the verifier checks lookup nodes as deterministic drafts.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from vllm_specbeam.core.budget import TreeShape
from vllm_specbeam.core.config import LOOKUP_OPTIONS, Option, SpecbeamConfigError
from vllm_specbeam.core.controller import StepLedger, forwards_that_pay
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.draft_runtime.base import DraftRuntime
from vllm_specbeam.draft_runtime.drafter import (
    DRAFT_MODEL_OPTIONS,
    GREEDY_EPS,
    DraftModelDrafter,
    draft_temperature,
    sampling_probs,
)
from vllm_specbeam.draft_runtime.priced import PricedDraftModel
from vllm_specbeam.methods.dsbd.beam_sampling import SamplingLaw, SparseRows, beam_joint, cut_rows, draw_pairs
from vllm_specbeam.methods.dsbd.maths import BeamForest, joint
from vllm_specbeam.methods.lookup_tree import branches as lookup_branches


def most_fed(depth: int, max_width: int, max_nodes: int) -> int:
    """The most nodes a draft of these sizes feeds the draft model: all but its
    last depth's, each depth at most ``max_width`` pairs, ``max_nodes`` in all.

    E.g. depth 5, width 4, 16 nodes: unpruned widths ``[4, 4, 4, 4]`` feed 12;
    pruned ones ``[1, 1, 1, 1, 4]`` feed 4, ``[4, 4, 4, 3, 1]`` 15 (the bound).
    """
    return max(0, min(max_nodes - 1, max_width * (depth - 1)))


@functools.lru_cache(maxsize=64)
def fill_shape(max_width: int, depth: int) -> DraftTree:
    """The forest's largest shape as the lookup budget values it (``lookup_first``): ``max_width``
    nodes per depth in draft order, each depth's below the depth before's first node (where most
    beams are drawn). E.g. width 2, depth 2: parents ``[-1, -1, 0, 0]``."""
    parents = [ROOT] * max_width + [max_width * (d - 1) for d in range(1, depth) for _ in range(max_width)]
    return DraftTree(np.zeros(len(parents), np.int64), np.asarray(parents, np.int64))


#: a chain's first node, as the learnt rates value it (:meth:`DsbdDrafter.gated`)
_CHAIN_START = TreeShape.of(DraftTree(np.zeros(1, np.int64), np.full(1, ROOT, np.int64)))


def mixed_forest(request: DraftRequest, lookup: DraftTree, forest: DraftTree) -> BeamForest:
    """The lookup's nodes, then the forest's below the root
    (:func:`~vllm_specbeam.methods.lookup_tree.branches.mixed_tree`), as the :class:`BeamForest` the
    verifier walks: lookup nodes' ``next_probs`` are zero (the draft never extends them); a forest of
    lookup nodes only needs no draft rows."""
    options = request.options
    mixed = lookup_branches.mixed_tree(lookup, forest)
    nxt = getattr(forest, "next_probs", None)
    if nxt is not None:
        nxt = np.concatenate([np.zeros((lookup.num_nodes, nxt.shape[-1]), nxt.dtype), nxt])  # [nodes, V]
    kinds = np.zeros(mixed.num_nodes, np.int64) if mixed.kinds is None else mixed.kinds  # [nodes]
    probs = mixed.draft_probs if forest.num_nodes else None
    return BeamForest(
        mixed.tokens,
        mixed.parents,
        probs,
        nxt,
        options["min_width"],
        options["width_threshold"],
        options["max_width"],
        kinds=kinds,
        from_index=mixed.from_index,
    )


class DsbdDrafter(lookup_branches.LookupFirstDrafter, PricedDraftModel, DraftModelDrafter):
    """Beam-sampling forests from a draft model (see the module docstring)."""

    OPTIONS: ClassVar[dict[str, Option]] = {
        **DRAFT_MODEL_OPTIONS,
        **LOOKUP_OPTIONS,
        "min_width": Option(1, "fewest beams a depth keeps", 1, 32),
        "max_width": Option(4, "pairs drafted per depth: the most beams a depth can keep", 1, 32),
        "width_threshold": Option(
            0.7, "tau_w: a depth keeps the most beams n it accepts with probability >= tau_w", 0.0, 1.0
        ),
        # 0.3: faster and higher-scoring than unpruned forests in every Qwen run (docs/measurements.md)
        "prune_ratio": Option(
            0.3,
            "greedy requests: a depth drafts a pair only if its draft probability is at least this fraction of "
            "the depth's best pair's (0: max_width pairs at every depth)",
            0.0,
            1.0,
        ),
    }

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> None:
        if options["min_width"] > options["max_width"]:
            raise SpecbeamConfigError(
                f"dsbd: min_width={options['min_width']} exceeds max_width={options['max_width']}"
            )

    @staticmethod
    def keeps_target_output(options: Mapping[str, Any]) -> bool:
        return options["max_width"] == 1  # one beam: a draft chain, greedy decoding's tokens

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        runtime = self.ready_runtime()
        if self.lookup is None:
            # priced, a chain (max_width 1) runs only where its first node's learnt value pays
            ledger = self.start_ledger()
            first = [_CHAIN_START if r.options["max_width"] == 1 else None for r in requests]
            return self.gated(runtime, requests, first, lambda rs, caps: self._draft(runtime, rs, caps, None, ledger))
        self.ledger = None  # the lookup's nodes are valued by its own budget, not in a ledger
        fills = [fill_shape(r.options["max_width"], r.options["num_speculative_tokens"]) for r in requests]
        return self.lookup.propose(
            runtime, requests, fills, lambda rs, caps, ex: self._draft(runtime, rs, caps, ex), mixed_forest
        )

    def _draft(
        self,
        runtime: DraftRuntime,
        requests: list[DraftRequest],
        caps: Sequence[int | None],
        excludes: Sequence[Sequence[int]] | None,
        ledger: StepLedger | None = None,
    ) -> list[DraftTree]:
        """The draft model's forests: at most ``caps`` nodes each (``None``: ``max_nodes``), first
        depths without the ``excludes`` tokens; chains priced by the step's ``ledger`` (:func:`draft_beams`)."""
        excludes = [[] for _ in requests] if excludes is None else excludes
        nodes = [
            r.options["max_nodes"] if cap is None else min(cap, r.options["max_nodes"])
            for r, cap in zip(requests, caps)
        ]
        sizes = [(r.options["num_speculative_tokens"], r.options["max_width"], n) for r, n in zip(requests, nodes)]
        synced = runtime.sync_many([(r.req_id, r.token_ids, most_fed(*size)) for r, size in zip(requests, sizes)])
        beams = [  # None: no slots for the tree, a depth or node budget of 0, or nothing left to draw
            None if logits is None or 0 in size else _start(r, logits, size[2], exclude)
            for r, size, logits, exclude in zip(requests, sizes, synced, excludes)
        ]
        draft_beams(runtime, [b for b in beams if b is not None], self.generator, ledger)
        return [DraftTree.empty() if b is None else b.forest() for b in beams]

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        req_ids = list(req_ids)
        if self.lookup is not None:
            self.lookup.remove(req_ids)
        super().remove_requests(req_ids)


def _start(
    request: DraftRequest, logits: torch.Tensor, max_nodes: int, exclude: Sequence[int]
) -> BeamSample | DraftBeamSearch | None:
    """The request's beams: sampled, or searched for greedy requests (see the module docstring);
    its first depth without the ``exclude`` tokens (``None``: they take all the draft's mass)."""
    options = request.options
    widths = [options["max_width"]] * options["num_speculative_tokens"]
    temperature = draft_temperature(options, request.temperature)
    excluded = torch.tensor(list(exclude), dtype=torch.int64)  # [excluded]
    if temperature < GREEDY_EPS:
        logits = logits.index_fill(-1, excluded, float("-inf"))
        return DraftBeamSearch(
            request.req_id, widths, logits.unsqueeze(0), max_nodes=max_nodes, prune_ratio=options["prune_ratio"]
        )
    beams = BeamSample(request.req_id, widths, logits, temperature, options, max_nodes)
    if excluded.numel():
        beams.rows = lookup_branches.without(beams.rows, excluded)
        if not bool((beams.rows > 0).any()):  # host sync: the lookup took all of q's support
            return None
    return beams


def draft_beams(
    runtime: DraftRuntime, beams: list[DraftBeams], generator: torch.Generator | None, ledger: StepLedger | None = None
) -> None:
    """Advance every request's beams to their last depth, one batched draft forward per depth for
    all requests still drafting (draws in request order). Given the step's ``ledger`` (not a
    probe's), each node of a one-beam chain (``max_width: 1``) is valued at its draft probability
    (times its request's :meth:`~vllm_specbeam.core.controller.StepLedger.worth_of`),
    and a chain is fed for its next node only where that node, guessed as likely as the last one
    given its parent, pays for its row and its share of the forward (:func:`forwards_that_pay`);
    beams of more are drafted whatever it costs, the ledger unvalued. A probe's node is valued
    at nothing: the step pays for it, the tokens the target commits value it."""
    priced = ledger is not None and not ledger.probing
    if ledger is not None:
        ledger.unvalued |= not all(b.is_chain for b in beams)
    drafting = list(beams)
    while drafting:
        depth = [(b, b.select(generator)) for b in drafting]
        drafting = [b for b, _ in depth if not b.done]
        if priced:
            assert ledger is not None
            for b, (tokens, _) in depth:
                if tokens:
                    ledger.add(b.chain_value(-1) * ledger.worth_of(b.req_id) if b.is_chain else 0.0, len(tokens))
            chains = [b for b in drafting if b.is_chain]
            fixed = sum(len(b.live) for b in drafting if not b.is_chain)
            guesses = [b.next_guess() * ledger.worth_of(b.req_id) for b in chains]
            chosen = forwards_that_pay(ledger, guesses, [1] * len(chains), fixed)
            for k in set(range(len(chains))) - set(chosen):
                chains[k].stop()
            drafting = [b for b in drafting if not b.done]
        logits = runtime.extend_many([(b.req_id, *nodes) for b, nodes in depth if not b.done])
        for b, rows in zip(drafting, logits):
            b.take(rows)


class DraftBeams(ABC):
    """One request's draft beams during a step, advanced one depth at a time.

    :meth:`select` picks a depth's pairs from the beams' scores and next-token
    rows; :func:`draft_beams` feeds the new nodes to the draft model together
    with the other requests' and hands their logits to :meth:`take`. The last
    depth is never fed. ``widths`` are the most pairs per depth, ``max_nodes``
    (default: their sum) the most in all: depth 5 at width 4 with 16 nodes
    drafts ``[4, 4, 4, 4]``. Beams start at the request's root, or (the full-width
    search, :mod:`vllm_specbeam.adapter.beam_search`) at ``live`` nodes already in the
    request's draft tree with their own ``scores``; ``first_node`` is the
    draft tree's node count before this search, so :attr:`parents` index the
    draft model's tree.
    """

    def __init__(
        self,
        req_id: str,
        widths: list[int],
        live: Sequence[int] = (ROOT,),
        scores: torch.Tensor | None = None,
        first_node: int = 0,
        max_nodes: int | None = None,
    ) -> None:
        self.req_id = req_id
        self.widths = widths
        self.max_nodes = sum(widths) if max_nodes is None else max_nodes
        self.depth = 0
        self.live = list(live)
        self.scores = torch.zeros(1) if scores is None else scores
        self.first_node = first_node
        self.tokens: list[int] = []
        self.parents: list[int] = []
        #: every drafted node's joint score (log-probability under the draft, from the start scores)
        self.node_scores: list[float] = []

    @property
    def done(self) -> bool:
        return self.depth == len(self.widths) or len(self.tokens) >= self.max_nodes

    @property
    def is_chain(self) -> bool:
        """One beam: every depth draws one pair (``max_width: 1``)."""
        return max(self.widths, default=1) == 1

    def chain_value(self, node: int) -> float:
        """A chain node's draft probability given the committed text: its estimated acceptance."""
        return math.exp(self.node_scores[node])

    def next_guess(self) -> float:
        """A chain's next node's estimated acceptance, were it as likely as the last given its parent."""
        last = self.chain_value(-1)
        return last * last / (self.chain_value(-2) if len(self.node_scores) > 1 else 1.0)

    def stop(self) -> None:
        """Draft no further depth."""
        self.max_nodes = len(self.tokens)

    def select(self, generator: torch.Generator | None) -> tuple[list[int], list[int]]:
        """Choose the next depth's pairs; the new nodes' tokens and parents."""
        width = min(self.widths[self.depth], self.max_nodes - len(self.tokens))
        beam, token, self.scores = self._choose(width, generator)
        self.depth = len(self.widths) if not token.numel() else self.depth + 1
        first = len(self.tokens)
        self.tokens += token.tolist()
        self.parents += [self.live[b] for b in beam.tolist()]
        self.node_scores += self.scores.tolist()
        self.live = [self.first_node + i for i in range(first, len(self.tokens))]
        return self.tokens[first:], self.parents[first:]

    @abstractmethod
    def _choose(self, width: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``width`` pairs as (beam, token) index tensors, and the new beams' scores."""

    @abstractmethod
    def take(self, logits: torch.Tensor) -> None:
        """The draft model's logits at the nodes :meth:`select` just returned."""


class BeamSample(DraftBeams):
    """Each depth's pairs drawn i.i.d. from the draft joint; every beam's ``q`` row recorded."""

    def __init__(
        self,
        req_id: str,
        widths: list[int],
        logits: torch.Tensor,
        temperature: float,
        options: Mapping[str, Any],
        max_nodes: int | None = None,
    ) -> None:
        super().__init__(req_id, widths, max_nodes=max_nodes)
        self.temperature, self.options = temperature, options
        self.rows = self._probs(logits.unsqueeze(0))
        self.draft_rows: list[torch.Tensor] = []
        self.next_rows: list[torch.Tensor] = []

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, self.temperature, self.options["top_k"], self.options["top_p"])

    def _choose(self, width: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        vocab = self.rows.shape[-1]
        pairs = torch.multinomial(joint(self.scores, self.rows), width, replacement=True, generator=generator)
        beam, token = pairs // vocab, pairs % vocab
        self.draft_rows.append(self.rows[beam])
        return beam, token, self.scores[beam] + self.rows[beam, token].log()

    def take(self, logits: torch.Tensor) -> None:
        self.rows = self._probs(logits)
        self.next_rows.append(self.rows)

    def forest(self) -> BeamForest:
        last = torch.zeros(len(self.live), self.rows.shape[-1])  # the last depth is never extended
        return BeamForest(
            np.asarray(self.tokens),
            np.asarray(self.parents),
            torch.cat(self.draft_rows).numpy(),
            torch.cat([*self.next_rows, last]).numpy(),
            min_width=self.options["min_width"],
            width_threshold=self.options["width_threshold"],
            max_width=self.options["max_width"],
        )


class DraftBeamSearch(DraftBeams):
    """Each depth's best pairs by joint log-score (distinct, deterministic).

    ``logits``: one row per live beam. ``banned``: a token never drafted (the
    full-width search bans EOS: a beam that ends is never extended).
    ``temperature`` scales the logits the scores are summed from (``mjsd``
    searches a sampled request's draft at its temperature). ``prune_ratio``
    drops pairs less likely than that fraction of the depth's best pair
    (relative-threshold pruning, Freitag and Al-Onaizan 2017): where the draft
    is sure the forest is a chain, so its rows go to the depths where beams
    compete. E.g. pairs of probability 0.5, 0.3, 0.02 at ratio 0.1 keep two.
    """

    def __init__(
        self,
        req_id: str,
        widths: list[int],
        logits: torch.Tensor,
        live: Sequence[int] = (ROOT,),
        scores: torch.Tensor | None = None,
        first_node: int = 0,
        banned: int | None = None,
        temperature: float = 1.0,
        max_nodes: int | None = None,
        prune_ratio: float = 0.0,
    ) -> None:
        super().__init__(req_id, widths, live, scores, first_node, max_nodes)
        self.banned = banned
        self.temperature = temperature
        self.log_prune_ratio = math.log(prune_ratio) if prune_ratio > 0 else float("-inf")
        self.logp = torch.log_softmax(logits / temperature, dim=-1)

    def _choose(self, width: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        vocab = self.logp.shape[-1]
        joint_scores = self.scores.unsqueeze(-1) + self.logp
        if self.banned is not None:
            joint_scores[:, self.banned] = float("-inf")
        scores, best = torch.topk(joint_scores.reshape(-1), min(width, joint_scores.numel()))
        # finite: fewer than ``width`` pairs left once -inf (banned) ones are dropped
        kept = torch.isfinite(scores) & (scores >= scores[0] + self.log_prune_ratio)
        scores, best = scores[kept], best[kept]
        return best // vocab, best % vocab, scores

    def take(self, logits: torch.Tensor) -> None:
        self.logp = torch.log_softmax(logits / self.temperature, dim=-1)

    def forest(self) -> BeamForest:
        return BeamForest(np.asarray(self.tokens), np.asarray(self.parents))


@dataclass(frozen=True)
class ForestRequest:
    """One prompt of a speculative beam search to draft below (plain data: it crosses ``collective_rpc``)."""

    #: the draft runtime's key for the prompt (its state lives across rounds until removed)
    key: str
    #: each target beam's tokens, prompt included
    beams: list[list[int]]
    #: the beams' cumulative logprobs under the target
    scores: list[float]
    #: depths to draft (0: none)
    depth: int


@torch.inference_mode()
def draft_forests(
    runtime: DraftRuntime, requests: Sequence[ForestRequest], width: int, eos: int | None
) -> list[list[DraftTree]]:
    """The speculative beam search's forests (:mod:`vllm_specbeam.adapter.beam_search`): per
    prompt one tree per beam, from the draft's beam search over all the prompt's beams,
    ``width`` pairs per depth, scores starting from the beams' own; an EOS candidate ends its
    beam. All prompts are drafted together, one batched draft forward per depth
    (:func:`_beam_starts`)."""
    starts = _beam_starts(runtime, requests, width)
    searches = {
        i: DraftBeamSearch(requests[i].key, [width] * requests[i].depth, s.rows, s.ends, s.scores, s.first_node, eos)
        for i, s in starts.items()
    }
    draft_beams(runtime, list(searches.values()), None)
    forests = [[DraftTree.empty() for _ in r.beams] for r in requests]
    for i, search in searches.items():
        forests[i] = _beam_trees(search, starts[i].ends, starts[i].first_node)
    return forests


@dataclass(frozen=True)
class _BeamStart:
    """Where a prompt's draft starts: its target beams' ends in the draft's tree."""

    #: ``[beams, V]``: the draft's logits at each beam's end
    rows: torch.Tensor
    #: each beam's end node (``ROOT``: the committed prefix's last token)
    ends: list[int]
    #: ``[beams]``: the beams' scores
    scores: torch.Tensor
    #: the tree nodes the beams' tails take; drafted nodes come after them
    first_node: int


def _beam_starts(runtime: DraftRuntime, requests: Sequence[ForestRequest], width: int) -> dict[int, _BeamStart]:
    """Feed every prompt's beams to the draft: the beams' common prefix is committed, their
    differing tails are tree nodes below it (the runtime keeps one state per prompt). Prompts
    with no depth to draft, or whose tree would not fit the draft's context, are left out.

    Example: beams ``[p a b]`` and ``[p a c d]`` commit ``[p a]``; the tails ``[b]``, ``[c d]``
    are nodes 0, 1, 2 with parents ``[-1, -1, 1]``, and the draft starts at nodes 0 and 2.
    """
    starts = []
    for request in requests:
        common = _common_prefix_len(request.beams)
        tails = DraftTree.from_paths(beam[common:] for beam in request.beams)
        starts.append((request.beams[0][:common], tails, [_walk(tails, beam[common:]) for beam in request.beams]))
    drafting = [i for i, r in enumerate(requests) if r.depth > 0]
    # reserve: every tail node and every drafted node but the last depth's are fed after the prefix
    at_prefix = runtime.sync_many(
        [(requests[i].key, starts[i][0], starts[i][1].num_nodes + width * (requests[i].depth - 1)) for i in drafting]
    )
    prefix_logits = {i: logits for i, logits in zip(drafting, at_prefix) if logits is not None}
    with_tails = [i for i in prefix_logits if starts[i][1].num_nodes]
    extended = runtime.extend_many(
        [(requests[i].key, starts[i][1].tokens.tolist(), starts[i][1].parents.tolist()) for i in with_tails]
    )
    at_tails = dict(zip(with_tails, extended))
    return {
        i: _BeamStart(
            torch.stack([prefix_logits[i] if end == ROOT else at_tails[i][end] for end in ends]),
            ends,
            torch.tensor(requests[i].scores, dtype=torch.float32),
            tails.num_nodes,
        )
        for i, (_, tails, ends) in ((i, starts[i]) for i in prefix_logits)
    }


class JointBeamSample(DraftBeams):
    """The full-width beam sampling's draft (:mod:`vllm_specbeam.adapter.beam_sampling`): each
    depth's pairs drawn i.i.d. from :func:`~vllm_specbeam.methods.dsbd.beam_sampling.beam_joint`
    over all live beams, the law the target's beams are drawn from; every row it drew from is
    kept, cut, for the verifier's ``Q``. An EOS pair ends its beam (score ``-inf``)."""

    def __init__(
        self, req_id: str, widths: list[int], start: _BeamStart, law: SamplingLaw, eos: int | None, seed: int
    ) -> None:
        super().__init__(req_id, widths, start.ends, start.scores.to(start.rows.device), start.first_node)
        self.law, self.eos = law, eos
        #: this prompt's own draws (``draft_beams``' shared generator is not used): batching keeps them
        self.generator = torch.Generator(device=start.rows.device).manual_seed(seed)
        self.rows = self._cut(start.rows)  # [live, V]
        #: the rows drawn from, per depth: the beams' ends', then each fed depth's nodes'
        self.drawn_rows = [self.rows]
        #: per depth, each pair's slot among that depth's live beams
        self.slots: list[list[int]] = []

    def _cut(self, logits: torch.Tensor) -> torch.Tensor:
        return cut_rows(torch.log_softmax(logits.float(), dim=-1), self.law)

    def _choose(self, width: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not bool(torch.isfinite(self.scores).any()):  # every beam ended
            none = torch.zeros(0, dtype=torch.int64)
            return none, none, self.scores[:0]
        vocab = self.rows.shape[-1]
        pairs = draw_pairs(beam_joint(self.scores, self.rows, self.law), width, self.generator)
        beam, token = pairs // vocab, pairs % vocab
        self.slots.append(beam.tolist())
        scores = self.scores[beam] + self.rows[beam, token]
        return beam, token, scores if self.eos is None else scores.masked_fill(token == self.eos, float("-inf"))

    def take(self, logits: torch.Tensor) -> None:
        self.rows = self._cut(logits)
        self.drawn_rows.append(self.rows)

    def sampled_forest(self) -> list[Any]:
        """Plain data for ``collective_rpc``: tokens, parents (a node's, or ``-1 - b`` below
        target beam ``b``), scores, and the rows drawn from (:meth:`SparseRows.to_data`): one
        row per target beam, then one per node of every depth but the last."""
        parents: list[int] = []
        start = 0
        for depth, slots in enumerate(self.slots):
            previous = start - len(self.slots[depth - 1]) if depth else 0
            parents += [-1 - s if depth == 0 else previous + s for s in slots]
            start += len(slots)
        rows = SparseRows.from_cut(torch.cat(self.drawn_rows[: len(self.slots)]))  # beams + fed nodes
        return [self.tokens, parents, self.node_scores, rows.to_data()]


@dataclass(frozen=True)
class SampleForestRequest:
    """One prompt of a speculative beam sampling to draft below (plain data, as :class:`ForestRequest`)."""

    forest: ForestRequest
    #: seeds the draft's draws for this prompt and round
    seed: int


@torch.inference_mode()
def sample_forests(
    runtime: DraftRuntime, requests: Sequence[SampleForestRequest], width: int, law: SamplingLaw, eos: int | None
) -> list[list[Any]]:
    """The speculative beam sampling's forests: per prompt, ``width`` pairs per depth drawn by
    :class:`JointBeamSample` from all its target beams (``[]``: not drafted). One batched draft
    forward per depth for all prompts; each prompt's draws from its own seed."""
    starts = _beam_starts(runtime, [r.forest for r in requests], width)
    samples = {
        i: JointBeamSample(
            requests[i].forest.key, [width] * requests[i].forest.depth, start, law, eos, requests[i].seed
        )
        for i, start in starts.items()
    }
    draft_beams(runtime, list(samples.values()), None)
    return [samples[i].sampled_forest() if i in samples else [] for i in range(len(requests))]


def _common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the tokens every sequence starts with (at least the prompt)."""
    first = list(sequences[0])
    return min(_common_prefix(first, list(s)) for s in sequences)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix; the usual case (``b`` extends ``a``) is one C-level compare."""
    if len(a) <= len(b) and a == b[: len(a)]:
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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
