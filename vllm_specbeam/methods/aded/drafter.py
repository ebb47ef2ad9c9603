"""ADED: adaptive tri-gram drafting with Monte Carlo tree search, no draft model.

Each step, per request: the tri-grams committed since the last step raise
their weight in the request's overlay (:mod:`vllm_specbeam.methods.aded.trigram`);
the tree starts with what ``lookup_tree`` would draft (the continuations of
every earlier occurrence of the request's longest recent n-gram,
``prompt_lookup_min`` to ``prompt_lookup_max`` tokens; 0: none, the paper's
search alone); then an MCTS (:mod:`vllm_specbeam.methods.aded.mcts`) below the
last two tokens fills the rest of the node budget, with walks in proportion
to the nodes left to it. A request whose last search drafted no node of its
own that the target went on to commit rests its search (:class:`SearchRest`).

With a ``trigram`` corpus, each drafted node is attributed to the source of
its larger share (corpus or the request's own tri-grams); what the target
keeps of each scales the corpus for that request (``corpus_weight``).

The target's tokenizer comes in as the ``tokenizer`` *option*, filled from
the target model in the front end, and is read only to refuse a matrix
built with another vocabulary. Design and figures: docs/methods/aded.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import numpy as np

from vllm_specbeam.core.budget import FILL_KIND, BackOff
from vllm_specbeam.core.config import Option, SpecbeamConfigError, node_cap
from vllm_specbeam.core.drafter import DraftRequest, TreeDrafter
from vllm_specbeam.core.lookup import Source, best_match
from vllm_specbeam.core.tree import ROOT, DraftTree, committed_path
from vllm_specbeam.methods.aded import trigram
from vllm_specbeam.methods.aded.mcts import SearchParams, search

#: sources a drafted node is attributed to (index into :class:`SourceRecord`'s arrays)
CORPUS, CONTEXT = 0, 1
#: each step's counts are added to the older ones times this: a source's record
#: reaches back about ``1 / (1 - SOURCE_DECAY)`` = 10 steps
SOURCE_DECAY = 0.9
#: most recent earlier occurrences of the recent n-gram drafted (``lookup_tree``'s default)
MAX_MATCHES = 64
#: pseudo-counts every source starts from: half a node kept of one checked
SOURCE_PRIOR_KEPT, SOURCE_PRIOR_CHECKED = 0.5, 1.0
#: how long a request's search rests after fruitless ones (1, 2, 4, 8 steps; the schedule
#: a draft model behind lookup branches retries on too)
SearchRest = BackOff
#: the step budget's kind of the search's nodes (the matches' are 0-7, by match length and source:
#: :func:`~vllm_specbeam.core.lookup.match_kind`), so it learns whether they pay apart
SEARCH_KIND = FILL_KIND


@dataclass
class SourceRecord:
    """Decayed counts, per source, of a request's drafted nodes the target checked and kept."""

    checked: np.ndarray = field(default_factory=lambda: np.zeros(2))  # [sources]
    kept: np.ndarray = field(default_factory=lambda: np.zeros(2))  # [sources]

    def add(self, checked: np.ndarray, kept: np.ndarray) -> None:
        self.checked = SOURCE_DECAY * self.checked + checked
        self.kept = SOURCE_DECAY * self.kept + kept

    @property
    def corpus_weight(self) -> float:
        """The corpus's acceptance over the context's (smoothed), squared: 1 until the
        target has judged them. Squared because the two live on different scales (a
        corpus probability up to 1, a request's gain 0.04 a sighting): a corpus kept a
        third as often must already rank below the request's own. Example: corpus 0
        kept of 6 checked, context 3 of 4: ((0.5 / 7) / (3.5 / 5)) ** 2 = 0.01."""
        rate = (self.kept + SOURCE_PRIOR_KEPT) / (self.checked + SOURCE_PRIOR_CHECKED)  # [sources]
        return float(rate[CORPUS] / rate[CONTEXT]) ** 2


