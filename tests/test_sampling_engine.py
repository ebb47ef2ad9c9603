"""End to end: sampling with a tree method keeps the target's distribution.

Many seeded requests are sampled with and without speculation, ``MAX_TOKENS``
tokens each; the two samples must come from one law. The 1st token comes from
the prefill step, every later one through tree verification, so the statistic
covers the whole sampled prefix (:func:`prefix_homogeneity`): at every
position from the 2nd on, a chi-square test of homogeneity of the token's
marginal, and one of the token given the token before it (so a bug that keeps
the marginals but breaks how tokens follow each other shows too); the
smallest of these p-values times their number (Bonferroni) must exceed 0.001.
The test must also see that trees were drafted and accepted, or it would
prove nothing.

Its power, measured with bugs planted in the verifiers (``benchmarks/planted_bugs.py``,
``docs`` in its docstring): a skipped residual update, a reused uniform or
target rows without top-p are each caught far below the threshold in every
case; ``test_planted_residual_bug_is_caught`` keeps one such case in CI.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import pytest
import torch
from conftest import runner_stats, token_ids
from specs import ADED, ADED_AUTO, LOOKUP

from benchmarks.planted_bugs import plant_residual_bug

NUM_SAMPLES = 2000
MAX_TOKENS = 6
ALPHA = 1e-3
CASES = [(1.0, 1.0), (1.3, 0.9)]  # (temperature, top_p): verified rows keep several tokens


def chi_square_statistic(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic of the 2 x k table of two samples, and its degrees of freedom.

    Categories expected fewer than 5 times in the smaller sample are pooled into one."""
    total_a, total_b = sum(a.values()), sum(b.values())
    if not total_a or not total_b:
        return 0.0, 0
    pooled = a + b
    keys = [k for k in pooled if pooled[k] * min(total_a, total_b) / (total_a + total_b) >= 5]
    rest = [k for k in pooled if k not in keys]
    table = torch.tensor(
        [[a[k] for k in keys] + [sum(a[k] for k in rest)], [b[k] for k in keys] + [sum(b[k] for k in rest)]],
        dtype=torch.float64,
    )
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


def chi_square_p_value(statistic: float, dof: int) -> float:
    if dof == 0:
        return 1.0
    half = torch.tensor([dof / 2.0, statistic / 2.0], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))  # the chi-square survival function


def chi_square_homogeneity(a: Counter, b: Counter) -> float:
    """p-value that two samples come from one categorical distribution."""
    return chi_square_p_value(*chi_square_statistic(a, b))


def prefix_homogeneity(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], start: int = 1) -> float:
    """p-value that two samples of equally long token sequences come from one law.

    For every position ``i >= start``: the token's marginal, and the token
    given the one before it (one 2 x k table per previous token, their
    statistics and degrees of freedom added up, which is the chi-square test
    of the pair's joint given the previous token's). Bonferroni over the
    ``2 * (length - start)`` tests, so the result is a valid p-value however
    the tests depend on each other.
    """
    length = min(len(seq) for seq in (*a, *b))
    p_values = []
    for i in range(start, length):
        p_values.append(chi_square_homogeneity(Counter(s[i] for s in a), Counter(s[i] for s in b)))
        given: dict[int, tuple[Counter, Counter]] = defaultdict(lambda: (Counter(), Counter()))
        for side, sample in enumerate((a, b)):
            for seq in sample:
                given[seq[i - 1]][side][seq[i]] += 1
        statistic, dof = 0.0, 0
        for ours, theirs in given.values():
            s, d = chi_square_statistic(ours, theirs)
            statistic, dof = statistic + s, dof + d
        p_values.append(chi_square_p_value(statistic, dof))
    return min(1.0, len(p_values) * min(p_values))


