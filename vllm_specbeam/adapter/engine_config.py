"""How a plugin method's configuration reaches vLLM 0.32 and comes back out.

The user's speculative config is validated by :mod:`vllm_specbeam.core.config`
(no vLLM there); vLLM itself is given the :func:`vllm_carrier` config it
accepts, the engine settings the tree runner needs are made by
:func:`configure_engine` (the worker class, and on CUDA the attention backend
and cudagraph mode), and the plugin's validated options travel to every
process in ``VllmConfig.additional_config[ADDITIONAL_CONFIG_KEY]``. Everything
that needs the options back reads them with :func:`plugin_config`.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from vllm_specbeam.core.config import METHODS, SpecbeamConfig, SpecbeamConfigError

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs

#: Where the plugin's options travel in ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "specbeam"
#: The class vLLM's ``custom_class`` carrier instantiates as the runner's drafter.
DRAFTER_HOST = "vllm_specbeam.adapter.runner.DrafterHost"
#: The workers that build the tree runner, by platform (:mod:`.cpu_worker`, :mod:`.worker`).
CPU_WORKER = "vllm_specbeam.adapter.cpu_worker.TreeCPUWorker"
GPU_WORKER = "vllm_specbeam.adapter.worker.TreeGPUWorker"
#: The scheduler of plugin engines (:mod:`vllm_specbeam.adapter.scheduler`): no prefill chunk ends inside a tree,
#: and each request's ``cache_salt`` reaches the workers.
SCHEDULER = "vllm_specbeam.adapter.scheduler.TreePromptScheduler"
#: ``SamplingParams.extra_args`` key in which :data:`SCHEDULER` hands the workers a request's ``cache_salt``
#: (vLLM 0.32 keeps the salt on the engine core's ``Request`` only)
CACHE_SALT_KEY = "specbeam_cache_salt"

V2_RUNNER_PROBLEM = (
    "vllm-specbeam's tree runner extends vLLM's V1 model runner, but this engine would run the V2 model "
    "runner, which knows nothing of draft trees"
)


def plugin_config(vllm_config: VllmConfig) -> SpecbeamConfig | None:
    """The plugin's validated configuration, or None when no plugin method runs."""
    data = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    return None if data is None else SpecbeamConfig.from_dict(data)


def with_plugin_config(additional_config: dict[str, Any] | None, config: SpecbeamConfig) -> dict[str, Any]:
    """``additional_config`` with the plugin's options added."""
    return {**(additional_config or {}), ADDITIONAL_CONFIG_KEY: config.to_dict()}


def vllm_carrier(config: SpecbeamConfig) -> dict[str, Any]:
    """The speculative config vLLM itself is given for a plugin method.

    vLLM's validator only knows its own methods, so the engine is started with
    ``custom_class`` naming the plugin's drafter host: it loads no model, keeps
    vLLM on its V1 runner with synchronous scheduling (which the tree runner
    extends), and the plugin's runner takes over drafting and verification.
    ``num_speculative_tokens`` becomes the node budget: the scheduler
    allocates KV slots and the metrics size their per-position arrays from it,
    and a tree needs a slot and a count for every node.
    """
    return {"method": "custom_class", "model": DRAFTER_HOST, "num_speculative_tokens": config.max_nodes}


def is_carrier(speculative_config: SpeculativeConfig) -> bool:
    """Whether vLLM's speculative config is :func:`vllm_carrier`'s: a plugin method runs."""
    return speculative_config.method == "custom_class" and speculative_config.model == DRAFTER_HOST


def _plugin_worker(worker_cls: object) -> str:
    """The plugin's worker for this platform, refusing the V2 runner and another ``worker_cls``."""
    import vllm.envs as envs
    from vllm.platforms import current_platform

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        # vLLM 0.32.0 config/vllm.py ``use_v2_model_runner``: the variable wins
        # over custom_class, which V2 does not support either.
        raise SpecbeamConfigError(f"{V2_RUNNER_PROBLEM} (VLLM_USE_V2_MODEL_RUNNER=1): unset VLLM_USE_V2_MODEL_RUNNER")
    if current_platform.is_cuda():
        worker = GPU_WORKER
    elif current_platform.is_cpu():
        worker = CPU_WORKER
    else:
        raise SpecbeamConfigError(
            f"vllm-specbeam verifies trees on vLLM's CPU backend and on CUDA GPUs, not on "
            f"{current_platform.device_name}; use vLLM's built-in speculative methods there"
        )
    if worker_cls not in ("auto", worker):
        raise SpecbeamConfigError(
            f"vllm-specbeam methods run in the plugin's worker ({worker}), but worker_cls="
            f"{worker_cls if isinstance(worker_cls, str) else 'a class object'} was set; remove --worker-cls / "
            f"worker_cls (worker_extension_cls adds methods to any worker, this one included)"
        )
    return worker


