"""Installing the plugin changes nothing on a CUDA machine until a plugin method runs.

vLLM runs ``register()`` in every process of every engine. On a (mocked) CUDA
platform, ``register()`` and every module of the plugin's CUDA path must leave
torch and vLLM as they were: vLLM 0.32.0's ``v1/worker/cpu/shm.py``, imported
by its CPU worker, replaces the symbols below process-wide on import (on a GPU
the KV cache would be sized from host memory, and CUDA-graph capture would
run on a placeholder stream). Each check runs in a fresh interpreter, where
nothing else has imported vLLM's CPU worker yet.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

#: what vLLM 0.32.0 v1/worker/cpu/shm.py replaces on import: ``module:attribute.path``
SHM_PATCHED = (
    "torch:Event",
    "torch.cuda:Event",
    "torch.cuda:Stream",
    "torch.cuda:stream",
    "torch.cuda:current_stream",
    "torch.cuda:set_stream",
    "torch.accelerator:synchronize",
    "torch.accelerator:empty_cache",
    "torch.accelerator:get_memory_info",
    "torch:Tensor.pin_memory",
    "torch:Tensor.record_stream",
    "vllm.utils.torch_utils:async_tensor_h2d",
    "vllm.v1.worker.gpu.buffer_utils:UvaBuffer",
    "triton.language:debug_barrier",
    "vllm.triton_utils:tl.debug_barrier",
)
#: CUDA ops vLLM 0.32.0 calls while its CUDA modules import (w8a8_utils.py, ...), absent from the CPU build
CUDA_OPS_QUERIED_AT_IMPORT = ("cutlass_scaled_mm_supports_block_fp8",)
#: the modules whose import is the side effect
CPU_WORKER_MODULES = "vllm.v1.worker.cpu"


@dataclass
class PathLoad:
    """What loading a platform's path did to the process."""

    #: plugin modules loaded (the subclasses patches.check imports, and the attention backend)
    loaded: list[str]
    #: problems patches.check found (none: the whole path was looked up)
    problems: dict[str, str]
    #: SHM_PATCHED symbols no longer the object they were before
    changed: list[str]
    #: vllm.v1.worker.cpu* modules in sys.modules
    cpu_worker_modules: list[str]


#: a symbol this torch, Triton or vLLM lacks (Triton 3.9 has no ``tl.debug_barrier``): shm.py would add it
ABSENT = object()


def _symbol(path: str) -> object:
    module, _, attributes = path.partition(":")
    value: object = importlib.import_module(module)
    for name in attributes.split("."):
        value = getattr(value, name, ABSENT)
    return value


def stub_gpu_only_parts() -> None:
    """What vLLM's CPU build lacks for importing its CUDA modules: the flash-attention
    extensions, and CUDA ops some modules query at import (answered "unsupported")."""
    import types

    import torch

    flash_attn = types.ModuleType("vllm.vllm_flash_attn")
    flash_attn.__getattr__ = lambda name: None  # type: ignore[method-assign]  # never called here
    sys.modules.setdefault(flash_attn.__name__, flash_attn)
    for op in CUDA_OPS_QUERIED_AT_IMPORT:
        setattr(torch.ops._C, op, lambda *args, **kwargs: False)


def load_path(platform: str) -> PathLoad:
    """Mock ``current_platform`` as ``platform``, run ``register()`` and import every
    plugin module of that platform's path; report what changed."""
    from vllm.platforms import current_platform

    before = {path: _symbol(path) for path in SHM_PATCHED}
    current_platform.is_cuda = lambda: platform == "cuda"  # type: ignore[method-assign]
    current_platform.is_cpu = lambda: platform == "cpu"  # type: ignore[method-assign]
    if platform == "cuda":
        stub_gpu_only_parts()

    from vllm_specbeam.adapter import patches, plugin

    plugin.register()
    targets = [t for t in patches.TARGETS if t.platform in (None, platform)]
    problems = patches.check(targets)
    modules = {t.subclass.partition(":")[0] for t in targets if t.subclass}
    modules |= {"vllm_specbeam.adapter.attention.cuda"} if platform == "cuda" else set()
    for module in sorted(modules):
        importlib.import_module(module)
    return PathLoad(
        loaded=sorted(m for m in modules if m in sys.modules),
        problems=problems,
        changed=[path for path, value in before.items() if _symbol(path) is not value],
        cpu_worker_modules=sorted(m for m in sys.modules if m.startswith(CPU_WORKER_MODULES)),
    )


def run_fresh(platform: str) -> PathLoad:
    done = subprocess.run(
        [sys.executable, __file__, platform], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return PathLoad(**json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_cuda_path_loads_no_cpu_worker_and_changes_no_torch_symbol():
    load = run_fresh("cuda")
    assert load.problems == {}  # every CUDA target was found, so the whole path was imported
    assert {"vllm_specbeam.adapter.worker", "vllm_specbeam.adapter.runner"} <= set(load.loaded)
    assert "vllm_specbeam.adapter.attention.cuda" in load.loaded
    assert load.cpu_worker_modules == []
    assert load.changed == []


def test_the_cpu_path_still_loads_the_cpu_worker():
    """The control: the same check sees vLLM's CPU worker and its patches where they belong."""
    load = run_fresh("cpu")
    assert load.problems == {}
    assert "vllm_specbeam.adapter.cpu_worker" in load.loaded
    assert "vllm.v1.worker.cpu.shm" in load.cpu_worker_modules
    assert {"torch.cuda:Stream", "torch.accelerator:get_memory_info", "torch:Tensor.pin_memory"} <= set(load.changed)


if __name__ == "__main__":
    print(json.dumps(asdict(load_path(sys.argv[1]))))
