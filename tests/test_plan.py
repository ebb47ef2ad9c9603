"""The comparison's plan, frozen: engines, rows, settings and their order for a set of command lines.

``tests/data/plan_frozen.json`` holds what ``benchmarks/plan.py`` planned before its rows became a
registry of builders (issue #61), key order included (it reaches ``result.json``); a change of plan
shows here as a diff. The behaviour each row stands for is tested in ``tests/test_benchmarks.py``.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks import plan

FROZEN = Path(__file__).parent / "data" / "plan_frozen.json"

#: every row a command line can name (the plugin methods' and their extra rows)
ROWS = (
    "none", "ngram", "draft_model", "suffix", "beam_search", "lookup_tree", "aded", "dsbd", "mcsd", "mjsd",
    plan.SPEC_BEAM, plan.DSBD_CHAIN, plan.MCSD_STOP, plan.LOOKUP_GLOBAL, plan.MCSD_LOOKUP, plan.DSBD_CHAIN_LOOKUP,
)  # fmt: skip
#: every optional model and file given
EVERYTHING = {"draft": "/d", "trigram": "/m", "stop_model": "/s", "draft_vocab": "/v"}


def cases() -> dict[str, dict[str, Any]]:
    """Case name -> PlanOptions' arguments (``suffix``: whether arctic-inference is installed)."""
    found: dict[str, dict[str, Any]] = {"default": {}, "default-suffix": {"suffix": True}}
    for sweep in sorted(plan.SWEEPS):
        found[f"all-{sweep}"] = {"sweep": sweep, **EVERYTHING}
        found[f"all-{sweep}-suffix"] = {"sweep": sweep, "draft": "/d", "suffix": True}
        found[f"all-{sweep}-no-draft"] = {"sweep": sweep, "trigram": "/m"}
    found["all-options"] = {
        **EVERYTHING, "draft_dtype": "bfloat16", "beam_widths": (1, 3), "beam_depths": (2, None),
        "draft_ks": (2, 4), "mcsd_depths": (4, 8),
    }  # fmt: skip
    for row in ROWS:
        found[f"{row}-alone"] = {"methods": (row,), "sweep": "full", **EVERYTHING, "suffix": True}
        found[f"{row}-no-draft"] = {"methods": ("none", row), "sweep": "quick"}
    for row in ("dsbd", "mcsd", "mjsd", plan.DSBD_CHAIN, plan.MCSD_STOP, plan.MCSD_LOOKUP, plan.DSBD_CHAIN_LOOKUP):
        found[f"{row}+vocab-alone"] = {"methods": (row + plan.VOCAB_SUFFIX,), **EVERYTHING}
    found["subset-vocab-only"] = {"methods": ("draft_model", plan.MCSD_STOP + plan.VOCAB_SUFFIX), **EVERYTHING}
    found["subset-beams"] = {"methods": ("none", plan.SPEC_BEAM, "beam_search"), "draft": "/d", "beam_depths": (3, 5)}
    found["subset-chains"] = {"methods": ("draft_model", plan.DSBD_CHAIN), "draft": "/d", "draft_ks": (5, 7)}
    found["subset-twins"] = {
        "methods": (plan.MCSD_LOOKUP, plan.DSBD_CHAIN_LOOKUP), "draft": "/d", "sweep": "none", "draft_ks": (3, 5)
    }  # fmt: skip
    found["subset-mixed"] = {
        "methods": ("ngram", "aded", plan.LOOKUP_GLOBAL, "mcsd", plan.DSBD_CHAIN + plan.VOCAB_SUFFIX),
        **EVERYTHING,
        "mcsd_depths": (6, 10),
    }
    return found


def planned(options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``plan()``'s answer to ``options`` as JSON data, with arctic-inference installed or not."""
    options = dict(options)
    installed = options.pop("suffix", False)
    find_spec = importlib.util.find_spec

    def arctic_as_wanted(name: str, *args: Any) -> Any:
        if name == "arctic_inference":
            return find_spec("json") if installed else None
        return find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", arctic_as_wanted)
    status, engines = plan.plan(plan.PlanOptions(**options))
    answer = {"status": {name: asdict(s) for name, s in status.items()}, "engines": [asdict(e) for e in engines]}
    return json.loads(json.dumps(answer))


@pytest.mark.parametrize("case", sorted(cases()))
def test_plan_is_the_frozen_one(case, monkeypatch):
    expected = json.loads(FROZEN.read_text())[case]
    actual = planned(cases()[case], monkeypatch)
    assert actual == expected
    assert json.dumps(actual) == json.dumps(expected)  # key order too


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"methods": ("nope",)}, r"unknown method\(s\) \['nope'\].*--methods"),
        ({"methods": ("mcsd+vocab",), "draft": "/d"}, r"\['mcsd\+vocab'\] need --draft-vocab"),
        ({"methods": ("lookup_tree+vocab",), "draft_vocab": "/v"}, "name the method without"),
        ({"methods": ("draft_model+vocab",), "draft": "/d", "draft_vocab": "/v"}, "name the method without"),
    ],
)
def test_plan_names_what_is_wrong_and_the_fix(options, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        planned(options, monkeypatch)
