"""The plan: which engines a comparison starts, with which settings, and why a method is skipped.

Every method's sweep is one row of ``SWEEPS`` per level (``--sweep``). Plugin
methods sweep inside one engine started at the grid's maximum (per-request
options may only lower it); vLLM's methods get an engine per setting. The
no-speculation engine is planned last: it also scores every output.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass, field, replace
from typing import Any

#: Rows of their own, on engines of a plugin method:
#: ``dsbd`` at ``max_width: 1``, a chain from the same draft as vLLM's ``draft_model`` at the same K,
#: the runtimes compared on the same work (its own row, so the adaptive width's best stays apart);
DSBD_CHAIN = "dsbd-chain"
#: ``mcsd`` with the ``--stop-model`` (``vllm-specbeam mcsd train``), at the same settings (its
#: ``no-stop`` ones: the stop model's ablation, on its engine);
MCSD_STOP = "mcsd+stop"
#: ``lookup_tree`` with ``"scope": "global"`` (drafting from every request the engine finished,
#: like vLLM's ``suffix``), its other defaults (prompt_lookup_max 24, depth_factor 1) as they are;
LOOKUP_GLOBAL = "lookup_tree+global"
#: ``aded`` started from the ``--trigram`` matrix, next to ``aded`` without a corpus;
ADED_CORPUS = "aded+corpus"
#: the plugin's full-width speculative beam search
#: (:func:`vllm_specbeam.adapter.beam_search.beam_search`, on a ``dsbd`` engine), next to ``LLM.beam_search``;
SPEC_BEAM = "dsbd-beam"
#: with ``--draft-vocab``: every plugin engine with a draft model again with that ``draft_vocab`` (``mcsd+vocab``).
VOCAB_SUFFIX = "+vocab"
#: a draft-model row again with ``"lookup": "global"`` (issue #48: each tree starts with ``lookup_tree``'s
#: branches from every request the engine finished, the draft fills what the budget leaves), at the row's
#: settings and sizes (``mcsd+lookup`` at mcsd's node budget with the lookup on), an engine per setting
#: (:func:`row_engines`): ``mcsd+lookup`` beside ``mcsd``, and ``dsbd-chain+lookup`` (``max_width: 1``:
#: lossless) beside ``dsbd-chain``.
LOOKUP_SUFFIX = "+lookup"
LOOKUP_TWIN = {"lookup": "global"}
MCSD_LOOKUP = "mcsd" + LOOKUP_SUFFIX
DSBD_CHAIN_LOOKUP = DSBD_CHAIN + LOOKUP_SUFFIX

#: Rows whose greedy output is not the target's by design (``mjsd``'s joint rule;
#: ``dsbd``'s row runs its adaptive beam width, lossless only as ``dsbd-chain``):
#: their clear-margin divergences are recorded, not reported as bug signals.
LOSSY_METHODS = {"mjsd", "dsbd"}
#: vLLM's own speculative methods (the peers the plugin's are compared with).
VLLM_METHODS = ("ngram", "draft_model", "suffix")
#: Plugin methods whose output is a beam search result: when one is available, vLLM's
#: ``LLM.beam_search`` runs as their reference ("beam_search" in the results).
BEAM_METHODS = {"dsbd"}
#: Engine settings both beam searches run with: each beam is re-submitted as
#: a request per step (per round), sharing its prompt's blocks through the
#: prefix cache; the CPU default block of 128 makes that far slower than 32.
#: The speculative search also needs the whole prompt in one step.
BEAM_ENGINE = {"block_size": 32, "enable_prefix_caching": True}
#: ``mcsd``'s depth (its stopping rule's deepest level) unless ``--mcsd-depths`` says otherwise.
MCSD_DEPTH = 6
#: ``mjsd``'s depth, as the paper's γ; ``max_nodes`` fits the tree variant.
MJSD_DEPTH = 4

SUFFIX_UNAVAILABLE = (
    "needs the arctic-inference package, which is not installed: PyPI has only its sdist, a C++ "
    "extension that `make bench` builds into the venv (see the Makefile's .suffix target)"
)


@dataclass(frozen=True)
class Grid:
    """One sweep level's settings of every method."""

    #: tree methods: (depth, node budget), after the per-step budget at the method's defaults
    tree: tuple[tuple[int, int], ...]
    #: ``ngram``'s K, an engine each
    chain: tuple[int, ...]
    #: ``draft_model``'s K (an engine each) and ``dsbd-chain``'s
    draft: tuple[int, ...]
    #: beam widths of both beam searches
    beam: tuple[int, ...]
    #: vLLM's ``suffix`` depth: its default 24 (``suffix_decoding_max_tree_depth``) and shallower
    suffix: tuple[int, ...]
    #: ``lookup_tree+global``'s (depth, node budget): the scope's defaults (24, 48) first
    lookup_global: tuple[tuple[int, int], ...]
    #: ``dsbd``'s (depth, nodes, prune_ratio) beside the ``tree`` points (at its default ratio 0.3): a
    #: depth drafts only the pairs within the ratio of its best, so the budget lasts more depths
    #: (methods/dsbd/drafter.py); ratio 0 is the unpruned forest. On the ``dsbd`` engine only.
    dsbd_prune: tuple[tuple[int, int, float], ...]
    #: ``mcsd``'s ``k_config``s, each with its stopping rule and without (``no-stop``); ``[1]`` is
    #: the target-initialised shape (methods/mcsd/drafter.py)
    mcsd: tuple[tuple[int, ...], ...]
    #: ``mjsd``'s per-request options: the draft's beams, MTAD's threshold 0.5 (the default) and the
    #: arXiv version's 0.9, the tree variant's verified beams
    mjsd: tuple[dict[str, Any], ...]


