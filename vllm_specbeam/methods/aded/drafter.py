"""ADED: adaptive tri-gram drafting with Monte Carlo tree search, no draft model.

Each step, per request: the tri-grams committed since the last step raise
their weight in the request's overlay (see :mod:`vllm_specbeam.methods.aded.trigram`),
then an MCTS (see :mod:`vllm_specbeam.methods.aded.mcts`) below the last two tokens
builds the draft tree. The corpus matrix is optional: without one, drafts
come from the request's own prompt and output, like prompt lookup but with
a search over branches.

Adaptation counts each committed tri-gram once, when it is committed: a new
request's last ``adapt_window`` tokens (its whole prompt when there is no
corpus, since nothing else would inform the drafts), then the tokens each step
adds. The paper re-raises every tri-gram of the sliding 16-token window at
every step instead; counting once is ``O(new tokens)`` per step and does not
make a tri-gram's weight depend on how many tokens the steps around it
happened to accept.

The target's tokenizer comes in as the ``tokenizer`` *option* (a name or
path), not as a constructor argument: options are what travel from the front
end to the workers as plain JSON, and the engine can fill this one from the
target model's config before the drafter exists. It is only read when a
``trigram`` matrix is given, to refuse a matrix built with another vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import numpy as np

from vllm_specbeam.core.config import Option, SpecbeamConfigError
from vllm_specbeam.core.drafter import DraftRequest, TreeDrafter
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.methods.aded import trigram
from vllm_specbeam.methods.aded.mcts import SearchParams, search


@dataclass
class _RequestState:
    """A request's own tri-gram gains and how much of its context they cover."""

    overlay: trigram.Overlay = field(default_factory=trigram.Overlay)
    #: tokens whose tri-grams (the ones ending at them) have been observed
    observed: int = 0


def load_matrix(options: Mapping[str, Any]) -> trigram.TrigramMatrix:
    """The corpus matrix named by the options (memory-mapped), or an empty one."""
    path = options.get("trigram", "")
    if not path:
        return trigram.TrigramMatrix.empty()
    tokenizer = options.get("tokenizer", "")
    if not tokenizer:
        raise SpecbeamConfigError(
            "aded: option 'trigram' needs the target's tokenizer in option 'tokenizer' to check the matrix "
            "was built with the same vocabulary"
        )
    try:
        return trigram.load(path, tokenizer)
    except (OSError, ValueError) as error:
        raise SpecbeamConfigError(f"aded: {error}") from error


class AdedDrafter(TreeDrafter):
    """Tri-gram matrix + per-request adaptive overlays + MCTS draft trees."""

    OPTIONS: ClassVar[dict[str, Option]] = {
        "trigram": Option(
            "",
            "directory of a tri-gram matrix from `vllm-specbeam trigram build` "
            '("" = no corpus: draft from the prompt and the output alone)',
            per_request=False,
        ),
        "tokenizer": Option(
            "",
            "the target's tokenizer (name or path), to check the matrix was built with it; "
            "filled in from the target model",
            per_request=False,
        ),
        "iterations": Option(150, "MCTS iterations per draft tree", 1, 10_000),
        "num_paths": Option(24, "most-visited search paths merged into the draft tree", 1, 256),
        "adapt_window": Option(
            16,
            "tri-grams of the last this many tokens of a new request's context seed its "
            "weights (0 = the whole context; without a corpus the whole prompt is used); "
            "after that every committed tri-gram counts once",
            0,
            1 << 20,
        ),
        "adapt_step": Option(trigram.DEFAULT_ADAPT_STEP, "weight a tri-gram gains each time it is committed", 0.0, 1.0),
        "adapt_cap": Option(trigram.DEFAULT_ADAPT_CAP, "most weight a tri-gram can gain from adaptation", 0.0, 1.0),
        "global_update": Option(
            False,
            "adapt one matrix shared by all requests instead of this request's own "
            "(what a request learns then helps, or misleads, every later request)",
        ),
        "seed": Option(0, "seed of the MCTS roll-outs (drafts are reproducible per context length)", 0, 2**31 - 1),
    }

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.matrix = load_matrix(self.options)
        #: gains of every request that opted in to ``global_update``, read by all
        self.shared = trigram.Overlay()
        self._requests: dict[str, _RequestState] = {}

    @staticmethod
    def check_startup(options: Mapping[str, Any]) -> None:
        """The matrix opens and was built with the target's tokenizer."""
        load_matrix(options)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(request) for request in requests]

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        options = request.options
        tokens = np.asarray(request.token_ids, dtype=np.int64)
        state = self._observe(request.req_id, tokens, options)
        if tokens.size < 2:
            return DraftTree.empty()
        successors = partial(self.matrix.lookup, overlays=(self.shared, state.overlay), cap=options["adapt_cap"])
        params = SearchParams(
            iterations=options["iterations"],
            num_paths=options["num_paths"],
            depth=options["num_speculative_tokens"],
            max_nodes=options["max_nodes"],
        )
        rng = np.random.default_rng((options["seed"], tokens.size))
        return search(successors, int(tokens[-2]), int(tokens[-1]), params, rng)

    def _observe(self, req_id: str, tokens: np.ndarray, options: Mapping[str, Any]) -> _RequestState:
        """Add the tri-grams committed since this request's last step (only those)."""
        state = self._requests.get(req_id)
        if state is None or state.observed > tokens.size:  # new, or its context was cut back
            state = self._requests[req_id] = _RequestState(observed=self._seed_start(tokens.size, options))
        target = self.shared if options["global_update"] else state.overlay
        target.observe(tokens[max(0, state.observed - 2) :], options["adapt_step"], options["adapt_cap"])
        state.observed = tokens.size
        return state

    def _seed_start(self, num_tokens: int, options: Mapping[str, Any]) -> int:
        """``observed`` for a new request, so that its first observation covers the
        tri-grams inside its last ``adapt_window`` tokens (all of them without a corpus)."""
        window = options["adapt_window"]
        if window == 0 or self.matrix.num_keys == 0:
            return 0
        return max(0, num_tokens - window) + 2

    @property
    def live_requests(self) -> int:
        return len(self._requests)

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)