def sample_sequences(
    llm,
    prompt: str,
    temperature: float,
    top_p: float = 1.0,
    extra_args: dict | None = None,
    num_samples: int = NUM_SAMPLES,
    max_tokens: int = MAX_TOKENS,
) -> list[tuple[int, ...]]:
    """``num_samples`` seeded requests (seeds 0, 1, ...) in one ``generate`` call."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args=extra_args,
        )
        for seed in range(num_samples)
    ]
    return [tuple(out) for out in token_ids(llm.generate([prompt] * num_samples, params, use_tqdm=False))]


#: samples without speculation, per (prompt, temperature, top_p): drawn once per session for every
#: module that compares against them (seeded requests: the same draws whichever module asks first)
_TARGET_SAMPLES: dict[tuple[str, float, float], list[tuple[int, ...]]] = {}


def target_samples(engines, prompt: str, temperature: float, top_p: float = 1.0) -> list[tuple[int, ...]]:
    """:func:`sample_sequences` on the engine without speculation, ``NUM_SAMPLES`` of ``MAX_TOKENS`` tokens."""
    key = (prompt, temperature, top_p)
    if key not in _TARGET_SAMPLES:
        drawn = sample_sequences(engines.get(None), prompt, temperature, top_p)
        assert len(set(drawn)) > 1, "the target is deterministic: the test would prove nothing"
        _TARGET_SAMPLES[key] = drawn
    return _TARGET_SAMPLES[key]


@pytest.fixture(scope="module")
def prompt(prompts) -> str:
    return prompts[6]  # 140 words with repeated phrases: lookup and tri-grams both find drafts


#: the per-step budget cuts trees by their shapes and the requests' histories only: sampling stays the target's
SPEC_CASES = [
    *[
        pytest.param(spec, *case, id=f"{name}-{case}")
        for spec, name in ((LOOKUP, "lookup_tree"), (ADED, "aded"))
        for case in CASES
    ],
    pytest.param(ADED_AUTO, *CASES[0], id=f"aded-auto-{CASES[0]}"),
]


@pytest.mark.parametrize(("spec", "temperature", "top_p"), SPEC_CASES)
def test_tree_sampling_matches_target_distribution(engines, prompt, spec, temperature, top_p):
    llm = engines.get(spec)
    before = runner_stats(llm)
    ours = sample_sequences(llm, prompt, temperature, top_p)
    after = runner_stats(llm)
    assert after["trees"] > before["trees"] and after["accepted"] > before["accepted"]
    if spec is ADED_AUTO:  # the budget chose the trees
        assert after["budget_asked"] > before["budget_asked"]
    if spec is LOOKUP:  # few matches often make a single chain: block verification has run too
        assert after["block_verified"] > 0
    assert prefix_homogeneity(ours, target_samples(engines, prompt, temperature, top_p)) > ALPHA


def test_planted_residual_bug_is_caught(engines, prompt):
    """The check has teeth end to end: the README's planted bug fails it by a wide margin
    (p about 1e-24 where the old statistic, tokens 2-3 of 600 requests, gave 2e-4)."""
    llm = engines.get(LOOKUP)
    llm.collective_rpc(plant_residual_bug, args=(True,))
    try:
        buggy = sample_sequences(llm, prompt, 1.0)
    finally:
        llm.collective_rpc(plant_residual_bug, args=(False,))
    assert prefix_homogeneity(buggy, target_samples(engines, prompt, 1.0)) < ALPHA**2


def test_seed_makes_a_sampled_request_reproducible(engines, prompts, prompt):
    """The same seed gives the same tokens, alone or in a batch; another seed gives other tokens."""
    from vllm import SamplingParams

    llm = engines.get(LOOKUP)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=32, ignore_eos=True)
    first = token_ids(llm.generate([prompt], params, use_tqdm=False))
    batched = token_ids(llm.generate(prompts[:4] + [prompt], params, use_tqdm=False))[-1:]
    assert first == token_ids(llm.generate([prompt], params, use_tqdm=False)) == batched
    others = [SamplingParams(temperature=1.0, seed=seed, max_tokens=32, ignore_eos=True) for seed in (1, 2, 3)]
    other = token_ids(llm.generate([prompt] * 3, others, use_tqdm=False))
    # 32 tokens at temperature 1: three other seeds all drawing the same 32 would mean the seed is ignored
    assert all(o != first[0] for o in other) and len({tuple(o) for o in other}) == 3


# ---------------------------------------------------------------- the statistics themselves
def chain_samples(
    rows: torch.Tensor, count: int, length: int, generator: torch.Generator, bump: float = 0.0
) -> list[tuple[int, ...]]:
    """``count`` sequences of a Markov chain with transition ``rows`` from token 0; with ``bump``,
    the 5th token after a 0 moves ``bump`` of its probability from token 2 to token 1."""
    tokens = torch.zeros(count, 1, dtype=torch.int64)
    for i in range(1, length):
        table = rows.clone()
        if i == 4:
            table[0, 1], table[0, 2] = table[0, 1] + bump, table[0, 2] - bump
        step = torch.multinomial(table[tokens[:, -1]], 1, generator=generator)
        tokens = torch.cat([tokens, step], dim=1)
    return [tuple(seq) for seq in tokens.tolist()]


def test_chi_square_detects_a_different_distribution():
    """The statistics used above have power: a shifted distribution fails them."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.4, 0.3, 0.3])
    a = Counter(torch.multinomial(p, NUM_SAMPLES, True, generator=generator).tolist())
    b = Counter(torch.multinomial(q, NUM_SAMPLES, True, generator=generator).tolist())
    same = Counter(torch.multinomial(p, NUM_SAMPLES, True, generator=generator).tolist())
    assert chi_square_homogeneity(a, b) < ALPHA
    assert chi_square_homogeneity(a, same) > ALPHA


def test_prefix_statistic_is_calibrated_and_sees_deep_positions():
    """Same law: no more small p-values than uniform ones would give (no false alarms
    from the many small tables); a shift of one transition at the 5th token only is found."""
    generator = torch.Generator().manual_seed(1)
    with torch.random.fork_rng():  # the chain itself must not depend on what ran before
        torch.manual_seed(1)
        rows = torch.distributions.Dirichlet(torch.full((6,), 0.5)).sample((6,))
    rows[0] = torch.tensor([0.3, 0.25, 0.25, 0.1, 0.05, 0.05])
    p_values = [
        prefix_homogeneity(*(chain_samples(rows, 300, MAX_TOKENS, generator) for _ in range(2))) for _ in range(100)
    ]
    assert sum(p < 0.1 for p in p_values) / len(p_values) < 0.2
    assert min(p_values) > ALPHA
    honest = chain_samples(rows, NUM_SAMPLES, MAX_TOKENS, generator)
    shifted = chain_samples(rows, NUM_SAMPLES, MAX_TOKENS, generator, bump=0.2)
    assert prefix_homogeneity(honest, shifted) < ALPHA
    assert prefix_homogeneity(honest, chain_samples(rows, NUM_SAMPLES, MAX_TOKENS, generator)) > ALPHA
