"""``lookup_tree``: prompt-lookup drafting that keeps *every* match.

vLLM's ``ngram`` method finds one earlier occurrence of the recent n-gram and
drafts its continuation as a chain. Text often continues an n-gram in more
than one way (a variable used in several statements, a repeated phrase with
different endings); keeping all continuations as one trie lets the target
accept whichever is right, for the same single verification pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from vllm_specbeam.core.config import Option, SpecbeamConfigError
from vllm_specbeam.core.drafter import DraftRequest, TreeDrafter
from vllm_specbeam.core.tree import DraftTree


def match_ends(tokens: np.ndarray, min_n: int, max_n: int) -> np.ndarray:
    """End indices of the earlier occurrences of the longest suffix n-gram.

    Looks for the suffix of length ``n`` for the largest ``n`` in
    ``[min_n, max_n]`` that occurs earlier, and returns the index of the last
    token of every such occurrence, most recent first. Vectorised: candidates
    are the earlier positions of the last token, extended backwards together.
    """
    length = tokens.size
    if length < min_n + 1:
        return np.zeros(0, np.int64)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    matched = np.ones(ends.size, np.int64)
    alive = np.ones(ends.size, bool)
    for k in range(1, max_n):
        if k >= length:
            break
        ok = alive & (ends - k >= 0)
        ok[ok] = tokens[ends[ok] - k] == tokens[-1 - k]
        alive = ok
        matched += alive
    best = int(min(matched.max(initial=0), max_n))
    if best < min_n:
        return np.zeros(0, np.int64)
    return ends[matched >= best][::-1]


class LookupTreeDrafter(TreeDrafter):
    """Draft the continuations of every earlier occurrence of the recent n-gram,
    merged into one trie, most frequent continuations first."""

    OPTIONS: ClassVar[dict[str, Option]] = {
        "prompt_lookup_min": Option(2, "shortest suffix n-gram to look up", 1, 64),
        "prompt_lookup_max": Option(5, "longest suffix n-gram to look up", 1, 64),
        "max_matches": Option(64, "most recent matches considered per step", 1, 4096),
    }

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> None:
        if options["prompt_lookup_min"] > options["prompt_lookup_max"]:
            raise SpecbeamConfigError(
                f"prompt_lookup_min={options['prompt_lookup_min']} must not exceed "
                f"prompt_lookup_max={options['prompt_lookup_max']}"
            )

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(request) for request in requests]

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        opts = request.options
        tokens = request.token_ids
        ends = match_ends(tokens, opts["prompt_lookup_min"], opts["prompt_lookup_max"])[: opts["max_matches"]]
        depth = opts["num_speculative_tokens"]
        paths = [tokens[end + 1 : end + 1 + depth] for end in ends]
        paths = [p for p in paths if p.size]
        if not paths:
            return DraftTree.empty()
        # Equal weights: a node's weight is how many matches continue through it;
        # ties go to the most recent match (paths are listed most recent first).
        return DraftTree.from_weighted_paths(paths, np.ones(len(paths)), opts["max_nodes"])
