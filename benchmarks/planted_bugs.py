"""How strong is the end-to-end distribution test? Plant bugs in the verifiers and measure.

Runs the engines of ``tests/test_sampling_engine.py`` (the tiny random llama,
``lookup_tree`` and ``aded``, the same prompt, temperatures and seeds) in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a bug is planted by
replacing a function of the verifier modules, and prints the p-value of the
test's statistic (:func:`test_sampling_engine.prefix_homogeneity`) for the
honest code and for each planted bug, next to the old statistic (joint of the
2nd and 3rd tokens of 600 requests). The bugs:

* ``residual``: after a rejected draft the target's token is still drawn from
  ``p`` instead of the residual ``norm(max(p - q, 0))`` (tree rejection
  sampling keeps ``r = p``; block verification draws its token from ``p``);
* ``reused-uniform``: the committed token is drawn with the uniform that
  already decided the first draft's acceptance (one uniform too few);
* ``no-top-p``: the verifier's target rows lack top-k/top-p (only at
  ``top_p < 1``: elsewhere it is the honest code).

``accept with p instead of min(1, p / q)`` and ``tried siblings kept in q``
change nothing for these two methods: their drafts are deterministic (``q``
a point mass, ``p / q = p``, siblings distinct); the exact enumerations of
``tests/test_verifiers_sampling.py`` cover them for sampled drafts.

    python benchmarks/planted_bugs.py --out results/planted_bugs.json
    python benchmarks/planted_bugs.py --reuse --samples 1200 --out results/planted_bugs.json  # fewer requests

The test keeps one planted case in CI (``test_planted_residual_bug_is_caught``,
which plants the ``residual`` bug of :func:`plant_residual_bug` in the worker
through ``collective_rpc``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


# ---------------------------------------------------------------- the bugs
@contextlib.contextmanager
def patched(module: object, name: str, value: object) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def plant_residual_bug(worker: object, planted: bool) -> None:
    """Plant (``planted=True``) or remove the ``residual`` bug: after a rejected draft,
    keep sampling from ``p`` instead of the residual (tree rejection sampling keeps
    ``r = p``; block verification draws its token from ``p``).

    Runs wherever the verifiers run: in this process (:func:`residual_bug`), or in
    vLLM's worker through ``llm.collective_rpc(plant_residual_bug, args=(True,))``
    (``tests/test_sampling_engine.py``), where ``worker`` is the worker and the
    function arrives by reference: the worker imports this module, so its folder
    must be on ``sys.path`` before the engine starts (worker processes inherit it)."""
    import torch

    from vllm_specbeam.core.verifiers import block, rejection

    honest = getattr(rejection, "_honest", None) or (rejection.child_step, block.block_table)
    rejection._honest = honest
    child_step, block_table = honest

    def no_residual_update(residual, draft, tokens):
        return child_step(residual, draft, tokens)[0], residual

    def stops_from_p(trees, target, row_starts):
        table = block_table(trees, target, row_starts)
        lengths = torch.tensor([tree.num_nodes for tree in trees])
        positions = torch.arange(table.stops.shape[1])
        rows = torch.as_tensor(row_starts[: len(trees)])[:, None] + torch.minimum(positions, lengths[:, None])
        return block.BlockTable(table.ends, target.to(table.stops.dtype)[rows.to(target.device)])

    rejection.child_step = no_residual_update if planted else child_step
    block.block_table = stops_from_p if planted else block_table


@contextlib.contextmanager
def residual_bug() -> Iterator[None]:
    plant_residual_bug(None, True)
    try:
        yield
    finally:
        plant_residual_bug(None, False)


@contextlib.contextmanager
def reused_uniform_bug() -> Iterator[None]:
    from vllm_specbeam.core.verifiers import block, rejection

    draw = rejection.draw_uniforms

    def one_too_few(counts, generators, device):
        out = draw(counts, generators, device)
        for u in out:
            if u.numel() > 1:
                u[-1] = u[0]
        return out

    with patched(rejection, "draw_uniforms", one_too_few), patched(block, "draw_uniforms", one_too_few):
        yield


@contextlib.contextmanager
def no_top_p_bug() -> Iterator[None]:
    import torch

    from vllm_specbeam.adapter import verification

    def temperature_only(logits, batch_indices, rows_per_request, sampling_metadata):
        index = torch.as_tensor(batch_indices, device=logits.device)
        temperature = sampling_metadata.temperature[index].repeat_interleave(
            torch.as_tensor(rows_per_request, device=logits.device)
        )
        return (logits.to(torch.float32) / temperature[:, None]).softmax(-1)

    with patched(verification, "target_probabilities", temperature_only):
        yield


BUGS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "honest": contextlib.nullcontext,
    "residual": residual_bug,
    "reused-uniform": reused_uniform_bug,
    "no-top-p": no_top_p_bug,
}


# ---------------------------------------------------------------- the runs
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000, help="seeded requests per run")
    parser.add_argument("--cases", nargs="+", default=None, help="temperature,top_p pairs (default: the test's CASES)")
    parser.add_argument("--methods", nargs="+", default=["lookup_tree", "aded"])
    parser.add_argument("--bugs", nargs="+", default=list(BUGS))
    parser.add_argument("--out", type=Path, default=Path("results/planted_bugs.json"))
    parser.add_argument("--reuse", action="store_true", help="recompute p-values from --out's samples")
    return parser.parse_args()


def collect(args: argparse.Namespace, cases: list[tuple[float, float]]) -> dict[str, dict[str, list[list[int]]]]:
    """Each case's sampled token ids: vLLM without speculation (``reference``), then every method
    under every bug (``method/bug``)."""
    from conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, make_prompts
    from test_sampling_engine import ADED, LOOKUP, MAX_TOKENS
    from tiny_model import build_tiny_model
    from vllm import LLM, SamplingParams

    model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama"))
    prompt = make_prompts(10)[6]
    specs = {"lookup_tree": LOOKUP, "aded": ADED}

    def sample(llm, temperature: float, top_p: float) -> list[list[int]]:
        params = [
            SamplingParams(temperature=temperature, top_p=top_p, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True)
            for s in range(args.samples)
        ]
        outputs = llm.generate([prompt] * args.samples, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    samples: dict[str, dict[str, list[list[int]]]] = {}
    for name in [None, *args.methods]:
        llm = LLM(
            model=model,
            speculative_config=None if name is None else specs[name],
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            seed=0,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            distributed_executor_backend="uni",
        )
        for temperature, top_p in cases:
            case = samples.setdefault(f"T={temperature} top_p={top_p}", {})
            for bug in ["reference"] if name is None else args.bugs:
                if bug == "no-top-p" and top_p == 1.0:
                    continue
                start = time.perf_counter()
                with BUGS.get(bug, contextlib.nullcontext)():
                    case[bug if name is None else f"{name}/{bug}"] = sample(llm, temperature, top_p)
                print(f"{name or 'none'} {temperature} {top_p} {bug}: {time.perf_counter() - start:.1f}s", flush=True)
        llm.llm_engine.engine_core.shutdown()
    return samples


def print_table(samples: dict[str, dict[str, list[list[int]]]], num_samples: int) -> None:
    """Each run's p-value under the new test and the old one, against its case's reference."""
    from test_sampling_engine import MAX_TOKENS, chi_square_homogeneity, prefix_homogeneity

    new_title = f"new test p ({num_samples} requests, tokens 2-{MAX_TOKENS})"
    print(f"| case | run | {new_title} | old test p (600 requests, tokens 2-3) |")
    print("|---|---|---|---|")
    for case, runs in samples.items():
        reference = [tuple(s) for s in runs["reference"]]
        for run, seqs in runs.items():
            if run == "reference":
                continue
            seqs = [tuple(s) for s in seqs][:num_samples]
            new = prefix_homogeneity(seqs, reference[:num_samples])
            old = chi_square_homogeneity(Counter(s[1:3] for s in seqs[:600]), Counter(s[1:3] for s in reference[:600]))
            print(f"| {case} | {run} | {new:.2g} | {old:.2g} |")


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(TESTS))
    from test_sampling_engine import CASES

    cases = CASES if args.cases is None else [tuple(float(v) for v in c.split(",")) for c in args.cases]
    if args.reuse:
        samples = json.loads(args.out.read_text())
    else:
        samples = collect(args, cases)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(samples))
    print_table(samples, args.samples)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
