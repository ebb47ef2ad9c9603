"""MCSD drafting: multi-candidate trees with dynamic depth.

Per request and step the draft grows the ``k_config`` tree level by level
(:mod:`vllm_specbeam.methods.mcsd.maths`): each frontier node gets its ``k`` best
tokens (greedy) or ``k`` draws without replacement from ``q`` (sampling), all
requests' new levels in one draft forward
(:meth:`~vllm_specbeam.draft_runtime.base.DraftRuntime.extend_many`).

**Dynamic depth.** Each frontier node's ``q`` row is scored (the estimated acceptance
of its next token: a trained stop model's, :mod:`~.stopping`, or q's top-1 probability).
With ``"stop_threshold": "auto"`` (the default), once the runner has priced a step's rows
and the draft's forwards (:meth:`plan_step`), scores are node values and every level and
draft forward must raise the step's expected tokens per second (:mod:`vllm_specbeam.core.controller`);
else drafting goes on while some node scores the threshold (Lu et al. 2024; ``auto``: 0.5).
``k_config: [1]`` is the paper's target-initialised ``[W, 1, 1, ...]`` (docs/methods/mcsd.md).

**Lookup branches** (``"lookup": "global"``, the default, or ``"request"``): the tree
starts with ``lookup_tree``'s branches and the draft fills what they leave, or does not
run (:mod:`vllm_specbeam.methods.lookup_tree.branches`); ``"off"``: the draft alone.

**Stop-model data.** A :class:`ScoreObserver` sees every scored ``q`` row and the tokens
committed after it: ``vllm-specbeam mcsd train`` installs one with ``collect`` on
(:mod:`vllm_specbeam.adapter.mcsd_train`); serving runs none.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from vllm_specbeam.core.budget import TreeShape
from vllm_specbeam.core.config import AUTO, LOOKUP_OPTIONS, Option, SpecbeamConfigError
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
from vllm_specbeam.methods.lookup_tree import branches as lookup_branches
from vllm_specbeam.methods.mcsd import stopping
from vllm_specbeam.methods.mcsd.maths import (
    best_candidates,
    largest_tree,
    level_sizes,
    level_widths,
    sampled_candidates,
)

#: ``"stop_threshold": "auto"`` before the runner has priced a step, and for a probe
UNPRICED_THRESHOLD = 0.5


@functools.lru_cache(maxsize=64)
def _shape(k_config: tuple[int, ...], depth: int) -> DraftTree:
    """The largest tree of a configuration, its mask built once (:meth:`DraftTree.with_tokens`)."""
    shape = largest_tree(k_config, depth)
    shape.ancestor_mask  # noqa: B018 - computed here, sliced by every step's trees
    return shape


@dataclasses.dataclass(frozen=True)
class ScoredRows:
    """One request's frontier rows as :meth:`McsdDrafter._score` saw them."""

    req_id: str
    #: the request's committed tokens, for its root row; ``None`` for the rows of deeper levels
    length: int | None
    paths: list[tuple[int, ...]]  # the tokens from the root to each row's node
    logits: torch.Tensor  # [rows, V]: the draft's logits at those nodes
    features: torch.Tensor  # [rows, stopping.NUM_FEATURES]


class ScoreObserver(Protocol):
    """What watches the rows the drafter scores and the tokens committed after them: the stop
    model's training data (:mod:`vllm_specbeam.adapter.mcsd_train` installs one as
    :attr:`McsdDrafter.observer`)."""

    def proposing(self, requests: Sequence[DraftRequest]) -> None:
        """A step's requests, before their trees are drafted (the tokens committed since the last)."""

    def scored(self, rows: Sequence[ScoredRows]) -> None:
        """The frontier rows scored for the requests growing a level."""

    def removed(self, req_ids: Sequence[str]) -> None:
        """Requests that finished or left the batch."""


