"""The tree runner's parts that need no engine: which requests draft and with what options,
how trees are clipped and priced, where a step's trees lie in the batch, and how verdicts are
laid out for vLLM (``adapter/step_selection.py``, ``step_trees.py``, ``verification.py``,
``step_timing.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from vllm_specbeam.adapter import step_timing
from vllm_specbeam.adapter.engine_config import CACHE_SALT_KEY
from vllm_specbeam.adapter.step_selection import (
    BatchRequest,
    automatic_trees,
    budget_gain,
    clip_to_room,
    finished_request,
    request_args,
    requests_to_draft,
    useful_depth,
)
from vllm_specbeam.adapter.step_timing import StepTimer, decode_step
from vllm_specbeam.adapter.step_trees import (
    BatchRow,
    BatchRows,
    PromptTrees,
    prompt_tree_in_step,
    scheduled_tree,
    verifying_tree,
    verifying_trees,
)
from vllm_specbeam.adapter.tree_counts import TreeCounts
from vllm_specbeam.adapter.tree_prompt import TREE_PARENTS_KEY
from vllm_specbeam.adapter.verification import (
    PLACEHOLDER_TOKEN_ID,
    Accepted,
    StepTree,
    TreeVerification,
    accepted_logprobs,
    count_tree,
    first_logit_rows,
)
from vllm_specbeam.core.budget import FILL_KIND, StepBudget, StepCostModel
from vllm_specbeam.core.config import parse
from vllm_specbeam.core.tree import DraftTree

FIXED = parse({"method": "lookup_tree", "num_speculative_tokens": 4, "max_nodes": 8})
AUTO = parse({"method": "lookup_tree", "num_speculative_tokens": 4, "max_nodes": "auto"})


def request(req_id: str, index: int, params: SamplingParams | None, outputs: int = 3, sampled: bool = True):
    tokens = np.arange(10 + outputs, dtype=np.int64)
    return BatchRequest(req_id, index, params, outputs, tokens, sampled)


# ------------------------------------------------------------ who drafts, with what options
def test_requests_to_draft_keeps_tree_requests_with_depth_left_and_caps_their_depth() -> None:
    salted = SamplingParams(temperature=0.7, extra_args={CACHE_SALT_KEY: "tenant-a"})
    batch = [
        request("plain", 0, SamplingParams(temperature=0.0)),
        request("not-sampled", 1, SamplingParams(), sampled=False),  # nothing committed this step
        request("min-p", 2, SamplingParams(min_p=0.1)),  # vLLM applies min-p per sequence: no tree
        request("no-params", 3, None),  # a pooling request
        request("near-end", 4, SamplingParams(max_tokens=10), outputs=7),  # 3 left: depth 2
        request("last-token", 5, SamplingParams(max_tokens=8), outputs=7),  # only the target's token left
        request("salted", 6, salted),
    ]
    asked = requests_to_draft(batch, FIXED, draft_cap=None, max_model_len=1024)
    assert [r.req_id for r in asked.requests] == ["plain", "near-end", "salted"]
    assert asked.batch_indices == [0, 4, 6]
    assert asked.automatic == [False, False, False] and asked.sitting_out == 0
    assert [r.options["num_speculative_tokens"] for r in asked.requests] == [4, 2, 4]
    assert [r.tokens_left for r in asked.requests] == [13, 3, 13]  # vLLM's default max_tokens: 16
    assert [r.temperature for r in asked.requests] == [0.0, 1.0, 0.7]
    assert [r.cache_salt for r in asked.requests] == [None, None, "tenant-a"]
    assert asked.requests[1].token_ids is batch[4].token_ids


def test_a_request_near_its_end_drafts_no_lookup_branch_past_max_tokens() -> None:
    """``mcsd``'s lookup may draft deeper (``lookup_depth`` 8) than its draft model (4): a request
    with 4 tokens of depth left lowers both, though its depth is the engine's (a planted bug that
    lowered only a shallower ``num_speculative_tokens`` drafted 5 deep and ran past ``max_tokens``)."""
    hybrid = parse({"method": "mcsd", "num_speculative_tokens": 4, "k_config": [2, 2], "lookup": "global",
                    "lookup_depth": 8, "model": "draft"})  # fmt: skip
    batch = [
        request("early", 0, SamplingParams(max_tokens=48), outputs=3),
        request("near-end", 1, SamplingParams(max_tokens=48), outputs=43),  # 5 left: depth 4
        request("nearer", 2, SamplingParams(max_tokens=48), outputs=45),  # 3 left: depth 2
    ]
    asked = requests_to_draft(batch, hybrid, draft_cap=None, max_model_len=1024)
    depths = [(r.options["num_speculative_tokens"], r.options["lookup_depth"]) for r in asked.requests]
    assert depths == [(4, 8), (4, 4), (2, 2)]


def test_requests_to_draft_asks_the_budget_for_auto_requests_and_counts_those_it_sits_out() -> None:
    caps = {"paying": 3, "idle": 0}
    seen = []

    def draft_cap(req_id: str, cap: int) -> int:
        seen.append((req_id, cap))
        return caps[req_id]

    batch = [request("paying", 0, SamplingParams()), request("idle", 1, SamplingParams())]
    asked = requests_to_draft(batch, AUTO, draft_cap, max_model_len=1024)
    auto_max_nodes = AUTO.options["auto_max_nodes"]
    assert seen == [("paying", auto_max_nodes), ("idle", auto_max_nodes)]
    assert [r.req_id for r in asked.requests] == ["paying"] and asked.requests[0].options["max_nodes"] == 3
    assert asked.automatic == [True] and asked.batch_indices == [0] and asked.sitting_out == 1


def test_a_request_number_under_an_auto_engine_caps_the_budget_instead_of_fixing_the_tree() -> None:
    seen = []

    def draft_cap(req_id: str, cap: int) -> int:
        seen.append((req_id, cap))
        return 0  # the budget sits it out, as it may any automatic request

    capped = request("capped", 0, SamplingParams(extra_args={"max_nodes": 4}))
    asked = requests_to_draft([capped], AUTO, draft_cap, max_model_len=1024)
    assert seen == [("capped", 4)]
    assert asked.requests == [] and asked.sitting_out == 1


def test_requests_to_draft_of_an_empty_batch_asks_nothing() -> None:
    asked = requests_to_draft([], FIXED, draft_cap=None, max_model_len=1024)
    assert (asked.requests, asked.batch_indices, asked.automatic, asked.sitting_out) == ([], [], [], 0)


def test_useful_depth_counts_the_target_token_and_no_limit_is_unbounded() -> None:
    assert useful_depth(max_tokens=10, num_output_tokens=5) == 4
    assert useful_depth(max_tokens=6, num_output_tokens=5) == 0
    assert useful_depth(max_tokens=None, num_output_tokens=5) > 1 << 60


def test_request_args_split_the_cache_salt_from_the_options() -> None:
    salted = request_args(SamplingParams(extra_args={"max_nodes": 4, CACHE_SALT_KEY: "s"}))
    assert (salted.overrides, salted.cache_salt) == ({"max_nodes": 4}, "s")
    plain = request_args(SamplingParams(extra_args={"max_nodes": 4}))
    assert (plain.overrides, plain.cache_salt) == ({"max_nodes": 4}, None)
    assert request_args(SamplingParams()).overrides is None


def test_finished_request_is_the_whole_sequence_of_a_text_request_only() -> None:
    params = SamplingParams(temperature=0.5, extra_args={"max_nodes": 4, CACHE_SALT_KEY: "s"})
    state = SimpleNamespace(sampling_params=params, prompt_token_ids=[1, 2], output_token_ids=[3])
    done = finished_request("r", state, FIXED)
    assert done is not None and done.token_ids.tolist() == [1, 2, 3] and done.token_ids.dtype == np.int64
    assert (done.options["max_nodes"], done.temperature, done.cache_salt) == (4, 0.5, "s")
    assert finished_request("r", None, FIXED) is None  # already gone
    embeds = SimpleNamespace(sampling_params=params, prompt_token_ids=None, output_token_ids=[3])
    assert finished_request("r", embeds, FIXED) is None


# ------------------------------------------------------------ clipping and the budget's share
def test_clip_to_room_leaves_a_slot_for_the_target_token() -> None:
    tree = DraftTree.chain([5, 6, 7, 8, 9])
    assert clip_to_room(tree, num_tokens=10, max_model_len=13).tokens.tolist() == [5, 6]
    assert clip_to_room(tree, num_tokens=10, max_model_len=11).num_nodes == 0
    assert clip_to_room(tree, num_tokens=10, max_model_len=10).num_nodes == 0  # no room at all
    assert clip_to_room(tree, num_tokens=10, max_model_len=100).tokens.tolist() == [5, 6, 7, 8, 9]


def test_automatic_trees_chooses_the_auto_ones_and_prices_the_fixed_ones() -> None:
    trees = [DraftTree.chain([1, 2, 3]), DraftTree.chain([4, 5]), DraftTree.chain([6] * 4), DraftTree.empty()]
    choice = automatic_trees(trees, [True, False, True, False])
    assert choice.chosen == [0, 2] and choice.fixed_rows == 2
    assert automatic_trees([], []).chosen == [] and automatic_trees([], []).fixed_rows == 0


@pytest.mark.parametrize(
    ("automatic", "expected"),
    [([], 0.0), ([False], None), ([True, True], 2.5), ([True, False], None)],
    ids=["nothing-drafted", "fixed-only", "all-auto", "mixed"],
)
def test_budget_gain_values_only_steps_whose_trees_it_chose(automatic, expected) -> None:
    assert budget_gain(automatic, kept_value=2.5) == expected


# ------------------------------------------------------------ where a step's trees lie
def test_scheduled_tree_is_the_proposed_prefix_and_padding_is_no_tree() -> None:
    proposed = {"r": DraftTree(np.array([7, 8, 9]), np.array([-1, -1, 0]))}
    assert scheduled_tree("r", [7, 8], proposed).tokens.tolist() == [7, 8]  # the scheduler cut it short
    assert scheduled_tree("r", [-1, -1, -1], proposed).num_nodes == 0  # vLLM's padding of a restarting decode
    with pytest.raises(RuntimeError, match="not the tree proposed"):
        scheduled_tree("r", [7, 9], proposed)


def test_verifying_tree_roots_after_recomputed_rows() -> None:
    tree = DraftTree.chain([1, 2, 3])
    decode = verifying_tree("r", BatchRow(batch_index=2, first_row=10, num_computed=7, num_scheduled=4), 3, tree)
    assert (decode.batch_index, decode.root_row, decode.root_position) == (2, 10, 7)
    # A resumed request recomputes 2 tokens before its root in the same step.
    resumed = verifying_tree("r", BatchRow(2, first_row=10, num_computed=5, num_scheduled=6), 3, tree)
    assert (resumed.root_row, resumed.root_position) == (12, 7)
    # Padding drafts still take their rows: the root comes before them.
    padded = verifying_tree("r", BatchRow(0, first_row=0, num_computed=7, num_scheduled=4), 3, DraftTree.empty())
    assert (padded.root_row, padded.root_position, padded.tree.num_nodes) == (0, 7, 0)


def test_verifying_trees_reads_the_batch_layout() -> None:
    rows = BatchRows({"a": 0, "b": 1}, np.array([0, 4, 5]), np.array([9, 20]), np.array([4, 1]))
    proposed = {"a": DraftTree.chain([1, 2, 3])}
    trees = verifying_trees({"a": [1, 2, 3], "b": []}, proposed, rows)
    assert [(t.req_id, t.root_row, t.root_position) for t in trees] == [("a", 0, 9)]
    assert rows.row("b") == BatchRow(1, 4, 20, 1) and rows.row("gone") is None


def test_prompt_tree_in_step_only_when_the_step_computes_its_rows() -> None:
    tree = DraftTree(np.array([4, 5, 6]), np.array([-1, 0, 0]))  # a 10-token prompt: root at 6
    whole = prompt_tree_in_step("r", BatchRow(1, first_row=5, num_computed=0, num_scheduled=10), tree, 10)
    assert whole is not None and (whole.root_row, whole.root_position) == (11, 6)
    chunk_above = prompt_tree_in_step("r", BatchRow(1, first_row=5, num_computed=0, num_scheduled=6), tree, 10)
    assert chunk_above is None
    last_chunk = prompt_tree_in_step("r", BatchRow(1, first_row=0, num_computed=6, num_scheduled=4), tree, 10)
    assert last_chunk is not None and (last_chunk.root_row, last_chunk.root_position) == (0, 6)


def test_prompt_trees_hand_out_logprob_requests_with_rows_this_step() -> None:
    trees = PromptTrees()
    params = SamplingParams(extra_args={TREE_PARENTS_KEY: [-1, 0]})
    trees.add("tree", params, [1, 2, 3, 4, 5])
    trees.add("plain", SamplingParams(), [1, 2, 3])
    assert trees.get("plain") is None
    tree = trees.get("tree")
    assert tree is not None and tree.tokens.tolist() == [4, 5]  # the prompt's last two tokens
    pending = {"tree": 2, "plain": 1, "later": 3}
    taken = trees.take_logprobs(pending, scheduled={"tree": 5, "plain": 3})
    assert taken == {"tree": (2, tree)} and pending == {"plain": 1, "later": 3}
    trees.forget(["tree"])
    assert trees.get("tree") is None


# ------------------------------------------------------------ verdicts in vLLM's shape
def test_accepted_rows_lay_verdicts_out_and_move_accepted_nodes_off_their_rows() -> None:
    counts = TreeCounts()
    verification = TreeVerification((None, None, None), counts)  # type: ignore[arg-type]
    branching = DraftTree(np.array([10, 11, 12]), np.array([-1, -1, 1]))  # root -> {10, 11 -> 12}
    verification.verifying = [StepTree("a", 0, root_row=0, root_position=7, tree=branching)]
    first_logit = first_logit_rows(SimpleNamespace(num_draft_tokens=[3, 0]))
    assert first_logit.tolist() == [0, 4]
    verdicts = [Accepted(path=np.array([1, 2]), tokens=[11, 12, 40])]
    rows = verification.accepted_rows(verdicts, torch.tensor([99, 50]), first_logit, width=4)
    assert rows.output.tolist() == [[11, 12, 40, PLACEHOLDER_TOKEN_ID], [50] + [PLACEHOLDER_TOKEN_ID] * 3]
    assert rows.logit_rows.tolist() == [[0, 2, 3, 0], [4, 4, 4, 4]]
    # nodes 1, 2 (rows 2, 3) commit at depths 1, 2 (rows 1, 2): both move, in order
    assert [r.tolist() for r in rows.src_rows] == [[2, 3]] and [r.tolist() for r in rows.dst_rows] == [[1, 2]]
    assert (counts.trees, counts.nodes, counts.accepted, counts.accepted_off_first_branch) == (1, 3, 2, 1)
    assert verification.verifying == []


def test_accepted_logprobs_are_vllms_at_the_committed_cells_and_only_there_computed() -> None:
    """The committed cells hold what vLLM's rejection sampler computes at every cell (its
    ``parse_output`` keeps those); the full-vocabulary softmax runs on the committed rows alone."""
    from vllm.v1.sample.sampler import Sampler

    counts = TreeCounts()
    verification = TreeVerification((None, None, None), counts)  # type: ignore[arg-type]
    tree = DraftTree(np.array([10, 11, 12]), np.array([-1, -1, 1]))
    verification.verifying = [StepTree("a", 0, root_row=0, root_position=7, tree=tree)]
    first_logit = first_logit_rows(SimpleNamespace(num_draft_tokens=[3, 0, 0]))
    verdicts = [Accepted(path=np.array([1, 2]), tokens=[11, 12, 40])]
    rows = verification.accepted_rows(verdicts, torch.tensor([99, 50, 7]), first_logit, width=4)
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))  # [rows, vocab]
    sampler = Sampler()
    seen: list[int] = []  # rows of each softmax
    stock = sampler.compute_logprobs

    def counted(rows_in: torch.Tensor) -> torch.Tensor:
        seen.append(rows_in.shape[0])
        return stock(rows_in)

    sampler.compute_logprobs = counted  # type: ignore[method-assign]
    got = accepted_logprobs(sampler, logits, rows, max_num_logprobs=2)
    assert seen == [5]  # 3 committed tokens of the tree's request, one of each other: not 3 x 4 cells
    every = Sampler.gather_logprobs(
        stock(logits[torch.from_numpy(rows.logit_rows.reshape(-1))]), 2, rows.output.view(-1).clamp(min=0).long()
    )
    committed = rows.output.view(-1) != PLACEHOLDER_TOKEN_ID
    assert committed.sum() == 5 and got.logprobs.shape == every.logprobs.shape == (12, 3)
    for ours, theirs in zip(got[:3], every[:3]):
        assert torch.equal(ours[committed], theirs[committed])
    assert accepted_logprobs(sampler, logits, rows, max_num_logprobs=None) is None


def test_count_tree_splits_nodes_by_source_and_skips_padding() -> None:
    counts = TreeCounts()
    count_tree(counts, DraftTree.empty(), np.zeros(0, np.int64))
    assert counts.trees == 0
    tree = DraftTree(
        np.array([1, 2, 3]), np.array([-1, 0, 0]), kinds=[0, FILL_KIND, 0], from_index=[True, False, False]
    )
    count_tree(counts, tree, np.array([0, 1]))
    assert (counts.nodes_lookup, counts.nodes_fill, counts.accepted_lookup, counts.accepted_fill) == (2, 1, 1, 1)
    assert (counts.nodes_from_index, counts.accepted_from_index, counts.depth_sum) == (1, 1, 2)
    assert counts.accepted_off_first_branch == 0


# ------------------------------------------------------------ timed steps
def output(rows: int, drafts: dict, new: list | None = None) -> SimpleNamespace:
    """A scheduler output of requests "a" and "b" carrying on, ``rows`` rows in all."""
    scheduled = dict.fromkeys(["a", "b"], 1)
    return SimpleNamespace(
        total_num_scheduled_tokens=rows,
        scheduled_spec_decode_tokens=drafts,
        num_scheduled_tokens=scheduled,
        scheduled_new_reqs=new or [],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["a", "b"]),
    )


def test_decode_step_times_decoding_steps_only() -> None:
    tree_step = decode_step(output(5, {"a": [1, 2, 3]}), now=1.0)
    assert tree_step is not None and (tree_step.rows, tree_step.start, tree_step.plain) == (5, 1.0, False)
    plain = decode_step(output(2, {}), now=2.0)
    assert plain is not None and plain.plain
    assert decode_step(output(9, {}), now=3.0) is None  # prompt rows in it
    assert decode_step(output(2, {}, new=[object()]), now=3.0) is None  # a new request


def test_a_kind_of_step_timed_for_the_first_time_is_fitted_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three plain steps, then the first chain step: its line is fitted when that step ends, not
    at the next of the every-16-steps refits (until then the plain line prices its nodes)."""
    monkeypatch.setattr(step_timing, "same_on_every_rank", lambda lines: lines)  # one rank, no TP group
    budget = StepBudget()
    timer = StepTimer(budget)
    refits = [timer.time_step(output(2, {})) for _ in range(4)]  # the first only starts a timing
    assert refits == [False, True, False, False] and budget.plain_cost is not None and budget.chain_cost is None
    timer.time_step(output(5, {"a": [1, 2, 3]}))  # a chain step starts
    assert timer.time_step(output(2, {})) and budget.chain_cost is not None
    assert not timer.time_step(output(2, {}))  # a plain step again: its kind was timed before