@dataclass(frozen=True)
class Draft:
    """A request's last draft: its nodes' tokens, parents, kinds and sources, and where it hangs."""

    tree: DraftTree
    sources: np.ndarray | None  # [nodes] CORPUS or CONTEXT; None without a corpus
    #: committed tokens when it was drafted: the ones after this show what the target kept
    context: int
    #: whether the search walked for it (else it has no say on the search's rest)
    searched: bool

    def judged(self, new_tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Nodes checked and kept per source ([sources] each), given the tokens committed since.

        The target checks the children of the root and of every node it kept,
        and keeps the one (if any) matching the next committed token. Example:
        nodes ``a`` (root child), ``b``, ``c`` (children of ``a``) and new tokens
        ``a c x``: ``a`` kept; ``b``, ``c`` checked, ``c`` kept; nothing below ``c``.
        """
        assert self.sources is not None  # judged only with a corpus
        path = committed_path(self.tree.tokens.tolist(), self.tree.parents.tolist(), new_tokens)
        checked, kept = np.zeros(2), np.zeros(2)
        for parent in [ROOT, *path][: len(new_tokens)]:  # a parent whose children met a committed token
            np.add.at(checked, self.sources[self.tree.parents == parent], 1.0)
        np.add.at(kept, self.sources[path], 1.0)
        return checked, kept

    def search_paid(self, new_tokens: list[int]) -> bool:
        """Whether the tokens committed since walk through one of the search's own nodes.

        Judged on the tree as drafted: a node the step budget pruned counts when
        the target committed its token anyway (the search was right; the budget
        learns that from the same tokens)."""
        path = committed_path(self.tree.tokens.tolist(), self.tree.parents.tolist(), new_tokens)
        return self.tree.kinds is not None and any(self.tree.kinds[node] == SEARCH_KIND for node in path)


@dataclass
class _RequestState:
    """A request's own tri-gram gains, how much of its context they cover, and its sources' record."""

    overlay: trigram.Overlay = field(default_factory=trigram.Overlay)
    #: tokens whose tri-grams (the ones ending at them) have been observed
    observed: int = 0
    record: SourceRecord = field(default_factory=SourceRecord)
    rest: SearchRest = field(default_factory=SearchRest)
    draft: Draft | None = None


def load_matrix(options: Mapping[str, Any]) -> trigram.TrigramMatrix:
    """The corpus matrix named by the options (memory-mapped), or an empty one."""
    path = options.get("trigram", "")
    if not path:
        return trigram.TrigramMatrix.empty()
    tokenizer = options.get("tokenizer", "")
    if not tokenizer:
        raise SpecbeamConfigError(
            "aded: option 'trigram' needs the target's tokenizer in option 'tokenizer' to check the matrix "
            "was built with the same vocabulary"
        )
    try:
        return trigram.load(path, tokenizer)
    except (OSError, ValueError) as error:
        raise SpecbeamConfigError(f"aded: {error}") from error


class AdedDrafter(TreeDrafter):
    """Tri-gram matrix + per-request adaptive overlays + MCTS draft trees."""

    OPTIONS: ClassVar[dict[str, Option]] = {
        "trigram": Option(
            "",
            "directory of a tri-gram matrix from `vllm-specbeam trigram build` "
            '("" = no corpus: draft from the prompt and the output alone)',
            per_request=False,
        ),
        "tokenizer": Option(
            "",
            "the target's tokenizer (name or path), to check the matrix was built with it; "
            "filled in from the target model",
            per_request=False,
        ),
        "iterations": Option(
            150,
            "MCTS iterations of a draft tree at the engine's full node budget (max_nodes, or "
            "auto_max_nodes when it is auto); a step with a smaller budget runs proportionally "
            "fewer (4 of 16 nodes: a quarter), at least 1",
            1,
            10_000,
        ),
        "num_paths": Option(24, "most-visited search paths merged into the draft tree", 1, 256),
        "adapt_window": Option(
            0,
            "tri-grams of the last this many tokens of a new request's context seed its "
            "weights (0 = the whole context; without a corpus the whole prompt is used); "
            "after that every committed tri-gram counts once",
            0,
            1 << 20,
        ),
        "adapt_step": Option(trigram.DEFAULT_ADAPT_STEP, "weight a tri-gram gains each time it is committed", 0.0, 1.0),
        "adapt_cap": Option(trigram.DEFAULT_ADAPT_CAP, "most weight a tri-gram can gain from adaptation", 0.0, 1.0),
        "global_update": Option(
            False,
            "adapt one matrix shared by all requests instead of this request's own "
            "(what a request learns then helps, or misleads, every later request)",
        ),
        "prompt_lookup_min": Option(1, "shortest recent n-gram whose earlier continuations are drafted first", 1, 64),
        "prompt_lookup_max": Option(
            5,
            "longest recent n-gram whose earlier continuations (in the request's own tokens) are drafted "
            "before the search; 0 = none: the tri-gram search alone, as in the paper",
            0,
            64,
        ),
        "seed": Option(0, "seed of the MCTS roll-outs (drafts are reproducible per context length)", 0, 2**31 - 1),
    }

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.matrix = load_matrix(self.options)
        #: gains of every request that opted in to ``global_update``, read by all
        self.shared = trigram.Overlay()
        self._requests: dict[str, _RequestState] = {}

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> None:
        low, high = options["prompt_lookup_min"], options["prompt_lookup_max"]
        if high and low > high:
            raise SpecbeamConfigError(
                f"aded: prompt_lookup_min={low} must not exceed prompt_lookup_max={high} "
                "(or set prompt_lookup_max to 0 to draft from the tri-gram search alone)"
            )

    @staticmethod
    def check_startup(options: Mapping[str, Any]) -> None:
        """The matrix opens and was built with the target's tokenizer."""
        load_matrix(options)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(request) for request in requests]

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        options = request.options
        tokens = np.asarray(request.token_ids, dtype=np.int64)
        state = self._observe(request.req_id, tokens, options)
        state.draft = None
        if tokens.size < 2:
            return DraftTree.empty()
        budget, depth = options["max_nodes"], options["num_speculative_tokens"]
        matched = _matched_paths(tokens, options, depth, budget)
        # asked every step: a rest counts request-steps, searched or not
        walks = self.iterations(options["iterations"], budget - matched.num_nodes) if state.rest.allows() else 0
        tree, walked, sources = matched, 0, None  # no walks: the matches are the draft, as they stand
        if walks:
            lookup = partial(
                self.matrix.lookup,
                overlays=(self.shared, state.overlay),
                cap=options["adapt_cap"],
                corpus_weight=state.record.corpus_weight,
            )
            params = SearchParams(iterations=walks, num_paths=options["num_paths"], depth=depth, max_nodes=budget)
            rng = np.random.default_rng((options["seed"], tokens.size))
            w1, w2 = int(tokens[-2]), int(tokens[-1])
            found = search(lambda pairs: lookup(pairs).table, w1, w2, params, rng, first=matched.leaf_paths())
            # the matches' nodes come first in the tree: their kind says how long the match was
            kinds = np.full(found.tree.num_nodes, SEARCH_KIND)  # [nodes]
            if matched.kinds is not None:  # None: nothing matched (or prompt_lookup_max 0)
                kinds[: matched.num_nodes] = matched.kinds
            tree, walked = found.tree.with_kinds(kinds), found.iterations
            if tree.num_nodes and self.matrix.num_keys:  # without a corpus every node is the context's
                sources = _sources(tree, w1, w2, lookup)
        if tree.num_nodes and self.matrix.num_keys:  # the matches' nodes (all, without walks) are the context's
            if sources is None:
                sources = np.full(tree.num_nodes, CONTEXT)
            sources[: matched.num_nodes] = CONTEXT
        if sources is not None or walked:
            state.draft = Draft(tree, sources, tokens.size, searched=walked > 0)
        return tree

    def iterations(self, iterations: int, budget: int) -> int:
        """Walks for the nodes a step leaves to the search: ``iterations`` at the engine's
        full budget, proportionally fewer below it (150 at 16 nodes: 38 at 4, 10 at 1,
        none at 0)."""
        return max(0, math.ceil(iterations * min(1.0, budget / node_cap(self.options))))

    def _observe(self, req_id: str, tokens: np.ndarray, options: Mapping[str, Any]) -> _RequestState:
        """Add the tri-grams committed since this request's last step (only those),
        and score its last draft against the tokens committed since it."""
        state = self._requests.get(req_id)
        if state is None or state.observed > tokens.size:  # new, or its context was cut back
            state = self._requests[req_id] = _RequestState(observed=self._seed_start(tokens.size, options))
        target = self.shared if options["global_update"] else state.overlay
        target.observe(tokens[max(0, state.observed - 2) :], options["adapt_step"], options["adapt_cap"])
        state.observed = tokens.size
        draft = state.draft
        if draft is not None and tokens.size > draft.context:
            committed = tokens[draft.context :].tolist()
            if draft.sources is not None:
                state.record.add(*draft.judged(committed))
            if draft.searched:
                state.rest.after(paid=draft.search_paid(committed))
        return state

    def _seed_start(self, num_tokens: int, options: Mapping[str, Any]) -> int:
        """``observed`` for a new request, so that its first observation covers the
        tri-grams inside its last ``adapt_window`` tokens (all of them without a corpus)."""
        window = options["adapt_window"]
        if window == 0 or self.matrix.num_keys == 0:
            return 0
        return max(0, num_tokens - window) + 2

    @property
    def live_requests(self) -> int:
        return len(self._requests)

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)


