"""Lookup branches in a draft-model method's trees (``"lookup": "request" | "global"``).

Each step a request's tree starts with what ``lookup_tree`` drafts (its drafter,
request or global scope, reused as is: node kinds 0-2 by match length). The draft
model drafts below the root, after them, only the nodes they and ``max_nodes``
leave (:func:`~vllm_specbeam.core.budget.lookup_first`: nodes valued by the
acceptance per kind, depth and rank that :class:`~vllm_specbeam.core.budget.StepBudget`
learns from the committed tokens); when they leave none, the draft runs no forward
that step (``DraftRuntime.defer``) and catches up at its next sync. Its first-level
tokens exclude the lookup's, so no draft node repeats a lookup sibling. A draft that
``stop_threshold`` alone left out is tried regardless after 1, 2, 4, 8 such request-steps
(an engine-wide :class:`~vllm_specbeam.core.budget.BackOff`), since its value is learnt only
from its tries, which probe with one node (the draft's first, from its sync). The threshold judges the
fill's first level only; below it, the draft's own stopping rule decides. Either way the draft
runs only while it lags at most :data:`EXPLORE_MAX_LAG` committed tokens, since it must first
catch up on them, or on new text (:data:`NEW_TEXT_STEPS` steps without a branch): a request the
lookup serves never feeds its prompt to the draft. The batch's lookup nodes are then cut to
those that pay for their rows under the runner's fitted step cost (as ``"max_nodes": "auto"``).

Lossless: lookup nodes are deterministic drafts (a point mass as their ``q`` row),
draft-model nodes samples of the draft's ``q`` with the lookup's tokens removed;
the rejection rule tries the lookup siblings first and removes each tried token
from the later siblings' ``q``, which is then exactly the law the samples were
drawn from (``tests/test_hybrid_lookup.py`` enumerates it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_specbeam.core.budget import (
    FILL_KIND,
    BackOff,
    LookupShare,
    RequestBudget,
    StepBudget,
    choose_nodes,
    lookup_first,
)
from vllm_specbeam.core.config import AUTO, TREE_OPTIONS
from vllm_specbeam.core.controller import DraftGate, StepLedger, StepPrices
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import ROOT, DraftTree, committed_path
from vllm_specbeam.draft_runtime.base import DraftRuntime
from vllm_specbeam.methods.lookup_tree.drafter import LookupTreeDrafter

#: most committed tokens the draft may lag behind and still draft (it feeds them first: 32 rows cost about
#: two one-row forwards on this project's CPU, docs/results/row-cost-epyc)
EXPLORE_MAX_LAG = 32
#: ``lookup_tree`` options the lookup branches override (see :class:`LookupBranches`)
HYBRID_LOOKUP = {"prompt_lookup_min": 2}
#: consecutive steps without a lookup branch after which the draft catches up however far it lags: the
#: text is new, and the draft, once caught up, drafts it from then on (one step without a branch is mostly
#: an edit in copied text, where a catch-up of the whole prompt buys a node or two)
NEW_TEXT_STEPS = 2

#: a draft model's trees for ``requests``: at most ``caps`` nodes each, first levels without ``excludes``
DraftFill = Callable[[list[DraftRequest], list[int], list[list[int]]], list[DraftTree]]
#: one request's tree from its lookup tree and the draft model's (empty when it ran no forward)
Mix = Callable[[DraftRequest, DraftTree, DraftTree], DraftTree]


@dataclass(frozen=True)
class LookupSplit:
    """One request's share of a step: lookup nodes to verify, and room for the draft model."""

    #: the lookup nodes verified this step
    verified: DraftTree
    #: the lookup nodes the budget judges at the next step: those before the step cost's cut (the
    #: committed tokens tell whether the cut ones would have paid)
    judged: DraftTree
    #: how many of the fill's first nodes the draft may add (0: no draft forward for it this step)
    fill_nodes: int
    #: the verified lookup nodes' values summed (expected accepted tokens)
    value: float = 0.0
    #: the values of the fill's first-level nodes among ``fill_nodes``
    fill_first: tuple[float, ...] = ()