class _Growth:
    """One request's tree during a step, one level at a time."""

    def __init__(
        self,
        request: DraftRequest,
        widths: list[int],
        root_logits: torch.Tensor,
        cap: int | None = None,
        exclude: Sequence[int] = (),
        priced: bool = False,
        worth: float = 1.0,
    ) -> None:
        self.req_id = request.req_id
        #: its committed token against a step's average (:attr:`StepLedger.worth`): scales its levels' values
        self.worth = worth
        #: each level and draft forward priced (:func:`_levels_that_pay`), else held to ``threshold``
        threshold = request.options["stop_threshold"]
        self.priced = priced and threshold == AUTO
        #: drafted by the request's own ``stop_threshold``, not by the step's prices
        self.threshold_fixed = threshold != AUTO
        self.threshold = UNPRICED_THRESHOLD if threshold == AUTO else float(threshold)
        #: most nodes to draft (``None``: the whole ``widths`` tree), and first-level tokens not to draft
        self.cap = cap
        self.exclude = torch.tensor(list(exclude), dtype=torch.int64)  # [excluded]
        self.widths = widths
        temperature = draft_temperature(request.options, request.temperature)
        self.temperature = temperature if temperature >= GREEDY_EPS else 0.0
        self.options = request.options
        self.rows = root_logits.unsqueeze(0)  # [frontier, V]: draft logits at the frontier
        self.frontier = [ROOT]
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.paths: list[tuple[int, ...]] = [()]  # of the frontier rows
        self.probs: list[torch.Tensor] = []  # per level [nodes, V]: the q each node was drawn from
        self.levels = 0
        #: per frontier node: its estimated chance of acceptance, and its parent row's score
        self.values = [1.0]
        self.hints = [1.0]

    def level_value(self, scored: list[list[float]]) -> tuple[float, int]:
        """The next level's expected accepted tokens and its nodes, from the frontier rows' scores
        (:meth:`McsdDrafter._score`: per row, the best token's score, then q's next probabilities)."""
        width = self.widths[self.levels]
        nodes = len(self.frontier) * width
        if self.cap is not None:
            nodes = min(nodes, self.cap - len(self.tokens))
        values = [v * (row[j] if j < len(row) else 0.0) for v, row in zip(self.values, scored) for j in range(width)]
        return sum(values[:nodes]) * self.worth, nodes

    def next_guess(self) -> float:
        """The next level's expected accepted tokens before its rows are scored: each frontier
        node's value times its parent row's score (confidence persists from one depth to the next)."""
        return sum(v * h for v, h in zip(self.values, self.hints)) * self.worth

    def grow(self, generator: torch.Generator, scored: list[list[float]] | None = None) -> tuple[list[int], list[int]]:
        """Add the next level below the frontier; its tokens and parents. ``scored``: the frontier
        rows' scores (:meth:`level_value`), from which the new nodes' values follow."""
        width = self.widths[self.levels]
        excluding = self.levels == 0 and self.exclude.numel() > 0
        if self.temperature:
            q = sampling_probs(self.rows, self.temperature, self.options["top_k"], self.options["top_p"])
            if excluding:  # the law the first level is drawn from: q without the lookup's tokens
                q = lookup_branches.without(q, self.exclude)
            if excluding and not bool((q > 0).any()):  # host sync: the lookup took all of q's support
                chosen = torch.zeros(1, 0, dtype=torch.int64)  # [frontier, 0]
            else:
                chosen = sampled_candidates(q, width, generator)  # [frontier, w]
            self.probs.append(q.repeat_interleave(chosen.shape[1], dim=0))
        else:
            rows = self.rows.index_fill(-1, self.exclude, float("-inf")) if excluding else self.rows
            chosen = best_candidates(rows, width)
        tokens = chosen.reshape(-1).tolist()
        parents = [p for p in self.frontier for _ in range(chosen.shape[1])]
        paths = [path + (t,) for path, row in zip(self.paths, chosen.tolist()) for t in row]
        if scored is not None:
            ranks = range(chosen.shape[1])
            self.values = [v * (row[j] if j < len(row) else 0.0) for v, row in zip(self.values, scored) for j in ranks]
            self.hints = [row[0] for row in scored for _ in ranks]
        if self.cap is not None and len(self.tokens) + len(tokens) >= self.cap:  # the cap ends the tree here
            left = self.cap - len(self.tokens)
            tokens, parents, paths = tokens[:left], parents[:left], paths[:left]
            self.values, self.hints = self.values[:left], self.hints[:left]
            if self.probs:
                self.probs[-1] = self.probs[-1][:left]
            self.levels = len(self.widths) - 1
        first = len(self.tokens)
        self.tokens += tokens
        self.parents += parents
        self.frontier = list(range(first, len(self.tokens)))
        self.paths = paths
        self.levels += 1
        return tokens, parents

    @property
    def done(self) -> bool:
        return self.levels == len(self.widths) or not self.frontier

    def tree(self, k_config: Sequence[int], depth: int) -> DraftTree:
        """The drafted tree; its mask sliced from the largest tree's when it has that shape."""
        tokens = np.asarray(self.tokens, np.int64)
        probs = torch.cat(self.probs).numpy() if self.probs else None
        shape = _shape(tuple(k_config), depth)
        if np.array_equal(shape.parents[: tokens.size], self.parents):
            return shape.with_tokens(tokens, probs)
        return DraftTree(tokens, np.asarray(self.parents, np.int64), probs)


