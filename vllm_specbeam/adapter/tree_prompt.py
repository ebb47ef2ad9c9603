"""Tree prompts: a draft tree appended to a prompt, scored in one prefill.

The speculative beam search (:mod:`vllm_specbeam.adapter.beam_search`) submits
each beam as an ordinary request whose prompt is the beam's tokens followed
by the flattened draft tree, the tree's parents in
``SamplingParams.extra_args[TREE_PARENTS_KEY]``. The runner gives those rows
depth-based positions and ancestor-only attention, and vLLM's prompt
logprobs return the target's top tokens at every tree row: one ``generate``
verifies the whole forest in one target pass.

Two things keep this exact:

* **the root row is computed**: :func:`block_hash_extra_keys` gives every
  cache block holding the root or a tree row a key unique to the request, so
  it is never served from, nor serves, the prefix cache (its rows were
  computed with tree positions and masks);
* **prompt logprobs are read from the end**: the runner returns a tree
  prompt's logprobs at the root and the tree's rows only, so the last
  ``num_nodes`` entries are the tree's; entry ``k`` was computed at the row
  *before* tree token ``k`` (the root, then node ``k - 1``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_specbeam.adapter.engine_config import SCHEDULER
from vllm_specbeam.core.tree import ROOT, DraftTree

#: ``SamplingParams.extra_args`` key holding the parents of the tree that ends the prompt
TREE_PARENTS_KEY = "specbeam_tree_parents"


CHUNKED_PREFILL = (
    "tree prompts (speculative beam search) under chunked prefill need the plugin's scheduler, "
    "which keeps a tree's rows in one prefill chunk, but scheduler_cls={cls} was set: remove "
    "--scheduler-cls / scheduler_cls, or start the engine with enable_chunked_prefill=False"
)


class TreePromptError(ValueError):
    """A tree-prompt request that cannot be scored as asked."""


def tree_parents(extra_args: Mapping[str, Any] | None) -> list[int] | None:
    """The parents of a tree-prompt request, ``None`` for any other request."""
    if not extra_args or TREE_PARENTS_KEY not in extra_args:
        return None
    return extra_args[TREE_PARENTS_KEY]


def tree_root(num_prompt_tokens: int, num_nodes: int) -> int:
    """Index of the root of the tree ending a prompt: its last token before the tree's rows.
    Example: a 10-token prompt ending in a 3-node tree has its root at 6 (rows 6-9)."""
    return num_prompt_tokens - num_nodes - 1


def chunking_problem(scheduler_config: Any) -> str | None:
    """Why this engine's prefill chunks may split a tree, or ``None``."""
    if scheduler_config.enable_chunked_prefill and scheduler_config.scheduler_cls != SCHEDULER:
        return CHUNKED_PREFILL.format(cls=scheduler_config.scheduler_cls)
    return None


def tree_row_limit(scheduler_config: Any) -> int | None:
    """The most rows (root and nodes) one prefill chunk of this engine computes;
    ``None`` without chunked prefill (a whole prompt is one step)."""
    if not scheduler_config.enable_chunked_prefill:
        return None
    limit = scheduler_config.max_num_batched_tokens
    if scheduler_config.long_prefill_token_threshold > 0:
        limit = min(limit, scheduler_config.long_prefill_token_threshold)
    return int(limit)