class LookupBranches:
    """A draft-model drafter's lookup source and the acceptance learnt per node kind."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        scope = "global" if options["lookup"] == "global" else "request"
        lookup = {key: spec.default for key, spec in {**TREE_OPTIONS, **LookupTreeDrafter.OPTIONS}.items()}
        lookup.update(
            LookupTreeDrafter.defaults_for({"scope": scope}), scope=scope, index_isolation=options["index_isolation"]
        )
        # the branches the draft-model methods were measured with: matches of two tokens or more (one-token
        # matches find a branch almost every step, and the draft catches up on new text only after steps
        # without one), the global scope as deep as its match is long
        lookup.update(HYBRID_LOOKUP if scope == "request" else {**HYBRID_LOOKUP, "depth_factor": 1.0})
        #: the engine-wide options of the lookup drafter (depth and node budget set per request)
        self.options = lookup
        self.drafter = LookupTreeDrafter(lookup)
        #: acceptance per (kind, depth, rank), learnt from the committed tokens (no step cost: never pruned by it)
        self.values = StepBudget()
        #: how long a draft the threshold left out waits before it is tried regardless (engine-wide)
        self.fill_rest = BackOff()
        #: per request: its length when the draft last ran for it (the draft lags the tokens since)
        self.drafted_at: dict[str, int] = {}
        #: per request: consecutive steps, up to this one, without a lookup branch
        self.without_lookup: dict[str, int] = {}
        #: engine depth: a request drafting shallower (per request, or near its max_tokens) draws lookup
        #: branches no deeper than its depth
        self.engine_depth = int(options["num_speculative_tokens"])
        #: the step being drafted (:meth:`LookupFirstDrafter.plan_step`): its requests and what the runner
        #: measured of a step's rows and draft forwards
        self.prices = StepPrices(0, None)
        #: which requests a priced draft drafts for (:meth:`propose` given a ledger)
        self.gate = DraftGate()

    def request(self, request: DraftRequest) -> DraftRequest:
        """``request`` with the lookup drafter's options."""
        options = request.options
        depth = options["lookup_depth"]
        if options["num_speculative_tokens"] < self.engine_depth:
            depth = min(depth, options["num_speculative_tokens"])
        lookup = {**self.options, "num_speculative_tokens": depth, "max_nodes": options["max_nodes"]}
        return dataclasses.replace(request, options=lookup)

    def split(
        self, requests: Sequence[DraftRequest], fills: Sequence[DraftTree], auto_threshold: float | None = None
    ) -> list[LookupSplit]:
        """Per request: its lookup nodes and the draft's room (``fill``: the largest tree the draft
        could grow; its first level held to ``stop_threshold``, ``auto_threshold`` for ``"auto"``,
        or, with ``None``, to nothing: :meth:`priced` decides), then the batch's lookup nodes cut
        to those that pay for their rows
        (:func:`~vllm_specbeam.core.budget.choose_nodes` under :attr:`prices`, as ``lookup_tree``'s
        ``"max_nodes": "auto"``; the fill's rows are counted as fixed)."""
        found = self.drafter.propose([self.request(r) for r in requests])
        engine = self.values.engine_rates()
        out: list[LookupShare] = []
        for request, lookup, fill in zip(requests, found, fills):
            tokens = request.token_ids
            state = self.values.requests.setdefault(request.req_id, RequestBudget())
            if state.drafted is not None:
                committed = tokens[state.drafted_at :].tolist()
                if committed and state.drafted.kinds is not None and FILL_KIND in state.drafted.kinds:
                    self.fill_rest.after(paid=fill_paid(state.drafted, committed))
                self.values.observe_committed(request.req_id, committed, tokens.size)
            rates = self.values.rates(request.req_id, engine)
            # a method without a stopping threshold (dsbd) drafts every fill node the budget leaves
            min_value = request.options.get("stop_threshold", 0.0)
            if min_value == AUTO:
                min_value = auto_threshold or 0.0
            budget = request.options["max_nodes"]
            split = lookup_first(lookup, fill, budget, rates, min_value)
            missed = self.without_lookup[request.req_id] = (
                self.without_lookup.get(request.req_id, 0) + 1 if lookup.num_nodes == 0 else 0
            )
            # a draft that lags far first feeds what it lags (at a request's start, its whole prompt),
            # which pays only on new text: one step without a branch is mostly an edit in copied text
            may_catch_up = (
                tokens.size - self.drafted_at.get(request.req_id, 0) <= EXPLORE_MAX_LAG or missed >= NEW_TEXT_STEPS
            )
            if split.fill_nodes == 0 and min_value > 0:
                # the fill's value is learnt only from its tries: one the threshold alone leaves out
                # is tried regardless on a back-off, else a value once below it stays there
                waived = lookup_first(lookup, fill, budget, rates, 0.0)
                if waived.fill_nodes > 0 and self.fill_rest.allows() and may_catch_up:
                    # a probe: its first node, from the sync's logits (no extend)
                    split = dataclasses.replace(waived, fill_nodes=1)
            elif split.fill_nodes > 0 and not may_catch_up:
                split = lookup_first(lookup, fill, budget, rates, np.inf)  # the lookup's branches alone
            out.append(split)
        lookups = [share.lookup for share in out]
        masks = [np.ones(tree.num_nodes, bool) for tree in lookups]
        step = self.prices.step
        if step is not None:
            batch = self.prices.batch_size
            rows = batch + sum(share.fill_nodes for share in out)
            masks = choose_nodes(lookups, [share.values for share in out], batch, rows, step)
        return [
            LookupSplit(
                tree.keep(mask),
                tree,
                share.fill_nodes,
                float(np.asarray(share.values)[mask].sum()),
                tuple(share.fill_first),
            )
            for tree, mask, share in zip(lookups, masks, out)
        ]

    def priced(
        self, requests: Sequence[DraftRequest], splits: list[LookupSplit], ledger: StepLedger
    ) -> list[LookupSplit]:
        """``splits`` with the lookup nodes' values and rows in ``ledger``, and the draft only for the
        ``"stop_threshold": "auto"`` requests whose first level pays for its forward
        (:class:`~vllm_specbeam.core.controller.DraftGate`, valued by the learnt rates; the forward is
        charged here, the levels as they are drafted)."""
        ledger.add(sum(split.value for split in splits), sum(split.verified.num_nodes for split in splits))
        candidates = [
            k
            for k, (r, split) in enumerate(zip(requests, splits))
            if split.fill_nodes > 0 and r.options.get("stop_threshold") == AUTO
        ]
        if not candidates:
            return splits
        first = [splits[k].fill_first for k in candidates]
        drafting = self.gate.choose(ledger, [sum(values) for values in first], [len(values) for values in first])
        chosen = {candidates[k]: 1 if ledger.probing else splits[candidates[k]].fill_nodes for k in drafting}
        return [
            dataclasses.replace(split, fill_nodes=chosen.get(k, 0)) if k in candidates else split
            for k, split in enumerate(splits)
        ]

    def propose(
        self,
        runtime: DraftRuntime,
        requests: list[DraftRequest],
        fills: Sequence[DraftTree],
        draft: DraftFill,
        mix: Mix = lambda request, lookup, drafted: mixed_tree(lookup, drafted),
        ledger: StepLedger | None = None,
        unpriced_threshold: float | None = None,
    ) -> list[DraftTree]:
        """Every request's tree: its lookup branches (:meth:`split`), then ``draft``'s nodes for
        those the lookup leaves room for (and, given the step's ``ledger``, whose draft pays:
        :meth:`priced`; ``unpriced_threshold``: what ``"stop_threshold": "auto"`` means without
        one), mixed by ``mix``; the others run no draft forward (``runtime.defer``) and get
        ``mix(request, lookup, DraftTree.empty())``."""
        splits = self.split(requests, fills, auto_threshold=None if ledger is not None else unpriced_threshold)
        if ledger is not None:
            splits = self.priced(requests, splits, ledger)
        drafting = [k for k, split in enumerate(splits) if split.fill_nodes > 0]
        for k in drafting:
            self.drafted_at[requests[k].req_id] = requests[k].token_ids.size
        runtime.defer([r.req_id for r, split in zip(requests, splits) if split.fill_nodes == 0])
        drafted = dict(
            zip(
                drafting,
                draft(
                    [requests[k] for k in drafting],
                    [splits[k].fill_nodes for k in drafting],
                    [root_tokens(splits[k].verified) for k in drafting],
                ),
            )
        )
        trees = []
        for k, (request, split) in enumerate(zip(requests, splits)):
            fill = drafted.get(k)
            trees.append(mix(request, split.verified, DraftTree.empty() if fill is None else fill))
            # the cut lookup nodes are judged too (so their values can rise again), unless the fill's
            # first level, drawn without the verified lookup's tokens only, may repeat a cut one
            self.drafted(request, split.judged if fill is None else trees[-1])
        return trees

    def drafted(self, request: DraftRequest, tree: DraftTree) -> None:
        """The tree verified for ``request`` this step (its nodes are judged at the next)."""
        self.values.drafted(request.req_id, tree, request.token_ids.size)

    def finished(self, requests: list[DraftRequest]) -> None:
        if self.drafter.learns_across_requests:
            self.drafter.finished([self.request(r) for r in requests])

    def remove(self, req_ids: Sequence[str]) -> None:
        self.values.remove(req_ids)
        for req_id in req_ids:
            self.drafted_at.pop(req_id, None)
            self.without_lookup.pop(req_id, None)


