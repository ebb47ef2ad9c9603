"""``lookup_tree`` against vLLM's ``suffix`` decoding on recorded answers, offline, without an engine.

The greedy answers no speculation gave in a ``compare.py`` run (its ``outputs.json``)
are what the target commits. The requests run one after another at batch 1, in the
prompts' order, every drafter starting empty, as an engine run at batch 1 does: the
cross-request stores (``suffix``'s response tree, ``lookup_tree``'s global index) see
the earlier requests. Every drafter follows its own trajectory: a request's first step
is the prefill (one token, no draft); each later step drafts from the committed tokens,
accepts the nodes the answer walks down (greedy), and commits them and the target's
own token. So ``accepted/step`` is the engine's figure (accepted drafts over all steps).

Drafters:

- ``suffix k24``: arctic-inference's :class:`SuffixDecodingCache` called exactly as
  vLLM 0.32's ``SuffixDecodingProposer`` calls it, with vLLM's defaults (tree depth
  24, 24 speculative tokens, ``max_spec_factor`` 1, ``min_token_prob`` 0.1, 10,000
  cached responses): ``start_request`` with the prompt, ``add_active_response`` with
  each step's committed tokens, ``speculate`` on the last 24 tokens; a chain.
- ``lookup_tree`` in request and global scope, each ``auto`` (``"max_nodes":
  "auto"``: the step budget, :class:`StepBudget`, pricing nodes on ``--line``) and
  ``cap`` (the budget off: the tree at ``auto_max_nodes``, as ``"max_nodes": 16`` / ``48``).

Every step where a drafter accepts fewer tokens than are *available* is put down to
one cause (the first that applies). *Available*: take the longest suffix (at most 24
tokens) of the committed tokens that occurs before, in the request's own tokens or in
an earlier request's prompt or answer; over all its occurrences, the most answer tokens
that follow it (at most 24, and at most the tokens left to commit but one): what a
drafter matching that longest suffix could get with perfect ranking and no depth or
node limit. A drafter's *candidates*: every continuation it could have drafted from
its own match this step (``lookup_tree``: its tree with no node cap; ``suffix``: the
tree speculation, ``use_tree_spec``, of its prompt tree and response tree with no
probability floor).

- ``budget``: the candidates at the node cap held more, the budget cut or skipped them;
- ``ranked``: only the candidates past the node cap (``lookup_tree``) or off the chosen
  chain (``suffix``) held more: the right continuation ranked below a wrong one;
- ``no match``: no candidates at all;
- ``depth``: the accepted path reached the end of every candidate (the depth limit,
  the match-length limit, or the end of the matched text);
- ``shorter match``: the candidates left the answer, and the drafter matched a shorter
  suffix than the longest one available;
- ``other text``: the candidates left the answer, after a match as long as the longest
  available: the continuing occurrence lies in text the drafter does not search (another
  request's prompt for ``suffix``, any other request for request scope) or past its
  64 matches.

    python benchmarks/suffix_replay.py --outputs docs/results/lookup-vs-suffix-replay/outputs.json \\
        --model smollm2-135m-instruct --out docs/results/lookup-vs-suffix-replay
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the package from the repository
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import shlex
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from benchmarks.replay import load_recorded, recorded_run_arguments
from vllm_specbeam.core.budget import StepBudget, StepCost
from vllm_specbeam.core.config import METHODS, node_cap, parse
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.lookup import match_ends
from vllm_specbeam.core.tree import ROOT, DraftTree, committed_path

#: ``suffix``'s tree depth in vLLM 0.32 (``suffix_decoding_max_tree_depth``): the longest match and draft
MAX_DEPTH = 24
#: vLLM's default ``max_model_len`` for the main job (2048): caps ``suffix``'s draft like the proposer does
MAX_MODEL_LEN = 2048
#: no node cap: every candidate
ALL_NODES = 1 << 20
CAUSES = ("budget", "ranked", "no match", "depth", "shorter match", "other text")


@dataclass
class Draft:
    """What a drafter gave at one step, and what it could have given."""

    tree: DraftTree  # verified
    capped: DraftTree  # before the step budget (at the node cap)
    candidates: DraftTree  # every continuation of its match
    match: int  # the length of the suffix it matched (0: none)
    seconds: float  # its own propose call


class Contender(Protocol):
    name: str

    def draft(self, req_id: str, prompt: np.ndarray, context: np.ndarray, new: list[int], left: int) -> Draft: ...

    def committed(self, req_id: str, committed: list[int], num_tokens: int) -> None: ...

    def finish(self, req_id: str, tokens: np.ndarray, new: list[int]) -> None: ...


def merge(trees: list[tuple[list[int], list[int]]]) -> DraftTree:
    """Trees (tokens, parents) merged into one trie of all their root-to-leaf paths."""
    paths: list[list[int]] = []
    for tokens, parents in trees:
        has_child = set(parents)
        for leaf in (i for i in range(len(tokens)) if i not in has_child):
            path, node = [], leaf
            while node != ROOT:
                path.append(int(tokens[node]))
                node = int(parents[node])
            paths.append(path[::-1])
    if not paths:
        return DraftTree.empty()
    return DraftTree.from_weighted_paths(paths, np.ones(len(paths)), ALL_NODES)


class SuffixChain:
    """vLLM 0.32's ``SuffixDecodingProposer`` for one request a step (its calls, its defaults)."""

    def __init__(self, k: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.name = f"suffix k{k}"
        self.k, self.factor, self.min_prob = k, max_spec_factor, min_token_prob
        self.cache = SuffixDecodingCache(max_tree_depth=MAX_DEPTH, max_cached_requests=10000)

    def draft(self, req_id: str, prompt: np.ndarray, context: np.ndarray, new: list[int], left: int) -> Draft:
        tokens = np.ascontiguousarray(context, np.int32)
        start = time.perf_counter()
        if req_id not in self.cache.active_requests:
            if req_id in self.cache.cached_requests:
                self.cache.evict_cached_response(req_id)
            self.cache.start_request(req_id, np.ascontiguousarray(prompt, np.int32))
        self.cache.add_active_response(req_id, new)
        pattern = tokens[max(0, tokens.size - MAX_DEPTH) :]
        spec = min(self.k, MAX_MODEL_LEN - tokens.size - 1)
        chain = self.cache.speculate(
            req_id, pattern, max_spec_tokens=spec, max_spec_factor=self.factor, min_token_prob=self.min_prob
        )
        seconds = time.perf_counter() - start
        tree = DraftTree(np.asarray(chain.token_ids, np.int64), np.asarray(chain.parents, np.int64))
        # every continuation of its match: both stores' trees, no probability floor (read-only calls)
        from arctic_inference.suffix_decoding._C import SuffixTree

        stores = [self.cache._local_trees[req_id], self.cache._global_tree]
        wide = [SuffixTree.speculate_ndarray(s, pattern, ALL_NODES, self.factor, 0.0, 0.0, True) for s in stores]
        candidates = merge([(list(w.token_ids), list(w.parents)) for w in wide])
        # the match it drafted from (arctic reports the longest suffix in a store even when only the
        # request's own end holds it, with nothing after: a draft's is a match with a continuation)
        match = chain.match_len if chain.token_ids else max([w.match_len for w in wide if w.token_ids], default=0)
        return Draft(tree, tree, candidates, int(match), seconds)

    def committed(self, req_id: str, committed: list[int], num_tokens: int) -> None:
        pass  # the next draft call adds them, as vLLM's proposer does

    def finish(self, req_id: str, tokens: np.ndarray, new: list[int]) -> None:
        # vLLM's proposer also sees the last step's tokens (it runs before the scheduler
        # finishes the request), then stops it once it leaves the batch; its response stays cached
        self.cache.add_active_response(req_id, new)
        self.cache.stop_request(req_id)


class LookupTree:
    """The plugin's ``lookup_tree`` with its step budget (``auto``) or at its node cap (``cap``)."""

    def __init__(self, options: dict[str, Any], policy: str, line: StepCost, branch: float = 0.0) -> None:
        self.options = dict(options)
        self.policy = policy
        scope = "global" if options["scope"] == "global" else "request"
        self.name = f"lookup_tree {scope} {policy} (d{options['num_speculative_tokens']}/n{node_cap(options)})"
        self.drafter = METHODS["lookup_tree"].drafter_class()(self.options)
        self.budget = StepBudget()
        # chains on ``line``; a step whose trees branch pays ``branch`` more (the CPU's off-branch rows)
        self.budget.chain_cost = line
        self.budget.cost = StepCost(line.intercept + branch, line.slope)

    def _propose(self, req_id: str, context: np.ndarray, depth: int, nodes: int) -> DraftTree:
        options = {**self.options, "num_speculative_tokens": depth, "max_nodes": nodes}
        return self.drafter.propose([DraftRequest(req_id, context, options)])[0]

    def draft(self, req_id: str, prompt: np.ndarray, context: np.ndarray, new: list[int], left: int) -> Draft:
        depth = min(self.options["num_speculative_tokens"], left - 1)  # as the engine caps it
        cap = node_cap(self.options)
        if depth < 1:
            empty = DraftTree.empty()
            return Draft(empty, empty, empty, self._match(req_id, context, depth), 0.0)
        ask = self.budget.draft_cap(req_id, cap) if self.policy == "auto" else cap
        seconds = 0.0
        tree = DraftTree.empty()
        if ask:
            start = time.perf_counter()
            tree = self._propose(req_id, context, depth, ask)
            seconds = time.perf_counter() - start
        capped = tree if ask == cap else self._propose(req_id, context, depth, cap)
        if self.policy == "auto" and ask:
            tree = self.budget.prune([req_id], [tree], [context.size], 1)[0]
        candidates = self._propose(req_id, context, depth, ALL_NODES)
        return Draft(tree, capped, candidates, self._match(req_id, context, depth), seconds)

    def _match(self, req_id: str, tokens: np.ndarray, depth: int) -> int:
        """The length of the suffix the drafter drafts from at ``depth`` (0: none)."""
        options = {**self.options, "num_speculative_tokens": max(depth, 1)}
        choice = self.drafter.choose(DraftRequest(req_id, tokens, options))
        return 0 if choice is None else choice.length

    def committed(self, req_id: str, committed: list[int], num_tokens: int) -> None:
        if self.policy == "auto":
            self.budget.observe_committed(req_id, committed, num_tokens)

    def finish(self, req_id: str, tokens: np.ndarray, new: list[int]) -> None:
        if self.drafter.learns_across_requests:
            self.drafter.finished([DraftRequest(req_id, tokens, self.options)])
        self.budget.remove([req_id])


def walk(tree: DraftTree, answer: list[int]) -> tuple[int, bool]:
    """The answer tokens ``tree`` accepts, and whether the accepted path ends at a leaf (the root when empty)."""
    parents = tree.parents.tolist()
    path = committed_path(tree.tokens.tolist(), parents, answer)
    last = path[-1] if path else ROOT
    return len(path), last not in parents


def available(earlier: list[np.ndarray], context: np.ndarray, answer: list[int]) -> tuple[int, int]:
    """The longest suffix (at most :data:`MAX_DEPTH`) of ``context`` found before (in ``context`` or ``earlier``
    sequences), and the most ``answer`` tokens following one of its occurrences (at most ``len(answer)``)."""
    separator = np.full(1, -1, np.int64)
    hay = np.concatenate([part for seq in earlier for part in (seq, separator)] + [np.asarray(context, np.int64)])
    found = match_ends(hay[:-1], hay, 1, MAX_DEPTH)
    best = 0
    want = np.asarray(answer, np.int64)
    for end in found.ends:
        after = hay[end + 1 : end + 1 + want.size]
        after = after[: np.flatnonzero(after == -1)[0]] if (after == -1).any() else after
        same = after == want[: after.size]
        best = max(best, int(after.size if same.all() else np.argmin(same)))
        if best == want.size:
            break
    return found.length, best


def cause(draft: Draft, accepted: int, answer: list[int], longest: int) -> str:
    """Why a step accepted fewer tokens than available (module docstring)."""
    if walk(draft.capped, answer)[0] > accepted:
        return "budget"
    most, at_leaf = walk(draft.candidates, answer)
    if most > accepted:
        return "ranked"
    if draft.candidates.num_nodes == 0:
        return "no match"
    if at_leaf:
        return "depth"
    return "shorter match" if draft.match < longest else "other text"


@dataclass
class Result:
    name: str
    steps: int = 0
    accepted: int = 0
    drafted: int = 0  # nodes verified
    seconds: list[float] = field(default_factory=list)  # its propose calls
    #: per drafting step: request, tokens committed before, nodes, accepted, available, match, longest, cause
    records: list[list[Any]] = field(default_factory=list)

    @property
    def per_step(self) -> float:
        return self.accepted / max(self.steps, 1)


def replay(contender: Contender, prompts: list[list[int]], answers: list[list[int]]) -> Result:
    """Commit ``answers`` after ``prompts`` one request after another, drafted by ``contender`` (see the module)."""
    result = Result(contender.name)
    earlier: list[np.ndarray] = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        req_id = f"{i}"
        prompt_ids = np.asarray(prompt, np.int64)
        done, new = 1, answer[:1]  # the prefill step: one token, no draft
        result.steps += 1
        while done < len(answer):
            context = np.asarray(prompt + answer[:done], np.int64)
            left = len(answer) - done
            draft = contender.draft(req_id, prompt_ids, context, new, left)
            rest = answer[done:]
            accepted = min(walk(draft.tree, rest)[0], left - 1)  # the engine stops at max_tokens
            longest, avail = available(earlier, context, rest[: min(MAX_DEPTH, left - 1)])
            why = cause(draft, accepted, rest, longest) if accepted < avail else ""
            result.records.append([i, done, draft.tree.num_nodes, accepted, avail, draft.match, longest, why])
            if draft.seconds:
                result.seconds.append(draft.seconds)
            result.drafted += draft.tree.num_nodes
            new = answer[done : done + accepted + 1]  # the accepted drafts and the target's own
            done += len(new)
            result.steps += 1
            result.accepted += accepted
            contender.committed(req_id, new, len(prompt) + done)
        full = np.asarray(prompt + answer, np.int64)
        contender.finish(req_id, full, new)
        earlier.append(full)
    return result


def losses(result: Result) -> dict[str, tuple[int, int]]:
    """Per cause: the steps, and the tokens lost (available minus accepted)."""
    out = {c: [0, 0] for c in CAUSES}
    for *_, accepted, avail, _match, _longest, why in result.records:
        if why:
            out[why][0] += 1
            out[why][1] += avail - accepted
    return {c: (steps, lost) for c, (steps, lost) in out.items()}


def contenders(line: StepCost, also: list[dict[str, Any]] = (), branch: float = 0.0) -> list[Contender]:
    """``suffix`` k24, then ``lookup_tree`` in both scopes and each of ``also`` (more options), ``auto`` and ``cap``."""
    made: list[Contender] = [SuffixChain()]
    for user in ({}, {"scope": "global"}, *also):
        options = parse({"method": "lookup_tree", **user}).options
        for policy in ("auto", "cap"):
            made.append(LookupTree(options, policy, line, branch))
            if user in also:
                made[-1].name += " " + json.dumps(user)
    return made


def table(results: list[Result]) -> str:
    lines = [
        "| drafter | steps | accepted/step | tokens/step | nodes/step | available/step | "
        + " | ".join(f"{c} (steps, tokens)" for c in CAUSES)
        + " | drafting µs/step (median) |",
        "|---|---|---|---|---|---|" + "---|" * len(CAUSES) + "---|",
    ]
    for r in results:
        drafting = len(r.records)
        avail = sum(rec[4] for rec in r.records) / max(r.steps, 1)
        tokens = (r.accepted + r.steps) / max(r.steps, 1)
        cells = " | ".join(f"{s}, {t}" for s, t in losses(r).values())
        micros = 1e6 * statistics.median(r.seconds) if r.seconds else 0.0
        lines.append(
            f"| {r.name} | {r.steps} | {r.per_step:.2f} | {tokens:.2f} | {r.drafted / max(drafting, 1):.1f} | "
            f"{avail:.2f} | {cells} | {micros:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    recorded_run_arguments(parser, batch_size=1)
    parser.add_argument(
        "--line",
        type=float,
        nargs=2,
        default=(0.018, 0.001),
        metavar=("INTERCEPT_S", "SLOPE_S"),
        help="the step budget's cost line (default: about the main job's fitted line at batch 1)",
    )
    parser.add_argument(
        "--branch",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="what a step whose trees branch costs more than a step of chains (on CPU: the off-branch rows)",
    )
    parser.add_argument(
        "--also",
        type=json.loads,
        default=[],
        metavar="JSON",
        help="more lookup_tree settings to replay, a JSON list of option objects",
    )
    parser.add_argument("--out", type=Path, help="write table.md and steps.json here")
    args = parser.parse_args(argv)

    prompts, answers = load_recorded(args.outputs, args.model, args.prompts, args.batch_size)
    results = [replay(c, prompts, answers) for c in contenders(StepCost(*args.line), args.also, args.branch)]
    head = (
        f"{len(answers)} requests one after another, {sum(map(len, answers))} answer tokens; "
        f"budget line {args.line[0] * 1e3:g} ms + {args.line[1] * 1e3:g} ms a row, "
        f"{args.branch * 1e3:g} ms more when a tree branches; "
        "losses: steps, and tokens short of the available"
    )
    command = shlex.join(["python", "benchmarks/suffix_replay.py", *(sys.argv[1:] if argv is None else argv)])
    text = f"{command}\n\n{head}\n\n{table(results)}\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(text)
        steps = {
            "columns": ["request", "position", "nodes", "accepted", "available", "match", "longest", "cause"],
            "drafters": {r.name: r.records for r in results},
        }
        (args.out / "steps.json").write_text(json.dumps(steps, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
