"""Tree verification in the runner's ``_sample``: what each request accepts, in vLLM's shape.

The method's verifier replaces vLLM's rejection sampler for the requests whose
trees run this step (:class:`TreeVerification`); the runner moves the accepted
nodes' K/V into consecutive slots (:func:`move_accepted_kv`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_specbeam.adapter.attention.step import move_kv_slots
from vllm_specbeam.adapter.tree_counts import TreeCounts
from vllm_specbeam.core.budget import FILL_KIND
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.core.verifiers.base import TreeVerifier

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1  # vllm.v1.sample.rejection_sampler.PLACEHOLDER_TOKEN_ID
SAMPLING_EPS = 1e-5  # vllm.v1.sample.sampler: temperatures below are greedy


def target_probabilities(
    logits: torch.Tensor, batch_indices: list[int], rows_per_request: np.ndarray, sampling_metadata: SamplingMetadata
) -> torch.Tensor:
    """The target's sampling distribution for each verification row.

    Temperature, top-k and top-p of each request applied to all its rows, with
    vLLM's own top-k/top-p op (vllm/v1/sample/ops/topk_topp_sampler.py), so
    the distribution is the one vLLM samples from without speculation.
    """
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    index = torch.as_tensor(batch_indices, device=logits.device)
    repeats = torch.as_tensor(rows_per_request, device=logits.device)

    def per_row(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[index].repeat_interleave(repeats)

    scaled = logits.to(torch.float32) / per_row(sampling_metadata.temperature)[:, None]
    return apply_top_k_top_p(scaled, per_row(sampling_metadata.top_k), per_row(sampling_metadata.top_p)).softmax(-1)


@dataclass(frozen=True)
class StepTree:
    """A tree whose rows run in this step: a verifying request's drafts, or
    the tree at the end of a tree-prompt request's prompt."""

    req_id: str
    batch_index: int
    #: token row of the tree's root in this step's batch
    root_row: int
    #: the root's position (tokens before it); a node's position is this + its depth
    root_position: int
    tree: DraftTree


@dataclass(frozen=True)
class Accepted:
    """What verification decided for one request."""

    #: accepted nodes, shallowest first
    path: np.ndarray  # [accepted]
    #: tokens to commit: the accepted drafts, then one token from the target
    tokens: list[int]


@dataclass
class AcceptedRows:
    """The accepted paths laid out for vLLM: its output tokens, their logit rows, the K/V to move."""

    #: each request's committed tokens, padded with ``PLACEHOLDER_TOKEN_ID``
    output: torch.Tensor  # [num_reqs, width] int32
    #: the logit row of every output token, for the logprobs vLLM reports
    logit_rows: np.ndarray  # [num_reqs, width]
    #: token rows whose K/V move, and where to: one array per verifying request, root-first
    src_rows: list[np.ndarray]
    dst_rows: list[np.ndarray]


def first_logit_rows(spec_decode_metadata: SpecDecodeMetadata) -> np.ndarray:
    """Each request's first logit row: vLLM 0.32.0 gpu_model_runner.py
    ``_calc_spec_decode_metadata`` gives every request 1 + its drafts rows, in order."""
    num_sampled = np.asarray(spec_decode_metadata.num_draft_tokens) + 1
    return np.cumsum(num_sampled) - num_sampled  # [num_reqs]


def count_tree(counts: TreeCounts, tree: DraftTree, path: np.ndarray) -> None:
    """Count one verified tree and its accepted ``path``, by where its nodes came from."""
    if tree.num_nodes == 0:  # vLLM's padding rows, not a draft
        return
    counts.trees += 1
    counts.nodes += tree.num_nodes
    counts.depth_sum += tree.max_depth
    counts.accepted += int(path.size)
    if tree.kinds is not None:
        fill = tree.kinds >= FILL_KIND  # [nodes]
        counts.nodes_fill += int(fill.sum())
        counts.nodes_lookup += int(fill.size - fill.sum())
        counts.accepted_fill += int(fill[path].sum())
        counts.accepted_lookup += int(path.size - fill[path].sum())
    if tree.from_index is not None:
        counts.nodes_from_index += int(tree.from_index.sum())
        counts.accepted_from_index += int(tree.from_index[path].sum())
    first_children = {int(p): int(np.argmax(tree.parents == p)) for p in tree.parents[path]}
    counts.accepted_off_first_branch += sum(first_children[int(tree.parents[n])] != int(n) for n in path)


