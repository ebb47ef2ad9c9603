"""Lookup branches in a draft-model method's trees (``"lookup": "request" | "global"``).

Each step a request's tree starts with what ``lookup_tree`` drafts (its drafter,
request or global scope, with :attr:`LookupBranches.DEFAULTS` over its own defaults: node
kinds by match length and source). The draft model drafts below the root, after them, only the
nodes they and ``max_nodes`` leave (:func:`lookup_first`: nodes valued by the acceptance per
kind, depth and rank that :class:`~vllm_specbeam.core.budget.StepBudget` learns from the
committed tokens); when they leave none, the draft runs no forward that step
(``DraftRuntime.defer``) and catches up at its next sync. Its first-level tokens exclude the
lookup's, so no draft node repeats a lookup sibling. A draft that ``stop_threshold`` alone left
out is tried regardless after 1, 2, 4, 8 such request-steps (an engine-wide
:class:`~vllm_specbeam.core.budget.BackOff`), since its value is learnt only from its tries,
which probe with one node (the draft's first, from its sync). The threshold judges the fill's
first level only; below it, the draft's own stopping rule decides. Either way the draft runs
only while it lags at most :data:`EXPLORE_MAX_LAG` committed tokens, since it must first catch
up on them, or on new text (:data:`NEW_TEXT_STEPS` steps without a branch): a request the
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
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from vllm_specbeam.core.budget import (
    FILL_KIND,
    BackOff,
    RequestBudget,
    StepBudget,
    TreeShape,
    choose_nodes,
    path_values,
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
#: consecutive steps without a lookup branch after which the draft catches up however far it lags: the
#: text is new, and the draft, once caught up, drafts it from then on (one step without a branch is mostly
#: an edit in copied text, where a catch-up of the whole prompt buys a node or two)
NEW_TEXT_STEPS = 2

#: a draft model's trees for ``requests``: at most ``caps`` nodes each, first levels without ``excludes``
DraftFill = Callable[[list[DraftRequest], list[int], list[list[int]]], list[DraftTree]]
#: one request's tree from its lookup tree and the draft model's (empty when it ran no forward)
Mix = Callable[[DraftRequest, DraftTree, DraftTree], DraftTree]


@dataclass(frozen=True)
class LookupShare:
    """What :func:`lookup_first` keeps of a step's tree."""

    #: the lookup nodes kept
    lookup: DraftTree
    #: their values (:func:`~vllm_specbeam.core.budget.path_values`), in their order
    values: list[float]
    #: how many of the fill's first nodes the draft model may add (0: it does not run)
    fill_nodes: int
    #: the values of those of them below the root (the draft's first level)
    fill_first: list[float] = field(default_factory=list)


def lookup_first(
    lookup: DraftTree, fill: DraftTree, budget: int, rates: np.ndarray, min_value: float = 0.0
) -> LookupShare:
    """Lookup branches first, ``fill`` (the largest tree a draft model may grow below the root,
    its nodes drafted in order) gets what they leave: the lookup nodes kept with their values,
    and how many of ``fill``'s first nodes to draft.

    Both hang from the root as :func:`mixed_tree` joins them, and every node is valued by
    :func:`~vllm_specbeam.core.budget.path_values` under ``rates``
    (:meth:`~vllm_specbeam.core.budget.StepBudget.rates`). The ``budget`` most valuable nodes
    are kept, ties to the lookup's; a fill node below the root worth less than ``min_value``
    (0: none is) is never kept, nor are its descendants. Deeper fill nodes are not held to
    ``min_value``: the draft model's own stopping rule judges them token by token, and their
    learnt values never get trials if a cell left at its prior cuts them. 0 (the lookup alone
    fills the budget with nodes valued above the fill's, or the fill is worth too little): the
    draft model does not run.
    Example: at rate 0.9 for lookup and 0.6 for fill nodes everywhere, budget 3, a 2-node
    lookup chain (0.9, 0.81) and a fill chain (0.6, 0.36): the lookup chain and 1 fill node;
    with ``min_value`` 0.7, no fill node; with ``min_value`` 0.5 and budget 4, both fill nodes.
    """
    both = mixed_tree(lookup, fill)
    parents = both.parents  # [nodes]
    values = np.asarray(path_values(TreeShape.of(both), rates))  # [nodes]
    for node in range(lookup.num_nodes, both.num_nodes):  # parents come first: one pass cuts whole branches
        parent = int(parents[node])
        if (values[node] < min_value) if parent == ROOT else values[parent] == -np.inf:
            values[node] = -np.inf
    best = np.argsort(-values, kind="stable")[:budget]  # ties to the earlier node: the lookup's, a parent
    best = best[np.isfinite(values[best])]
    kept = np.zeros(lookup.num_nodes, bool)  # [lookup nodes]: a parent is never worth less than its child
    kept[best[best < lookup.num_nodes]] = True
    drafted = best[best >= lookup.num_nodes]  # [fill nodes kept]
    return LookupShare(
        lookup.keep(kept),
        values[: lookup.num_nodes][kept].tolist(),
        int(drafted.size),
        values[drafted[parents[drafted] == ROOT]].tolist(),
    )