def fill_paid(tree: DraftTree, committed: Sequence[int]) -> bool:
    """Whether the tokens committed after ``tree``'s root walk through one of its draft model's
    (:data:`FILL_KIND`) nodes. Example: lookup ``a`` and fill ``b`` below the root, committed
    ``[b, x]``: paid; ``[a, x]``: not."""
    path = committed_path(tree.tokens.tolist(), tree.parents.tolist(), committed)
    return tree.kinds is not None and any(tree.kinds[node] == FILL_KIND for node in path)


def mixed_tree(lookup: DraftTree, draft: DraftTree) -> DraftTree:
    """The lookup's nodes, then the draft model's below the root after them (kind :data:`FILL_KIND`).

    When the draft's nodes are samples (``draft_probs``), every lookup node gets the
    point mass on its token as its ``q`` row: a deterministic draft, verified as one.
    Example: lookup ``[5, 6]`` (a chain), draft ``[7, 8]`` (a chain): tokens
    ``[5, 6, 7, 8]``, parents ``[-1, 0, -1, 2]``, kinds ``[k, k, 3, 3]`` (``from_index``:
    the lookup's, then none of the draft's).
    """
    if draft.num_nodes == 0:
        return lookup
    n = lookup.num_nodes
    parents = np.concatenate([lookup.parents, np.where(draft.parents == ROOT, ROOT, draft.parents + n)])
    kinds = np.concatenate(
        [np.zeros(n, np.int64) if lookup.kinds is None else lookup.kinds, np.full(draft.num_nodes, FILL_KIND)]
    )
    probs = None
    if draft.draft_probs is not None:
        point = np.zeros((n, draft.draft_probs.shape[-1]), draft.draft_probs.dtype)  # [lookup nodes, V]
        point[np.arange(n), lookup.tokens] = 1.0
        probs = np.concatenate([point, draft.draft_probs])  # [nodes, V]
    from_index = (
        None if lookup.from_index is None else np.concatenate([lookup.from_index, np.zeros(draft.num_nodes, bool)])
    )
    tokens = np.concatenate([lookup.tokens, draft.tokens])
    return DraftTree(tokens, parents, probs, kinds=kinds, from_index=from_index)


