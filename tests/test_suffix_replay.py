"""The offline replay of ``lookup_tree`` against ``suffix`` (benchmarks/suffix_replay.py) on planted histories.

Every figure below is worked out by hand from the module docstring's rules: the prefill
commits one token undrafted, each later step commits the accepted drafts and one more.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from benchmarks.suffix_replay import LookupTree, SuffixChain, available, losses, replay
from vllm_specbeam.core.budget import StepCost
from vllm_specbeam.core.config import parse

LINE = StepCost(0.018, 0.001)
#: the answer repeats the prompt, then ends with a new token
PROMPT = list(range(10, 18))
ANSWER = [*range(10, 18), 30]


def lookup(scope: str) -> LookupTree:
    """The drafter the figures below were worked out for: matches of 2 tokens or more, and the
    global scope as deep as its match is long."""
    extra = {"scope": "global", "depth_factor": 1.0} if scope == "global" else {}
    return LookupTree(parse({"method": "lookup_tree", "prompt_lookup_min": 2, **extra}).options, "cap", LINE)


def test_request_scope_steps_accepted_and_causes() -> None:
    result = replay(lookup("request"), [PROMPT], [ANSWER])
    # prefill 10; "17 10" unseen: no draft, 11; "10 11" drafts 12..15 (depth 4), all taken, +16;
    # one token left past 17: depth 1, 17 taken, +30
    assert (result.steps, result.accepted) == (4, 5)
    columns = [rec[1:5] + rec[7:] for rec in result.records]  # position, nodes, accepted, available, cause
    assert columns == [[1, 0, 0, 7, "no match"], [2, 4, 4, 6, "depth"], [7, 1, 1, 1, ""]]
    assert losses(result)["no match"] == (1, 7) and losses(result)["depth"] == (1, 2)


def test_global_scope_reads_the_earlier_request() -> None:
    other = [1, 2, 3, 4]
    result = replay(lookup("global"), [PROMPT, other], [ANSWER, ANSWER])
    # each request: no draft, then a 2-token match drafts 2 deep (depth_factor 1), then a
    # 5-token match 3 deep (the tokens left but one); the second request matches the first's text
    assert (result.steps, result.accepted) == (8, 10)
    assert [rec[3] for rec in result.records] == [0, 2, 3, 0, 2, 3]
    assert result.records[4][5] == 2  # its 2-token match came from the index (its own text has none)


def test_available_is_the_longest_match_best_continuation() -> None:
    earlier = [np.array([7, 8, 1, 2, 3, 4, 5])]
    context = np.array([9, 9, 8, 1, 2, 7, 8, 1])
    # longest suffix found before: "7 8 1" (3), followed by 2 3 4 5; "8 1" also follows with 2 in the context
    assert available(earlier, context, [2, 3, 4, 6]) == (3, 3)
    assert available([], context, [2, 3]) == (2, 1)  # "8 1" in its own text, then 2 (its end: 7 is not the answer)


needs_arctic = pytest.mark.skipif(
    importlib.util.find_spec("arctic_inference") is None, reason="arctic-inference is not installed"
)


@needs_arctic
def test_suffix_chain_grows_with_its_match() -> None:
    prompt = list(range(10, 30))
    result = replay(SuffixChain(), [prompt], [prompt])  # the answer repeats the prompt
    # max_spec_factor 1: a k-token match drafts k. Prefill 10; "10" (1) drafts 11, +12;
    # "10 11 12" (3) drafts 13..15, +16; 7 tokens draft 17..23, +24; 15 tokens draft 25..29
    # (and on): 4 taken, the tokens left but one, +29
    assert [rec[3] for rec in result.records] == [1, 3, 7, 4]
    assert (result.steps, result.accepted) == (5, 15)


@needs_arctic
def test_suffix_caches_the_whole_answer() -> None:
    suffix = SuffixChain()
    replay(suffix, [[1, 2, 3]], [[5, 6, 7, 8]])  # no drafts: prefill 5, then +6, +7, +8 alone
    suffix.cache.start_request("next", np.array([9], np.int32))
    suffix.cache.add_active_response("next", [6, 7])
    # the last step's token reached the response tree, as vLLM's proposer adds it
    assert suffix.cache.speculate("next", np.array([9, 6, 7], np.int32), max_spec_tokens=4).token_ids == [8]