#: The sweep levels: ``none`` runs the defaults (and, for ``dsbd``, its best pruned setting).
SWEEPS = {
    "none": Grid(
        tree=(),
        chain=(4,),
        draft=(3,),
        beam=(4,),
        suffix=(24,),
        lookup_global=((24, 48),),
        dsbd_prune=((6, 16, 0.3),),
        mcsd=((1,),),
        mjsd=({"beam_width": 4},),
    ),
    "quick": Grid(
        tree=((3, 8), (5, 16)),
        chain=(4,),
        draft=(3, 5),
        beam=(2, 4),
        suffix=(24, 4),
        lookup_global=((24, 48), (8, 16)),
        dsbd_prune=((5, 16, 0.0), (6, 16, 0.3)),
        mcsd=((2,), (1,)),
        mjsd=({"beam_width": 4}, {"beam_width": 4, "threshold": 0.9}),
    ),
    "full": Grid(
        tree=((2, 4), (3, 8), (4, 16), (6, 24), (8, 32)),
        chain=(2, 4, 6),
        draft=(3, 5),
        beam=(2, 4),
        suffix=(24, 8, 4),
        lookup_global=((24, 48), (16, 32), (8, 16)),
        dsbd_prune=((5, 16, 0.0), (6, 16, 0.1), (6, 16, 0.3), (8, 16, 0.3)),
        mcsd=((4, 2, 2), (2, 2), (2,), (1,)),
        mjsd=(
            {"beam_width": 2},
            {"beam_width": 4},
            {"beam_width": 8},
            {"beam_width": 4, "threshold": 0.9},
            {"beam_width": 4, "num_beams_verified": 2},
        ),
    ),
}


@dataclass(frozen=True)
class PlanOptions:
    """What the plan depends on: the command line's methods and sweep, and the
    resolved paths of the optional models and files (None: not given)."""

    methods: tuple[str, ...] = ("all",)
    sweep: str = "quick"
    draft: str | None = None
    draft_dtype: str = "auto"
    trigram: str | None = None
    stop_model: str | None = None
    draft_vocab: str | None = None
    beam_widths: tuple[int, ...] | None = None
    beam_depths: tuple[int | None, ...] | None = None
    draft_ks: tuple[int, ...] | None = None
    mcsd_depths: tuple[int, ...] | None = None


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