def lookup_alone(lookup: DraftTree, budget: int, rates: np.ndarray) -> LookupShare:
    """The ``budget`` most valuable lookup nodes, and no room for the draft model."""
    return lookup_first(lookup, DraftTree.empty(), budget, rates)


def fill_threshold(options: Mapping[str, Any], auto_threshold: float | None) -> float:
    """The least value of the fill's first-level nodes: ``stop_threshold``, ``auto_threshold`` for
    ``"auto"``; 0 (none) without one (a method without a stopping threshold, dsbd, drafts every
    fill node the budget leaves)."""
    threshold = options.get("stop_threshold", 0.0)
    return (auto_threshold or 0.0) if threshold == AUTO else float(threshold)


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

    #: per scope, the lookup options over ``lookup_tree``'s own defaults that the draft-model methods
    #: were measured with: matches of two tokens or more (one-token matches find a branch almost every
    #: step, and the draft catches up on new text only after steps without one), the global scope as
    #: deep as its match is long
    DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "request": {"prompt_lookup_min": 2},
        "global": {"prompt_lookup_min": 2, "depth_factor": 1.0},
    }

    def __init__(self, options: Mapping[str, Any]) -> None:
        scope = "global" if options["lookup"] == "global" else "request"
        #: the engine-wide options of the lookup drafter (depth and node budget set per request)
        self.options = self.lookup_options(scope, options["index_isolation"])
        self.drafter = LookupTreeDrafter(self.options)
        #: acceptance per (kind, depth, rank), learnt from the committed tokens (no step cost: never pruned by it)
        self.values = StepBudget()
        #: how long a draft the threshold left out waits before it is tried regardless (engine-wide)
        self.fill_rest = BackOff()
        #: per request: its length when the draft last ran for it (the draft lags the tokens since)
        self.drafted_at: dict[str, int] = {}
        #: per request: consecutive steps, up to this one, without a lookup branch
        self.without_lookup: dict[str, int] = {}
        #: engine depth: a request that sets a shallower one draws lookup branches no deeper than it
        #: (near its max_tokens the runner lowers ``lookup_depth`` itself)
        self.engine_depth = int(options["num_speculative_tokens"])
        #: the step being drafted (:meth:`LookupFirstDrafter.plan_step`): its requests and what the runner
        #: measured of a step's rows and draft forwards
        self.prices = StepPrices(0, None)
        #: which requests a priced draft drafts for (:meth:`propose` given a ledger)
        self.gate = DraftGate()

    @classmethod
    def lookup_options(cls, scope: str, index_isolation: str) -> dict[str, Any]:
        """The lookup drafter's options: ``lookup_tree``'s defaults for ``scope``, then :attr:`DEFAULTS`."""
        options = {key: spec.default for key, spec in {**TREE_OPTIONS, **LookupTreeDrafter.OPTIONS}.items()}
        options.update(LookupTreeDrafter.defaults_for({"scope": scope}), scope=scope, index_isolation=index_isolation)
        options.update(cls.DEFAULTS[scope])
        return options

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
        """Per request: its lookup nodes and the draft's room (:meth:`share`; ``fill``: the largest
        tree the draft could grow; its first level held to ``stop_threshold``, ``auto_threshold`` for
        ``"auto"``, or, with ``None``, to nothing: :meth:`priced` decides), then the batch's lookup
        nodes cut to those that pay for their rows (:meth:`cut_to_step_cost`)."""
        found = self.drafter.propose([self.request(r) for r in requests])
        engine = self.values.engine_rates()
        shares = [
            self.share(request, lookup, fill, self.judged_rates(request, engine), auto_threshold)
            for request, lookup, fill in zip(requests, found, fills)
        ]
        return self.cut_to_step_cost(shares)

    def judged_rates(self, request: DraftRequest, engine_rates: np.ndarray) -> np.ndarray:
        """``request``'s acceptance rates, once its last tree is judged by the tokens committed since
        (and the fill's back-off told whether they walked through one of its nodes)."""
        tokens = request.token_ids
        state = self.values.requests.setdefault(request.req_id, RequestBudget())
        if state.drafted is not None:
            committed = tokens[state.drafted_at :].tolist()
            if committed and state.drafted.kinds is not None and FILL_KIND in state.drafted.kinds:
                self.fill_rest.after(paid=fill_paid(state.drafted, committed))
            self.values.observe_committed(request.req_id, committed, tokens.size)
        return self.values.rates(request.req_id, engine_rates)

    def share(
        self, request: DraftRequest, lookup: DraftTree, fill: DraftTree, rates: np.ndarray, auto: float | None
    ) -> LookupShare:
        """One request's lookup nodes and the draft's room (:func:`lookup_first`, the fill held to
        :func:`fill_threshold`); a fill the threshold alone leaves out probes on the back-off, and a
        draft that may not catch up (:meth:`may_catch_up`) leaves the lookup alone."""
        budget = request.options["max_nodes"]
        threshold = fill_threshold(request.options, auto)
        share = lookup_first(lookup, fill, budget, rates, threshold)
        may_catch_up = self.may_catch_up(request, branched=lookup.num_nodes > 0)
        if share.fill_nodes == 0 and threshold > 0:
            # the fill's value is learnt only from its tries: one the threshold alone leaves out
            # is tried regardless on a back-off, else a value once below it stays there
            waived = lookup_first(lookup, fill, budget, rates)
            if waived.fill_nodes > 0 and self.fill_rest.allows() and may_catch_up:
                return dataclasses.replace(waived, fill_nodes=1)  # a probe: its first node, from the sync's logits
        elif share.fill_nodes > 0 and not may_catch_up:
            return lookup_alone(lookup, budget, rates)
        return share

    def may_catch_up(self, request: DraftRequest, branched: bool) -> bool:
        """Whether the draft may run for ``request`` this step (``branched``: the lookup found a branch).
        A draft that lags far first feeds what it lags (at a request's start, its whole prompt), which
        pays only on new text: one step without a branch is mostly an edit in copied text."""
        missed = 0 if branched else self.without_lookup.get(request.req_id, 0) + 1
        self.without_lookup[request.req_id] = missed
        lag = request.token_ids.size - self.drafted_at.get(request.req_id, 0)
        return lag <= EXPLORE_MAX_LAG or missed >= NEW_TEXT_STEPS

    def cut_to_step_cost(self, shares: Sequence[LookupShare]) -> list[LookupSplit]:
        """The batch's lookup nodes that pay for their rows
        (:func:`~vllm_specbeam.core.budget.choose_nodes` under :attr:`prices`, as ``lookup_tree``'s
        ``"max_nodes": "auto"``; the fill's rows are counted as fixed); all of them before a step was timed."""
        lookups = [share.lookup for share in shares]
        masks = [np.ones(tree.num_nodes, bool) for tree in lookups]
        step = self.prices.step
        if step is not None:
            batch = self.prices.batch_size
            rows = batch + sum(share.fill_nodes for share in shares)
            masks = choose_nodes(lookups, [share.values for share in shares], batch, rows, step)
        return [
            LookupSplit(
                tree.keep(mask),
                tree,
                share.fill_nodes,
                float(np.asarray(share.values)[mask].sum()),
                tuple(share.fill_first),
            )
            for tree, mask, share in zip(lookups, masks, shares)
        ]

    def priced(
        self,
        runtime: DraftRuntime,
        requests: Sequence[DraftRequest],
        splits: list[LookupSplit],
        ledger: StepLedger,
    ) -> list[LookupSplit]:
        """``splits`` with the lookup nodes' values and rows in ``ledger``, and the draft only for the
        ``"stop_threshold": "auto"`` requests whose first level pays for their share of its forward,
        catch-up included (:class:`~vllm_specbeam.core.controller.DraftGate`, valued by the learnt
        rates; the forward is charged here, the levels as they are drafted)."""
        worth = [ledger.worth_of(r.req_id) for r in requests]
        ledger.add(sum(s.value * w for s, w in zip(splits, worth)), sum(s.verified.num_nodes for s in splits))
        candidates = [
            k
            for k, (r, split) in enumerate(zip(requests, splits))
            if split.fill_nodes > 0 and r.options.get("stop_threshold") == AUTO
        ]
        if not candidates:
            return splits
        first = [splits[k].fill_first for k in candidates]
        gains = [sum(values) * worth[k] for k, values in zip(candidates, first)]
        fed = [runtime.sync_rows(requests[k].req_id, requests[k].token_ids) for k in candidates]
        left = [requests[k].tokens_left for k in candidates]
        drafting = self.gate.choose(ledger, gains, [len(values) for values in first], fed, left)
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
            splits = self.priced(runtime, requests, splits, ledger)
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
        return self.lookup is not None or super().cuts_to_step_cost  # type: ignore[misc]

    def plan_step(self, prices: StepPrices) -> None:
        super().plan_step(prices)  # type: ignore[misc]  # a priced draft model's own
        if self.lookup is not None:
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
