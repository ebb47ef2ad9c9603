"""Full-width beam sampling: the law, the speculative step's exactness, the engine samplers.

The maths tests enumerate every drafted sequence and accept/reject outcome
exactly; the engine tests compare the speculative sampler with the target-only
reference by a two-sample chi-square; benchmarks/beam_sampling_bench.py runs
both on the tiny model.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from vllm_specbeam.methods.dsbd import beam_sampling as bs
from vllm_specbeam.methods.dsbd.maths import residual_chain

LAWS = [bs.SamplingLaw(1.0), bs.SamplingLaw(0.7, top_p=0.9), bs.SamplingLaw(1.3, top_k=5, top_p=0.8)]


def vllm_cut(logprobs: torch.Tensor, law: bs.SamplingLaw) -> torch.Tensor:
    """``[L, V]`` which tokens vLLM's own CPU sampler keeps (temperature, then top-k/top-p)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    rows = logprobs.shape[0]
    k = torch.full((rows,), law.top_k) if law.top_k > 0 else None
    p = torch.full((rows,), law.top_p) if law.top_p < 1 else None
    return torch.isfinite(apply_top_k_top_p_pytorch(logprobs / law.temperature, k, p, allow_cpu_sync=True))


# ---------------------------------------------------------------- rows
@pytest.mark.parametrize("law", LAWS)
def test_rows_are_cut_as_vllm_cuts_them(law):
    logprobs = torch.log_softmax(torch.randn(64, 40, generator=torch.Generator().manual_seed(0)) * 2, dim=-1)
    assert torch.equal(torch.isfinite(bs.cut_rows(logprobs, law)), vllm_cut(logprobs, law))


@pytest.mark.parametrize("law", LAWS[1:])
def test_a_row_cut_from_its_top_logprobs_is_exact_or_refused(law):
    """From any number of a row's best logprobs the cut is the full row's, or refused;
    and a nucleus is often decided from a few of them."""
    logprobs = torch.log_softmax(torch.randn(64, 40, generator=torch.Generator().manual_seed(1)) * 3, dim=-1)
    ordered = logprobs.sort(dim=-1, descending=True).values
    decided_early = 0
    for row in ordered:
        full = bs.kept_count(row, 40, law)
        for seen in range(1, 41):
            try:
                assert bs.kept_count(row[:seen], 40, law) == full
            except bs.InexactRowError:
                assert seen < 40
                continue
            decided_early += seen < 20
            break
    assert decided_early > 32


def test_batched_cuts_over_a_real_vocabulary_are_vllms_and_each_rows():
    """Qwen2.5-Coder's 151,936 tokens, rows from flat to peaked: the batched cut is vLLM's, the
    batched counts from each row's top 64 logprobs are the row-by-row ones, those decided are
    the whole row's, and the cut rows travel as their kept tokens alone."""
    vocab = 151_936
    sharpness = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 8.0]).unsqueeze(-1)
    logprobs = torch.log_softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)) * sharpness, -1)
    top = logprobs.topk(64).values  # [6, 64]
    for law in LAWS[1:]:
        cut = bs.cut_rows(logprobs, law)  # [6, V]
        assert torch.equal(torch.isfinite(cut), vllm_cut(logprobs, law))
        kept = bs.kept_counts(top, vocab, law)  # [6]
        assert torch.equal(kept, torch.cat([bs.kept_counts(row.unsqueeze(0), vocab, law) for row in top]))
        decided = kept != bs.UNDECIDED
        assert torch.equal(kept[decided], torch.isfinite(cut).sum(-1)[decided])
        assert law.top_k or 0 < int(decided.sum()) < 6  # top_p alone: flat rows are not decided
        shipped = bs.SparseRows.from_data(bs.SparseRows.from_cut(cut).to_data())  # the draft's rows, as sent
        assert torch.equal(shipped.dense([4, 0, 4], vocab), cut[[4, 0, 4]].double())


def test_an_uncut_row_needs_every_logprob():
    row = torch.log_softmax(torch.randn(30), dim=-1).sort(descending=True).values
    with pytest.raises(bs.InexactRowError, match="nucleus"):
        bs.kept_count(row[:29], 30, bs.SamplingLaw(1.0))
    assert bs.kept_count(row, 30, bs.SamplingLaw(1.0)) == 30


