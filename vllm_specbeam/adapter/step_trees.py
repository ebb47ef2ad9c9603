"""The trees whose rows run in a step, found in vLLM's batch, and the attention layers' view of them.

A step's trees are the drafts the scheduler scheduled for verifying requests
and the trees ending tree-prompt requests' prompts
(:mod:`vllm_specbeam.adapter.tree_prompt`, kept by :class:`PromptTrees`); the
runner's ``_prepare_inputs`` finds them here and sets each node's position to
``context + depth``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_specbeam.adapter import tree_prompt
from vllm_specbeam.adapter.attention import cpu as cpu_attention
from vllm_specbeam.adapter.verification import StepTree
from vllm_specbeam.core.tree import DraftTree

if TYPE_CHECKING:
    from vllm_specbeam.adapter.attention.cuda import GpuTreeStep


@dataclass(frozen=True)
class BatchRow:
    """Where one request's rows lie in the step's batch."""

    batch_index: int
    #: the token row of its first scheduled token
    first_row: int
    #: its tokens computed before this step, and its rows in this step
    num_computed: int
    num_scheduled: int


@dataclass(frozen=True)
class BatchRows:
    """The step's batch layout, as vLLM's ``_prepare_inputs`` left it (arrays by batch index)."""

    req_id_to_index: Mapping[str, int]
    #: each request's first token row (vLLM's ``query_start_loc.np``)
    first_rows: np.ndarray  # [num_reqs + 1]
    num_computed: np.ndarray  # [max_num_reqs]
    num_scheduled: np.ndarray  # [num_reqs]

    def row(self, req_id: str) -> BatchRow | None:
        """``req_id``'s rows, ``None`` when it is not in the batch."""
        index = self.req_id_to_index.get(req_id)
        if index is None:
            return None
        return BatchRow(
            index, int(self.first_rows[index]), int(self.num_computed[index]), int(self.num_scheduled[index])
        )


def scheduled_tree(req_id: str, drafts: list[int], proposed: Mapping[str, DraftTree]) -> DraftTree:
    """The tree behind the drafts the scheduler scheduled for ``req_id`` (``proposed``: the last
    tree proposed for each request)."""
    if min(drafts) < 0:
        # vLLM 0.32.0 scheduler.py pads a (re)starting decode to the
        # full draft length with -1 (to keep CUDA graphs uniform):
        # rows to skip, nothing to verify.
        return DraftTree.empty()
    # The scheduler may cut the list short; a prefix of a
    # topologically ordered tree is still a tree.
    tree = proposed[req_id].truncate(len(drafts))
    if tree.tokens.tolist() != list(drafts):
        raise RuntimeError(f"vllm-specbeam: drafts scheduled for {req_id} are not the tree proposed for it")
    return tree


def verifying_tree(req_id: str, row: BatchRow, num_drafts: int, tree: DraftTree) -> StepTree:
    """A verifying request's ``tree`` in the step, behind ``num_drafts`` scheduled drafts."""
    # The drafts are the last rows of the request; before the root may
    # come prompt or recomputed tokens (a resumed request).
    before_root = row.num_scheduled - 1 - num_drafts
    return StepTree(req_id, row.batch_index, row.first_row + before_root, row.num_computed + before_root, tree)


def verifying_trees(
    scheduled_drafts: Mapping[str, list[int]], proposed: Mapping[str, DraftTree], rows: BatchRows
) -> list[StepTree]:
    """The trees behind the drafts the scheduler scheduled (``scheduled_spec_decode_tokens``)."""
    trees = []
    for req_id, drafts in scheduled_drafts.items():
        if drafts:
            tree = scheduled_tree(req_id, drafts, proposed)
            row = rows.row(req_id)
            assert row is not None, f"vllm-specbeam: drafts scheduled for {req_id}, which is not in the batch"
            trees.append(verifying_tree(req_id, row, len(drafts), tree))
    return trees


