"""A draft model priced by the goodput controller: what ``mcsd`` and ``dsbd``'s chains share.

Before each step the runner hands the fitted prices (:meth:`PricedDraftModel.plan_step`). A
step's drafting starts a :class:`~vllm_specbeam.core.controller.StepLedger`
(:meth:`~PricedDraftModel.start_ledger`); :meth:`~PricedDraftModel.gated` drafts only for the
requests whose first level, valued by the acceptance learnt from their committed tokens, pays for
its share of the draft forward, catch-up included, spread over the steps it buys
(:class:`~vllm_specbeam.core.controller.DraftGate`); the method charges its levels to the
ledger as it grows them (:func:`~vllm_specbeam.core.controller.forwards_that_pay`), and the
ledger's tokens are what the controller's switch weighs (:attr:`~PricedDraftModel.expected_gain`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from vllm_specbeam.core.budget import StepBudget, TreeShape, path_values
from vllm_specbeam.core.controller import DraftGate, StepLedger, StepPrices
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.draft_runtime.base import DraftRuntime

#: drafts the trees of these requests, at most ``caps`` nodes each (``None``: the request's own)
DraftFn = Callable[[list[DraftRequest], list[int | None]], list[DraftTree]]


class PricedDraftModel:
    """Mixed in before a draft-model drafter's base class (see the module docstring)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)  # type: ignore[call-arg]  # the drafter's base class
        #: what the runner measured (:meth:`plan_step`); ``None``: drafting unpriced
        self.prices: StepPrices | None = None
        #: the draft's acceptance per depth and rank, learnt from the committed tokens
        self.values = StepBudget()
        self.gate = DraftGate()
        #: the last step's account (``None``: unpriced)
        self.ledger: StepLedger | None = None

    @property
    def cuts_to_step_cost(self) -> bool:
        return True

    def plan_step(self, prices: StepPrices) -> None:
        self.prices = prices

    def start_ledger(self) -> StepLedger | None:
        """This step's account, empty (``None`` before the runner priced a step)."""
        self.ledger = None if self.prices is None else StepLedger.of(self.prices)
        return self.ledger

    @property
    def probed(self) -> bool:
        ledger, prices = self.ledger, self.prices
        return ledger is not None and prices is not None and ledger.probed_alone(prices.batch_size)

    @property
    def expected_gain(self) -> float | None:
        ledger = self.ledger
        if ledger is None or ledger.unvalued or self.prices is None:
            return None
        return ledger.tokens - self.prices.batch_size

    @property
    def invested_seconds(self) -> float:
        return 0.0 if self.ledger is None else self.ledger.invested_seconds

    def gated(
        self,
        runtime: DraftRuntime,
        requests: list[DraftRequest],
        first_levels: Sequence[TreeShape | None],
        draft: DraftFn,
    ) -> list[DraftTree]:
        """``draft``'s trees, priced (a ledger started): only for the requests whose
        ``first_levels[k]`` pays for its share of the draft forward (``None``: a request drafted
        unpriced, always); a probe drafts one node. The others run no draft (``runtime.defer``)."""
        for request in requests:
            self.values.judge(request.req_id, request.token_ids)
        drafting, caps = list(range(len(requests))), list[int | None]([None] * len(requests))
        ledger = self.ledger
        if ledger is not None:
            gated = [k for k, shape in enumerate(first_levels) if shape is not None]
            # hopeful: a first level is valued only by the draft's tries, and a gate that refuses
            # on a low prior never tries it (a cold batch of 8 never drafted, at 0.45 against 0.85)
            rates = [self.values.rates(requests[k].req_id, hopeful=True) for k in gated]
            first = [path_values(first_levels[k], rate) for k, rate in zip(gated, rates)]  # type: ignore[arg-type]
            gains = [sum(v) * ledger.worth_of(requests[k].req_id) for k, v in zip(gated, first)]
            fed = [runtime.sync_rows(requests[k].req_id, requests[k].token_ids) for k in gated]
            left = [requests[k].tokens_left for k in gated]
            chosen = [gated[k] for k in self.gate.choose(ledger, gains, [len(v) for v in first], fed, left)]
            drafting = sorted(set(drafting) - set(gated) | set(chosen))
            caps = [1 if ledger.probing and k in chosen else None for k in drafting]
            runtime.defer([r.req_id for k, r in enumerate(requests) if k not in drafting])
        trees = [DraftTree.empty() for _ in requests]
        for k, tree in zip(drafting, draft([requests[k] for k in drafting], caps)):
            trees[k] = tree
            self.values.drafted(requests[k].req_id, tree, requests[k].token_ids.size)
        return trees

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        req_ids = list(req_ids)
        self.values.remove(req_ids)
        super().remove_requests(req_ids)  # type: ignore[misc]  # the drafter's base class
