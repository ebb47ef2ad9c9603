"""Which requests draft in a step, with what options, and how much of their trees the step keeps.

Pure functions of the batch as the runner reads it (no engine): the runner's
drafting step (:mod:`.drafting`) feeds them vLLM's batch and applies what they
decide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_specbeam.adapter.engine_config import CACHE_SALT_KEY
from vllm_specbeam.core.config import AUTO, DEPTH_OPTIONS, SpecbeamConfig, node_cap
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import DraftTree

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams

#: ``draft_cap(req_id, cap)``: the nodes the step budget lets a ``"max_nodes": "auto"`` request draft (0: none)
DraftCap = Callable[[str, int], int]


def request_supports_trees(params: SamplingParams) -> bool:
    """Whether a request's target distribution can be verified as a tree.

    Temperature, top-k and top-p are applied per row exactly as vLLM does.
    Penalties, min-p, logit bias, bad words, min-tokens and structured output
    are applied by vLLM depending on the tokens before each row (or not at all
    on its speculative path), which a tree does not have in one sequence: such
    requests decode without speculation (one token per step), exactly.
    """
    return (
        params.min_p == 0.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.logit_bias
        and not params.allowed_token_ids
        and not params.bad_words
        and not params.min_tokens
        and params.thinking_token_budget is None
        and params.structured_outputs is None
    )


@dataclass(frozen=True)
class RequestArgs:
    """What a request's ``SamplingParams.extra_args`` hold for the drafter."""

    #: the plugin's options, as the request sets them
    overrides: dict[str, Any] | None
    #: its ``cache_salt``, which the plugin's scheduler put there (adapter/scheduler.py)
    cache_salt: str | None


def request_args(params: SamplingParams) -> RequestArgs:
    """``params.extra_args`` split into the request's options and its ``cache_salt``."""
    extra = params.extra_args
    if not extra or CACHE_SALT_KEY not in extra:
        return RequestArgs(extra, None)
    return RequestArgs({k: v for k, v in extra.items() if k != CACHE_SALT_KEY}, extra[CACHE_SALT_KEY])


def finished_request(req_id: str, state: Any, config: SpecbeamConfig) -> DraftRequest | None:
    """A finished request's whole sequence and options (``state``: the runner's ``CachedRequestState``,
    ``None`` if gone), for a drafter that learns across requests; ``None`` for no text request."""
    params = None if state is None else state.sampling_params
    if state is None or params is None or state.prompt_token_ids is None:
        return None  # not a text request (pooling, prompt embeddings)
    tokens = np.asarray([*state.prompt_token_ids, *state.output_token_ids], np.int64)
    args = request_args(params)
    return DraftRequest(req_id, tokens, config.with_overrides(args.overrides), params.temperature, args.cache_salt)


@dataclass(frozen=True)
class BatchRequest:
    """One request of the batch, as the drafting step reads it after a step."""

    req_id: str
    #: its row in vLLM's input batch
    batch_index: int
    params: SamplingParams | None
    #: tokens generated so far
    num_output_tokens: int
    #: every committed token: prompt then generated
    token_ids: np.ndarray  # [num_tokens]
    #: the step committed tokens for it (vLLM's ``sampled_token_ids`` row is not empty)
    sampled: bool


@dataclass
class DraftAsk:
    """The requests a step asks its drafter for trees (:func:`requests_to_draft`)."""

    requests: list[DraftRequest] = field(default_factory=list)
    #: each one's index in the batch, and whether its nodes are the budget's to choose (``"auto"``)
    batch_indices: list[int] = field(default_factory=list)
    automatic: list[bool] = field(default_factory=list)
    #: requests the budget sat out this step (their drafts have not paid)
    sitting_out: int = 0


def useful_depth(max_tokens: int | None, num_output_tokens: int) -> int:
    """The deepest draft a step could still keep.

    A step commits the accepted drafts and one target token: with 5 tokens left to
    generate, drafts past depth 4 could never be kept, so none are drafted.
    """
    return (max_tokens or 1 << 62) - num_output_tokens - 1


def tokens_left(request: BatchRequest, max_model_len: int) -> int | None:
    """The tokens ``request`` may still generate by its own ``max_tokens``; ``None`` when only the
    model's length bounds it (vLLM's server sets ``max_tokens`` to the room left when a request
    sets none)."""
    params = request.params
    if params is None or params.max_tokens is None:
        return None
    left = params.max_tokens - request.num_output_tokens
    return left if left < max_model_len - request.token_ids.size else None


def requests_to_draft(
    batch: Sequence[BatchRequest], config: SpecbeamConfig, draft_cap: DraftCap | None, max_model_len: int
) -> DraftAsk:
    """The requests whose drafter is asked this step, with their options for it: those that
    decode with trees and have tokens left to draft, less those the budget sits out."""
    asked = DraftAsk()
    for request in batch:
        params = request.params
        if not request.sampled or params is None or not request_supports_trees(params):
            continue
        depth = useful_depth(params.max_tokens, request.num_output_tokens)
        if depth < 1:  # finished, or only the target's own token left
            continue
        args = request_args(params)
        options = config.with_overrides(args.overrides)
        for key in DEPTH_OPTIONS:  # no draft past max_tokens: the lookup's branches may go deeper than the draft's
            if key in options and depth < options[key]:
                options[key] = depth
        # Under an automatic engine a request's number is its cap, never a fixed tree: a request
        # may lower the budget but not take its batch out of the controller's hands.
        auto = AUTO in (options["max_nodes"], config.options["max_nodes"])
        if auto:
            assert draft_cap is not None  # AUTO is an option of prunable methods only
            options["max_nodes"] = draft_cap(request.req_id, node_cap(options))
            if options["max_nodes"] == 0:  # sitting this step out: its drafts have not paid
                asked.sitting_out += 1
                continue
        asked.requests.append(
            DraftRequest(
                request.req_id,
                request.token_ids,
                options,
                params.temperature,
                args.cache_salt,
                tokens_left(request, max_model_len),
            )
        )
        asked.batch_indices.append(request.batch_index)
        asked.automatic.append(auto)
    return asked


def clip_to_room(tree: DraftTree, num_tokens: int, max_model_len: int) -> DraftTree:
    """``tree`` cut to the KV slots left below ``max_model_len`` after ``num_tokens`` committed
    tokens: every node needs a slot, and the step's own target token one more."""
    return tree.truncate(max(0, min(tree.num_nodes, max_model_len - num_tokens - 1)))


@dataclass(frozen=True)
class AutomaticTrees:
    """The trees the step budget chooses nodes of (``"max_nodes": "auto"``), and the rows the others take."""

    #: their positions among the step's trees
    chosen: list[int]
    #: nodes of the trees drafted with a fixed ``max_nodes`` (the budget prices them, never cuts them)
    fixed_rows: int


def automatic_trees(trees: Sequence[DraftTree], automatic: Sequence[bool]) -> AutomaticTrees:
    """Which of ``trees`` the budget cuts, and the rows the fixed ones already take."""
    chosen = [k for k, auto in enumerate(automatic) if auto]
    return AutomaticTrees(chosen, sum(tree.num_nodes for tree, auto in zip(trees, automatic) if not auto))


def budget_gain(automatic: Sequence[bool], kept_value: float) -> float | None:
    """The tokens this step's trees are expected to add, by the step budget: its kept nodes'
    ``kept_value`` when every tree was ``"auto"``; ``None`` when some tree was drafted unvalued
    (a fixed ``max_nodes``)."""
    if not any(automatic):  # nothing asked of the budget: nothing drafted, or fixed trees
        return None if automatic else 0.0
    return kept_value if all(automatic) else None