def check_params(params: Any, scheduler_config: Any) -> None:
    """Admission check of a tree-prompt request (fails that request only).

    The runner scores a tree only when its root and all its rows are computed
    in one step. Without chunked prefill every prompt is; with it, the
    plugin's scheduler (:class:`~vllm_specbeam.adapter.scheduler.TreePromptScheduler`)
    ends no prefill chunk inside a tree, so the tree's rows must fit one
    step's tokens. The tree's length against the prompt's is the runner's to
    check: a tree that does not fit below at least one prompt token is
    ignored there.
    """
    parents = tree_parents(getattr(params, "extra_args", None))
    if parents is None:
        return
    if not isinstance(parents, list) or not all(type(p) is int for p in parents):
        raise TreePromptError(f"extra_args[{TREE_PARENTS_KEY!r}] must be a list of ints, got {parents!r}")
    try:
        DraftTree(np.zeros(len(parents), np.int64), np.asarray(parents, np.int64))
    except ValueError as error:
        raise TreePromptError(f"extra_args[{TREE_PARENTS_KEY!r}]: {error}") from error
    problem = chunking_problem(scheduler_config)
    if parents and problem is not None:
        raise TreePromptError(problem)
    limit = tree_row_limit(scheduler_config)
    if parents and limit is not None and len(parents) + 1 > limit:
        raise TreePromptError(
            f"a tree of {len(parents)} nodes needs its root and nodes ({len(parents) + 1} rows) in one "
            f"prefill chunk, but this engine computes at most {limit} prompt tokens a step "
            "(max_num_batched_tokens, long_prefill_token_threshold): draft fewer nodes or raise "
            "--max-num-batched-tokens"
        )
    if parents and (params.prompt_logprobs is None or params.skip_reading_prefix_cache is not False):
        raise TreePromptError(
            "a tree-prompt request needs prompt_logprobs (the tree rows' scores) and "
            "skip_reading_prefix_cache=False (beams share their prefix through the cache)"
        )


def whole_tree_chunk(num_prompt_tokens: int, num_nodes: int, start: int, num_new_tokens: int) -> int:
    """A prefill chunk's token count from ``start``, cut so that the chunk does not end inside
    the tree at the end of the prompt (the rows from its root on).

    Example: a 10-token prompt ending in a 3-node tree has its root at index 6
    (rows 6-9). From 0 with room for 8 tokens the chunk stops before the root
    (6 tokens); from 6 it takes rows 6-9 when there is room for 4, and waits (0)
    with room for 3. A chunk that starts past the root is left alone.
    """
    root = tree_root(num_prompt_tokens, num_nodes)
    if start <= root < start + num_new_tokens < num_prompt_tokens:
        return root - start
    return num_new_tokens


def prompt_tree(params: Any, prompt_token_ids: Sequence[int]) -> DraftTree | None:
    """The tree at the end of an admitted request's prompt; ``None`` for
    ordinary requests and for a tree with no prompt token left to be its root."""
    parents = tree_parents(getattr(params, "extra_args", None))
    if not parents or len(parents) >= len(prompt_token_ids):
        return None
    tokens = np.asarray(prompt_token_ids[len(prompt_token_ids) - len(parents) :], np.int64)
    return DraftTree(tokens, np.asarray(parents, np.int64))