# ---------------------------------------------------------------- the law
def reference_joint(scores, logprobs, law) -> torch.Tensor:
    """The law from its definition: ``P(b, x) ∝ exp(S_b / T) p(x | b)^(1 / T)`` on the kept tokens."""
    kept = vllm_cut(logprobs, law)
    weights = torch.exp(scores / law.temperature).unsqueeze(-1) * logprobs.exp() ** (1 / law.temperature)
    weights = weights * kept
    return (weights / weights.sum()).reshape(-1)


@pytest.mark.parametrize("law", LAWS)
def test_the_joint_is_tempered_and_normalised_over_all_beams(law):
    gen = torch.Generator().manual_seed(2)
    logprobs = torch.log_softmax(torch.randn(3, 12, generator=gen, dtype=torch.float64), dim=-1)
    scores = torch.tensor([-0.5, -2.0, -1.1], dtype=torch.float64)
    joint = bs.beam_joint(scores, bs.cut_rows(logprobs, law), law)
    assert torch.allclose(joint, reference_joint(scores, logprobs, law), atol=1e-12)
    # not the per-row (one-sequence) law unless T = 1 and nothing is cut
    per_row = torch.softmax(scores, 0).unsqueeze(-1) * torch.softmax(bs.cut_rows(logprobs, law) / law.temperature, -1)
    assert (law == bs.SamplingLaw(1.0)) == torch.allclose(joint, per_row.reshape(-1), atol=1e-9)


def test_pairs_are_iid_draws_from_the_joint_and_seeded():
    joint = torch.tensor([0.5, 0.2, 0.0, 0.3])
    draws = bs.draw_pairs(joint, 40_000, torch.Generator().manual_seed(3))
    counts = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert counts[2] == 0 and torch.allclose(counts, joint.double(), atol=0.01)
    again = bs.draw_pairs(joint, 40_000, torch.Generator().manual_seed(3))
    assert torch.equal(draws, again)


def test_hugging_face_candidates_are_distinct_and_draw_in_order_from_the_joint():
    joint = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    gen = torch.Generator().manual_seed(4)
    firsts, seconds = torch.zeros(5), torch.zeros(5)
    for _ in range(4000):
        candidates = bs.hf_candidates(joint, 2, gen)
        assert candidates.numel() == 4 and len(set(candidates.tolist())) == 4 and 4 not in candidates
        firsts[candidates[0]] += 1
        seconds[candidates[1]] += 1
    assert torch.allclose(firsts / 4000, joint, atol=0.03)
    # without replacement: the second draw is P(x) * sum_y P(y) / (1 - P(y)), y != x
    second = torch.tensor([sum(joint[y] * joint[x] / (1 - joint[y]) for y in range(4) if y != x) for x in range(5)])
    assert torch.allclose(seconds / 4000, second, atol=0.03)


def test_the_best_beam_is_length_normalised():
    assert bs.length_normalised(-6.0, 3) > bs.length_normalised(-4.0, 1)
    assert bs.length_normalised(-6.0, 3, length_penalty=0.0) == -6.0


# ---------------------------------------------------------------- speculative step, enumerated
def checked_weight(target, draft, drafts, accepts, width) -> float:
    """The chance of this accept/reject pattern under the rule, or 0 for a pattern
    that marks a draft after the ``width``-th acceptance as rejected (unchecked drafts
    count once, as accepted)."""
    chain = residual_chain(target, draft, len(drafts))
    weight, accepted, rejections = 1.0, 0, 0
    for pair, accept in zip(drafts, accepts):
        if accepted == width:
            weight *= float(accept)
            continue
        ratio = min(1.0, float(chain[rejections, pair] / draft[pair]))
        weight *= ratio if accept else 1.0 - ratio
        accepted, rejections = (accepted + 1, 0) if accept else (accepted, rejections + 1)
    return weight


