"""End to end: sampling with a tree method keeps the target's distribution.

Many seeded requests are sampled with and without speculation; the joint
distribution of the 2nd and 3rd generated tokens (the first ones that go
through tree verification: the 1st comes from the prefill step) must be the
same. Two-sample chi-square test of homogeneity at significance 0.001, with
categories expected fewer than 5 times pooled into one. The test must also
see that trees were drafted and accepted, or it would prove nothing.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import make_prompts
from test_lookup_tree_engine import LOOKUP, runner_stats, token_ids

ADED = {"method": "aded", "num_speculative_tokens": 3, "max_nodes": 12, "iterations": 40, "num_paths": 8}
NUM_SAMPLES = 600
ALPHA = 1e-3


def chi_square_homogeneity(a: Counter, b: Counter) -> float:
    """p-value that two samples come from one categorical distribution."""
    total_a, total_b = sum(a.values()), sum(b.values())
    pooled = a + b
    keys = [k for k in pooled if pooled[k] * min(total_a, total_b) / (total_a + total_b) >= 5]
    rest = [k for k in pooled if k not in keys]
    table = torch.tensor(
        [[a[k] for k in keys] + [sum(a[k] for k in rest)], [b[k] for k in keys] + [sum(b[k] for k in rest)]],
        dtype=torch.float64,
    )
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


def sample_pairs(llm, prompt: str, temperature: float, top_p: float = 1.0, extra_args: dict | None = None) -> Counter:
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=temperature, top_p=top_p, seed=seed, max_tokens=3, ignore_eos=True, extra_args=extra_args
        )
        for seed in range(NUM_SAMPLES)
    ]
    outputs = token_ids(llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False))
    return Counter((out[1], out[2]) for out in outputs)


@pytest.fixture(scope="module")
def prompt() -> str:
    return make_prompts(10)[6]  # 140 words with repeated phrases: lookup and tri-grams both find drafts


@pytest.mark.parametrize("spec", [LOOKUP, ADED], ids=["lookup_tree", "aded"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_tree_sampling_matches_target_distribution(engines, prompt, spec, temperature, top_p):
    llm = engines.get(spec)
    before = runner_stats(llm)
    ours = sample_pairs(llm, prompt, temperature, top_p)
    after = runner_stats(llm)
    assert after["trees"] > before["trees"] and after["accepted"] > before["accepted"]
    if spec is LOOKUP:  # few matches often make a single chain: block verification has run too
        assert after["block_verified"] > 0
    reference = sample_pairs(engines.get(None), prompt, temperature, top_p)
    assert len(reference) > 1, "the target is deterministic here: the test would prove nothing"
    assert chi_square_homogeneity(ours, reference) > ALPHA


def test_seed_makes_a_sampled_request_reproducible(engines, prompt):
    from vllm import SamplingParams

    llm = engines.get(LOOKUP)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=32, ignore_eos=True)
    first = token_ids(llm.generate([prompt], params, use_tqdm=False))
    batched = token_ids(llm.generate(make_prompts(4) + [prompt], params, use_tqdm=False))[-1:]
    assert first == token_ids(llm.generate([prompt], params, use_tqdm=False)) == batched


def test_chi_square_detects_a_different_distribution():
    """The statistic used above has power: a shifted distribution fails it."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.4, 0.3, 0.3])
    a = Counter(torch.multinomial(p, NUM_SAMPLES, True, generator=generator).tolist())
    b = Counter(torch.multinomial(q, NUM_SAMPLES, True, generator=generator).tolist())
    same = Counter(torch.multinomial(p, NUM_SAMPLES, True, generator=generator).tolist())
    assert chi_square_homogeneity(a, b) < ALPHA
    assert chi_square_homogeneity(a, same) > ALPHA
