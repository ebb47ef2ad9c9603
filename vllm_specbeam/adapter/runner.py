"""Tree verification inside vLLM's V1 model runner.

One engine step of a plugin method, as the runner sees it (vLLM's
v1/worker/gpu_model_runner.py, synchronous scheduling):

1. ``_prepare_inputs`` (stock) lays out ``[root, node 0, node 1, ...]`` per
   request and gives every row a linear KV slot; the plugin then sets each
   node's *position* to ``context + depth``.
2. ``_model_forward`` runs the target once; the attention layers see the
   step's trees (CPU: :class:`~vllm_specbeam.adapter.attention.cpu.TreeStep`,
   CUDA: :class:`~vllm_specbeam.adapter.attention.cuda.GpuTreeStep`).
3. ``_sample`` runs the method's verifier instead of vLLM's rejection
   sampler, returns the accepted path in vLLM's shape, and moves the accepted
   nodes' K/V to consecutive slots.
4. ``propose_draft_token_ids`` asks the drafter for the next trees, cut by
   the step budget (:mod:`vllm_specbeam.core.budget`) under ``"max_nodes":
   "auto"``; the flattened tokens go to the scheduler as draft tokens.

Built only by the plugin's workers (:mod:`.worker`). Each vLLM method it
overrides is marked ``@override``; registration checks they still exist.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from typing_extensions import override

from vllm_specbeam.adapter import patches, tree_prompt
from vllm_specbeam.adapter.attention import cpu as cpu_attention
from vllm_specbeam.adapter.attention.step import check_tree_attention, distinct_kv_caches, move_kv_slots, tree_step
from vllm_specbeam.adapter.draft_model import SearchDraftRuntime, WorkerDraftRuntime, uses_worker_draft
from vllm_specbeam.adapter.engine_config import CACHE_SALT_KEY, plugin_config
from vllm_specbeam.adapter.metrics import RunnerMetrics
from vllm_specbeam.core.budget import FILL_KIND, StepBudget, StepCost, StepCostModel
from vllm_specbeam.core.config import AUTO, METHODS, SpecbeamConfig, node_cap
from vllm_specbeam.core.controller import StepPrices, Switch, utility
from vllm_specbeam.core.drafter import DraftRequest, TreeDrafter
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.core.verifiers.base import TreeVerifier
from vllm_specbeam.kernels import kv_move

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention import Attention
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import DraftTokenIds, SamplerOutput
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_specbeam.adapter.attention.cuda import GpuTreeStep

logger = logging.getLogger(__name__)

PLACEHOLDER_TOKEN_ID = -1  # vllm.v1.sample.rejection_sampler.PLACEHOLDER_TOKEN_ID
SAMPLING_EPS = 1e-5  # vllm.v1.sample.sampler: temperatures below are greedy
#: key of :attr:`TreeRunnerMixin.tree_stats` for the drafter's cross-request memory
STATE_BYTES = "drafter_state_bytes"
#: the step budget refits its cost line (and shares it across tensor-parallel ranks) every this many timed steps
BUDGET_REFIT_STEPS = 16
#: a batch that drafted this many timed steps in a row rests one, to time a plain step again
#: (the controller weighs drafting against it; costs drift on a shared machine)
PLAIN_REFRESH_STEPS = 64
#: seconds between two log lines of the step budget
BUDGET_LOG_SECONDS = 60.0


class DrafterHost:
    """What vLLM's ``custom_class`` carrier instantiates as the runner's drafter.

    vLLM builds it (``create_custom_proposer``) and calls ``load_model``; the
    tree runner asks its :attr:`drafter` for trees. vLLM's chain ``propose``
    must never be reached: the tree runner overrides the call site.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.config = plugin_config(vllm_config)
        drafter_cls = METHODS[self.config.method].drafter_class()
        self.drafter: TreeDrafter = drafter_cls(self.config.options)

    def load_model(self, target_model: torch.nn.Module) -> None:
        # An in-worker draft is loaded by the tree runner once the target is (it needs the runner).
        if not uses_worker_draft(self.config):
            self.drafter.load_model(target_model)

    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        raise RuntimeError(
            "vllm-specbeam: the chain proposer path was reached; the engine is not running the plugin's "
            "worker (vllm_specbeam.adapter.worker or .cpu_worker), which the speculative-config patch selects"
        )