def speculative_law(target, draft, width: int, num_drafts: int) -> dict[tuple[int, ...], float]:
    """The exact law of the ``width`` ordered output pairs of :func:`bs.speculative_depth`."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    pairs = range(target.numel())
    for drafts in itertools.product(pairs, repeat=num_drafts):
        drawn = math.prod(float(draft[d]) for d in drafts)
        for accepts in itertools.product([True, False], repeat=num_drafts):
            weight = drawn * checked_weight(target, draft, drafts, accepts, width)
            if weight == 0:
                continue
            uniforms = torch.tensor([0.0 if a else 1.0 for a in accepts], dtype=torch.float64)
            depth = bs.speculative_depth(target, draft, torch.tensor(drafts), uniforms, width)
            for rest in itertools.product(pairs, repeat=len(depth.remaining)):
                tail = math.prod(float(depth.remaining[i, x]) for i, x in enumerate(rest))
                law[(*depth.accepted, *rest)] += weight * tail
    return law


def law_gap(law: dict[tuple[int, ...], float], target: torch.Tensor, width: int) -> float:
    """The largest difference between ``law`` and ``width`` i.i.d. draws from ``target``."""
    outcomes = itertools.product(range(target.numel()), repeat=width)
    return max(abs(law.get(o, 0.0) - math.prod(float(target[x]) for x in o)) for o in outcomes)


def two_beams() -> tuple[torch.Tensor, torch.Tensor, bs.SamplingLaw]:
    """The target's and the draft's joints over 2 beams x 3 tokens."""
    law = bs.SamplingLaw(0.8, top_p=0.95)
    target_rows = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]], dtype=torch.float64))
    draft_rows = torch.log(torch.tensor([[0.3, 0.3, 0.4], [0.7, 0.2, 0.1]], dtype=torch.float64))
    scores = torch.tensor([-0.4, -1.1], dtype=torch.float64)
    target = bs.beam_joint(scores, bs.cut_rows(target_rows, law), law)
    draft = bs.beam_joint(torch.tensor([-0.9, -0.6], dtype=torch.float64), bs.cut_rows(draft_rows, law), law)
    return target, draft, law


@pytest.mark.parametrize("width,num_drafts", [(2, 3), (3, 2), (1, 2)])
def test_the_speculative_step_draws_width_iid_pairs_from_the_target(width, num_drafts):
    target, draft, _ = two_beams()
    assert law_gap(speculative_law(target, draft, width, num_drafts), target, width) < 1e-9


def test_the_enumeration_catches_a_skipped_residual(monkeypatch):
    target, draft, _ = two_beams()
    monkeypatch.setattr(bs, "remaining_law", lambda outcome, target, index: target)
    assert law_gap(speculative_law(target, draft, 2, 3), target, 2) > 1e-3


def test_the_enumeration_catches_a_joint_normalised_per_beam(monkeypatch):
    target, draft, law = two_beams()
    rows = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]], dtype=torch.float64))
    per_beam = torch.softmax(bs.cut_rows(rows, law) / law.temperature, dim=-1).reshape(-1) / 2
    assert law_gap(speculative_law(per_beam, draft, 2, 3), target, 2) > 1e-3


# ---------------------------------------------------------------- engine
SAMPLES = 2000
ENGINE = {"block_size": 32, "enable_prefix_caching": True, "enable_chunked_prefill": False}


@pytest.fixture(scope="module")
def llm(engines, near_draft):
    """A draft often, not always, the target: acceptances and rejections both."""
    spec = {"method": "dsbd", "model": near_draft, "num_speculative_tokens": 1, "max_nodes": 16}
    return engines.get(spec, **ENGINE)


def best_beams(outputs) -> list[tuple[int, ...]]:
    return [tuple(out.sequences[0].tokens[-2:]) for out in outputs]


def chi_square_p(a: list, b: list) -> float:
    """Two-sample chi-square p-value over the categories seen (rare ones pooled)."""
    counts: dict = defaultdict(lambda: [0, 0])
    for i, sample in enumerate((a, b)):
        for x in sample:
            counts[x][i] += 1
    cells = [c for c in counts.values() if sum(c) >= 10]
    rare = [sum(c[i] for c in counts.values() if sum(c) < 10) for i in range(2)]
    table = torch.tensor(cells + ([rare] if sum(rare) else []), dtype=torch.float64)  # [categories, 2]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


@pytest.mark.engine
def test_speculative_beam_sampling_draws_the_reference_beams(llm, monkeypatch):
    from conftest import make_prompts

    from vllm_specbeam.adapter.beam_sampling import BeamSampling, BeamSamplingParams, SpeculativeBeamSampling

    prompts = make_prompts(2)[1:] * SAMPLES
    params = BeamSamplingParams(2, 2, temperature=0.9, top_k=3, ignore_eos=True, seed=0)
    reference = best_beams(BeamSampling(llm).run(prompts, params))
    sampler = SpeculativeBeamSampling(llm, draft_width=3)
    ours = best_beams(sampler.run(prompts, BeamSamplingParams(**{**vars(params), "seed": 1})))
    assert sum(sampler.sampling_stats.accepted_per_depth) > 0 and sampler.stats.prompt_rounds < 2 * SAMPLES
    assert chi_square_p(ours, reference) > 0.01
    monkeypatch.setattr(bs, "remaining_law", lambda outcome, target, index: target)
    planted = best_beams(sampler.run(prompts, BeamSamplingParams(**{**vars(params), "seed": 2})))
    assert chi_square_p(planted, reference) < 1e-6


@pytest.mark.engine
def test_both_samplers_take_priorities_as_llm_beam_search_does(llm, monkeypatch):
    """One priority per prompt reaches every request the sampler sends for that prompt (recorded,
    then dropped: the engine schedules first come, first served); a wrong count is refused."""
    from conftest import make_prompts

    from vllm_specbeam.adapter.beam_sampling import BeamSampling, BeamSamplingParams, SpeculativeBeamSampling

    sent: list[list[int]] = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda *a, priority, **k: sent.append(priority) or generate(*a, **k))
    params = BeamSamplingParams(2, 2, temperature=0.9, top_k=3, ignore_eos=True, seed=0)
    for sampler in (BeamSampling(llm), SpeculativeBeamSampling(llm, draft_width=2)):
        with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
            sampler.run(make_prompts(3)[1:], params, priority=[0])
        sent.clear()
        sampler.run(make_prompts(3)[1:], params, priority=[3, 5])
        first = sent[0]  # both prompts still sampling: the first prompt's requests, then the second's
        assert first == sorted(first) and 3 in first and 5 in first
        assert all(set(p) <= {3, 5} for p in sent)


# ---------------------------------------------------------------- server
def test_a_sampled_server_request_keeps_its_seed_and_cuts():
    """The beam-search params a request makes carry it (patch 12: BeamSearchParams has no seed,
    top_k or top_p), and its cuts default as vLLM's sampling defaults them."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter import beam_search_server as server

    to_params = server.carrying_request(CompletionRequest.to_beam_search_params)
    request = CompletionRequest(model="m", prompt="p", use_beam_search=True, n=3, seed=7, top_p=0.9)
    params = to_params(request, 16, {})
    assert server.openai_request(params) is request
    assert server.openai_request(BeamSearchParams(beam_width=3, max_tokens=16)) is None  # made elsewhere: none
    serving = SimpleNamespace(default_sampling_params={"top_k": 20, "top_p": 0.8})
    sampling = server.sampling_params(serving, request, params)
    assert (sampling.beam_width, sampling.max_tokens, sampling.seed) == (3, 16, 7)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 0.9, 20)  # request, then server
    assert server.sampling_params(SimpleNamespace(default_sampling_params={}), request, params).top_k == 0


