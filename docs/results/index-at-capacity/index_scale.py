"""The global index's lookup at its capacity: the scan of the whole partition against the
occurrence lists, on real text, without an engine.

The index holds 2^16, 2^18 (``index_tokens``' default) or 2^20 tokens of Python's own standard library,
tokenised with SmolLM2's tokenizer, in sequences of 512 tokens (finished requests). Each of
HumanEval's first 32 prompts and reference solutions is then drafted for at every step of its
solution, as ``lookup_tree``'s global scope does (request tokens and the index, one-token
matches up to 24): ``LookupTreeDrafter.choose`` with the partition's occurrence lists, and the
same ``choose`` with the last token's occurrences found by a scan of the partition. Both must
choose alike; the table gives the median and 90th percentile of a step's lookup in µs, and of
the lookup with the tree it drafts (``LookupChoice.tree`` at the global scope's cap, 48 nodes), what
a step pays.

    python docs/results/index-at-capacity/index_scale.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from unittest.mock import patch

import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.models import resolve
from benchmarks.prompts import load_prompts
from vllm_specbeam.core.config import node_cap, parse
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.methods.lookup_tree.drafter import LookupTreeDrafter
from vllm_specbeam.methods.lookup_tree.index import Partition

SEQUENCE = 512


def stdlib_tokens(tokenizer, total: int) -> np.ndarray:
    out: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        out += tokenizer(path.read_text(errors="ignore"))["input_ids"]
        if len(out) >= total:
            break
    return np.asarray(out[:total], np.int64)


def scan(partition: Partition, token: int) -> np.ndarray:
    """:meth:`Partition.occurrences` as a scan of the whole partition."""
    return np.flatnonzero(partition.corpus == token)


def timed_choices(drafter: LookupTreeDrafter, requests: list[DraftRequest]) -> tuple[list[float], list[float], list]:
    """Each step's lookup, and its lookup with the tree it drafts, in seconds; the choices."""
    lookups, steps, choices = [], [], []
    for request in requests:
        began = time.perf_counter()
        choice = drafter.choose(request)
        chosen = time.perf_counter()
        if choice is not None:
            choice.tree(node_cap(request.options))
        lookups.append(chosen - began)
        steps.append(time.perf_counter() - began)
        choices.append(None if choice is None else (choice.ends, choice.length))
    return lookups, steps, choices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--index-tokens", type=int, nargs="+", default=[1 << 16, 1 << 18, 1 << 20])
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve(args.model))
    spec = parse({"method": "lookup_tree", "scope": "global"}, None, None)
    text = stdlib_tokens(tokenizer, max(args.index_tokens))
    requests = []
    for prompt in load_prompts("humaneval_edit", args.prompts):
        tokens = np.asarray(tokenizer(prompt.text)["input_ids"], np.int64)
        requests += [
            DraftRequest("r", tokens[:end], dict(spec.options)) for end in range(max(2, tokens.size - 200), tokens.size)
        ]
    print(f"{len(requests)} steps of {args.prompts} prompts\n")
    print("| index tokens | memory MiB | occurrence lists µs (p90) | with the tree µs (p90) | scan µs (p90) |")
    print("|---|---|---|---|---|")
    for size in args.index_tokens:
        drafter = LookupTreeDrafter({**spec.options, "index_tokens": size})
        for start in range(0, size, SEQUENCE):
            drafter.index.add(None, text[start : min(start + SEQUENCE, size)])
        lists, steps, fast = timed_choices(drafter, requests)
        with patch.object(Partition, "occurrences", scan):
            scanned, _, slow = timed_choices(drafter, requests)
        assert fast == slow, "the occurrence lists and the scan chose differently"
        times = {"lists": lists, "steps": steps, "scan": scanned}
        cells = [f"{1e6 * statistics.median(t):.0f} ({1e6 * np.percentile(t, 90):.0f})" for t in times.values()]
        print(f"| {drafter.index.num_tokens} | {drafter.state_bytes / 2**20:.1f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
