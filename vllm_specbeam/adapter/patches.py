"""Every vLLM symbol the plugin wraps, replaces or subclasses, and the
one way it does so.

Each such symbol is a :class:`Target` below, named by the module it is read
from in vLLM 0.32.0's sources (all found unchanged in 0.33.0; what else
differs between the releases: :mod:`vllm_specbeam.adapter.vllm_versions`).
At registration (plugin.py ``register``, in
every process) :func:`check` looks each target of the platform up before
anything is touched: a symbol that is missing or of another kind, or another
vLLM version, is a *problem*. Problems are logged there and raised by
:func:`raise_problems` where a plugin method is requested (the
speculative-config patch): ``register()`` itself must not raise, since vLLM's
loader calls it in every process of every engine, plugin method or not.

:func:`wrap` and :func:`replaced` are the only ways the plugin changes a vLLM
symbol; plugin classes that subclass a vLLM class mark the methods they
override with ``@override`` (PEP 698), and :func:`check` makes sure each of
those still exists in the installed vLLM, where a renamed method would
otherwise silently never be called.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from vllm_specbeam.adapter import vllm_versions
from vllm_specbeam.core.config import SpecbeamConfigError

#: The vLLM release every target was read from.
READ_FROM = "0.32.0"

#: Set on every wrapper :func:`wrap` installs: the target it wraps.
_WRAPS = "_specbeam_wraps"


@dataclass(frozen=True)
class Target:
    """A vLLM symbol the plugin relies on, as ``module:qualified.name``."""

    path: str
    #: what it must be: a callable, a class, or any attribute (an enum member, a class variable)
    kind: Literal["callable", "class", "attribute"] = "callable"
    #: checked only where ``current_platform.is_<platform>()`` holds; ``None``: everywhere
    platform: Literal["cpu", "cuda"] | None = None
    #: ``module:qualname`` of the plugin class that subclasses this class: its
    #: ``@override`` methods must exist here too
    subclass: str | None = None

    @property
    def module(self) -> str:
        return self.path.partition(":")[0]

    @property
    def source(self) -> str:
        """The vLLM source file the symbol is read from (as in vLLM 0.32.0): ``a/b.py``,
        or ``a/b/__init__.py`` for a package."""
        path = self.module.replace(".", "/")
        try:
            package = importlib.util.find_spec(self.module).submodule_search_locations is not None  # type: ignore[union-attr]
        except (ImportError, AttributeError, ValueError):
            package = False
        return f"{path}/__init__.py" if package else f"{path}.py"

    def locate(self) -> tuple[Any, str, Any]:
        """``(owner, name, value)``: ``getattr(owner, name)`` is the symbol.

        Raises ``LookupError`` saying what is wrong.
        """
        try:
            owner: Any = importlib.import_module(self.module)
        except Exception as error:
            raise LookupError(f"its module does not import ({type(error).__name__}: {error})") from error
        *parents, name = self.path.partition(":")[2].split(".")
        for part in parents:
            owner = getattr(owner, part, None)
            if owner is None:
                raise LookupError(f"{part!r} not found")
        if not hasattr(owner, name):
            raise LookupError("not found")
        value = getattr(owner, name)
        if self.kind == "class" and not isinstance(value, type):
            raise LookupError(f"is a {type(value).__name__}, not a class")
        if self.kind == "callable" and not callable(value):
            raise LookupError(f"is a {type(value).__name__}, not callable")
        return owner, name, value

    def describe(self, reason: str) -> str:
        return f"{self.path} (read from {self.source} in vLLM {READ_FROM}): {reason}"


def _runner(platform: Literal["cpu", "cuda"], path: str) -> Target:
    return Target(path, "class", platform, subclass="vllm_specbeam.adapter.runner:TreeRunnerMixin")


# ----------------------------------------------------------------- the targets
# What each is for: plugin.py's docstring (the numbers are its patches).
#: 1. validates a plugin method's config and hands vLLM the carrier config
CREATE_SPECULATIVE_CONFIG = Target("vllm.engine.arg_utils:EngineArgs.create_speculative_config")
#: 2. per-request options and tree prompts, checked at admission
VALIDATE_PARAMS = Target("vllm.v1.engine.input_processor:InputProcessor._validate_params")
#: 3. the worker classes named in ``worker_cls`` build the tree runner (adapter/worker.py)
CPU_WORKER = Target(
    "vllm.v1.worker.cpu_worker:CPUWorker", "class", "cpu", subclass="vllm_specbeam.adapter.worker:TreeCPUWorker"
)
#: the runner class ``CPUWorker.init_device`` builds, by this module-global name
CPU_WORKER_RUNNER = _runner("cpu", "vllm.v1.worker.cpu_worker:CPUModelRunner")
GPU_WORKER = Target(
    "vllm.v1.worker.gpu_worker:Worker", "class", "cuda", subclass="vllm_specbeam.adapter.worker:TreeGPUWorker"
)
GPU_RUNNER = _runner("cuda", "vllm.v1.worker.gpu_model_runner:GPUModelRunner")
#: the CPU backend's attention, wrapped to recompute tree rows (adapter/attention/cpu.py)
CPU_ATTENTION_FORWARD = Target("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward", platform="cpu")
#: 4. the CUDA tree backend (adapter/attention/cuda.py): vLLM's Triton backend,
#: subclassed, registered in the ``CUSTOM`` slot
REGISTER_BACKEND = Target("vllm.v1.attention.backends.registry:register_backend", platform="cuda")
CUSTOM_BACKEND_SLOT = Target("vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM", "attribute", "cuda")
TRITON_BACKEND = Target(
    "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend",
    "class",
    "cuda",
    subclass="vllm_specbeam.adapter.attention.cuda:TreeTritonAttentionBackend",
)
TRITON_IMPL = Target(
    "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl",
    "class",
    "cuda",
    subclass="vllm_specbeam.adapter.attention.cuda:TreeTritonAttentionImpl",
)
#: class variables the tree backend overrides: what vLLM's selector refuses, and no full CUDA graphs
TRITON_CLASS_VARIABLES = tuple(
    Target(f"vllm.v1.attention.backends.triton_attn:{name}", "attribute", "cuda")
    for name in (
        "TritonAttentionBackend.supported_dtypes",
        "TritonAttentionBackend.supported_kv_cache_dtypes",
        "TritonAttentionMetadataBuilder._cudagraph_support",
    )
)
#: 5. prefix-cache keys of tree-prompt blocks (adapter/tree_prompt.py)
BLOCK_HASH_EXTRA_KEYS = Target("vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys")
#: 6. the server's use_beam_search (adapter/beam_search_server.py)
ONLINE_BEAM_SEARCH = Target("vllm.entrypoints.generate.beam_search.online:BeamSearchOnlineMixin.beam_search")
#: 7. KV slots the scheduler reserves past a step's tokens: the in-worker draft's scratch (adapter/draft_model.py)
NUM_LOOKAHEAD_TOKENS = Target("vllm.config.vllm:VllmConfig.num_lookahead_tokens", "attribute")
#: 8. sampling without the generators of requests whose token is discarded (adapter/cpu_generators.py)
SAMPLE_TOKENS = Target("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens", platform="cpu")
#: 9. ``min_p`` and ``logit_bias`` on plugin engines (their requests are never drafted): admitted,
#: and the runner built with vLLM's built-in logits processors, which apply them
VALIDATE_SPEC_DECODE_PARAMS = Target("vllm.sampling_params:SamplingParams._validate_spec_decode")
RUNNER_LOGITSPROCS = Target("vllm.v1.worker.gpu_model_runner:build_logitsprocs")
BUILTIN_LOGITSPROCS = Target("vllm.v1.sample.logits_processor:BUILTIN_LOGITS_PROCESSORS", "attribute")
#: 10. the scheduler of plugin engines (adapter/scheduler.py): prefill chunks end outside tree prompts' trees
SCHEDULER = Target(
    "vllm.v1.core.sched.scheduler:Scheduler", "class", subclass="vllm_specbeam.adapter.scheduler:TreePromptScheduler"
)

TARGETS = (
    CREATE_SPECULATIVE_CONFIG,
    VALIDATE_PARAMS,
    CPU_WORKER,
    CPU_WORKER_RUNNER,
    GPU_WORKER,
    GPU_RUNNER,
    CPU_ATTENTION_FORWARD,
    REGISTER_BACKEND,
    CUSTOM_BACKEND_SLOT,
    TRITON_BACKEND,
    TRITON_IMPL,
    *TRITON_CLASS_VARIABLES,
    BLOCK_HASH_EXTRA_KEYS,
    ONLINE_BEAM_SEARCH,
    NUM_LOOKAHEAD_TOKENS,
    SAMPLE_TOKENS,
    VALIDATE_SPEC_DECODE_PARAMS,
    RUNNER_LOGITSPROCS,
    BUILTIN_LOGITSPROCS,
    SCHEDULER,
)


# ------------------------------------------------------------------ checking
#: the problems :func:`check` found last, by target path ("vllm" for the version)
_problems: dict[str, str] = {}


def check(targets: Iterable[Target]) -> dict[str, str]:
    """Look every target up (and the vLLM version); remember and return the
    problems, each naming the symbol, the file it was read from and what is wrong."""
    _problems.clear()
    version = vllm_versions.vllm_version()
    if vllm_versions.release_of(version) is None:
        _problems["vllm"] = vllm_versions.unsupported(version)
    for target in targets:
        try:
            _, _, value = target.locate()
            if target.subclass is not None:
                _check_overrides(target, value)
        except LookupError as error:
            _problems[target.path] = target.describe(str(error))
    return dict(_problems)


def _check_overrides(target: Target, base: type) -> None:
    """Every ``@override`` method of the plugin's subclass exists on ``base``."""
    module, _, name = (target.subclass or "").partition(":")
    try:
        subclass = getattr(importlib.import_module(module), name)
    except Exception as error:
        raise LookupError(f"{target.subclass} does not import ({type(error).__name__}: {error})") from error
    for attr, member in vars(subclass).items():
        if getattr(getattr(member, "__func__", member), "__override__", False) and not hasattr(base, attr):
            raise LookupError(f"has no {attr!r}, which {target.subclass} overrides")