# ---------------------------------------------------------------- benchmark
def test_the_benchmark_pools_rounds_into_medians_and_ratios():
    from benchmarks import beam_sampling_bench as bench

    assert bench.round_order(0) == ["reference", "speculative"] and bench.round_order(1) == bench.round_order(0)[::-1]

    def record(sampler, batch, wall, **more):
        base = {"sampler": sampler, "width": 2, "batch_size": batch, "wall_s": wall, "output_tokens": 60}
        return {**base, "loglik_per_token": [-0.5, -1.5], "texts": ["a", "b"], **more}

    spec = {"prompt_rounds": 10, "steps": 30}
    rounds = [
        [record("speculative", 1, 2.0, accepted_per_depth=[8, 4], **spec), record("reference", 1, 6.0)],
        [record("reference", 1, 4.0), record("speculative", 1, 3.0, accepted_per_depth=[6], **spec)],
    ]
    reference, speculative = bench.pool(rounds)
    assert (reference["sampler"], reference["tokens_per_s"], reference["speedup"]) == ("reference", 12.5, 1.0)
    assert speculative["tokens_per_s"] == 25.0 and speculative["speedup"] == 2.0  # medians of 30, 20 and 10, 15
    assert speculative["steps_per_round"] == 3.0 and speculative["accepted_per_depth"] == [0.7, 0.2]
    assert reference["mean_loglik_per_token"] == -1.0 and reference["texts"] == [["a", "b"]] * 2
    row = read_table(bench.table([reference, speculative]))[1]
    assert (row["speedup"], row["steps/round"], row["accepted pairs per depth"]) == ("2.00", "3.00", "0.70 / 0.20")


