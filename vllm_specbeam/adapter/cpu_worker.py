"""The plugin's CPU worker: vLLM 0.32's ``CPUWorker`` building the tree runner.

A module of its own, imported only where ``current_platform.is_cpu()``:
importing ``vllm.v1.worker.cpu_worker`` imports ``vllm.v1.worker.cpu.shm``,
which patches ``torch.cuda`` and ``torch.accelerator`` process-wide (vLLM 0.32.0
v1/worker/cpu/shm.py). On a CUDA machine that would size the KV cache from host
memory and break CUDA-graph capture, in every engine, plugin method or not.
"""

from __future__ import annotations

from typing_extensions import override
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_specbeam.adapter import patches
from vllm_specbeam.adapter.runner import tree_runner_class
from vllm_specbeam.adapter.worker import TreeWorkerMixin, check_v1_runner


class TreeCPUWorker(TreeWorkerMixin, CPUWorker):
    """vLLM's CPU worker with the tree runner."""

    @override
    def init_device(self) -> None:
        # vLLM 0.32.0 v1/worker/cpu_worker.py: ``CPUWorker.init_device`` binds
        # threads and sets up the distributed environment, then builds
        # ``CPUModelRunner(...)`` through that module-global name; unlike the
        # GPU worker it has no method that only builds the runner. Rather than
        # copy init_device, the name means the tree runner during this one call
        # (one worker per process, nothing else builds a runner meanwhile).
        check_v1_runner(self)
        with patches.replaced(patches.CPU_WORKER_RUNNER, tree_runner_class):
            super().init_device()
