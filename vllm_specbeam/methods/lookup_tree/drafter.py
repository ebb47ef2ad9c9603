"""``lookup_tree``: prompt-lookup drafting that keeps *every* match.

vLLM's ``ngram`` method finds one earlier occurrence of the recent n-gram and
drafts its continuation as a chain. Text often continues an n-gram in more
than one way (a variable used in several statements, a repeated phrase with
different endings); keeping all continuations as one trie lets the target
accept whichever is right, for the same single verification pass.

With ``"scope": "global"`` the matches also come from the prompts and
outputs of the requests this engine finished before
(:mod:`vllm_specbeam.methods.lookup_tree.index`), counted with the request's
own. Which match length drafts is suffix decoding's rule
(:func:`~vllm_specbeam.core.lookup.best_match`). With
``"index_isolation": "salt"`` (the default) a request matches, and feeds, only
the finished requests with its ``cache_salt``; a request with ``"share": false``
is never indexed. Repeated text is worth deep drafts and novel text is not, so
the global scope drafts up to twice as deep as the matched n-gram is long
(``depth_factor``; vLLM's ``suffix`` drafts as deep), up to 24 tokens: a 3-token
match drafts 6 deep, a request repeating an earlier answer 24 deep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from vllm_specbeam.core.config import INDEX_ISOLATION, Option, SpecbeamConfigError
from vllm_specbeam.core.drafter import DraftRequest, TreeDrafter
from vllm_specbeam.core.lookup import LookupChoice, Source, best_match
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.methods.lookup_tree.index import SuffixIndex


class LookupTreeDrafter(TreeDrafter):
    """Draft the continuations of every earlier occurrence of the recent n-gram,
    merged into one trie, most frequent continuations first."""

    OPTIONS: ClassVar[dict[str, Option]] = {
        "prompt_lookup_min": Option(1, "shortest suffix n-gram to look up", 1, 64),
        "prompt_lookup_max": Option(5, "longest suffix n-gram to look up", 1, 64),
        "max_matches": Option(64, "most recent matches considered per step", 1, 4096),
        "scope": Option(
            "request",
            "request: draft from the request's own tokens; global: also from the prompts and outputs of "
            "requests this engine finished (drafts only: outputs never change)",
            choices=("request", "global"),
            per_request=False,
        ),
        "index_tokens": Option(
            1 << 18,
            "global scope: most tokens indexed, all salts together (the largest salt's oldest requests dropped first)",
            1,
            1 << 28,
            per_request=False,
        ),
        "index_isolation": INDEX_ISOLATION,
        "share": Option(True, "global scope: index this request's prompt and output for drafting others'"),
        "depth_factor": Option(
            0.0, "draft at most depth_factor x (matched n-gram length) tokens deep; 0: always the full depth", 0, 64
        ),
    }
    #: what ``"scope": "global"`` changes unless set: deep drafts, as deep as the match is long
    GLOBAL_DEFAULTS: ClassVar[dict[str, Any]] = {
        "num_speculative_tokens": 24,
        "auto_max_nodes": 48,
        "prompt_lookup_max": 24,
        "depth_factor": 2.0,
    }

    @classmethod
    def defaults_for(cls, user: Mapping[str, Any]) -> dict[str, Any]:
        if user.get("scope") != "global":
            return {}
        defaults = dict(cls.GLOBAL_DEFAULTS)
        # a smaller node budget or a longer minimum n-gram, set alone, lowers or raises its partner
        for size in ("max_nodes", "auto_max_nodes"):
            if isinstance(user.get(size), int):
                defaults["num_speculative_tokens"] = min(defaults["num_speculative_tokens"], user[size])
        if isinstance(user.get("prompt_lookup_min"), int):
            defaults["prompt_lookup_max"] = max(defaults["prompt_lookup_max"], user["prompt_lookup_min"])
        return defaults

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> None:
        if options["prompt_lookup_min"] > options["prompt_lookup_max"]:
            raise SpecbeamConfigError(
                f"prompt_lookup_min={options['prompt_lookup_min']} must not exceed "
                f"prompt_lookup_max={options['prompt_lookup_max']}"
            )

    @staticmethod
    def salted_index(options: Mapping[str, Any]) -> bool:
        return options["scope"] == "global" and options["index_isolation"] == "salt"

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.index = SuffixIndex(self.options["index_tokens"]) if self.options["scope"] == "global" else None
        self.salted = self.salted_index(self.options)

    @property
    def learns_across_requests(self) -> bool:
        return self.index is not None

    @property
    def state_bytes(self) -> int:
        return 0 if self.index is None else self.index.nbytes

    @property
    def index_stats(self) -> dict[str, int | list[int]]:
        if self.index is None:
            return {}
        return {f"index_{key}": value for key, value in dataclasses.asdict(self.index.stats()).items()}

    def _salt(self, request: DraftRequest) -> str | None:
        """The index partition ``request`` reads and feeds: its salt's, or the one shared by all."""
        return request.cache_salt if self.salted else None

    def finished(self, requests: list[DraftRequest]) -> None:
        assert self.index is not None  # asked only when learns_across_requests
        for request in requests:
            if request.options["share"]:
                self.index.add(self._salt(request), request.token_ids)

    def forget_finished(self) -> None:
        if self.index is not None:
            self.index = SuffixIndex(self.index.capacity)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(request) for request in requests]

    def choose(self, request: DraftRequest) -> LookupChoice | None:
        """The match that drafts for ``request``: :func:`best_match` over its own tokens (source
        0) and, in the global scope, its partition of the index (source 1)."""
        opts = request.options
        tokens = request.token_ids
        low, high = opts["prompt_lookup_min"], opts["prompt_lookup_max"]
        sources = [Source.own(tokens, low, high)]
        partition = None if self.index is None else self.index.partition(self._salt(request))
        if partition is not None:
            sources.append(partition.source(tokens, low, high))
        return best_match(sources, lambda length: self._depth(opts, length), opts["max_matches"])

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        choice = self.choose(request)
        if choice is None:
            return DraftTree.empty()
        return choice.tree(request.options["max_nodes"])

    @staticmethod
    def _depth(opts: Mapping[str, Any], length: int) -> int:
        """How deep a ``length``-token match drafts (a 3-token match at factor 2: at most 6)."""
        depth = opts["num_speculative_tokens"]
        return min(depth, max(1, int(opts["depth_factor"] * length))) if opts["depth_factor"] > 0 else depth