def _matched_paths(tokens: np.ndarray, options: Mapping[str, Any], depth: int, budget: int) -> DraftTree:
    """What ``lookup_tree`` drafts (its request scope): the continuations of every earlier
    occurrence of the best-scoring recent n-gram (:func:`best_match`), merged, the most
    frequent kept first."""
    if not options["prompt_lookup_max"]:
        return DraftTree.empty()
    own = Source.own(tokens, options["prompt_lookup_min"], options["prompt_lookup_max"])
    choice = best_match([own], lambda length: depth, MAX_MATCHES)
    return DraftTree.empty() if choice is None else choice.tree(budget)


def _sources(tree: DraftTree, w1: int, w2: int, lookup: Callable[[np.ndarray], trigram.Continuations]) -> np.ndarray:
    """The source of every node ([nodes]): looked up again, in one call, after its parent's state.

    Example: below context ``... 7 8``, nodes ``9`` (root child) and ``5`` (its
    child) come from the states ``(7, 8)`` and ``(8, 9)``.
    """
    above = np.zeros((tree.num_nodes, 2), np.int64)  # [nodes, 2] the state each node follows
    for i, parent in enumerate(tree.parents.tolist()):
        above[i] = (w1, w2) if parent == ROOT else (above[parent, 1], tree.tokens[parent])
    found = lookup(above)
    slot = np.argmax(found.table.tokens == tree.tokens[:, None], axis=1)  # [nodes] where each node's token is
    return np.where(found.from_corpus[np.arange(tree.num_nodes), slot], CORPUS, CONTEXT)
