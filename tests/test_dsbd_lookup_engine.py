"""``dsbd`` with lookup branches (``"lookup": "global"``, issue #48) inside vLLM, at ``max_width: 1``.

Greedy output equals vLLM's without speculation (a width of one keeps one beam a depth,
lookup siblings or not: greedy decoding); both sources' nodes are verified and accepted,
and steps whose lookup branches fill the budget run no draft forward.
(The mixed depth's law, enumerated: tests/test_dsbd_lookup.py.)
"""

from __future__ import annotations

import pytest
from test_hybrid_lookup_engine import assert_greedy_exact_with_both_sources

#: a chain of the draft's (``max_width`` 1, 4 deep) below lookup branches up to 8 deep, 8 nodes a
#: tree: one full lookup branch leaves the draft nothing, and it runs no forward that step
DSBD_LOOKUP = {
    "method": "dsbd",
    "num_speculative_tokens": 4,
    "max_nodes": 8,
    "max_width": 1,
    "lookup": "global",
    "lookup_depth": 8,
}


@pytest.fixture(scope="module")
def hybrid(engines, near_draft):
    config = {**DSBD_LOOKUP, "model": near_draft}
    engines.stop(config)  # a fresh index: nothing of the prompts learnt by an earlier module
    yield engines.get(config)
    engines.stop(config)


def test_greedy_equals_no_speculation_and_both_sources_are_accepted(hybrid, prompts, reference) -> None:
    grown = assert_greedy_exact_with_both_sources(hybrid, prompts, reference)
    # one beam a depth: every accepted depth kept exactly one
    assert grown["beam_width_sum"] == grown["beam_depths"] > 0, grown
