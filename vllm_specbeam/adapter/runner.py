"""Tree verification inside vLLM's V1 model runner.

One engine step of a plugin method, as the runner sees it (vLLM's
v1/worker/gpu_model_runner.py, synchronous scheduling):

1. ``_prepare_inputs`` (stock) lays out ``[root, node 0, node 1, ...]`` per
   request and gives every row a linear KV slot; the plugin then sets each
   node's *position* to ``context + depth`` (:mod:`.step_trees`).
2. ``_model_forward`` runs the target once; the attention layers see the
   step's trees (CPU: :class:`~vllm_specbeam.adapter.attention.cpu.TreeStep`,
   CUDA: :class:`~vllm_specbeam.adapter.attention.cuda.GpuTreeStep`).
3. ``_sample`` runs the method's verifier instead of vLLM's rejection
   sampler (:mod:`.verification`), returns the accepted path in vLLM's shape,
   and moves the accepted nodes' K/V to consecutive slots.
4. ``propose_draft_token_ids`` asks the drafter for the next trees
   (:mod:`.drafting`), cut by the step budget (:mod:`vllm_specbeam.core.budget`)
   under ``"max_nodes": "auto"``; the flattened tokens go to the scheduler as
   draft tokens. The budget's cost lines come from the engine's own steps
   (:mod:`.step_timing`).

Built only by the plugin's workers (:mod:`.worker`). Each vLLM method it
overrides is marked ``@override``; registration checks they still exist.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from typing_extensions import override

from vllm_specbeam.adapter import mcsd_train, patches, step_trees, verification
from vllm_specbeam.adapter.attention import cpu as cpu_attention
from vllm_specbeam.adapter.attention.step import check_tree_attention, distinct_kv_caches, tree_step
from vllm_specbeam.adapter.draft_model import SearchDraftRuntime, WorkerDraftRuntime, uses_worker_draft
from vllm_specbeam.adapter.drafting import TreeDrafting, batch_requests
from vllm_specbeam.adapter.engine_config import plugin_config
from vllm_specbeam.adapter.logitsprocs import builtin_logitsprocs
from vllm_specbeam.adapter.metrics import RunnerMetrics
from vllm_specbeam.adapter.step_selection import finished_request
from vllm_specbeam.adapter.step_timing import DraftForwards, fitted_lines, same_on_every_rank
from vllm_specbeam.adapter.tree_counts import STATE_BYTES, TreeCounts, lines_stats
from vllm_specbeam.adapter.verification import Accepted, StepTree, TreeVerification
from vllm_specbeam.core.budget import StepCost
from vllm_specbeam.core.config import METHODS, SpecbeamConfig
from vllm_specbeam.core.drafter import TreeDrafter
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.kernels import kv_move

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import DraftTokenIds, SamplerOutput
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_specbeam.adapter.attention.cuda import GpuTreeStep


class DrafterHost:
    """What vLLM's ``custom_class`` carrier instantiates as the runner's drafter.

    vLLM builds it (``create_custom_proposer``) and calls ``load_model``; the
    tree runner asks its :attr:`tree_drafter` for trees. vLLM's chain ``propose``
    must never be reached: the tree runner overrides the call site.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.config = plugin_config(vllm_config)
        drafter_cls = METHODS[self.config.method].drafter_class()
        self.tree_drafter: TreeDrafter = drafter_cls(self.config.options)
        if self.config.options.get("collect"):  # `vllm-specbeam mcsd train`: the stop model's rows
            mcsd_train.install_collector(self.tree_drafter)

    def load_model(self, target_model: torch.nn.Module) -> None:
        # An in-worker draft is loaded by the tree runner once the target is (it needs the runner).
        if not uses_worker_draft(self.config):
            self.tree_drafter.load_model(target_model)

    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        raise RuntimeError(
            "vllm-specbeam: the chain proposer path was reached; the engine is not running the plugin's "
            "worker (vllm_specbeam.adapter.worker or .cpu_worker), which the speculative-config patch selects"
        )


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
        self.tree_counts = TreeCounts()
        self.tree_verification = TreeVerification(METHODS[config.method].verifiers(), self.tree_counts)
        self.move_accepted_kv = True  # switched off only by a test that proves the move matters
        #: the last tree proposed for each request, which the scheduler schedules as its drafts
        self._proposed: dict[str, DraftTree] = {}
        self.prompt_trees = step_trees.PromptTrees()
        self._tree_step: cpu_attention.TreeStep | GpuTreeStep | None = None
        #: the drafts proposed this step, for :meth:`take_draft_token_ids`
        self._step_drafts: DraftTokenIds | None = None
        #: the draft model inside the worker (draft-model methods on CPU), see :mod:`.draft_model`
        self.draft_runtime: WorkerDraftRuntime | None = None
        self.drafting = TreeDrafting(
            config,
            self.tree_drafter,
            self.tree_counts,
            same_on_every_rank if vllm_config.parallel_config.tensor_parallel_size > 1 else None,
        )
        self.budget, self.step_timer, self.switch = self.drafting.budget, self.drafting.timer, self.drafting.switch
        #: seconds of the in-worker draft's forwards by rows, fitted as the target's steps are
        self.draft_forwards = DraftForwards()
        self.draft_cost: StepCost | None = None
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
        return self.prompt_trees.get(req_id)

    @property
    def tree_stats(self) -> dict[str, int | float | list[int]]:
        """The counters as a plain dict, for readers through ``LLM.collective_rpc``
        (tests, benchmarks), and the drafter's memory and cross-request index now (not counters)."""
        # the fitted costs, once there are (not counters: readers take them as they are)
        lines = lines_stats(self.cost_lines)
        drafter = self.tree_drafter
        return {**self.tree_counts.as_dict(), STATE_BYTES: drafter.state_bytes, **drafter.index_stats, **lines}

    @property
    def cost_lines(self) -> dict[str, StepCost | None]:
        """The fitted lines by stats prefix (:func:`.step_timing.fitted_lines`)."""
        return fitted_lines(self.budget, self.draft_cost)

    @property
    def drafter_host(self) -> DrafterHost:
        """vLLM's ``self.drafter``: the :class:`DrafterHost` its ``custom_class`` carrier built."""
        return self.drafter

    @property
    def tree_drafter(self) -> TreeDrafter:
        return self.drafter_host.tree_drafter

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
            if self.step_timer is not None:  # the draft's time, not the target's rows'
                self.step_timer.add_draft_seconds(time.perf_counter() - start)
            self.tree_counts.steps_without_draft_forward += self.tree_counts.draft_forwards == forwards
        if ran and self.metrics is not None:
            self.metrics.publish(self.tree_counts, self.cost_lines)
        return output

    def record_draft_forward(self, rows: int, seconds: float) -> None:
        """One forward of the in-worker draft (:class:`WorkerDraftRuntime`): counted, and fitted."""
        self.tree_counts.draft_forwards += 1
        self.tree_counts.draft_rows += rows
        self.draft_forwards.observe(rows, seconds)

    @override
    def _update_states(self, scheduler_output: SchedulerOutput) -> Callable[..., Any] | None:
        finished = set(scheduler_output.finished_req_ids)
        self._forget_finished(finished)
        for new in scheduler_output.scheduled_new_reqs:
            self.prompt_trees.add(new.req_id, new.sampling_params, new.prompt_token_ids)
        # A preempted request's drafter state is rebuilt when it resumes;
        # its last tree is kept: the scheduler may verify those drafts
        # right after the resumed request's recomputed tokens.
        preempted = set(scheduler_output.preempted_req_ids or ())
        self.tree_counts.preempted += len(preempted)
        gone = finished | preempted
        if gone:
            self.tree_drafter.remove_requests(gone)
        return super()._update_states(scheduler_output)

    def _forget_finished(self, finished: set[str]) -> None:
        """Forget finished requests; a drafter that learns across requests gets their sequences first."""
        for req_id in finished:
            self._proposed.pop(req_id, None)
        self.prompt_trees.forget(finished)
        if self.budget is not None:
            self.budget.remove(finished)
        if finished and self.tree_drafter.learns_across_requests:
            requests = (finished_request(r, self.requests.get(r), self.tree_config) for r in sorted(finished))
            self.tree_drafter.finished([request for request in requests if request is not None])

    @override
    def execute_model(self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
        if self.step_timer is not None and self.step_timer.time_step(scheduler_output):
            self.draft_cost = same_on_every_rank(self.draft_forwards.model.fitted())
        return super().execute_model(scheduler_output, *args, **kwargs)

    # -------------------------------------------------------------- inputs
    @override
    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput, num_scheduled_tokens: np.ndarray
    ) -> tuple[torch.Tensor, SpecDecodeMetadata | None, int]:
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        batch = self.input_batch  # query_start_loc.np: each request's first token row (see _build_tree_step)
        rows = step_trees.BatchRows(
            batch.req_id_to_index, self.query_start_loc.np, batch.num_computed_tokens_cpu, num_scheduled_tokens
        )
        verifying = step_trees.verifying_trees(scheduler_output.scheduled_spec_decode_tokens, self._proposed, rows)
        self.tree_verification.verifying = verifying
        trees = verifying + self.prompt_trees.in_step(rows, lambda req_id: self.requests[req_id].num_prompt_tokens)
        if not trees:
            self._tree_step = None
            return result
        step = self._build_tree_step(trees, scheduler_output.total_num_scheduled_tokens)
        self.tree_counts.steps_branched += bool(verifying) and step.needs_attention
        if self.step_timer is not None:
            self.step_timer.mark_branched(step.needs_attention)
        # Slots were computed from the linear positions above and stay linear;
        # only the positions the model sees (RoPE) become context + depth.
        self.positions[step.node_rows.to(self.positions.device)] = step.node_positions.to(
            self.positions.device, self.positions.dtype
        )
        self._tree_step = step
        return result

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
        # vLLM 0.32.0 gpu_model_runner.py _get_prompt_logprobs_dict: a request stays in
        # num_prompt_logprobs until the step that computes its last prompt row, which
        # returns its LogprobsTensors (the output processor takes any number of positions).
        pending = self.num_prompt_logprobs
        ours = self.prompt_trees.take_logprobs(pending, num_scheduled_tokens)
        logprobs_dict: dict[str, Any] = super()._get_prompt_logprobs_dict(hidden_states, num_scheduled_tokens)
        for req_id, (num_logprobs, tree) in ours.items():
            request = self.requests[req_id]
            index = self.input_batch.req_id_to_index[req_id]
            row = step_trees.BatchRow(
                index, int(self.query_start_loc.np[index]), request.num_computed_tokens, num_scheduled_tokens[req_id]
            )
            entry = step_trees.prompt_tree_in_step(req_id, row, tree, len(request.prompt_token_ids or ()))
            if entry is None:
                pending[req_id] = num_logprobs  # a prefill chunk above the tree
                continue
            mode = self.model_config.logprobs_mode
            logprobs_dict[req_id] = step_trees.tree_logprobs(
                self.model, self.sampler, mode, hidden_states, entry, num_logprobs
            )
            request.in_progress_prompt_logprobs_cpu = None
        return logprobs_dict

    def _build_tree_step(self, trees: list[StepTree], num_tokens: int) -> cpu_attention.TreeStep | GpuTreeStep:
        """The attention layers' view of this step's trees, built once per step."""
        # vLLM 0.32.0 gpu_model_runner.py _prepare_inputs: query_start_loc.np
        # holds each request's first token row.
        return step_trees.build_tree_step(trees, num_tokens, self.query_start_loc.np, self.device)

    @override
    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._tree_step is None:  # no tree in this step: vLLM's forward as it is
            return super()._model_forward(*args, **kwargs)
        with tree_step(self._tree_step):
            return super()._model_forward(*args, **kwargs)

    # -------------------------------------------------------------- verify
    @override
    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: SpecDecodeMetadata | None) -> SamplerOutput:
        if spec_decode_metadata is None or not self.tree_verification.verifying:
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
        first_logit = verification.first_logit_rows(spec_decode_metadata)  # [num_reqs]
        verdicts = self._verify(logits, first_logit, sampling_metadata)
        rows = self.tree_verification.accepted_rows(verdicts, plain, first_logit, spec_decode_metadata.max_spec_len + 1)
        if self.move_accepted_kv:
            self._move_accepted_kv(rows.src_rows, rows.dst_rows)
        self._tree_step = None
        output = rows.output.to(logits.device)
        logprobs = verification.accepted_logprobs(self.sampler, logits, rows, sampling_metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs)

    def _verify(
        self, logits: torch.Tensor, first_logit: np.ndarray, sampling_metadata: SamplingMetadata
    ) -> list[Accepted]:
        """What to accept for each verifying request (:meth:`.verification.TreeVerification.verify`)."""
        verifying = self.tree_verification.verifying
        temperatures = {entry.req_id: self.requests[entry.req_id].sampling_params.temperature for entry in verifying}
        return self.tree_verification.verify(logits, first_logit, sampling_metadata, temperatures)

    def _move_accepted_kv(self, src_rows: list[np.ndarray], dst_rows: list[np.ndarray]) -> None:
        """Copy the accepted nodes' K/V, all layers, from token rows ``src_rows``
        to ``dst_rows`` (one array per verifying request, root-first).

        Rows become slots through the step's slot mapping, which vLLM 0.32.0
        v1/worker/block_table.py ``compute_slot_mapping`` writes into
        ``slot_mapping.gpu`` (a CPU tensor too on the CPU backend).
        """
        slots = self.input_batch.block_table[0].slot_mapping.gpu  # [num_tokens]
        on_cuda = self.device.type != "cpu"
        pointers = self._kv_layer_pointers if on_cuda else None
        self.tree_counts.kv_moves += verification.move_accepted_kv(
            slots, src_rows, dst_rows, self._kv_layers, on_cuda, pointers
        )

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

        req_ids = self.input_batch.req_ids
        self.drafting.observe_committed(req_ids, sampled_token_ids, self.input_batch.num_tokens_no_spec)
        if not self.drafting.drafts_this_step(req_ids, [self.requests[r].sampling_params for r in req_ids]):
            if self.draft_runtime is not None:
                self.draft_runtime.defer(req_ids)
            return [[] for _ in req_ids]
        batch = batch_requests(self.input_batch, self.requests, sampled_token_ids)
        self.draft_forwards.drafting()
        proposal = self.drafting.propose(batch, self.vllm_config.model_config.max_model_len, self.draft_cost)
        self.draft_forwards.drafted(proposal.draft_seconds)
        if self.draft_runtime is not None:
            # those the drafter was not asked for (one token left, a prompt's chunk) wait for a
            # step that drafts them: fed now, a batch's last step would feed every context; a beam
            # search's scoring requests still feed their shared prefix, which its next rounds hit
            idle = [r for r in req_ids if r not in proposal.trees and self.prompt_tree(r) is None]
            self.draft_runtime.defer(idle)
        self._proposed.update(proposal.trees)
        self._step_drafts = DraftTokenIds(list(req_ids), proposal.drafts)
        return proposal.drafts


@functools.cache
def tree_runner_class(base: type) -> type:
    """``base`` (vLLM's CPU or GPU model runner) with tree verification."""
    return type(f"Tree{base.__name__}", (TreeRunnerMixin, base), {})