def configure_engine(engine_args: EngineArgs, parallel_config: ParallelConfig, config: SpecbeamConfig) -> None:
    """Make the engine run ``config``'s plugin method: the tree runner's worker, the
    plugin's scheduler (unless another was set; then no index partitioned by salt),
    and on CUDA the tree attention backend outside CUDA graphs.

    Called for plugin methods only, from the speculative-config patch, which
    vLLM 0.32.0 engine/arg_utils.py ``EngineArgs.create_engine_config`` runs
    *after* building ``parallel_config`` (so ``EngineArgs.worker_cls`` has
    been read: the config object is set) and *before* it reads
    ``attention_backend`` / ``attention_config`` and ``compilation_config``.
    """
    from vllm.platforms import current_platform

    parallel_config.worker_cls = _plugin_worker(parallel_config.worker_cls)
    if engine_args.scheduler_cls is None:
        # read after this patch, into SchedulerConfig (vLLM 0.32.0 EngineArgs.create_engine_config)
        engine_args.scheduler_cls = SCHEDULER
    if engine_args.scheduler_cls != SCHEDULER and METHODS[config.method].drafter_class().salted_index(config.options):
        # without the salt every request would read the unsalted partition: tenants' text shared after all
        raise SpecbeamConfigError(
            f'the cross-request index keeps requests with different cache_salt apart ("index_isolation": '
            f'"salt"), and only the plugin\'s scheduler hands the salt to the workers, but scheduler_cls='
            f"{engine_args.scheduler_cls} was set: remove --scheduler-cls / scheduler_cls, or set "
            f'"index_isolation": "none" to share the index between all requests'
        )
    if current_platform.is_cuda():
        from vllm_specbeam.adapter.attention.cuda import register_tree_backend

        register_tree_backend()
        _select_attention_backend(engine_args)
        _select_cudagraph_mode(engine_args)


def _select_attention_backend(engine_args: EngineArgs) -> None:
    """The tree backend in vLLM's ``CUSTOM`` slot, unless another was asked for."""
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    # vLLM 0.32.0 engine/arg_utils.py: ``attention_backend`` (--attention-backend)
    # and ``attention_config.backend`` are mutually exclusive; "auto" means None.
    requested = AttentionConfig.validate_backend_before(engine_args.attention_backend) or (
        engine_args.attention_config.backend
    )
    if requested == custom:
        return
    if requested is not None:
        raise SpecbeamConfigError(
            f"vllm-specbeam verifies trees on CUDA with its own attention backend (a Triton backend in "
            f"vLLM's CUSTOM slot), but attention backend {requested.name} was requested; remove "
            f"--attention-backend / attention_config.backend"
        )
    config = copy.deepcopy(engine_args.attention_config)  # the user's object stays as they wrote it
    config.backend = custom
    engine_args.attention_config = config


def _select_cudagraph_mode(engine_args: EngineArgs) -> None:
    """Attention outside CUDA graphs: each step's tree mask is built on the host."""
    from vllm.config import CUDAGraphMode

    mode = engine_args.compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        raise SpecbeamConfigError(
            f"vllm-specbeam tree verification on CUDA needs cudagraph_mode PIECEWISE or NONE, got "
            f"{mode.name}: each step's tree mask is built on the host, so attention must run outside "
            f'CUDA graphs; pass --compilation-config \'{{"cudagraph_mode": "PIECEWISE"}}\' or '
            f"--enforce-eager (PIECEWISE is the default with a vllm-specbeam method)"
        )
    if mode is None:  # vLLM would choose FULL_AND_PIECEWISE
        config = copy.deepcopy(engine_args.compilation_config)
        config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        engine_args.compilation_config = config
