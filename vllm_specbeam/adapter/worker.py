"""The plugin's GPU worker, and what its CPU worker (:mod:`.cpu_worker`) shares with it.

For a plugin method the speculative-config patch names one of them, by
platform, in ``ParallelConfig.worker_cls``: vLLM's extension point for the
worker, resolved by name in every worker process (v1/worker/worker_base.py
``WorkerWrapperBase.init_worker``). Engines without a plugin method keep
vLLM's own workers and runners.

Nothing here may import ``vllm.v1.worker.cpu*``: vLLM 0.32.0's
``v1/worker/cpu/shm.py`` replaces ``torch.cuda.Stream``, ``torch.accelerator``'s
memory queries and more, process-wide, on import, and this module is loaded in
every process of a CUDA engine (patches.check looks its classes up).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_specbeam.adapter import mcsd_train
from vllm_specbeam.adapter.engine_config import V2_RUNNER_PROBLEM
from vllm_specbeam.adapter.runner import tree_runner_class
from vllm_specbeam.methods.dsbd.beam_sampling import SamplingLaw
from vllm_specbeam.methods.dsbd.drafter import ForestRequest, SampleForestRequest, draft_forests, sample_forests


def check_v1_runner(worker: Worker) -> None:
    """The speculative-config patch refuses ``VLLM_USE_V2_MODEL_RUNNER=1``;
    what else selects the V2 runner (vLLM 0.32.0 config/vllm.py
    ``use_v2_model_runner``) is refused here, before a runner is built."""
    if worker.use_v2_model_runner:
        raise RuntimeError(
            f"{V2_RUNNER_PROBLEM}: HiSparse attention and watermarking need the V2 runner; "
            f"start the engine without them to use a vllm-specbeam method"
        )


class TreeWorkerMixin:
    """What both tree workers add to vLLM's: the in-worker draft's warm-up, and methods
    ``LLM.collective_rpc`` calls by name (no pickled function, so no
    ``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""

    model_runner: GPUModelRunner

    def compile_or_warm_up_model(self) -> Any:
        # vLLM 0.32.0 v1/worker/cpu_worker.py and gpu_worker.py warm up (compile) the target only;
        # the in-worker draft (adapter/draft_model.py) is compiled here, before the first request
        # and before vLLM's compile_or_warm_up_model resets the random seed.
        runtime = getattr(self.model_runner, "draft_runtime", None)
        if runtime is not None:
            runtime.warm_up()
        return super().compile_or_warm_up_model()  # type: ignore[misc]

    def specbeam_forget_finished(self) -> None:
        """Empty the drafter's cross-request index (``lookup_tree``'s global scope, a draft-model
        method's global lookup), as a newly started engine has it; ``POST /collective_rpc`` on a
        server in ``VLLM_SERVER_DEV_MODE``."""
        self.model_runner.tree_drafter.forget_finished()  # type: ignore[attr-defined]

    def specbeam_stats(self) -> dict[str, int | float | list[int]]:
        """The runner's counters and what the drafter and the draft runtimes hold now (requests
        with state, the beam searches' draft blocks), for a server in ``VLLM_SERVER_DEV_MODE``
        (``POST /collective_rpc``)."""
        runner = self.model_runner
        runtime = getattr(runner, "draft_runtime", None)
        search = vars(runner).get("search_draft_runtime")  # built by the first speculative beam search
        return {
            **runner.tree_stats,  # type: ignore[attr-defined]
            "drafter_live_requests": runner.tree_drafter.live_requests,  # type: ignore[attr-defined]
            "draft_runtime_live_requests": runtime.live_requests if runtime is not None else 0,
            "beam_search_draft_prompts": search.live_requests if search is not None else 0,
            "beam_search_draft_blocks": search.pool.num_blocks if search is not None else 0,
        }

    def specbeam_take_stop_data(self) -> dict[str, list]:
        """``mcsd``'s labelled draft rows, for ``vllm-specbeam mcsd train`` (plain lists for the RPC)."""
        return mcsd_train.take_stop_data(self.model_runner.tree_drafter)  # type: ignore[attr-defined]

    def specbeam_draft_forests(
        self, requests: list[list[Any]], width: int, eos: int | None
    ) -> list[list[tuple[list[int], list[int]]]]:
        """The speculative beam search's drafting in the worker (adapter/beam_search.py): per
        prompt ``[key, beams, scores, depth]``, per beam its tree as ``(tokens, parents)``."""
        runtime = self.model_runner.search_draft_runtime  # type: ignore[attr-defined]
        forests = draft_forests(runtime, [ForestRequest(*request) for request in requests], width, eos)
        return [[(tree.tokens.tolist(), tree.parents.tolist()) for tree in trees] for trees in forests]

    def specbeam_sample_forests(
        self, requests: list[list[Any]], width: int, law: list[float], eos: int | None
    ) -> list[list[Any]]:
        """The speculative beam sampling's drafting (adapter/beam_sampling.py): per prompt
        ``[key, beams, scores, depth, seed]``; ``law``: ``[temperature, top_k, top_p]``."""
        runtime = self.model_runner.search_draft_runtime  # type: ignore[attr-defined]
        sampling = SamplingLaw(float(law[0]), int(law[1]), float(law[2]))
        forests = [SampleForestRequest(ForestRequest(*r[:4]), int(r[4])) for r in requests]
        return sample_forests(runtime, forests, width, sampling, eos)

    def specbeam_release_forests(self, keys: list[str]) -> None:
        """Free finished searches' draft blocks."""
        self.model_runner.search_draft_runtime.remove(keys)  # type: ignore[attr-defined]


class TreeGPUWorker(TreeWorkerMixin, Worker):
    """vLLM's GPU worker with the tree runner."""

    @override
    def _make_model_runner(self) -> GPUModelRunner:
        # vLLM 0.32.0 v1/worker/gpu_worker.py: the runner factory "subclasses override".
        check_v1_runner(self)
        return tree_runner_class(GPUModelRunner)(self.vllm_config, self.device)