def test_draft_forwards_are_priced_with_the_drafting_steps_host_work_and_syncs_as_timed() -> None:
    """Three 40 ms forwards of 8 rows in a 160 ms drafting step are fitted as forwards of 53.3 ms
    (the forward alone under-priced every level); a sync's forward outside a drafting step as it is."""
    forwards, spent = step_timing.DraftForwards(), StepCostModel()
    for step in range(4):
        forwards.drafting()
        for _ in range(3):
            forwards.observe(8 + step, 0.040)
            spent.observe(8 + step, 0.160 / 3)
        forwards.drafted(0.160)
    forwards.observe(100, 0.090)  # a sync after a step
    spent.observe(100, 0.090)
    assert forwards.model.fitted() == spent.fitted()
    assert forwards.model.fitted().seconds(8) > 0.050


def test_tokens_left_counts_a_requests_own_limit_and_not_the_servers_room() -> None:
    """The server sets ``max_tokens`` to the room left below ``max_model_len`` when a request sets
    none: that bound tells nothing of when the request ends."""
    from vllm_specbeam.adapter.step_selection import tokens_left

    own = request("a", 0, SamplingParams(max_tokens=48), outputs=8)  # 18 tokens committed
    assert tokens_left(own, 4096) == 40
    room = request("b", 0, SamplingParams(max_tokens=4096 - 10), outputs=8)
    assert tokens_left(room, 4096) is None
    assert tokens_left(request("c", 0, None), 4096) is None