@functools.lru_cache(maxsize=64)
def _first_level(k_config: tuple[int, ...]) -> TreeShape:
    """The first level of a configuration's trees, as the learnt rates value it."""
    return TreeShape.of(largest_tree(k_config, 1))


def rows_reach(scored: list[list[float]], threshold: float) -> bool:
    """The unpriced stopping rule: some frontier row's score reaches ``threshold``."""
    return max(row[0] for row in scored) >= threshold


def _levels_that_pay(
    growing: list[_Growth], scored: list[list[list[float]]], ledger: StepLedger
) -> tuple[list[_Growth], list[list[list[float]]]]:
    """The growths whose next level is drafted, with their scores: the unpriced ones, and the
    priced ones whose level, valued by its rows' scores, pays for its verified rows (most valuable
    first, each added to ``ledger``)."""
    levels = [g.level_value(rows) if g.priced else (0.0, 0) for g, rows in zip(growing, scored)]
    order = sorted(range(len(growing)), key=lambda k: -levels[k][0] / max(levels[k][1], 1))
    kept = sorted(k for k in order if not growing[k].priced or ledger.take(*levels[k]))
    return [growing[k] for k in kept], [scored[k] for k in kept]


def _extends_that_pay(growing: list[_Growth], ledger: StepLedger) -> list[_Growth]:
    """The growths whose frontier the next draft forward feeds: the unpriced ones, and the priced
    ones whose next level's guessed value pays for its rows and their share of the forward
    (:func:`~vllm_specbeam.core.controller.forwards_that_pay`)."""
    priced = [g for g in growing if g.priced]
    fixed = sum(len(g.frontier) for g in growing if not g.priced)
    chosen = forwards_that_pay(ledger, [g.next_guess() for g in priced], [len(g.frontier) for g in priced], fixed)
    extending = {id(priced[k]) for k in chosen}
    return [g for g in growing if not g.priced or id(g) in extending]