def prompt_tree_in_step(req_id: str, row: BatchRow, tree: DraftTree, num_prompt_tokens: int) -> StepTree | None:
    """A tree-prompt request's tree if this step computes its rows, else ``None``.

    A tree's root and rows are computed in one step: without chunked
    prefill the whole prompt is, with it the plugin's scheduler ends no
    chunk inside a tree (adapter/scheduler.py; tree_prompt.check_params
    refuses a tree too large for one step).
    """
    root = tree_prompt.tree_root(num_prompt_tokens, tree.num_nodes)
    if not row.num_computed <= root < row.num_computed + row.num_scheduled:
        return None
    return StepTree(req_id, row.batch_index, row.first_row + root - row.num_computed, root, tree)


class PromptTrees:
    """The trees at the end of tree-prompt requests' prompts, from a request's arrival to its end."""

    def __init__(self) -> None:
        self._trees: dict[str, DraftTree] = {}

    def get(self, req_id: str) -> DraftTree | None:
        return self._trees.get(req_id)

    def add(self, req_id: str, params: Any, prompt_token_ids: list[int] | None) -> None:
        """Keep a newly scheduled request's tree, if its prompt ends in one."""
        tree = tree_prompt.prompt_tree(params, prompt_token_ids or [])
        if tree is not None:
            self._trees[req_id] = tree

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._trees.pop(req_id, None)

    def in_step(self, rows: BatchRows, num_prompt_tokens: Callable[[str], int]) -> list[StepTree]:
        """The tree-prompt requests whose tree rows are computed this step."""
        trees = []
        for req_id, tree in self._trees.items():
            row = rows.row(req_id)
            entry = None if row is None else prompt_tree_in_step(req_id, row, tree, num_prompt_tokens(req_id))
            if entry is not None:
                trees.append(entry)
        return trees

    def take_logprobs(self, pending: dict[str, int], scheduled: Mapping[str, int]) -> dict[str, tuple[int, DraftTree]]:
        """The tree-prompt requests in ``pending`` (vLLM's ``num_prompt_logprobs``) with rows this step,
        taken out of it: their number of logprobs, and their tree."""
        return {
            req_id: (pending.pop(req_id), tree)
            for req_id, tree in self._trees.items()
            if req_id in pending and req_id in scheduled
        }


def build_tree_step(
    trees: list[StepTree], num_tokens: int, request_starts: np.ndarray, device: torch.device
) -> cpu_attention.TreeStep | GpuTreeStep:
    """The attention layers' view of this step's trees, built once per step; ``request_starts``:
    each batch row's first token row."""
    indices = [entry.batch_index for entry in trees]
    root_rows = [entry.root_row for entry in trees]
    root_positions = [entry.root_position for entry in trees]
    draft_trees = [entry.tree for entry in trees]
    if device.type == "cpu":
        return cpu_attention.TreeStep.build(indices, root_rows, root_positions, draft_trees)
    from vllm_specbeam.adapter.attention.cuda import GpuTreeStep

    starts = request_starts[indices].tolist()
    return GpuTreeStep.build(starts, root_rows, root_positions, draft_trees, num_tokens, device)


def tree_logprobs(
    model: Any, sampler: Any, logprobs_mode: str, hidden_states: torch.Tensor, entry: StepTree, num_logprobs: int
) -> Any:
    """vLLM's ``LogprobsTensors`` of a tree prompt's rows in the step's ``hidden_states``: the root
    and the tree's nodes but the last, each scored against its next prompt token (a node)."""
    from vllm.v1.outputs import LogprobsTensors

    tree = entry.tree
    logits = model.compute_logits(hidden_states[entry.root_row : entry.root_row + tree.num_nodes])  # [num_nodes, V]
    raw = logprobs_mode in ("raw_logits", "processed_logits")
    scores = logits.to(torch.float32) if raw else sampler.compute_logprobs(logits)
    targets = torch.as_tensor(tree.tokens, device=logits.device)  # [num_nodes]: each row's next prompt token
    token_ids, logprobs, ranks, *_ = sampler.gather_logprobs(scores, num_logprobs, targets)
    # host sync on CUDA (one per tree-prompt request, as vLLM's own sync here)
    return LogprobsTensors(token_ids.cpu(), logprobs.cpu(), ranks.cpu())
