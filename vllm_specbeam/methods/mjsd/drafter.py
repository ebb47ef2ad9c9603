"""MJSD drafting: the draft's beam search over joint likelihood, proposed with its ``log Q``.

Multi-token joint speculative decoding (Qin et al., arXiv 2407.09722; MTAD at
ICLR 2025), **lossy by design** in its default ``"verify": "joint"``
(:mod:`vllm_specbeam.methods.mjsd.verifier`). Per step and request the draft
runs beam search with ``beam_width`` beams for ``num_speculative_tokens``
depths, all requests in one draft forward per depth (dsbd's
:func:`~vllm_specbeam.methods.dsbd.drafter.draft_beams`), and the best
``num_beams_verified`` final beams are proposed as one tree with their prefix
joint probabilities (:func:`~vllm_specbeam.methods.mjsd.maths.beam_proposal`).
Beams are scored at the temperature the target's ``P`` is taken at (1 for
greedy requests); with ``draft_sampling`` sampled requests' beams are drawn
by beam sampling at the draft temperature instead.

``"verify": "block"`` is the lossless mode: one chain sampled from ``q``
(its argmax chain for greedy requests), verified by the exact rules.
Design and figures: docs/methods/mjsd.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from vllm_specbeam.core.config import Option, SpecbeamConfigError
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.draft_runtime.drafter import DRAFT_MODEL_OPTIONS, GREEDY_EPS, DraftModelDrafter, draft_temperature
from vllm_specbeam.methods.dsbd.drafter import BeamSample, DraftBeams, DraftBeamSearch, draft_beams
from vllm_specbeam.methods.mjsd.maths import beam_proposal


class MjsdDrafter(DraftModelDrafter):
    """Draft beam search proposals with their joint draft probabilities (see the module docstring)."""

    OPTIONS: ClassVar[dict[str, Option]] = {
        **DRAFT_MODEL_OPTIONS,
        "beam_width": Option(4, "beams of the draft's beam search (at most the engine's per request)", 1, 32),
        "threshold": Option(
            0.5,
            "tau: accept the longest drafted prefix with P(prefix) / Q(prefix) >= tau (joint mode; 0.5 as MTAD, "
            "the ICLR 2025 version; the arXiv version's 0.9 stays close to greedy)",
            0.0,
            1.0,
        ),
        "num_beams_verified": Option(
            1, "best final beams verified together as one tree; the best passing one is kept", 1, 32
        ),
        "draft_sampling": Option(False, "sampled requests draw their beams by beam sampling (MTAD) instead"),
        "verify": Option(
            "joint",
            "joint: the joint-likelihood rule (lossy: better than greedy); block: a sampled chain "
            "verified exactly (the target's own distribution)",
            choices=("joint", "block"),
        ),
    }
    CAPPED_BY_ENGINE: ClassVar[tuple[str, ...]] = ("beam_width",)

    @staticmethod
    def keeps_target_output(options: Mapping[str, Any]) -> bool:
        return False  # the joint threshold accepts what the target's own rule would not

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> None:
        if options["num_beams_verified"] > options["beam_width"]:
            raise SpecbeamConfigError(
                f"mjsd: num_beams_verified={options['num_beams_verified']} exceeds beam_width="
                f"{options['beam_width']}; verify at most beam_width beams or raise beam_width"
            )

    @staticmethod
    def draft_slots(options: Mapping[str, Any]) -> int:
        """Every beam of every depth but the last is fed to the draft."""
        return max(int(options["max_nodes"]), options["beam_width"] * (options["num_speculative_tokens"] - 1))

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        runtime = self.ready_runtime()
        widths = [[_width(r.options)] * r.options["num_speculative_tokens"] for r in requests]
        synced = runtime.sync_many([(r.req_id, r.token_ids, sum(w[:-1])) for r, w in zip(requests, widths)])
        beams = [None if logits is None else _start(r, w, logits) for r, w, logits in zip(requests, widths, synced)]
        draft_beams(runtime, [b for b in beams if b is not None], self.generator)
        return [DraftTree.empty() if b is None else _proposal(r, b) for r, b in zip(requests, beams)]


def _width(options: Mapping[str, Any]) -> int:
    return 1 if options["verify"] == "block" else int(options["beam_width"])


def _start(request: DraftRequest, widths: list[int], logits: torch.Tensor) -> DraftBeams:
    """Beam sampling (``draft_sampling`` or block chains, at the draft temperature) or beam search.

    The search scores beams at the temperature the target's ``P`` is taken
    at: the request's, or 1 for greedy requests (the rule needs real
    probabilities on both sides).
    """
    options = request.options
    temperature = draft_temperature(options, request.temperature)
    if temperature >= GREEDY_EPS and (options["draft_sampling"] or options["verify"] == "block"):
        return BeamSample(request.req_id, widths, logits, temperature, options)
    scale = request.temperature if request.temperature >= GREEDY_EPS else 1.0
    return DraftBeamSearch(request.req_id, widths, logits.unsqueeze(0), temperature=scale)


def _proposal(request: DraftRequest, beams: DraftBeams) -> DraftTree:
    options = request.options
    if options["verify"] == "block":  # one chain: exact rules, with its q rows when sampled
        rows = torch.cat(beams.draft_rows).numpy() if isinstance(beams, BeamSample) else None
        return DraftTree(np.asarray(beams.tokens, np.int64), np.asarray(beams.parents, np.int64), rows)
    return beam_proposal(
        beams.tokens,
        beams.parents,
        beams.node_scores,
        options["num_beams_verified"],
        options["max_nodes"],
        options["threshold"],
    )
