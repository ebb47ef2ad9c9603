"""The small interface every drafting strategy implements.

Modelled on vLLM's ``v1/spec_decode`` proposers: one class per file, created
once per worker, asked once per engine step for the drafts of every running
request. Unlike vLLM's proposers a drafter returns a :class:`DraftTree` per
request, which may be a chain, a tree or a forest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from vllm_specbeam.core.controller import StepPrices
from vllm_specbeam.core.tree import DraftTree


@dataclass
class DraftRequest:
    """What a drafter may read about one request at one step."""

    req_id: str
    #: every committed token so far: prompt then generated (the root is the last one)
    token_ids: np.ndarray
    #: the strategy's options after per-request overrides (``SamplingParams.extra_args``)
    options: Mapping[str, Any]
    #: temperature of the request (0 = greedy)
    temperature: float = 0.0
    #: vLLM's ``cache_salt`` of the request (``None``: unsalted): a cross-request index shares text
    #: only between requests with the same salt, as vLLM's prefix cache shares blocks
    cache_salt: str | None = None
    #: the tokens it may still generate by its ``max_tokens`` (``None``: no limit of its own)
    tokens_left: int | None = None


class TreeDrafter(ABC):
    """Proposes one draft tree per request per step.

    ``options`` are the validated, engine-wide defaults of the strategy
    (see :mod:`vllm_specbeam.core.config`); per-request values arrive with each
    :class:`DraftRequest`.
    """

    #: per-request options that may only be lowered, like depth and node budget:
    #: engine-wide sizes (KV slots reserved for drafting) follow their engine values
    CAPPED_BY_ENGINE: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    @staticmethod
    def defaults_for(user: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults that depend on what the user chose (``lookup_tree``'s global scope
        drafts deeper); options the user set are never changed."""
        return {}

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> None:
        """Raise ``SpecbeamConfigError`` for option values that do not go
        together. Runs at start-up and for every request's overrides, so it
        must be cheap."""

    @staticmethod
    def keeps_target_output(options: Mapping[str, Any]) -> bool:
        """Whether these options keep the target's output: greedy decoding's tokens, the target's
        law when sampling. Only then may the goodput controller switch drafting off under load (a
        lossy method's drafts are part of what its output means)."""
        return True

    @staticmethod
    def salted_index(options: Mapping[str, Any]) -> bool:
        """Whether these engine-wide options give a cross-request index partitioned by
        :attr:`DraftRequest.cache_salt` (the engine must then carry each request's salt to it)."""
        return False

    @staticmethod
    def check_startup(options: Mapping[str, Any]) -> None:
        """Raise ``SpecbeamConfigError`` when the engine-wide options name files
        or models that cannot serve (missing, other vocabulary). Runs once, in
        the front end, before the engine starts."""

    def load_model(self, target_model: Any) -> None:
        """Called once the target is loaded (draft-model drafters get the engine's draft through
        ``use_runtime`` instead)."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """One tree per request (``DraftTree.empty()`` for no draft this step).

        A tree may hold at most ``options["max_nodes"]`` nodes and reach at most
        ``options["num_speculative_tokens"]`` deep.
        """

    @property
    def cuts_to_step_cost(self) -> bool:
        """Whether the drafter cuts its trees by what a step costs (:meth:`plan_step`): the runner then
        times its steps, as for ``"max_nodes": "auto"``, and its draft model's forwards."""
        return False

    def plan_step(self, prices: StepPrices) -> None:
        """Before :meth:`propose`, when :attr:`cuts_to_step_cost`: the step's requests and the fitted
        seconds of a step by rows and of a draft forward by rows (``None`` until measured)."""

    @property
    def probed(self) -> bool:
        """Whether the last :meth:`propose` drafted only a probe: a draft that did not pay, tried
        so that its value is learnt (the switch judges the step after it)."""
        return False

    @property
    def expected_gain(self) -> float | None:
        """The tokens the last :meth:`propose`'s trees are expected to add to the step, when it
        valued them all (:meth:`plan_step`); ``None`` when it did not. The runner weighs them
        against the step's rows and the drafting's seconds (the goodput controller's switch)."""
        return None

    @property
    def invested_seconds(self) -> float:
        """Seconds of the last :meth:`propose`'s drafting spent for the steps after it (a draft's
        catch-up, :func:`~vllm_specbeam.core.controller.catch_up_rows`): the switch judges the
        step without them."""
        return 0.0

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Free per-request state: the request finished, was aborted or preempted."""

    @property
    def learns_across_requests(self) -> bool:
        """Whether :meth:`finished` wants finished requests' tokens (the runner skips collecting them if not)."""
        return False

    def finished(self, requests: list[DraftRequest]) -> None:
        """Finished requests, each with its whole token sequence (prompt, then output) and its options."""

    def forget_finished(self) -> None:
        """Forget the text :meth:`finished` gave (a newly started engine's state): e.g. before
        timing a workload again, whose earlier run's outputs would otherwise be drafted."""

    @property
    def state_bytes(self) -> int:
        """Bytes the drafter keeps across requests (``lookup_tree``'s global index), bounded by its options."""
        return 0

    @property
    def index_stats(self) -> dict[str, int | list[int]]:
        """What its cross-request index holds now, for the runner's stats (empty without one): partitions,
        the largest ones' tokens, sequences evicted so far."""
        return {}

    @property
    def live_requests(self) -> int:
        """Requests whose state this drafter holds now (what :meth:`remove_requests` frees)."""
        return 0
