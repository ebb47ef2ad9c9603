"""Seeded sampled requests whose prompts are prefilled in chunks.

vLLM 0.32's runner rewinds such a request's generator after each partial
chunk, which a CPU generator cannot do: the engine died
(``RuntimeError: CPU Generator does not use offset``) with and without a
plugin method. The plugin's fix (adapter/cpu_generators.py) leaves those
generators out of the step, so a seeded request draws what it would have
drawn unchunked.
"""

from __future__ import annotations

import pytest
from conftest import MAX_MODEL_LEN, make_prompts
from specs import LOOKUP


@pytest.mark.parametrize("speculative_config", [None, LOOKUP], ids=["no-speculation", "lookup_tree"])
def test_seeded_requests_survive_chunked_prefill_and_sample_as_unchunked(engines, speculative_config) -> None:
    from vllm import SamplingParams

    prompts = make_prompts(10)  # 4 to 300 words: the long ones take several 64-token chunks
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True) for seed in range(10)]
    chunked = engines.get(speculative_config, max_num_batched_tokens=64, max_num_seqs=8)
    whole = engines.get(speculative_config)  # the session's engine: one step holds any prompt
    assert whole.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens >= MAX_MODEL_LEN
    outputs = {}
    for name, llm in [("chunked", chunked), ("whole", whole)]:
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(tokens) == 24 for tokens in outputs["chunked"])
    assert outputs["chunked"] == outputs["whole"]
    # the seeds matter: other seeds draw other tokens
    reseeded = [SamplingParams(temperature=1.0, seed=seed + 100, max_tokens=24, ignore_eos=True) for seed in range(10)]
    assert [o.outputs[0].token_ids for o in whole.generate(prompts, reseeded, use_tqdm=False)] != outputs["whole"]
