"""Patch 8: seeded requests survive a chunked prefill on CPU, with or without a plugin method.

vLLM 0.32.0's runner samples a token for every request of a step, also for
one whose prompt is only partly in (a chunked prefill); it then discards that
token and rewinds the request's own generator by the Philox offset of one
draw (``gen.set_offset(gen.get_offset() - 4)`` in ``_bookkeeping_sync``,
vllm/v1/worker/gpu_model_runner.py). A CPU generator (Mersenne Twister) has no
offset: the call raises ``RuntimeError: CPU Generator does not use offset``
and the engine dies with every request in flight. Any seeded sampled request
whose prompt does not fit in one step triggers it (2,000 seeded requests in
one ``generate``, or a busy server).

On CPU the plugin keeps those requests' generators out of the step instead:
their discarded token is drawn from the global generator, their own is never
advanced, so there is nothing to rewind, and a seeded request draws the same
numbers whether its prompt was chunked or not, which is what the rewind
achieves on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def sample_tokens(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``GPUModelRunner.sample_tokens`` (sampling and the bookkeeping that would
    rewind) without the generators of the requests whose token is discarded."""

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators: dict[int, Any] = self.input_batch.generators  # by batch row; the sampler reads this dict
        discarded = np.flatnonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])
        held = {row: generators.pop(row) for row in map(int, discarded) if row in generators}
        try:
            return stock(self, *args, **kwargs)
        finally:
            generators.update(held)

    return sample_tokens