def builtin_logitsprocs(stock: Callable[..., LogitsProcessors]) -> Callable[..., LogitsProcessors]:
    """vLLM's ``build_logitsprocs`` with all built-in processors (min-p, logit bias,
    min-tokens) although the engine speculates: requests that use them are never
    drafted here, and vLLM's sampler applies them to their one row a step (patch 9)."""

    def build(
        vllm_config: VllmConfig,
        device: torch.device,
        is_pin_memory: bool,
        is_pooling_model: bool,
        custom_logitsprocs: Sequence[Any] = (),
    ) -> LogitsProcessors:
        if is_pooling_model or custom_logitsprocs:  # vLLM's answer (custom ones are refused with speculation)
            return stock(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    return build


def request_supports_trees(params: SamplingParams) -> bool:
    """Whether a request's target distribution can be verified as a tree.

    Temperature, top-k and top-p are applied per row exactly as vLLM does.
    Penalties, min-p, logit bias, bad words, min-tokens and structured output
    are applied by vLLM depending on the tokens before each row (or not at all
    on its speculative path), which a tree does not have in one sequence: such
    requests decode without speculation (one token per step), exactly.
    """
    return (
        params.min_p == 0.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.logit_bias
        and not params.allowed_token_ids
        and not params.bad_words
        and not params.min_tokens
        and params.thinking_token_budget is None
        and params.structured_outputs is None
    )


@dataclass(frozen=True)
class RequestArgs:
    """What a request's ``SamplingParams.extra_args`` hold for the drafter."""

    #: the plugin's options, as the request sets them
    overrides: dict[str, Any] | None
    #: its ``cache_salt``, which the plugin's scheduler put there (adapter/scheduler.py)
    cache_salt: str | None


def request_args(params: SamplingParams) -> RequestArgs:
    """``params.extra_args`` split into the request's options and its ``cache_salt``."""
    extra = params.extra_args
    if not extra or CACHE_SALT_KEY not in extra:
        return RequestArgs(extra, None)
    return RequestArgs({k: v for k, v in extra.items() if k != CACHE_SALT_KEY}, extra[CACHE_SALT_KEY])


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
class DraftAsk:
    """The requests a step asks its drafter for trees (:meth:`TreeRunnerMixin._requests_to_draft`)."""

    requests: list[DraftRequest]
    #: each one's index in the batch, and whether its nodes are the budget's to choose (``"auto"``)
    positions: list[int]
    automatic: list[bool]
    #: requests the budget sat out this step (their drafts have not paid)
    sitting_out: int


@dataclass
class TimedStep:
    """A decode step being timed, from its ``execute_model`` to the next one's."""

    rows: int
    start: float
    #: it verifies no node: vLLM's plain decode step, timed apart from steps that verify trees
    plain: bool
    #: some tree in it branches (rows off a first branch: on CPU recomputed with the tree mask),
    #: timed apart from steps whose trees are all chains
    branched: bool = False
    #: the drafter's time within it (drafting is not a cost of the rows)
    draft_seconds: float = 0.0


@dataclass
class TreeCounts:
    """Running totals of one runner (read through :attr:`TreeRunnerMixin.tree_stats`)."""

    #: verified trees (vLLM's padding rows are not trees), their nodes, and the accepted nodes
    trees: int = 0
    nodes: int = 0
    accepted: int = 0
    #: accepted nodes that are not their parent's first child (a chain would have missed them)
    accepted_off_first_branch: int = 0
    #: the verified trees' depths, summed (mean depth drafted = depth_sum / trees)
    depth_sum: int = 0
    kv_moves: int = 0
    draft_seconds: float = 0.0
    #: forwards of an in-worker draft model (drafting and catching up on committed tokens), and their rows
    draft_forwards: int = 0
    draft_rows: int = 0
    #: lookup branches with a draft model (``"lookup"``): requests whose step ran no draft forward
    #: (``defer``), decode steps in which the draft ran none at all, and the verified trees' nodes and
    #: accepted nodes by source (kinds below ``FILL_KIND``: lookup branches; ``FILL_KIND``: what fills them)
    draft_deferred: int = 0
    steps_without_draft_forward: int = 0
    nodes_lookup: int = 0
    accepted_lookup: int = 0
    nodes_fill: int = 0
    accepted_fill: int = 0
    #: verified nodes that continue other requests' text (a cross-request index: ``DraftTree.from_index``),
    #: and those accepted: what finished requests drafted for later ones
    nodes_from_index: int = 0
    accepted_from_index: int = 0
    #: committed tokens whose draft K/V an in-worker draft kept from its tree (not fed again),
    #: and how many of those it moved to their committed slot (accepted nodes off the first branch)
    draft_kv_kept: int = 0
    draft_kv_moves: int = 0
    preempted: int = 0
    #: sampled single-chain drafts verified as a block
    block_verified: int = 0
    #: beam rules: beams kept, summed over accepted depths (mean width = sum / depths)
    beam_width_sum: int = 0
    beam_depths: int = 0
    #: lossy rules (``mjsd``'s joint rule): accepted drafts that were not the target's argmax
    accepted_off_argmax: int = 0
    #: the step budget (``"max_nodes": "auto"``): requests asked to draft, requests sitting a
    #: step out, nodes their drafters proposed, nodes kept (the rest were pruned)
    budget_asked: int = 0
    budget_idle: int = 0
    budget_drafted: int = 0
    budget_kept: int = 0
    #: the goodput controller (exact methods): decode steps after which drafts were asked for,
    #: those the whole batch skipped (vLLM's plain step: nothing drafted, verified or fed to a
    #: draft), and the steps that asked again after such a rest
    steps: int = 0
    steps_off: int = 0
    steps_probed: int = 0
    #: decode steps verifying a tree that branches (its rows off the first branch need the tree
    #: mask; the rest verified chains alone)
    steps_branched: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)

    def record_draft(self, deferred: int = 0, kv_kept: int = 0, kv_moves: int = 0) -> None:
        """What an in-worker draft did this step: requests it deferred, committed tokens whose
        draft K/V it kept, and how many of those it moved to their committed slot."""
        self.draft_deferred += deferred
        self.draft_kv_kept += kv_kept
        self.draft_kv_moves += kv_moves


def cost_stats(prefix: str, cost: StepCost | None) -> dict[str, float]:
    """A fitted line as stats: ``prefix_intercept_s``, ``_per_row_s``, ``_knee_rows``, ``_bend_s``
    (each row past ``knee`` rows costs ``per_row + bend``); none before it was fitted."""
    if cost is None:
        return {}
    values = {"intercept_s": cost.intercept, "per_row_s": cost.slope, "knee_rows": cost.knee, "bend_s": cost.bend}
    return {f"{prefix}_{name}": value for name, value in values.items()}


