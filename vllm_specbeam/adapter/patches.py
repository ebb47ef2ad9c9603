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
    #: the patch it belongs to (plugin.py's functions name them "Patch N"), and why
    #: the plugin touches it: rendered into docs/patches.md
    patch: int = 0
    why: str = ""

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


def _runner(platform: Literal["cpu", "cuda"], path: str, why: str) -> Target:
    return Target(path, "class", platform, "vllm_specbeam.adapter.runner:TreeRunnerMixin", 3, why)


# ----------------------------------------------------------------- the targets
CREATE_SPECULATIVE_CONFIG = Target(
    "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
    patch=1,
    why="a plugin method's speculative config is validated here and replaced by the `custom_class` carrier "
    'config vLLM accepts; the plugin\'s own settings travel in `VllmConfig.additional_config["specbeam"]` '
    "to every worker, and the engine settings a plugin method needs are made here "
    "(`adapter/engine_config.py`). Installed in every process; other methods go to vLLM unchanged",
)
VALIDATE_PARAMS = Target(
    "vllm.v1.engine.input_processor:InputProcessor._validate_params",
    patch=2,
    why="per-request options in `SamplingParams.extra_args` and tree prompts (`adapter/tree_prompt.py`) are "
    "checked at admission, so a bad value fails that request only",
)
CPU_WORKER = Target(
    "vllm.v1.worker.cpu_worker:CPUWorker",
    "class",
    "cpu",
    "vllm_specbeam.adapter.cpu_worker:TreeCPUWorker",
    3,
    "patch 1 names the plugin's subclass in `ParallelConfig.worker_cls` (vLLM's extension point); it builds "
    "the tree runner (`adapter/cpu_worker.py`, imported on CPU only: vLLM's CPU worker patches `torch.cuda` on import)",
)
CPU_WORKER_RUNNER = _runner(
    "cpu",
    "vllm.v1.worker.cpu_worker:CPUModelRunner",
    "the runner class `CPUWorker.init_device` builds, by this module-global name; the tree runner "
    "(`adapter/runner.py`) subclasses it and overrides a handful of its methods",
)
GPU_WORKER = Target(
    "vllm.v1.worker.gpu_worker:Worker",
    "class",
    "cuda",
    "vllm_specbeam.adapter.worker:TreeGPUWorker",
    3,
    "as `CPUWorker`, on CUDA",
)
GPU_RUNNER = _runner(
    "cuda",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
    "the CUDA runner the tree runner subclasses (`adapter/runner.py`)",
)
CPU_ATTENTION_FORWARD = Target(
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",
    platform="cpu",
    patch=3,
    why="wrapped by the runner in the worker's process, to recompute tree rows with the tree mask "
    "(`adapter/attention/cpu.py`)",
)
REGISTER_BACKEND = Target(
    "vllm.v1.attention.backends.registry:register_backend",
    platform="cuda",
    patch=4,
    why="points vLLM's `CUSTOM` attention-backend slot at the plugin's tree backend "
    "(`adapter/attention/cuda.py`) in every process; used only when patch 1 selects it",
)
CUSTOM_BACKEND_SLOT = Target(
    "vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM",
    "attribute",
    "cuda",
    patch=4,
    why="the slot the tree backend is registered in",
)
TRITON_BACKEND = Target(
    "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend",
    "class",
    "cuda",
    "vllm_specbeam.adapter.attention.cuda:TreeTritonAttentionBackend",
    4,
    "vLLM's Triton backend, subclassed: the tree backend",
)
TRITON_IMPL = Target(
    "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl",
    "class",
    "cuda",
    "vllm_specbeam.adapter.attention.cuda:TreeTritonAttentionImpl",
    4,
    "vLLM's Triton attention, subclassed: tree steps run the plugin's tree kernel",
)
TRITON_CLASS_VARIABLES = tuple(
    Target(
        f"vllm.v1.attention.backends.triton_attn:{name}",
        "attribute",
        "cuda",
        patch=4,
        why="a class variable the tree backend overrides: what vLLM's selector refuses, and no full CUDA graphs",
    )
    for name in (
        "TritonAttentionBackend.supported_dtypes",
        "TritonAttentionBackend.supported_kv_cache_dtypes",
        "TritonAttentionMetadataBuilder._cudagraph_support",
    )
)
BLOCK_HASH_EXTRA_KEYS = Target(
    "vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys",
    patch=5,
    why="prefix-cache blocks holding a tree prompt's tree rows get a key of their own, so they never serve "
    "another request (`adapter/tree_prompt.py`); in the engine-core process, where requests are hashed",
)
ONLINE_BEAM_SEARCH = Target(
    "vllm.entrypoints.generate.beam_search.online:BeamSearchOnlineMixin.beam_search",
    patch=6,
    why="the OpenAI server's `use_beam_search` runs the speculative beam search on `dsbd` engines "
    "(`adapter/beam_search_server.py`) and vLLM's own otherwise; in the API server's process",
)
COMPLETION_BEAM_PARAMS = Target(
    "vllm.entrypoints.openai.completion.protocol:CompletionRequest.to_beam_search_params",
    patch=12,
    why="vLLM's `BeamSearchParams` carries no `seed`, `top_k` or `top_p`: the params a completion request makes for "
    "`use_beam_search` carry the request too, for the speculative beam sampling (`adapter/beam_search_server.py`); "
    "in the API server's process",
)
CHAT_BEAM_PARAMS = Target(
    "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest.to_beam_search_params",
    patch=12,
    why="the same for chat completion requests",
)
NUM_LOOKAHEAD_TOKENS = Target(
    "vllm.config.vllm:VllmConfig.num_lookahead_tokens",
    "attribute",
    patch=7,
    why="for draft-model methods, also the KV slots the in-worker draft writes its tree nodes to "
    "(`adapter/draft_model.py` `lookahead`); read by the scheduler, in the engine-core process",
)
SAMPLE_TOKENS = Target(
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
    platform="cpu",
    patch=8,
    why="on CPU a step samples without the generators of requests whose token it discards, so vLLM's rewind "
    "of them, which CPU generators cannot do, is never needed (`adapter/cpu_generators.py`); a fix for every "
    "CPU engine, plugin method or not",
)
VALIDATE_SPEC_DECODE_PARAMS = Target(
    "vllm.sampling_params:SamplingParams._validate_spec_decode",
    patch=9,
    why="vLLM refuses `min_p` and `logit_bias` with any speculative config, since its rejection sampler cannot "
    "apply them to draft rows; the tree runner never drafts such requests and samples their one row with "
    "vLLM's own sampler, so a plugin engine admits them (in the API server's process)",
)
RUNNER_LOGITSPROCS = Target(
    "vllm.v1.worker.gpu_model_runner:build_logitsprocs",
    patch=9,
    why="with speculation vLLM builds only the min-tokens logits processor; a plugin engine's runner is "
    "built with all built-in ones (`adapter/logitsprocs.py` `builtin_logitsprocs`; custom ones stay refused)",
)
BUILTIN_LOGITSPROCS = Target(
    "vllm.v1.sample.logits_processor:BUILTIN_LOGITS_PROCESSORS",
    "attribute",
    patch=9,
    why="the built-in logits processors the runner is built with",
)
SCHEDULER = Target(
    "vllm.v1.core.sched.scheduler:Scheduler",
    "class",
    subclass="vllm_specbeam.adapter.scheduler:TreePromptScheduler",
    patch=10,
    why="patch 1 names the plugin's subclass in `SchedulerConfig.scheduler_cls` (unless the user set one): "
    "under chunked prefill it ends a prefill chunk before a tree prompt's tree instead of inside it, through "
    "the per-chunk hook vLLM calls for Mamba alignment (`adapter/scheduler.py`); its `add_request` copies each "
    "request's `cache_salt` (kept on the engine core's `Request` only) into `SamplingParams.extra_args`, for the "
    "workers' cross-request index; in the engine-core process",
)
PROMETHEUS_STAT_LOGGER = Target(
    "vllm.v1.metrics.loggers:PrometheusStatLogger.__init__",
    patch=11,
    why="where vLLM makes an engine's Prometheus metrics, in the front end's process (the API server's, or the "
    "`LLM`'s), a plugin engine's goodput-controller metrics join them: a collector reads what the runner "
    "writes in the worker (`adapter/metrics.py`); nothing is added for other engines",
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
    PROMETHEUS_STAT_LOGGER,
    COMPLETION_BEAM_PARAMS,
    CHAT_BEAM_PARAMS,
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