def request_params(parents: Sequence[int], num_logprobs: int) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments scoring a tree of ``parents`` at the
    end of the prompt: the top ``num_logprobs`` tokens at every tree row and at
    the root (greedy, one token: the last row's distribution is the sampled
    token's logprobs)."""
    kwargs: dict[str, Any] = {
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": num_logprobs,
        "detokenize": False,
        "extra_args": {TREE_PARENTS_KEY: [int(p) for p in parents]},
    }
    if len(parents):
        kwargs.update(prompt_logprobs=num_logprobs, skip_reading_prefix_cache=False)
    return kwargs


@dataclass(frozen=True)
class SharedTree:
    """Several beams of one prompt and a draft tree below each, as one tree
    below the beams' common prefix: one request scores them all.

    Beams ``[5, 7, 8, 2]`` and ``[5, 7, 9, 4]`` share ``[5, 7]``: the
    request's prompt is ``[5, 7]`` then the tree, rooted at the ``7``. Beam
    0's tail ``8, 2`` is nodes 0-1 and its draft tree (a 3-node chain) hangs
    below node 1 as nodes 2-4; beam 1's tail ``9, 4`` is nodes 5-6, its
    one-node tree node 7. Equal (parent, token) pairs are one node. Beam 0's
    rows of :func:`row_logprobs` are ``[2, 3, 4, 5]``: its end (node 1, row
    2), then its tree's nodes; a beam with no tail ends at the root (row 0).
    """

    #: how many leading tokens the beams share; the last of them is the root
    prefix_len: int
    tokens: list[int]
    parents: list[int]
    #: per beam: its rows in :func:`row_logprobs` order, its end first, then its tree's nodes
    rows: list[list[int]]

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_tail_nodes(self) -> int:
        """Nodes that are the beams' own tokens (not drafted): rows a per-beam request
        would read from its prompt instead."""
        return self.num_nodes - sum(len(r) - 1 for r in self.rows)


def shared_tree(beams: Sequence[Sequence[int]], trees: Sequence[DraftTree]) -> SharedTree:
    """The beams and their trees (``trees[b]`` below ``beams[b]``) as one :class:`SharedTree`."""
    first = beams[0]
    prefix_len = min(len(b) for b in beams)
    for beam in beams[1:]:
        prefix_len = next((i for i in range(prefix_len) if beam[i] != first[i]), prefix_len)
    if prefix_len == 0:
        raise ValueError("beams to score in one tree must share at least their first token (the root)")
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}

    def node(parent: int, token: int) -> int:
        key = (parent, token)
        if key not in index:
            index[key] = len(tokens)
            tokens.append(token)
            parents.append(parent)
        return index[key]

    rows = []
    for beam, tree in zip(beams, trees, strict=True):
        end = ROOT
        for token in beam[prefix_len:]:
            end = node(end, int(token))
        placed: list[int] = []
        for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
            placed.append(node(end if parent == ROOT else placed[parent], token))
        rows.append([end + 1] + [i + 1 for i in placed])
    return SharedTree(prefix_len, tokens, parents, rows)


def row_logprobs(output: Any, num_nodes: int) -> list[dict[int, Any]]:
    """The target's logprob dicts at the root and at every tree node (``num_nodes + 1``).

    ``output`` is the request's ``RequestOutput``. Row ``r`` is the root for
    ``r = 0`` and node ``r - 1`` otherwise.
    """
    last = output.outputs[0].logprobs[0]
    if num_nodes == 0:
        return [last]
    prompt = output.prompt_logprobs or []
    rows = prompt[len(prompt) - num_nodes :]
    if len(rows) != num_nodes or any(row is None for row in rows):
        raise TreePromptError(
            f"request {output.request_id}: vLLM returned {len(prompt)} prompt logprob rows, "
            f"fewer than the tree's {num_nodes}: its root row came from the prefix cache"
        )
    return [*rows, last]


def block_hash_extra_keys(stock: Any) -> Any:
    """Wrap vLLM 0.32.0 ``v1/core/kv_cache_utils.generate_block_hash_extra_keys``:
    blocks that hold the root or a tree row of a tree-prompt request get the
    request id as an extra key (see the module docstring)."""

    def generate_block_hash_extra_keys(
        request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int
    ) -> tuple[tuple[Any, ...] | None, int]:
        keys, next_mm_idx = stock(request, start_token_idx, end_token_idx, start_mm_idx)
        parents = tree_parents(getattr(request.sampling_params, "extra_args", None))
        if parents and end_token_idx > tree_root(request.num_prompt_tokens, len(parents)):
            keys = (*(keys or ()), ("specbeam_tree", request.request_id))
        return keys, next_mm_idx

    return generate_block_hash_extra_keys


def shared_prefix_len(num_prompt_tokens: int, num_nodes: int, block_size: int) -> int:
    """The leading tokens of a tree-prompt request that sit in cache blocks other requests may hit:
    the full blocks before the root's (:func:`block_hash_extra_keys` keys the rest to the request,
    and vLLM hashes full blocks only). Example: 100 prompt tokens ending in a 9-node tree, blocks
    of 32: the root is token 90, blocks 0-1 (tokens 0-63) may be shared, block 2 holds the root."""
    return tree_root(num_prompt_tokens, num_nodes) // block_size * block_size