class McsdDrafter(lookup_branches.LookupFirstDrafter, PricedDraftModel, DraftModelDrafter):
    """Multi-candidate trees with dynamic depth (see the module docstring)."""

    OPTIONS: ClassVar[dict[str, Option]] = {
        **DRAFT_MODEL_OPTIONS,
        **LOOKUP_OPTIONS,
        # on by default: faster than the draft alone on copied text and new text alike (docs/results.md)
        "lookup": dataclasses.replace(LOOKUP_OPTIONS["lookup"], default="global"),
        "target_model": Option(
            "", "the target model (name or path), for the stop model's pair check; filled in", per_request=False
        ),
        "k_config": Option(
            [1],
            "candidates per node at each depth, e.g. [4, 2, 2]; deeper levels keep 1 (a chain); "
            "the default [1] is the paper's target-initialised shape (see the module docstring)",
        ),
        "stop_model": Option(
            "",
            "directory written by `vllm-specbeam mcsd train` for this target/draft pair "
            "(empty: stop on the draft's own top-token probability)",
            per_request=False,
        ),
        "stop_threshold": Option(
            AUTO,
            "auto: draft a level, and run the draft at all, only where it raises the step's expected tokens per "
            "second under the measured costs (docs/budget.md; 0.5 until they are measured); a number: draft one "
            "more level while some frontier node's estimated acceptance is at least this (0 = never stop)",
            0.0,
            1.0,
            auto=True,
            kind=float,
        ),
        "collect": Option(
            False, "record scored rows for `vllm-specbeam mcsd train` (the command sets it)", per_request=False
        ),
    }

    #: what ``"lookup"`` on changes unless set: room for ``lookup_tree``'s global-scope trees
    #: (its 48 nodes); the draft's own nodes stay ``k_config``'s, so the room is the lookup's only
    LOOKUP_DEFAULTS: ClassVar[dict[str, Any]] = {"max_nodes": 48}

    @classmethod
    def defaults_for(cls, user: Mapping[str, Any]) -> dict[str, Any]:
        return {} if user.get("lookup", cls.OPTIONS["lookup"].default) == "off" else dict(cls.LOOKUP_DEFAULTS)

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> None:
        k_config = options["k_config"]
        if not k_config or not all(type(k) is int and 1 <= k <= 32 for k in k_config):
            raise SpecbeamConfigError(
                f"mcsd: k_config must be a non-empty list of candidate counts in [1, 32], got {k_config!r}"
            )
        depth = options["num_speculative_tokens"]
        if len(k_config) > depth:
            raise SpecbeamConfigError(
                f"mcsd: k_config {k_config} has {len(k_config)} levels but num_speculative_tokens={depth}; "
                f"shorten k_config or raise num_speculative_tokens"
            )
        nodes = sum(level_sizes(k_config, depth))
        if nodes > options["max_nodes"]:
            raise SpecbeamConfigError(
                f"mcsd: k_config {k_config} at depth {depth} drafts up to {nodes} nodes but max_nodes="
                f"{options['max_nodes']}; raise max_nodes to {nodes} or draft fewer candidates"
            )

    @staticmethod
    def check_startup(options: Mapping[str, Any]) -> None:
        DraftModelDrafter.check_startup(options)
        if options["stop_model"]:
            pair = None
            if options["target_model"] and options["draft_model"]:
                pair = stopping.PairIdentity.of(options["target_model"], options["draft_model"])
            stopping.load_stop_model(options["stop_model"], pair)

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        path = self.options.get("stop_model", "")
        self.stop_model = stopping.load_stop_model(path) if path else None
        #: what watches the scored rows (``None``: serving; ``vllm-specbeam mcsd train`` installs one)
        self.observer: ScoreObserver | None = None

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        runtime = self.ready_runtime()
        if self.observer is not None:
            self.observer.proposing(requests)
        ledger = self.start_ledger()
        if self.lookup is None:
            # priced, the draft runs only where its first level's learnt value pays for its share
            first = [
                _first_level(tuple(r.options["k_config"])) if r.options["stop_threshold"] == AUTO else None
                for r in requests
            ]
            return self.gated(
                runtime, requests, first, lambda rs, caps: self._draft(runtime, rs, caps, [[] for _ in rs], ledger)
            )
        fills = [_shape(tuple(r.options["k_config"]), r.options["num_speculative_tokens"]) for r in requests]
        return self.lookup.propose(
            runtime,
            requests,
            fills,
            lambda rs, caps, ex: self._draft(runtime, rs, caps, ex, ledger),
            ledger=ledger,
            unpriced_threshold=UNPRICED_THRESHOLD,
        )

    def _draft(
        self,
        runtime: DraftRuntime,
        requests: list[DraftRequest],
        caps: Sequence[int | None],
        excludes: Sequence[Sequence[int]],
        ledger: StepLedger | None = None,
    ) -> list[DraftTree]:
        """The draft model's trees: at most ``caps`` nodes each (``None``: the ``k_config`` tree),
        first levels without the ``excludes`` tokens; given the step's ``ledger``, each level
        and each draft forward only where it pays (else ``stop_threshold`` decides)."""
        widths = [level_widths(r.options["k_config"], r.options["num_speculative_tokens"]) for r in requests]
        reserve = [sum(level_sizes(r.options["k_config"], len(w))[:-1]) for r, w in zip(requests, widths)]
        reserve = [n if cap is None else min(n, cap) for n, cap in zip(reserve, caps)]
        synced = runtime.sync_many([(r.req_id, r.token_ids, n) for r, n in zip(requests, reserve)])
        # a probe is drafted whatever it costs and valued at nothing (the committed tokens value it)
        priced = ledger is not None and not ledger.probing
        worth = [1.0 if ledger is None else ledger.worth_of(r.req_id) for r in requests]
        growths = [
            None if logits is None else _Growth(r, w, logits, cap, exclude, priced, request_worth)
            for r, w, logits, cap, exclude, request_worth in zip(requests, widths, synced, caps, excludes, worth)
        ]
        growing = [g for g in growths if g is not None]
        if ledger is not None:  # requests drafted by their own threshold leave the step unvalued
            ledger.unvalued |= any(g.threshold_fixed for g in growing)
        scored = None
        if growing and (self.observer is not None or priced):
            scored = self._score(growing, [len(r.token_ids) for r, g in zip(requests, growths) if g is not None])
        while growing:
            if ledger is not None and scored is not None:
                growing, scored = _levels_that_pay(growing, scored, ledger)
            rows_of = scored if scored is not None else [None] * len(growing)
            levels = [(g, g.grow(self.generator, rows)) for g, rows in zip(growing, rows_of)]
            growing = [g for g, _ in levels if not g.done]
            if ledger is not None:
                growing = _extends_that_pay(growing, ledger)
            if not growing:
                break
            extending = set(map(id, growing))
            logits = runtime.extend_many([(g.req_id, *level) for g, level in levels if id(g) in extending])
            for g, rows in zip(growing, logits):
                g.rows = rows
            scored = self._score(growing, None)
            kept = [k for k, (g, rows) in enumerate(zip(growing, scored)) if g.priced or rows_reach(rows, g.threshold)]
            growing, scored = [growing[k] for k in kept], [scored[k] for k in kept]
        return [
            DraftTree.empty() if g is None else g.tree(r.options["k_config"], r.options["num_speculative_tokens"])
            for r, g in zip(requests, growths)
        ]

    # ------------------------------------------------------------ the stopping rule
    def _score(self, growing: list[_Growth], lengths: list[int] | None) -> list[list[list[float]]]:
        """Each request's frontier rows scored, all requests at once (one host sync per depth): per
        row the estimated acceptance of its best token (the stop model's, else q's top probability),
        then q's next :data:`~.stopping.NUM_TOP` - 1 probabilities. ``lengths``: the root rows' requests'
        committed tokens, for the :attr:`observer` only."""
        rows = torch.cat([g.rows for g in growing])  # [frontier rows of all requests, V]
        features = stopping.stop_features(rows)  # [rows, F]
        scores = features[:, 0] if self.stop_model is None else self.stop_model.probability(features)
        counts = [g.rows.shape[0] for g in growing]
        if self.observer is not None:
            self.observer.scored(
                [
                    ScoredRows(g.req_id, None if lengths is None else lengths[k], g.paths, g.rows, own)
                    for k, (g, own) in enumerate(zip(growing, features.split(counts)))
                ]
            )
        table = torch.cat([scores[:, None], features[:, 1 : stopping.NUM_TOP]], dim=1).tolist()  # host sync
        starts = np.cumsum([0, *counts]).tolist()
        return [table[start:end] for start, end in itertools.pairwise(starts)]

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        req_ids = list(req_ids)
        if self.observer is not None:
            self.observer.removed(req_ids)
        if self.lookup is not None:
            self.lookup.remove(req_ids)
        super().remove_requests(req_ids)