class TreeRunnerMixin:
    """Overrides of the V1 model runner; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        with patches.replaced(patches.RUNNER_LOGITSPROCS, builtin_logitsprocs):
            super().__init__(vllm_config, device)
        config = plugin_config(self.vllm_config)
        if config is None:
            raise RuntimeError(
                "vllm-specbeam: the tree runner was built for an engine without a vllm-specbeam method; "
                "only the plugin's workers build it, chosen by the speculative-config patch"
            )
        self.tree_config: SpecbeamConfig = config
        if self.device.type == "cpu":
            cpu_attention.install_cpu_tree_attention()
        self.greedy_verifier, self.sampling_verifier, self.chain_verifier = METHODS[config.method].verifiers()
        self.move_accepted_kv = True  # switched off only by a test that proves the move matters
        self._proposed: dict[str, DraftTree] = {}
        #: this step's trees under verification
        self._verifying: list[StepTree] = []
        #: trees at the end of tree-prompt requests' prompts (:mod:`vllm_specbeam.adapter.tree_prompt`)
        self._prompt_trees: dict[str, DraftTree] = {}
        self._tree_step: cpu_attention.TreeStep | GpuTreeStep | None = None
        #: the drafts proposed this step, for :meth:`take_draft_token_ids`
        self._step_drafts: DraftTokenIds | None = None
        self.tree_counts = TreeCounts()
        #: the draft model inside the worker (draft-model methods on CPU), see :mod:`.draft_model`
        self.draft_runtime: WorkerDraftRuntime | None = None
        #: each step's nodes for ``"max_nodes": "auto"`` requests (methods whose trees may be cut), and
        #: the step cost for drafters that cut their own trees by it (lookup branches of draft-model methods)
        self.budget = StepBudget() if METHODS[config.method].prunable or self.tree_drafter.cuts_to_step_cost else None
        #: seconds of the in-worker draft's forwards by rows, fitted as the target's steps are
        self.draft_cost_model = StepCostModel()
        self.draft_cost: StepCost | None = None
        #: whether the batch drafts at all (exact methods: lossy ones draft what their output means)
        self.switch = Switch() if self.budget is not None and METHODS[config.method].exact else None
        self._timed_step: TimedStep | None = None
        self._timed_steps = 0
        #: timed tree steps since the last timed plain one (one is rested for when it is overdue)
        self._steps_since_plain = 0
        self._budget_logged = time.monotonic()
        #: the controller's Prometheus metrics, written for the front end (:mod:`.metrics`)
        self.metrics = RunnerMetrics.for_runner(vllm_config)

    @functools.cached_property
    def search_draft_runtime(self) -> SearchDraftRuntime:
        """The draft for speculative beam searches: the engine's loaded draft, blocks of its own."""
        if self.draft_runtime is None:
            raise RuntimeError(
                "vllm-specbeam: this engine has no draft model; speculative beam search needs an engine "
                "started with dsbd and its draft"
            )
        return SearchDraftRuntime(self.draft_runtime)

    def prompt_tree(self, req_id: str) -> DraftTree | None:
        """The tree ending a tree-prompt request's prompt (:mod:`~vllm_specbeam.adapter.tree_prompt`), else ``None``."""
        return self._prompt_trees.get(req_id)

    @property
    def tree_stats(self) -> dict[str, int | float | list[int]]:
        """The counters as a plain dict, for readers through ``LLM.collective_rpc``
        (tests, benchmarks), and the drafter's memory and cross-request index now (not counters)."""
        # the fitted costs, once there are (not counters: readers take them as they are)
        lines = {
            key: value for prefix, cost in self.cost_lines.items() for key, value in cost_stats(prefix, cost).items()
        }
        drafter = self.tree_drafter
        return {**self.tree_counts.as_dict(), STATE_BYTES: drafter.state_bytes, **drafter.index_stats, **lines}

    @property
    def cost_lines(self) -> dict[str, StepCost | None]:
        """The fitted lines by stats prefix: the target's steps with trees and its plain steps, the draft's forwards."""
        budget = self.budget
        return {
            "step_cost": None if budget is None else budget.cost,
            "chain_cost": None if budget is None else budget.chain_cost,
            "plain_cost": None if budget is None else budget.plain_cost,
            "draft_cost": self.draft_cost,
        }

    @property
    def tree_drafter(self) -> TreeDrafter:
        return self.drafter.drafter

    # -------------------------------------------------------------- lifecycle
    @override
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        check_tree_attention([layer.impl for layer in self._attention_layers().values()], self.device)
        if uses_worker_draft(self.tree_config):
            assert self.tree_config.draft_model is not None  # parse() requires it for draft-model methods
            use_runtime = getattr(self.tree_drafter, "use_runtime", None)
            if use_runtime is None:
                raise NotImplementedError(
                    f"vllm-specbeam: {self.tree_config.method}'s drafter cannot use a draft model loaded by vLLM "
                    f"(it has no use_runtime method); give it one, as methods/dsbd/drafter.py does"
                )
            self.draft_runtime = WorkerDraftRuntime(self, self.tree_config.draft_model)
            use_runtime(self.draft_runtime)

    def _attention_layers(self) -> dict[str, Attention]:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        return get_layers_from_vllm_config(self.vllm_config, Attention)

    @functools.cached_property
    def _kv_layers(self) -> list[tuple[torch.nn.Module, torch.Tensor]]:
        """(attention layer, its KV cache) once per distinct cache tensor, the target's
        only: an in-worker draft moves its own (:class:`WorkerDraftRuntime`)."""
        draft = set() if self.draft_runtime is None else set(self.draft_runtime.layers)
        return distinct_kv_caches(layer for name, layer in self._attention_layers().items() if name not in draft)

    @functools.cached_property
    def _kv_layer_pointers(self) -> torch.Tensor:
        """The ``kv_move`` kernel's table of cache base addresses (caches never move)."""
        return kv_move.layer_pointer_table([kv_cache for _, kv_cache in self._kv_layers])

    @override
    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig, *args: Any, **kwargs: Any) -> None:
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                "vllm-specbeam tree verification needs a model with one KV cache group "
                "(plain full attention); this model has hybrid or several attention groups"
            )
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if self.draft_runtime is not None:
            self.draft_runtime.bind()

    @override
    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        ran = self.execute_model_state is not None
        forwards = self.tree_counts.draft_forwards
        output = super().sample_tokens(*args, **kwargs)
        if ran and self.draft_runtime is not None:
            # Every step, drafting or not (vLLM skips the drafter on some steps):
            # blocks the target computed must hold the draft's K/V before a prefix hit reuses them.
            start = time.perf_counter()
            self.draft_runtime.sync_step()
            if self._timed_step is not None:  # the draft's time, not the target's rows'
                self._timed_step.draft_seconds += time.perf_counter() - start
            self.tree_counts.steps_without_draft_forward += self.tree_counts.draft_forwards == forwards
        if ran and self.metrics is not None:
            self.metrics.publish(self.tree_counts, self.cost_lines)
        return output

    def record_draft_forward(self, rows: int, seconds: float) -> None:
        """One forward of the in-worker draft (:class:`WorkerDraftRuntime`): counted, and fitted."""
        self.tree_counts.draft_forwards += 1
        self.tree_counts.draft_rows += rows
        self.draft_cost_model.observe(rows, seconds)

    @override
    def _update_states(self, scheduler_output: SchedulerOutput) -> Callable[..., Any] | None:
        finished = set(scheduler_output.finished_req_ids)
        for req_id in finished:
            self._proposed.pop(req_id, None)
            self._prompt_trees.pop(req_id, None)
        if self.budget is not None:
            self.budget.remove(finished)
        if finished and self.tree_drafter.learns_across_requests:
            self.tree_drafter.finished([r for r in map(self._finished_request, sorted(finished)) if r is not None])
        for new in scheduler_output.scheduled_new_reqs:
            tree = tree_prompt.prompt_tree(new.sampling_params, new.prompt_token_ids or [])
            if tree is not None:
                self._prompt_trees[new.req_id] = tree
        # A preempted request's drafter state is rebuilt when it resumes;
        # its last tree is kept: the scheduler may verify those drafts
        # right after the resumed request's recomputed tokens.
        preempted = set(scheduler_output.preempted_req_ids or ())
        self.tree_counts.preempted += len(preempted)
        gone = finished | preempted
        if gone:
            self.tree_drafter.remove_requests(gone)
        return super()._update_states(scheduler_output)

    def _finished_request(self, req_id: str) -> DraftRequest | None:
        """A finished request's whole sequence and options (before vLLM forgets it in ``_update_states``)."""
        state = self.requests.get(req_id)
        params = None if state is None else state.sampling_params
        if state is None or params is None or state.prompt_token_ids is None:
            return None  # not a text request (pooling, prompt embeddings)
        tokens = np.asarray([*state.prompt_token_ids, *state.output_token_ids], np.int64)
        args = request_args(params)
        return DraftRequest(
            req_id, tokens, self.tree_config.with_overrides(args.overrides), params.temperature, args.cache_salt
        )

    # -------------------------------------------------------------- step budget
    @override
    def execute_model(self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
        if self.budget is not None:
            self._time_step(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def _time_step(self, scheduler_output: SchedulerOutput) -> None:
        """Feed the budget's cost lines: a decode step lasts from its
        ``execute_model`` to the next one's, less its drafting.

        Only steps of decoding requests count (prompt rows cost differently), and
        only when requests carried on into the next step (else the engine may have
        sat idle in between). Plain steps (no node) and tree steps are fitted apart. The lines the
        budget decides with are refitted every ``BUDGET_REFIT_STEPS`` timed steps, the same steps
        on every rank.
        """
        now = time.perf_counter()
        timed, budget = self._timed_step, self.budget
        assert budget is not None
        if timed is not None and scheduler_output.scheduled_cached_reqs.req_ids:
            model = budget.plain_model if timed.plain else budget.cost_model if timed.branched else budget.chain_model
            model.observe(timed.rows, now - timed.start - timed.draft_seconds)
            self._steps_since_plain = 0 if timed.plain else self._steps_since_plain + 1
            self._timed_steps += 1
            if self._timed_steps % BUDGET_REFIT_STEPS == 1:
                budget.cost = self._same_on_every_rank(budget.cost_model.fitted())
                budget.chain_cost = self._same_on_every_rank(budget.chain_model.fitted())
                budget.plain_cost = self._same_on_every_rank(budget.plain_model.fitted())
                self.draft_cost = self._same_on_every_rank(self.draft_cost_model.fitted())
        rows = scheduler_output.total_num_scheduled_tokens
        drafts = sum(len(d) for d in scheduler_output.scheduled_spec_decode_tokens.values())
        requests = len(scheduler_output.num_scheduled_tokens)
        decoding = not scheduler_output.scheduled_new_reqs and rows == requests + drafts  # one row each, plus drafts
        self._timed_step = TimedStep(rows, now, plain=drafts == 0) if decoding and rows > 0 else None

    def _same_on_every_rank(self, cost: StepCost | None) -> StepCost | None:
        """Rank 0's cost line (the target's or the draft's) on every tensor-parallel rank: each
        rank drafts and prunes for itself, and they must keep the same nodes. (vLLM 0.32.0
        vllm/distributed/parallel_state.py: ``get_tp_group``,
        ``GroupCoordinator.broadcast_object``.)"""
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return cost if group.world_size == 1 else group.broadcast_object(cost, src=0)

    def _log_budget(self) -> None:
        now = time.monotonic()
        if now - self._budget_logged < BUDGET_LOG_SECONDS or self.budget is None or self.budget.cost is None:
            return
        self._budget_logged = now
        counts, cost = self.tree_counts, self.budget.cost
        kept = (
            ""
            if counts.budget_asked == 0  # a drafter that cuts its own trees (no "auto" request)
            else f"{counts.budget_kept / counts.budget_asked:.2f} of {counts.budget_drafted / counts.budget_asked:.2f} "
            f"drafted nodes kept per asked request, {counts.budget_idle} idle; "
        )
        logger.info(
            "vllm-specbeam step budget: %sstep cost %.1f ms + %.3f ms per row, %.3f ms more per row past %d rows",
            kept,
            1e3 * cost.intercept,
            1e3 * cost.slope,
            1e3 * cost.bend,
            cost.knee,
        )

    # -------------------------------------------------------------- inputs
    @override
    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput, num_scheduled_tokens: np.ndarray
    ) -> tuple[torch.Tensor, SpecDecodeMetadata | None, int]:
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._verifying = [
            self._verifying_tree(req_id, drafts, num_scheduled_tokens)
            for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items()
            if drafts
        ]
        trees = self._verifying + self._prompt_trees_in_step(num_scheduled_tokens)
        if not trees:
            self._tree_step = None
            return result
        step = self._build_tree_step(trees, scheduler_output.total_num_scheduled_tokens)
        self.tree_counts.steps_branched += bool(self._verifying) and step.needs_attention
        if self._timed_step is not None:
            self._timed_step.branched = step.needs_attention
        # Slots were computed from the linear positions above and stay linear;
        # only the positions the model sees (RoPE) become context + depth.
        self.positions[step.node_rows.to(self.positions.device)] = step.node_positions.to(
            self.positions.device, self.positions.dtype
        )
        self._tree_step = step
        return result

    def _verifying_tree(self, req_id: str, drafts: list[int], num_scheduled_tokens: np.ndarray) -> StepTree:
        """The tree behind the drafts the scheduler scheduled for ``req_id``."""
        if min(drafts) < 0:
            # vLLM 0.32.0 scheduler.py pads a (re)starting decode to the
            # full draft length with -1 (to keep CUDA graphs uniform):
            # rows to skip, nothing to verify.
            tree = DraftTree.empty()
        else:
            # The scheduler may cut the list short; a prefix of a
            # topologically ordered tree is still a tree.
            tree = self._proposed[req_id].truncate(len(drafts))
            if tree.tokens.tolist() != list(drafts):
                raise RuntimeError(f"vllm-specbeam: drafts scheduled for {req_id} are not the tree proposed for it")
        index = self.input_batch.req_id_to_index[req_id]
        # The drafts are the last rows of the request; before the root may
        # come prompt or recomputed tokens (a resumed request).
        before_root = int(num_scheduled_tokens[index]) - 1 - len(drafts)
        return StepTree(
            req_id,
            index,
            root_row=int(self.query_start_loc.np[index]) + before_root,
            root_position=int(self.input_batch.num_computed_tokens_cpu[index]) + before_root,
            tree=tree,
        )

    def _prompt_trees_in_step(self, num_scheduled_tokens: np.ndarray) -> list[StepTree]:
        """The tree-prompt requests whose tree rows are computed this step.

        A tree's root and rows are computed in one step: without chunked
        prefill the whole prompt is, with it the plugin's scheduler ends no
        chunk inside a tree (adapter/scheduler.py; tree_prompt.check_params
        refuses a tree too large for one step).
        """
        trees = []
        for req_id, tree in self._prompt_trees.items():
            index = self.input_batch.req_id_to_index.get(req_id)
            if index is None:
                continue
            computed = int(self.input_batch.num_computed_tokens_cpu[index])
            root = tree_prompt.tree_root(self.requests[req_id].num_prompt_tokens, tree.num_nodes)
            if computed <= root < computed + int(num_scheduled_tokens[index]):
                root_row = int(self.query_start_loc.np[index]) + root - computed
                trees.append(StepTree(req_id, index, root_row, root, tree))
        return trees

    @override
    def _get_prompt_logprobs_dict(
        self, hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int]
    ) -> dict[str, Any]:
        """vLLM's prompt logprobs, except that a tree-prompt request gets them only at
        the rows :func:`~vllm_specbeam.adapter.tree_prompt.row_logprobs` reads: the
        root and the tree's nodes, ``num_nodes`` positions. vLLM would take the logits
        of every prompt row it computed (a beam's recomputed block, a shared tree's
        prefix and tails): a full-vocabulary projection, softmax and top-k each.
        """
        from vllm.v1.outputs import LogprobsTensors

        # vLLM 0.32.0 gpu_model_runner.py _get_prompt_logprobs_dict: a request stays in
        # num_prompt_logprobs until the step that computes its last prompt row, which
        # returns its LogprobsTensors (the output processor takes any number of positions).
        pending = self.num_prompt_logprobs
        ours = {
            req_id: (pending.pop(req_id), tree)
            for req_id, tree in self._prompt_trees.items()
            if req_id in pending and req_id in num_scheduled_tokens
        }
        logprobs_dict: dict[str, Any] = super()._get_prompt_logprobs_dict(hidden_states, num_scheduled_tokens)
        for req_id, (num_logprobs, tree) in ours.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens
            root = tree_prompt.tree_root(len(request.prompt_token_ids or ()), tree.num_nodes)
            if not start <= root < start + num_scheduled_tokens[req_id]:
                pending[req_id] = num_logprobs  # a prefill chunk above the tree
                continue
            row = int(self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]]) + root - start
            logits = self.model.compute_logits(hidden_states[row : row + tree.num_nodes])  # [num_nodes, V]
            raw = self.model_config.logprobs_mode in ("raw_logits", "processed_logits")
            scores = logits.to(torch.float32) if raw else self.sampler.compute_logprobs(logits)
            targets = torch.as_tensor(tree.tokens, device=logits.device)  # [num_nodes]: each row's next prompt token
            token_ids, logprobs, ranks, *_ = self.sampler.gather_logprobs(scores, num_logprobs, targets)
            # host sync on CUDA (one per tree-prompt request, as vLLM's own sync here)
            logprobs_dict[req_id] = LogprobsTensors(token_ids.cpu(), logprobs.cpu(), ranks.cpu())
            request.in_progress_prompt_logprobs_cpu = None
        return logprobs_dict

    def _build_tree_step(self, trees: list[StepTree], num_tokens: int) -> cpu_attention.TreeStep | GpuTreeStep:
        """The attention layers' view of this step's trees, built once per step."""
        indices = [entry.batch_index for entry in trees]
        root_rows = [entry.root_row for entry in trees]
        root_positions = [entry.root_position for entry in trees]
        draft_trees = [entry.tree for entry in trees]
        if self.device.type == "cpu":
            return cpu_attention.TreeStep.build(indices, root_rows, root_positions, draft_trees)
        from vllm_specbeam.adapter.attention.cuda import GpuTreeStep

        # vLLM 0.32.0 gpu_model_runner.py _prepare_inputs: query_start_loc.np
        # holds each request's first token row.
        request_starts = self.query_start_loc.np[indices].tolist()
        return GpuTreeStep.build(request_starts, root_rows, root_positions, draft_trees, num_tokens, self.device)

    @override
    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._tree_step is None:  # no tree in this step: vLLM's forward as it is
            return super()._model_forward(*args, **kwargs)
        with tree_step(self._tree_step):
            return super()._model_forward(*args, **kwargs)

    # -------------------------------------------------------------- verify
    @override
    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: SpecDecodeMetadata | None) -> SamplerOutput:
        if spec_decode_metadata is None or not self._verifying:
            # No draft in this step: vLLM's sampler, as without speculation. (vLLM 0.32.0's
            # rejection sampler given zero drafts fails on a top-k request: max() of an empty tensor.)
            return super()._sample(logits, None)
        from vllm.v1.outputs import SamplerOutput

        sampling_metadata = self.input_batch.sampling_metadata
        # Requests without a tree this step: one token, sampled by vLLM as usual.
        plain = self.sampler(
            logits=logits[spec_decode_metadata.bonus_logits_indices],
            sampling_metadata=dataclasses.replace(sampling_metadata, max_num_logprobs=None),
        ).sampled_token_ids.view(-1)  # [num_reqs]

        num_reqs = plain.shape[0]
        width = spec_decode_metadata.max_spec_len + 1
        # Each request's first logit row: vLLM 0.32.0 gpu_model_runner.py
        # _calc_spec_decode_metadata gives every request 1 + its drafts rows, in order.
        num_sampled = np.asarray(spec_decode_metadata.num_draft_tokens) + 1
        first_logit = np.cumsum(num_sampled) - num_sampled  # [num_reqs]
        verdicts = self._verify(logits, first_logit, sampling_metadata)

        output = torch.full((num_reqs, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        output[:, 0] = plain.to(torch.int32)  # host sync: the output is assembled on the host
        # The logit row of every output token, for the logprobs vLLM reports.
        logit_rows = np.repeat(first_logit[:, None], width, axis=1)  # [num_reqs, width]
        src_rows, dst_rows = [], []
        for entry, verdict in zip(self._verifying, verdicts):
            path = verdict.path
            output[entry.batch_index, : len(verdict.tokens)] = torch.tensor(verdict.tokens, dtype=torch.int32)
            self._count(entry.tree, path)
            logit_rows[entry.batch_index, 1 : len(verdict.tokens)] = first_logit[entry.batch_index] + 1 + path
            moved = path + 1 != np.arange(1, path.size + 1)
            src_rows.append(entry.root_row + 1 + path[moved])
            dst_rows.append(entry.root_row + 1 + np.flatnonzero(moved))
        if self.move_accepted_kv:
            self._move_accepted_kv(src_rows, dst_rows)
        self._verifying = []
        self._tree_step = None
        output = output.to(logits.device)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            chosen = logits[torch.from_numpy(logit_rows.reshape(-1)).to(logits.device)].to(torch.float32)
            tokens = output.view(-1).to(torch.int64).clamp(min=0)
            logprobs = self.sampler.gather_logprobs(
                self.sampler.compute_logprobs(chosen), sampling_metadata.max_num_logprobs, tokens
            )
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs)

    def _move_accepted_kv(self, src_rows: list[np.ndarray], dst_rows: list[np.ndarray]) -> None:
        """Copy the accepted nodes' K/V, all layers, from token rows ``src_rows``
        to ``dst_rows`` (one array per verifying request, root-first).

        Rows become slots through the step's slot mapping, which vLLM 0.32.0
        v1/worker/block_table.py ``compute_slot_mapping`` writes into
        ``slot_mapping.gpu`` (a CPU tensor too on the CPU backend).
        """
        slots = self.input_batch.block_table[0].slot_mapping.gpu  # [num_tokens]
        counts = [moves.size for moves in src_rows]
        rows = torch.from_numpy(np.concatenate([*src_rows, *dst_rows])).to(slots.device)
        src, dst = slots[rows].to(torch.int64).tensor_split([sum(counts)])  # [moves] each
        on_cuda = self.device.type != "cpu"
        move_kv_slots(self._kv_layers, src, dst, counts, on_cuda, self._kv_layer_pointers if on_cuda else None)
        self.tree_counts.kv_moves += sum(counts)

    def _verify(
        self, logits: torch.Tensor, first_logit: np.ndarray, sampling_metadata: SamplingMetadata
    ) -> list[Accepted]:
        """What to accept for each verifying request, in ``self._verifying``'s order.

        Greedy requests: exact argmax matching on the raw logits. Sampled
        requests: the method's lossless rule on the target's probabilities
        after vLLM's own temperature / top-k / top-p processing; a sampled
        request whose draft is a single chain gets block verification when the
        method allows it (never fewer accepted tokens, same distribution).
        """
        rules = [self._rule_for(entry) for entry in self._verifying]
        results: dict[int, Accepted] = {}
        for rule in {id(r): r for r in rules}.values():
            chosen = [k for k, r in enumerate(rules) if r is rule]
            indices = [self._verifying[k].batch_index for k in chosen]
            trees = [self._verifying[k].tree for k in chosen]
            # host sync: every rule returns its verdicts as host data
            if rule is self.greedy_verifier:
                verdict = rule.verify(trees, logits, first_logit[indices])
            else:
                rows_per_request = np.array([tree.num_nodes + 1 for tree in trees])
                rows = np.concatenate([first_logit[i] + np.arange(n) for i, n in zip(indices, rows_per_request)])
                verdict = rule.verify(
                    trees,
                    target_probabilities(logits[torch.from_numpy(rows)], indices, rows_per_request, sampling_metadata),
                    np.concatenate([[0], np.cumsum(rows_per_request)[:-1]]),
                    [sampling_metadata.generators.get(index) for index in indices],
                )
            if rule is self.chain_verifier:
                self.tree_counts.block_verified += len(chosen)
            for widths in verdict.widths or ():
                self.tree_counts.beam_width_sum += sum(widths)
                self.tree_counts.beam_depths += len(widths)
            self.tree_counts.accepted_off_argmax += sum(verdict.off_argmax or ())
            for k, path, tokens in zip(chosen, verdict.accepted, verdict.tokens):
                results[k] = Accepted(path, tokens)
        return [results[k] for k in range(len(rules))]

    def _rule_for(self, entry: StepTree) -> TreeVerifier:
        if self.requests[entry.req_id].sampling_params.temperature < SAMPLING_EPS:
            return self.greedy_verifier
        if self.chain_verifier is not None and entry.tree.is_chain:
            return self.chain_verifier
        return self.sampling_verifier

    def _count(self, tree: DraftTree, path: np.ndarray) -> None:
        if tree.num_nodes == 0:  # vLLM's padding rows, not a draft
            return
        counts = self.tree_counts
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

    # -------------------------------------------------------------- draft
    @override
    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Hand the scheduler this step's trees, and nothing else.

        vLLM 0.32.0 gpu_model_runner.py ``take_draft_token_ids`` reads a
        buffer that, on steps where the drafter is skipped (e.g. no request
        was verifying), holds stale or placeholder ids; the scheduler would
        then schedule drafts no tree describes. Here a step without proposals
        gives no drafts.
        """
        drafts, self._step_drafts = self._step_drafts, None
        return drafts

    @override
    def propose_draft_token_ids(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any
    ) -> list[list[int]]:
        from vllm.v1.outputs import DraftTokenIds

        batch = self.input_batch
        if self.budget is not None:
            for index, (req_id, sampled) in enumerate(zip(batch.req_ids, sampled_token_ids)):
                if sampled:
                    self.budget.observe_committed(req_id, sampled, int(batch.num_tokens_no_spec[index]))
        if not self._drafts_this_step():
            return [[] for _ in batch.req_ids]
        asked = self._requests_to_draft(sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        max_len = self.vllm_config.model_config.max_model_len
        start = time.perf_counter()
        budget = self.budget
        prices = StepPrices(
            batch.num_reqs,
            None if budget is None else budget.cost,
            self.draft_cost,
            None if budget is None else budget.plain_cost,
            None if budget is None else budget.chain_cost,
        )
        if self.budget is not None and self.tree_drafter.cuts_to_step_cost:
            self.tree_drafter.plan_step(prices)
        trees = self.tree_drafter.propose(asked.requests)
        elapsed = time.perf_counter() - start
        self.tree_counts.draft_seconds += elapsed
        if self._timed_step is not None:
            self._timed_step.draft_seconds += elapsed
        self.tree_counts.budget_idle += asked.sitting_out
        offered = asked.sitting_out > 0 or any(tree.num_nodes for tree in trees)
        if any(asked.automatic):
            trees = self._keep_what_pays(asked.requests, trees, asked.automatic)
        for index, request, tree in zip(asked.positions, asked.requests, trees):
            # Every node needs a KV slot below max_model_len.
            tree = tree.truncate(max(0, min(tree.num_nodes, max_len - request.token_ids.size - 1)))
            self._proposed[request.req_id] = tree
            drafts[index] = tree.tokens.tolist()
        if self.switch is not None:
            self._judge_step(prices, asked.automatic, offered, drafts, elapsed)
        self._step_drafts = DraftTokenIds(list(batch.req_ids), drafts)
        self._log_budget()
        return drafts

    def _requests_to_draft(self, sampled_token_ids: list[list[int]]) -> DraftAsk:
        """The requests whose drafter is asked this step, with their options for it: those that
        decode with trees and have tokens left to draft, less those the budget sits out."""
        batch, asked = self.input_batch, DraftAsk([], [], [], 0)
        for index, req_id in enumerate(batch.req_ids):
            state = self.requests[req_id]
            params = state.sampling_params
            num_tokens = int(batch.num_tokens_no_spec[index])
            if not sampled_token_ids[index] or params is None or not request_supports_trees(params):
                continue
            # A step commits the accepted drafts and one target token: with 5 tokens left to
            # generate, drafts past depth 4 could never be kept, so none are drafted.
            useful_depth = (params.max_tokens or 1 << 62) - len(state.output_token_ids) - 1
            if useful_depth < 1:  # finished, or only the target's own token left
                continue
            args = request_args(params)
            options = self.tree_config.with_overrides(args.overrides)
            if useful_depth < options["num_speculative_tokens"]:
                options["num_speculative_tokens"] = useful_depth
            auto = options["max_nodes"] == AUTO
            if auto:
                assert self.budget is not None  # AUTO is an option of prunable methods only
                options["max_nodes"] = self.budget.draft_cap(req_id, node_cap(options))
                if options["max_nodes"] == 0:  # sitting this step out: its drafts have not paid
                    asked.sitting_out += 1
                    continue
            asked.requests.append(
                DraftRequest(
                    req_id=req_id,
                    token_ids=batch.token_ids_cpu[index, :num_tokens],
                    options=options,
                    temperature=params.temperature,
                    cache_salt=args.cache_salt,
                )
            )
            asked.positions.append(index)
            asked.automatic.append(auto)
        return asked

    def _judge_step(
        self, prices: StepPrices, automatic: list[bool], offered: bool, drafts: list[list[int]], seconds: float
    ) -> None:
        """Tell the switch what this drafting step was worth: its :func:`utility`, and whether it was
        priced out (drafts were there to verify, or a drafter that prices its own drafts was asked,
        and the controller kept none: the batch then rests whatever the utility)."""
        assert self.switch is not None and self.budget is not None  # a switch runs only with a budget
        gain = self._expected_gain(automatic)
        rows = sum(map(len, drafts))
        offered = offered or (gain is not None and self.tree_drafter.cuts_to_step_cost and bool(automatic))
        branched = self.tree_drafter.cuts_to_step_cost or self.budget.kept_branches
        judged = None if gain is None else utility(prices, gain, rows, seconds, branched)
        self.switch.after(judged, offered and rows == 0)

    def _expected_gain(self, automatic: list[bool]) -> float | None:
        """The tokens this step's trees are expected to add: the budget's kept nodes' values for
        ``"max_nodes": "auto"`` requests, the drafter's own account for a drafter that prices its
        trees; ``None`` when some tree was drafted unvalued (a fixed ``max_nodes``)."""
        assert self.budget is not None  # a switch runs only with one
        if self.tree_drafter.cuts_to_step_cost:
            return self.tree_drafter.expected_gain
        if not any(automatic):  # nothing asked of the budget: nothing drafted, or fixed trees
            return None if automatic else 0.0
        return self.budget.kept_value if all(automatic) else None

    def _drafts_this_step(self) -> bool:
        """Whether this step asks the drafter at all (:class:`~vllm_specbeam.core.controller.Switch`).
        A step that does not is vLLM's plain decode step: no drafts go to the scheduler, so the
        next forward builds no tree and samples with vLLM's sampler, and the draft model feeds
        nothing (it catches up at its next sync)."""
        counts = self.tree_counts
        counts.steps += 1
        if self.switch is not None and self._steps_since_plain >= PLAIN_REFRESH_STEPS:
            self.switch.rest()  # the plain step's own time is due again (it may have drifted)
            self._steps_since_plain = 0
        drafts = self.switch is None or self.switch.drafts(self.input_batch.req_ids)
        counts.steps_off += not drafts
        if drafts and self.switch is not None and self.switch.probing:  # every request drafts, none sitting out
            counts.steps_probed += 1
            assert self.budget is not None  # a switch runs only with one
            self.budget.wake()
        if not drafts and self.draft_runtime is not None:
            self.draft_runtime.defer(self.input_batch.req_ids)
        return drafts

    def _keep_what_pays(
        self, requests: list[DraftRequest], trees: list[DraftTree], automatic: list[bool]
    ) -> list[DraftTree]:
        """``trees`` with the ``"max_nodes": "auto"`` requests' ones cut by the step budget."""
        assert self.budget is not None
        chosen = [k for k, auto in enumerate(automatic) if auto]
        fixed_rows = sum(tree.num_nodes for tree, auto in zip(trees, automatic) if not auto)
        kept = self.budget.prune(
            [requests[k].req_id for k in chosen],
            [trees[k] for k in chosen],
            [requests[k].token_ids.size for k in chosen],
            batch_size=self.input_batch.num_reqs,
            other_rows=fixed_rows,
        )
        trees = list(trees)
        for k, tree in zip(chosen, kept):
            self.tree_counts.budget_asked += 1
            self.tree_counts.budget_drafted += trees[k].num_nodes
            self.tree_counts.budget_kept += tree.num_nodes
            trees[k] = tree
        return trees


@functools.cache
def tree_runner_class(base: type) -> type:
    """``base`` (vLLM's CPU or GPU model runner) with tree verification."""
    return type(f"Tree{base.__name__}", (TreeRunnerMixin, base), {})