def without(q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``q``'s rows (``[rows, V]``) with ``tokens`` removed, renormalised: the law a draft model's
    first level is drawn from below lookup siblings (all zero where they took all of ``q``)."""
    q = q.index_fill(-1, tokens, 0.0)
    return q / q.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)


def root_tokens(tree: DraftTree) -> list[int]:
    """The tokens of ``tree``'s first level (what the draft's first level must not repeat)."""
    return tree.tokens[tree.parents == ROOT].tolist()


class LookupFirstDrafter:
    """The members a draft-model drafter with the ``"lookup"`` option shares: its
    lookup source (``None`` when off), which learns across requests in the global
    scope. Mixed in before the drafter's base class."""

    lookup: LookupBranches | None
    options: dict[str, Any]

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)  # type: ignore[call-arg]  # the drafter's base class
        self.lookup = None if self.options["lookup"] == "off" else LookupBranches(self.options)

    @property
    def cuts_to_step_cost(self) -> bool:
        return self.lookup is not None

    def plan_step(self, prices: StepPrices) -> None:
        assert self.lookup is not None  # asked only when cuts_to_step_cost
        self.lookup.prices = prices

    @staticmethod
    def salted_index(options: Mapping[str, Any]) -> bool:
        return options["lookup"] == "global" and options["index_isolation"] == "salt"

    @property
    def learns_across_requests(self) -> bool:
        return self.lookup is not None and self.lookup.drafter.learns_across_requests

    def finished(self, requests: list[DraftRequest]) -> None:
        if self.lookup is not None:
            self.lookup.finished(requests)

    def forget_finished(self) -> None:
        if self.lookup is not None:
            self.lookup.drafter.forget_finished()

    @property
    def state_bytes(self) -> int:
        return 0 if self.lookup is None else self.lookup.drafter.state_bytes

    @property
    def index_stats(self) -> dict[str, int | list[int]]:
        return {} if self.lookup is None else self.lookup.drafter.index_stats