def raise_problems() -> None:
    """Raise what :func:`check` found, with the fix."""
    if _problems:
        raise SpecbeamConfigError(report(_problems.values()))


def report(problems: Iterable[str]) -> str:
    lines = "".join(f"\n  - {problem}" for problem in problems)
    return (
        f"vllm-specbeam cannot run on the installed vLLM {vllm_versions.vllm_version()}; it hooks into vLLM "
        f"{READ_FROM}'s internals, and:{lines}\ninstall vLLM {vllm_versions.supported()}: "
        f"pip install '{vllm_versions.GPU_REQUIREMENT}' (or '{vllm_versions.CPU_REQUIREMENT}' on CPU-only machines)"
    )


# ------------------------------------------------------------------ changing
def _locate(target: Target) -> tuple[Any, str, Any]:
    try:
        return target.locate()
    except LookupError as error:
        raise SpecbeamConfigError(report([target.describe(str(error))])) from error


def wrap(target: Target, make_wrapper: Callable[[Any], Any]) -> None:
    """Put ``make_wrapper(stock)`` in place of ``target``; once per process
    (a second call leaves the first wrapper in place)."""
    owner, name, stock = _locate(target)
    if getattr(stock, _WRAPS, None) == target.path:
        return
    wrapper = make_wrapper(stock)
    setattr(wrapper, _WRAPS, target.path)
    setattr(owner, name, wrapper)


@contextlib.contextmanager
def replaced(target: Target, make_value: Callable[[Any], Any]) -> Iterator[None]:
    """``target`` is ``make_value(stock)`` inside the block, ``stock`` again after it."""
    owner, name, stock = _locate(target)
    setattr(owner, name, make_value(stock))
    try:
        yield
    finally:
        setattr(owner, name, stock)
