"""The tree runner's counters: one typed object the runner owns, read as plain stats.

Only the runner's parts write its fields; the in-worker draft reports through
:meth:`TreeCounts.record_draft`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_specbeam.core.budget import StepCost

#: key of :attr:`.runner.TreeRunnerMixin.tree_stats` for the drafter's cross-request memory
STATE_BYTES = "drafter_state_bytes"


@dataclass
class TreeCounts:
    """Running totals of one runner (read through :attr:`.runner.TreeRunnerMixin.tree_stats`)."""

    #: verified trees (vLLM's padding rows are not trees), their nodes, and the accepted nodes
    trees: int = 0
    nodes: int = 0
    accepted: int = 0
    #: accepted nodes that are not their parent's first child (a chain would have missed them)
    accepted_off_first_branch: int = 0
    #: the verified trees' depths, summed (mean depth drafted = depth_sum / trees)
    depth_sum: int = 0
    kv_moves: int = 0
    draft_seconds: float = 0.0
    #: forwards of an in-worker draft model (drafting and catching up on committed tokens), and their rows
    draft_forwards: int = 0
    draft_rows: int = 0
    #: lookup branches with a draft model (``"lookup"``): requests whose step ran no draft forward
    #: (``defer``), decode steps in which the draft ran none at all, and the verified trees' nodes and
    #: accepted nodes by source (kinds below ``FILL_KIND``: lookup branches; ``FILL_KIND``: what fills them)
    draft_deferred: int = 0
    steps_without_draft_forward: int = 0
    nodes_lookup: int = 0
    accepted_lookup: int = 0
    nodes_fill: int = 0
    accepted_fill: int = 0
    #: verified nodes that continue other requests' text (a cross-request index: ``DraftTree.from_index``),
    #: and those accepted: what finished requests drafted for later ones
    nodes_from_index: int = 0
    accepted_from_index: int = 0
    #: committed tokens whose draft K/V an in-worker draft kept from its tree (not fed again),
    #: and how many of those it moved to their committed slot (accepted nodes off the first branch)
    draft_kv_kept: int = 0
    draft_kv_moves: int = 0
    preempted: int = 0
    #: sampled single-chain drafts verified as a block
    block_verified: int = 0
    #: beam rules: beams kept, summed over accepted depths (mean width = sum / depths)
    beam_width_sum: int = 0
    beam_depths: int = 0
    #: lossy rules (``mjsd``'s joint rule): accepted drafts that were not the target's argmax
    accepted_off_argmax: int = 0
    #: the step budget (``"max_nodes": "auto"``): requests asked to draft, requests sitting a
    #: step out, nodes their drafters proposed, nodes kept (the rest were pruned)
    budget_asked: int = 0
    budget_idle: int = 0
    budget_drafted: int = 0
    budget_kept: int = 0
    #: the goodput controller (exact methods): decode steps after which drafts were asked for,
    #: those the whole batch skipped (vLLM's plain step: nothing drafted, verified or fed to a
    #: draft), and the steps that asked again after such a rest
    steps: int = 0
    steps_off: int = 0
    steps_probed: int = 0
    #: decode steps of a draining batch (no request joined for a while), where the step budget values
    #: each request's tokens by what they save of the batch's last steps (``core/drain.py``)
    steps_draining: int = 0
    #: decode steps verifying a tree that branches (its rows off the first branch need the tree
    #: mask; the rest verified chains alone)
    steps_branched: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)

    def record_draft(self, deferred: int = 0, kv_kept: int = 0, kv_moves: int = 0) -> None:
        """What an in-worker draft did this step: requests it deferred, committed tokens whose
        draft K/V it kept, and how many of those it moved to their committed slot."""
        self.draft_deferred += deferred
        self.draft_kv_kept += kv_kept
        self.draft_kv_moves += kv_moves


def cost_stats(prefix: str, cost: StepCost | None) -> dict[str, float]:
    """A fitted line as stats: ``prefix_intercept_s``, ``_per_row_s``, ``_knee_rows``, ``_bend_s``
    (each row past ``knee`` rows costs ``per_row + bend``); none before it was fitted."""
    if cost is None:
        return {}
    values = {"intercept_s": cost.intercept, "per_row_s": cost.slope, "knee_rows": cost.knee, "bend_s": cost.bend}
    return {f"{prefix}_{name}": value for name, value in values.items()}


def lines_stats(lines: Mapping[str, StepCost | None]) -> dict[str, float]:
    """Fitted lines by stats prefix as stats (:func:`cost_stats`), those fitted so far."""
    return {key: value for prefix, cost in lines.items() for key, value in cost_stats(prefix, cost).items()}