def plugin_methods() -> dict[str, Any]:
    from vllm_specbeam.core.config import METHODS

    return dict(METHODS)


def tree_sweep(
    method: Any, grid: tuple[tuple[int, int], ...], user: dict[str, Any] | None = None
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
        grid = grid or ((defaults["num_speculative_tokens"], defaults["max_nodes"]),)
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


def plan(options: PlanOptions) -> tuple[dict[str, MethodStatus], list[EngineSpec]]:
    """Which engines to start, and why each skipped method is skipped."""
    grid = SWEEPS[options.sweep]
    wanted = None if list(options.methods) == ["all"] else set(options.methods)
    # "X+vocab" without "X": X's engines are planned, then only their --draft-vocab twins kept
    vocab_only = {m.removesuffix(VOCAB_SUFFIX) for m in wanted or () if m.endswith(VOCAB_SUFFIX)} - (wanted or set())
    if vocab_only and not options.draft_vocab:
        raise SystemExit(f"{sorted(m + VOCAB_SUFFIX for m in vocab_only)} need --draft-vocab")
    if wanted is not None:
        wanted = {m.removesuffix(VOCAB_SUFFIX) for m in wanted}
    rows = {"none", *VLLM_METHODS, "beam_search", SPEC_BEAM, DSBD_CHAIN, MCSD_STOP, LOOKUP_GLOBAL, *plugin_methods()}
    rows |= {MCSD_LOOKUP, DSBD_CHAIN_LOOKUP}
    unknown = (wanted or set()) - rows
    if unknown:
        raise SystemExit(f"unknown method(s) {sorted(unknown)}")
    status: dict[str, MethodStatus] = {}
    engines: list[EngineSpec] = []

    def wants(row: str) -> bool:
        return wanted is None or row in wanted

    def lookup_twin(row: str, engine_id: str, config: dict[str, Any], settings: list[Setting]) -> None:
        """``row`` + :data:`LOOKUP_SUFFIX` when wanted: ``row``'s engine with :data:`LOOKUP_TWIN`, at
        its settings with a stopping rule (without one, the draft runs every step: no lookup's gain)."""
        if wants(row + LOOKUP_SUFFIX):
            status[row + LOOKUP_SUFFIX] = MethodStatus("plugin")
            stopping = [s for s in settings if s.values.get("stop_threshold") != 0.0]
            engines.extend(row_engines(engine_id + "-lookup", row + LOOKUP_SUFFIX, {**config, **LOOKUP_TWIN}, stopping))

    def chain(method: str, ks: tuple[int, ...], base: dict[str, Any]) -> None:
        status[method] = MethodStatus("vllm")
        for k in ks:
            config = {"method": method, "num_speculative_tokens": k, **base}
            engines.append(
                EngineSpec(f"{method}-k{k}", method, "vllm", config, [Setting(f"k{k}", {"num_speculative_tokens": k})])
            )

    if wanted is None or "ngram" in wanted:
        chain("ngram", grid.chain, {"prompt_lookup_min": 2, "prompt_lookup_max": 5})
    if wanted is None or "draft_model" in wanted:
        if options.draft:
            chain("draft_model", options.draft_ks or grid.draft, {"model": options.draft})
        else:
            status["draft_model"] = MethodStatus("vllm", "skipped", "needs --draft")
    if wanted is None or "suffix" in wanted:
        if importlib.util.find_spec("arctic_inference") is not None:
            chain("suffix", grid.suffix, {})
        else:
            status["suffix"] = MethodStatus("vllm", "skipped", SUFFIX_UNAVAILABLE)

    available_beam = []
    for name, method in plugin_methods().items():
        # rows of their own on a method's engines (the speculative beam search and the chain on
        # dsbd's, the global scope on lookup_tree's), with or without the method's own rows
        extra_rows = {
            "dsbd": {SPEC_BEAM, DSBD_CHAIN, DSBD_CHAIN_LOOKUP},
            "lookup_tree": {LOOKUP_GLOBAL},
            "mcsd": {MCSD_STOP, MCSD_LOOKUP},
        }.get(name, set())
        extra_rows_only = wanted is not None and name not in wanted and not wanted.isdisjoint(extra_rows)
        if wanted is not None and name not in wanted and not extra_rows_only:
            continue
        if method.needs_draft_model and not options.draft:
            status[name] = MethodStatus("plugin", "skipped", "needs --draft")
            continue
        sizes, settings = tree_sweep(method, grid.tree)
        config = {"method": name, **sizes}
        if method.needs_draft_model:
            config.update(model=options.draft, draft_dtype=options.draft_dtype)
        if name == "mcsd":
            config, settings = mcsd_plan(config, grid, options.mcsd_depths)
        if name == "mjsd":
            config, settings = mjsd_plan(config, grid)
        if not extra_rows_only:
            status[name] = MethodStatus("plugin")
            own = dsbd_plan(config, settings, grid) if name == "dsbd" else (config, settings)
            engines.append(EngineSpec(name, name, "plugin", *own))
        if name == "mcsd" and options.stop_model:
            status[MCSD_STOP] = MethodStatus("plugin")
            # Its no-stop settings are the stop model's ablation on the same engine.
            stop_config = {**config, "stop_model": options.stop_model}
            engines.append(EngineSpec("mcsd-stop", MCSD_STOP, "plugin", stop_config, settings))
        if name == "mcsd":
            # at least the node budget mcsd takes with the lookup on, as users get it
            nodes = max(config["max_nodes"], method.drafter_class().defaults_for(LOOKUP_TWIN)["max_nodes"])
            lookup_twin(name, name, {**config, "max_nodes": nodes}, settings)
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
                for w in options.beam_widths or grid.beam
                for d in options.beam_depths or (None,)
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
        if name == "dsbd" and (wants(DSBD_CHAIN) or wants(DSBD_CHAIN_LOOKUP)):
            ks = options.draft_ks or grid.draft
            chain_config = {**config, "num_speculative_tokens": max(ks), "max_nodes": max(ks), "max_width": 1}
            chain_settings = [
                Setting(f"k{k}", {"num_speculative_tokens": k}, {"num_speculative_tokens": k, "max_nodes": k})
                for k in ks
            ]
            if wants(DSBD_CHAIN):
                status[DSBD_CHAIN] = MethodStatus("plugin")
                engines.append(EngineSpec(DSBD_CHAIN, DSBD_CHAIN, "plugin", chain_config, chain_settings))
            lookup_twin(DSBD_CHAIN, DSBD_CHAIN, chain_config, chain_settings)
        if name == "lookup_tree" and wants(LOOKUP_GLOBAL):
            status[LOOKUP_GLOBAL] = MethodStatus("plugin")
            global_sizes, global_settings = tree_sweep(method, grid.lookup_global, {"scope": "global"})
            global_config = {**config, **global_sizes, "scope": "global"}
            engines.extend(row_engines("lookup_tree-global", LOOKUP_GLOBAL, global_config, global_settings))
        if name == "aded" and options.trigram:
            # The same method started from a corpus matrix, as its own row.
            status[ADED_CORPUS] = MethodStatus("plugin")
            engines.append(
                EngineSpec("aded-corpus", ADED_CORPUS, "plugin", {**config, "trigram": options.trigram}, settings)
            )

    if options.draft_vocab:
        drafting = [e for e in engines if e.kind == "plugin" and e.method != SPEC_BEAM and e.speculative_config]
        for engine in [e for e in drafting if "model" in (e.speculative_config or {})]:
            row = engine.method + VOCAB_SUFFIX
            status[row] = MethodStatus("plugin")
            config = {**(engine.speculative_config or {}), "draft_vocab": options.draft_vocab}
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
        settings = [Setting(f"w{w}", {"beam_width": w}, beam_width=w) for w in options.beam_widths or grid.beam]
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


def learns_across_requests(config: dict[str, Any]) -> bool:
    """Whether an engine of ``config`` drafts from the requests it finished (``lookup_tree``'s
    global scope, a draft-model method's global lookup branches)."""
    return config.get("scope") == "global" or config.get("lookup") == "global"


def row_engines(engine_id: str, row: str, config: dict[str, Any], settings: list[Setting]) -> list[EngineSpec]:
    """A plugin row's engines: one for all its settings, or one per setting (``<engine_id>-<label>``)
    when the engine learns across requests: a setting run after another would draft from the text
    the earlier one indexed, so a workload without repetition would have some."""
    if not learns_across_requests(config):
        return [EngineSpec(engine_id, row, "plugin", config, settings)]
    return [
        EngineSpec(f"{engine_id}-{s.label.replace('/', '-').replace(',', '-')}", row, "plugin", config, [s])
        for s in settings
    ]


def mcsd_plan(
    config: dict[str, Any], grid: Grid, depths: tuple[int, ...] | None = None
) -> tuple[dict[str, Any], list[Setting]]:
    """The ``mcsd`` engine (sized for the grid's largest tree at the deepest of ``depths``,
    default ``(MCSD_DEPTH,)``) and its settings, each at every depth (labelled ``d8/k1``
    when more than one depth runs; requests lower the engine's depth)."""
    from vllm_specbeam.methods.mcsd.maths import level_sizes

    depths = depths or (MCSD_DEPTH,)
    k_configs = [list(k) for k in grid.mcsd]
    nodes = max(sum(level_sizes(k, max(depths))) for k in k_configs)
    settings = []
    for depth, k_config in itertools.product(depths, k_configs):
        label = ("" if len(depths) == 1 else f"d{depth}/") + "k" + ",".join(map(str, k_config))
        values = {"k_config": k_config} | ({} if len(depths) == 1 else {"num_speculative_tokens": depth})
        settings.append(Setting(label, values, extra_args=dict(values)))
        no_stop = {**values, "stop_threshold": 0.0}
        settings.append(Setting(f"{label}/no-stop", no_stop, extra_args=dict(no_stop)))
    # the draft alone: its lookup twin (``mcsd+lookup``) is mcsd's default
    engine = {**config, "num_speculative_tokens": max(depths), "max_nodes": nodes, "k_config": k_configs[0]}
    return {**engine, "lookup": "off"}, settings


def dsbd_plan(config: dict[str, Any], settings: list[Setting], grid: Grid) -> tuple[dict[str, Any], list[Setting]]:
    """The ``dsbd`` engine, deep enough for the grid's pruned settings, and its settings with them."""
    pruned = [
        Setting(f"d{d}/n{n}/p{r}", values, dict(values))
        for d, n, r in grid.dsbd_prune
        for values in [{"num_speculative_tokens": d, "max_nodes": n, "prune_ratio": r}]
    ]
    depth = max([config["num_speculative_tokens"], *(d for d, _, _ in grid.dsbd_prune)])
    nodes = max([config["max_nodes"], *(n for _, n, _ in grid.dsbd_prune)])
    return {**config, "num_speculative_tokens": depth, "max_nodes": nodes}, [*settings, *pruned]


def mjsd_plan(config: dict[str, Any], grid: Grid) -> tuple[dict[str, Any], list[Setting]]:
    """The ``mjsd`` engine (sized for the grid's widest search and largest tree) and its settings."""
    settings = []
    for values in grid.mjsd:
        label = f"b{values['beam_width']}" + "".join(
            f"/{tag}{values[key]}" for key, tag in (("threshold", "tau"), ("num_beams_verified", "t")) if key in values
        )
        settings.append(Setting(label, dict(values), extra_args=dict(values)))
    widest = max(v["beam_width"] for v in grid.mjsd)
    nodes = MJSD_DEPTH * max(v.get("num_beams_verified", 1) for v in grid.mjsd)
    return {**config, "num_speculative_tokens": MJSD_DEPTH, "max_nodes": nodes, "beam_width": widest}, settings
