"""Replay recorded answers through a tree drafter and the step budget, without an engine.

The answers no speculation gave in a ``compare.py`` run (its ``outputs.json``)
are what the target commits. The requests run in lockstep as one closed batch,
as ``compare.py`` sends them, and each step costs a fixed line, ``intercept +
slope x rows`` (the budget's own cost model; take the figures from an
engine's fitted line, a row's ``step_cost`` in ``result.json``). Three policies see
the same drafts:

- ``none``: no drafts, one row and one token per request a step;
- ``budget``: the plugin's ``"max_nodes": "auto"`` (:class:`StepBudget`);
- ``oracle``: the drafter's whole tree cut to the nodes the target accepts,
  the best any budget can do with these drafts (no rejected row, none missed).

For each it prints the batch's time under the line, its steps, rows and
rejected rows, and the drafter's own time per request-step (measured here;
the line leaves it out). Greedy only: a node is accepted when it matches.

    python benchmarks/replay.py --outputs docs/results/budget-interleaved-smollm/outputs.json \\
        --model smollm2-135m-instruct --method aded --line 0.050 0.0025
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the package from the repository
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.models import resolve
from benchmarks.prompts import load_prompts
from vllm_specbeam.core.budget import StepBudget, StepCost
from vllm_specbeam.core.config import METHODS, node_cap, parse
from vllm_specbeam.core.drafter import DraftRequest, TreeDrafter
from vllm_specbeam.core.tree import DraftTree, committed_path

POLICIES = ("none", "budget", "oracle")


@dataclass
class Replay:
    """One policy's closed batch."""

    policy: str
    #: steps each request took, in prompt order
    steps: list[int]
    #: the batch's time under the line (drafting not included)
    seconds: float = 0.0
    #: rows verified (one per request a step, plus the drafted nodes kept) and the rejected ones
    rows: int = 0
    rejected: int = 0
    #: the drafter's own time, and the request-steps it drafted for
    draft_seconds: float = 0.0
    drafted_steps: int = 0


def replay(
    drafter: TreeDrafter,
    options: dict[str, Any],
    prompts: list[list[int]],
    answers: list[list[int]],
    policy: str,
    line: StepCost,
) -> Replay:
    """Commit ``answers`` after ``prompts`` (token ids) step by step under ``policy``."""
    budget = StepBudget()
    budget.cost = line
    done = [0] * len(answers)  # tokens of each answer committed
    total = Replay(policy, steps=[0] * len(answers))
    while live := [i for i, answer in enumerate(answers) if done[i] < len(answer)]:
        requests = []
        for i in live:
            depth = min(options["num_speculative_tokens"], len(answers[i]) - done[i] - 1)  # as the engine caps it
            cap = node_cap(options) if policy == "oracle" else budget.draft_cap(f"{i}", node_cap(options))
            if policy != "none" and depth >= 1 and cap:
                request_options = {**options, "num_speculative_tokens": depth, "max_nodes": cap}
                requests.append(DraftRequest(f"{i}", np.array(prompts[i] + answers[i][: done[i]]), request_options))
        trees: list[DraftTree] = []
        if requests:
            start = time.perf_counter()
            trees = drafter.propose(requests)
            total.draft_seconds += time.perf_counter() - start
            total.drafted_steps += len(requests)
        ids = [int(request.req_id) for request in requests]
        if policy == "budget":
            trees = budget.prune([r.req_id for r in requests], trees, [r.token_ids.size for r in requests], len(live))
        elif policy == "oracle":
            trees = [_accepted_only(tree, answers[i][done[i] :]) for i, tree in zip(ids, trees)]
        drafted = dict(zip(ids, trees))
        rows = len(live) + sum(tree.num_nodes for tree in trees)
        total.seconds += float(line.seconds(rows))
        total.rows += rows
        for i in live:
            tree = drafted.get(i, DraftTree.empty())
            accepted = len(committed_path(tree.tokens.tolist(), tree.parents.tolist(), answers[i][done[i] :]))
            total.rejected += tree.num_nodes - accepted
            committed = answers[i][done[i] : done[i] + accepted + 1]  # the accepted drafts and the target's own
            done[i] += len(committed)
            total.steps[i] += 1
            budget.observe_committed(f"{i}", committed, len(prompts[i]) + done[i])
    return total


def _accepted_only(tree: DraftTree, answer: list[int]) -> DraftTree:
    keep = np.zeros(tree.num_nodes, bool)  # [nodes]
    keep[committed_path(tree.tokens.tolist(), tree.parents.tolist(), answer)] = True
    return tree.keep(keep)


def recorded_answers(outputs: Path, batch_size: int) -> list[str]:
    """No speculation's texts at ``batch_size`` in a ``compare.py`` ``outputs.json``."""
    for run in json.loads(outputs.read_text()):
        if run["method"] == "none" and run["batch_size"] == batch_size:
            return list(run["texts"])
    raise SystemExit(f"{outputs}: no run of method 'none' at batch size {batch_size}")


def load_recorded(outputs: Path, model: str, prompts: str, batch_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and no speculation's answers of a ``compare.py`` run, as token ids of ``model``'s tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve(model))
    texts = recorded_answers(outputs, batch_size)
    prompt_ids = [tokenizer.encode(p.text) for p in load_prompts(prompts, len(texts))]
    answers = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return prompt_ids, answers


def recorded_run_arguments(parser: argparse.ArgumentParser, batch_size: int) -> None:
    """The options that name a ``compare.py`` run's recorded answers (:func:`load_recorded`)."""
    parser.add_argument("--outputs", type=Path, required=True, help="outputs.json of a compare.py run")
    parser.add_argument("--model", required=True, help="the run's target (its tokenizer)")
    parser.add_argument("--prompts", default="humaneval", help="the run's prompt set")
    parser.add_argument(
        "--batch-size", type=int, default=batch_size, help="the recorded run's batch (its prompts are the first ones)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    recorded_run_arguments(parser, batch_size=8)
    parser.add_argument("--method", default="lookup_tree", choices=[m for m, spec in METHODS.items() if spec.prunable])
    parser.add_argument("--options", default="{}", help="the method's options as JSON (its defaults otherwise)")
    parser.add_argument("--line", type=float, nargs=2, default=(0.050, 0.0025), metavar=("INTERCEPT_S", "SLOPE_S"))
    args = parser.parse_args(argv)

    prompts, answers = load_recorded(args.outputs, args.model, args.prompts, args.batch_size)
    config = parse({"method": args.method, **json.loads(args.options)}, target_tokenizer=resolve(args.model))
    line = StepCost(*args.line)
    print(
        f"{args.method}, {len(answers)} requests in one closed batch, {sum(map(len, answers))} tokens, "
        f"step = {line.intercept * 1e3:g} ms + {line.slope * 1e3:g} ms a row"
    )
    print("| policy | time (s) | vs none | steps (slowest) | rows | rejected | drafting ms a request-step |")
    print("|---|---|---|---|---|---|---|")
    baseline = None
    for policy in POLICIES:
        drafter = METHODS[args.method].drafter_class()(config.options)
        result = replay(drafter, config.options, prompts, answers, policy, line)
        baseline = baseline or result.seconds
        per_step = 1e3 * result.draft_seconds / max(result.drafted_steps, 1)
        print(
            f"| {policy} | {result.seconds:.3f} | {baseline / result.seconds:.3f} | {max(result.steps)} | "
            f"{result.rows} | {result.rejected} | {per_step:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
