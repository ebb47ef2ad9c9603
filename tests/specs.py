"""The speculative configs the tests share.

Each distinct config is one engine for the whole session (``conftest.Engines``),
so modules that test the same method ask for the same dict rather than a
near-copy of it.
"""

from __future__ import annotations

LOOKUP = {"method": "lookup_tree", "num_speculative_tokens": 4, "max_nodes": 12, "prompt_lookup_min": 1}
#: the per-step budget (``"max_nodes": "auto"``, the default)
LOOKUP_AUTO = {"method": "lookup_tree", "prompt_lookup_min": 1}
LOOKUP_GLOBAL = {"method": "lookup_tree", "num_speculative_tokens": 8, "max_nodes": 16, "scope": "global"}
ADED = {"method": "aded", "num_speculative_tokens": 3, "max_nodes": 12, "iterations": 40, "num_paths": 8}
ADED_AUTO = {**ADED, "max_nodes": "auto", "auto_max_nodes": 12}
#: draft-model methods: add ``"model"``
#: the draft alone (``"lookup"`` is ``"global"`` unless set: test_hybrid_lookup_engine's ``HYBRID``)
#: the paper's stopping rule (``"stop_threshold": "auto"``, the default, prices drafting by measured costs instead)
MCSD = {
    "method": "mcsd",
    "num_speculative_tokens": 4,
    "max_nodes": 14,
    "k_config": [2, 2],
    "lookup": "off",
    "stop_threshold": 0.5,
}
#: ``dsbd`` at one beam a depth: a draft chain, lossless, under the goodput controller
DSBD_CHAIN = {"method": "dsbd", "num_speculative_tokens": 3, "max_nodes": 12, "max_width": 1, "lookup": "off"}
