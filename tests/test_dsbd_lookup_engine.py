"""``dsbd`` with lookup branches (``"lookup": "global"``, issue #48) inside vLLM, at ``max_width: 1``.

Greedy output equals vLLM's without speculation (a width of one keeps one beam a depth,
lookup siblings or not: greedy decoding); both sources' nodes are verified and accepted,
and steps whose lookup branches fill the budget run no draft forward.
(The mixed depth's law, enumerated: tests/test_dsbd_lookup.py.)
"""

from __future__ import annotations

import pytest
from conftest import greedy, runner_stats, token_ids

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
    before = runner_stats(hybrid)
    assert token_ids(hybrid.generate(prompts, greedy(), use_tqdm=False)) == reference
    # one at a time, the longest prompts again: their answers are in the global index now
    again = [token_ids(hybrid.generate([p], greedy(), use_tqdm=False))[0] for p in prompts[7:]]
    assert again == reference[7:]
    after = runner_stats(hybrid)
    grown = {key: after[key] - before[key] for key in after}
    assert grown["nodes_lookup"] > 0 and grown["nodes_fill"] > 0, grown
    assert grown["accepted_lookup"] > 0 and grown["accepted_fill"] > 0, grown
    assert grown["nodes_lookup"] + grown["nodes_fill"] == grown["nodes"]
    assert grown["accepted_lookup"] + grown["accepted_fill"] == grown["accepted"]
    assert grown["draft_deferred"] > 0 and grown["steps_without_draft_forward"] > 0, grown
    # one beam a depth: every accepted depth kept exactly one
    assert grown["beam_width_sum"] == grown["beam_depths"] > 0, grown