def test_pass_at_1_differences_are_paired_by_problem(monkeypatch):
    """The gap's standard error comes from per-problem differences: two samplers that pass the
    same problems differ by 0 ± 0, however many problems either passes."""
    from benchmarks import beam_sampling_bench as bench
    from benchmarks import report

    outcomes = {"r": [[1, 1, 0, 0]] * 2, "s": [[1, 1, 0, 0], [1, 1, 0, 0]], "m": [[1, 0, 0, 0], [0, 0, 0, 0]]}
    monkeypatch.setattr(report, "humaneval_checks", lambda prompts, texts, timeout: outcomes[texts[0][0]])

    def row(sampler, tag):
        return {"sampler": sampler, "width": 2, "batch_size": 4, "texts": [[tag]] * 2}

    rows = [row("reference", "r"), row("speculative", "s"), row("multinomial", "m")]
    bench.pass_at_1([], rows, timeout=1.0)
    reference, speculative, multinomial = rows
    assert reference["pass_at_1"] == speculative["pass_at_1"] == 0.5 and "pass_at_1_minus_reference" not in reference
    assert (speculative["pass_at_1_minus_reference"], speculative["pass_at_1_minus_reference_se"]) == (0.0, 0.0)
    assert multinomial["pass_at_1"] == 0.125 and multinomial["pass_at_1_minus_reference"] == -0.375
    # per-problem gaps -0.5, -1, 0, 0: mean -0.375, stdev 0.4787, se 0.2394
    assert multinomial["pass_at_1_minus_reference_se"] == pytest.approx(0.47871 / 2, abs=1e-4)
    shown = read_table(
        bench.table([{**r, "tokens_per_s": 1.0, "speedup": None, "mean_loglik_per_token": -1.0} for r in rows])
    )
    assert [line["pass@1 − reference (± 2 SE)"] for line in shown] == ["–", "+0.000 ± 0.000", "-0.375 ± 0.479"]


def read_table(text: str) -> list[dict[str, str]]:
    header, _, *rows = (line.strip("|").split("|") for line in text.strip().splitlines())
    return [{h.strip(): c.strip() for h, c in zip(header, row)} for row in rows]


@pytest.mark.server  # an engine process per round
@pytest.mark.usefixtures("no_idle_engines")
def test_the_benchmark_runs_both_samplers_end_to_end(tiny_model, near_draft, tmp_path):
    from conftest import make_prompts

    from benchmarks.beam_sampling_bench import SAMPLERS, reference_row

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts(3)[1:]))
    out = tmp_path / "out"
    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "beam_sampling_bench.py"
    command = [
        *(sys.executable, str(bench), "--model", tiny_model, "--draft", near_draft, "--prompts", str(prompts)),
        *("--max-tokens", "6", "--widths", "2", "--batch-sizes", "1", "2", "--engine-rounds", "1", "--depth", "2"),
        *("--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--out", str(out)),
        *("--samplers", *SAMPLERS),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "result.json").read_text())["rows"]
    assert [(r["batch_size"], r["sampler"]) for r in rows] == [(b, s) for b in (1, 2) for s in SAMPLERS]
    for row in rows:
        assert row["tokens_per_s"] > 0 and -20 < row["mean_loglik_per_token"] < 0
        assert all(len(texts) == 2 for texts in row["texts"])
        if row["sampler"] == "speculative":
            assert row["steps_per_round"] >= 1 and sum(row["accepted_per_depth"]) > 0
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / reference_row(rows, row)["tokens_per_s"])
    assert len(read_table((out / "table.md").read_text())) == 6