def move_accepted_kv(
    slots: torch.Tensor,
    src_rows: list[np.ndarray],
    dst_rows: list[np.ndarray],
    kv_layers: list[tuple[torch.nn.Module, torch.Tensor]],
    on_cuda: bool,
    layer_pointers: torch.Tensor | None,
) -> int:
    """Copy K/V, all ``kv_layers``, from token rows ``src_rows`` to ``dst_rows`` (one array per
    request, root-first) through the step's slot mapping ``slots`` (``[num_tokens]``);
    ``layer_pointers``: the CUDA kernel's table. Returns the number of moves."""
    counts = [moves.size for moves in src_rows]
    rows = torch.from_numpy(np.concatenate([*src_rows, *dst_rows])).to(slots.device)
    src, dst = slots[rows].to(torch.int64).tensor_split([sum(counts)])  # [moves] each
    move_kv_slots(kv_layers, src, dst, counts, on_cuda, layer_pointers)
    return sum(counts)


class TreeVerification:
    """The step's trees under verification, and the method's rules that verify them."""

    def __init__(self, verifiers: tuple[TreeVerifier, TreeVerifier, TreeVerifier | None], counts: TreeCounts) -> None:
        self.greedy_verifier, self.sampling_verifier, self.chain_verifier = verifiers
        self.counts = counts
        #: this step's trees under verification
        self.verifying: list[StepTree] = []

    def verify(
        self,
        logits: torch.Tensor,
        first_logit: np.ndarray,
        sampling_metadata: SamplingMetadata,
        temperatures: Mapping[str, float],
    ) -> list[Accepted]:
        """What to accept for each verifying request, in :attr:`verifying`'s order.

        Greedy requests: exact argmax matching on the raw logits. Sampled
        requests: the method's lossless rule on the target's probabilities
        after vLLM's own temperature / top-k / top-p processing; a sampled
        request whose draft is a single chain gets block verification when the
        method allows it (never fewer accepted tokens, same distribution).
        """
        rules = [self._rule_for(entry, temperatures[entry.req_id]) for entry in self.verifying]
        results: dict[int, Accepted] = {}
        for rule in {id(r): r for r in rules}.values():
            chosen = [k for k, r in enumerate(rules) if r is rule]
            indices = [self.verifying[k].batch_index for k in chosen]
            trees = [self.verifying[k].tree for k in chosen]
            verdict = self._verdict(rule, trees, indices, logits, first_logit, sampling_metadata)
            self._count_verdict(rule, len(chosen), verdict)
            for k, path, tokens in zip(chosen, verdict.accepted, verdict.tokens):
                results[k] = Accepted(path, tokens)
        return [results[k] for k in range(len(rules))]

    def _rule_for(self, entry: StepTree, temperature: float) -> TreeVerifier:
        if temperature < SAMPLING_EPS:
            return self.greedy_verifier
        if self.chain_verifier is not None and entry.tree.is_chain:
            return self.chain_verifier
        return self.sampling_verifier

    def _verdict(
        self,
        rule: TreeVerifier,
        trees: list[DraftTree],
        indices: list[int],
        logits: torch.Tensor,
        first_logit: np.ndarray,
        sampling_metadata: SamplingMetadata,
    ) -> Any:
        """``rule``'s verdict on ``trees`` (batch rows ``indices``); host sync: every rule returns host data."""
        if rule is self.greedy_verifier:
            return rule.verify(trees, logits, first_logit[indices])
        rows_per_request = np.array([tree.num_nodes + 1 for tree in trees])
        rows = np.concatenate([first_logit[i] + np.arange(n) for i, n in zip(indices, rows_per_request)])
        return rule.verify(
            trees,
            target_probabilities(logits[torch.from_numpy(rows)], indices, rows_per_request, sampling_metadata),
            np.concatenate([[0], np.cumsum(rows_per_request)[:-1]]),
            [sampling_metadata.generators.get(index) for index in indices],
        )

    def _count_verdict(self, rule: TreeVerifier, num_trees: int, verdict: Any) -> None:
        counts = self.counts
        if rule is self.chain_verifier:
            counts.block_verified += num_trees
        for widths in verdict.widths or ():
            counts.beam_width_sum += sum(widths)
            counts.beam_depths += len(widths)
        counts.accepted_off_argmax += sum(verdict.off_argmax or ())

    def accepted_rows(
        self, verdicts: list[Accepted], plain: torch.Tensor, first_logit: np.ndarray, width: int
    ) -> AcceptedRows:
        """The verdicts in vLLM's shape, with ``plain`` (vLLM's one sampled token per request,
        ``[num_reqs]``) in column 0; the step's trees are counted and forgotten."""
        num_reqs = plain.shape[0]
        output = torch.full((num_reqs, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        output[:, 0] = plain.to(torch.int32)  # host sync: the output is assembled on the host
        logit_rows = np.repeat(first_logit[:, None], width, axis=1)  # [num_reqs, width]
        laid_out = AcceptedRows(output, logit_rows, [], [])
        for entry, verdict in zip(self.verifying, verdicts):
            path = verdict.path
            output[entry.batch_index, : len(verdict.tokens)] = torch.tensor(verdict.tokens, dtype=torch.int32)
            count_tree(self.counts, entry.tree, path)
            logit_rows[entry.batch_index, 1 : len(verdict.tokens)] = first_logit[entry.batch_index] + 1 + path
            moved = path + 1 != np.arange(1, path.size + 1)
            laid_out.src_rows.append(entry.root_row + 1 + path[moved])
            laid_out.dst_rows.append(entry.root_row + 1 + np.flatnonzero(moved))
        self.verifying = []
        return laid_out


def accepted_logprobs(sampler: Any, logits: torch.Tensor, rows: AcceptedRows, max_num_logprobs: int | None) -> Any:
    """vLLM's logprobs of the committed tokens ``rows.output`` at their logit rows (``None`` unless asked for).

    vLLM's rejection sampler computes them at every ``[num_reqs, width]`` cell, placeholders
    included, and its ``parse_output`` keeps the committed cells (``output`` not
    ``PLACEHOLDER_TOKEN_ID``). A tree's width is its node count, not a chain's few tokens, so
    only the committed cells are computed here; the others hold zeros that vLLM drops (the cells
    are chosen on the host, where the output was assembled: no sync). Example:
    200 requests, width 49: 200 + accepted rows through the full-vocabulary softmax, not 9,800.
    """
    if max_num_logprobs is None:
        return None
    from vllm.v1.outputs import LogprobsTensors

    committed = rows.output.view(-1) != PLACEHOLDER_TOKEN_ID  # [num_reqs * width], on the host
    cells = torch.from_numpy(rows.logit_rows.reshape(-1))[committed].to(logits.device)  # [num_committed]
    tokens = rows.output.view(-1)[committed].to(logits.device, torch.int64)  # [num_committed]
    found = sampler.gather_logprobs(sampler.compute_logprobs(logits[cells].to(torch.float32)), max_num_logprobs, tokens)
    where = committed.to(logits.device)
    every = []
    for part in (found.logprob_token_ids, found.logprobs, found.selected_token_ranks):
        full = part.new_zeros((where.numel(), *part.shape[1:]))  # [num_reqs * width, ...]
        full[where] = part
        every.append(full)
    return LogprobsTensors(*every)
