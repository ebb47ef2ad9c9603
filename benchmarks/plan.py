"""The plan: which engines a comparison starts, with which settings, and why a method is skipped.

Every method's sweep is one row of ``SWEEPS`` per level (``--sweep``). Plugin
methods sweep inside one engine started at the grid's maximum (per-request
options may only lower it); vLLM's methods get an engine per setting. The
no-speculation engine is planned last: it also scores every output.

:func:`plan` runs :data:`ROW_BUILDERS`, a function per family of rows, in the order
their engines run; a plugin method's rows (its own, and those on its engines such as
``dsbd-chain`` or ``mcsd+stop``) are built in turn from its engine (:data:`FAMILIES`).
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_specbeam.core.config import Method

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


def plugin_methods() -> dict[str, Method]:
    from vllm_specbeam.core.config import METHODS

    return dict(METHODS)


def tree_sweep(
    method: Method, grid: tuple[tuple[int, int], ...], user: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[Setting]]:
    """A tree method's engine sizes and its sweep: the fixed (depth, nodes) points
    of ``grid`` per request, led by the per-step budget at the method's defaults
    (``auto``) where the method has one. The engine is started at the largest
    of them (per-request options may only lower it), at a fixed ``max_nodes``
    when there are fixed points: under an automatic engine a request's number
    only caps the budget."""
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
    sizes = {
        "num_speculative_tokens": depth,
        "max_nodes": cap if fixed else AUTO,
        "auto_max_nodes": auto["auto_max_nodes"],
    }
    return sizes, [Setting("auto", dict(auto), dict(auto)), *fixed]


def known_rows() -> set[str]:
    """Every row ``--methods`` may name (besides ``X+vocab``)."""
    extra = (row for family in FAMILIES.values() for row in family.rows)
    return {"none", "beam_search", *VLLM_METHODS, *plugin_methods(), *extra}


def select(options: PlanOptions) -> tuple[frozenset[str] | None, frozenset[str]]:
    """The rows ``--methods`` names (None: all), ``X+vocab`` read as ``X``, and the methods named only
    as ``X+vocab``. ValueError names an unknown row, or a ``+vocab`` one without its file."""
    if list(options.methods) == ["all"]:
        return None, frozenset()
    named = set(options.methods)
    rows = frozenset(m.removesuffix(VOCAB_SUFFIX) for m in named)
    vocab_only = rows - named
    if vocab_only and not options.draft_vocab:
        raise ValueError(
            f"{sorted(m + VOCAB_SUFFIX for m in vocab_only)} need --draft-vocab: give the draft vocabulary "
            f"(vllm-specbeam draft-vocab build), or name the method without {VOCAB_SUFFIX}"
        )
    unknown = rows - known_rows()
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}: --methods takes all, or some of {sorted(known_rows())}")
    return rows, vocab_only


@dataclass
class Planned:
    """The plan as the row builders grow it: each row's status, the engines in the order they run."""

    options: PlanOptions
    grid: Grid
    #: the rows ``--methods`` names (None: all)
    rows: frozenset[str] | None
    #: the methods named only as ``X+vocab``: their engines are planned, then only their twins kept
    vocab_only: frozenset[str]
    status: dict[str, MethodStatus] = field(default_factory=dict)
    engines: list[EngineSpec] = field(default_factory=list)

    def wants(self, row: str) -> bool:
        return self.rows is None or row in self.rows

    def add(self, row: str, kind: str, engines: list[EngineSpec]) -> None:
        self.status[row] = MethodStatus(kind)
        self.engines.extend(engines)

    def add_plugin(self, row: str, engine_id: str, config: dict[str, Any], settings: list[Setting]) -> None:
        """A plugin row on one engine, or an engine per setting where it learns across requests."""
        self.add(row, "plugin", row_engines(engine_id, row, config, settings))

    def skip(self, row: str, kind: str, reason: str) -> None:
        self.status[row] = MethodStatus(kind, "skipped", reason)


def plan(options: PlanOptions) -> tuple[dict[str, MethodStatus], list[EngineSpec]]:
    """Which engines to start, and why each skipped method is skipped: every family's rows in
    turn (vLLM's, the plugin methods', the draft vocabulary's, the beam search's), the baseline
    last. ValueError names what in ``options.methods`` cannot be planned, and the fix."""
    planned = Planned(options, SWEEPS[options.sweep], *select(options))
    for build in ROW_BUILDERS:
        build(planned)
    for engine in planned.engines:
        planned.status[engine.method].engines.append(engine.id)
    return planned.status, planned.engines


def vllm_rows(planned: Planned) -> None:
    """vLLM's methods, an engine per K: ``draft_model`` with ``--draft``, ``suffix`` with arctic-inference."""
    grid, draft = planned.grid, planned.options.draft
    suffix_missing = importlib.util.find_spec("arctic_inference") is None
    chains = {  # method: (its Ks, its config, why it cannot run)
        "ngram": (grid.chain, {"prompt_lookup_min": 2, "prompt_lookup_max": 5}, None),
        "draft_model": (planned.options.draft_ks or grid.draft, {"model": draft}, None if draft else "needs --draft"),
        "suffix": (grid.suffix, {}, SUFFIX_UNAVAILABLE if suffix_missing else None),
    }
    for method, (ks, config, missing) in chains.items():
        if not planned.wants(method):
            continue
        if missing:
            planned.skip(method, "vllm", missing)
            continue
        settings = [Setting(f"k{k}", {"num_speculative_tokens": k}) for k in ks]
        configs = [{"method": method, "num_speculative_tokens": k, **config} for k in ks]
        engines = [EngineSpec(f"{method}-k{k}", method, "vllm", c, [s]) for k, c, s in zip(ks, configs, settings)]
        planned.add(method, "vllm", engines)


# ---------------------------------------------------------------- plugin methods and rows on their engines
@dataclass(frozen=True)
class MethodEngine:
    """A plugin method's engine as its rows start from: its config and its sweep."""

    name: str
    method: Method
    config: dict[str, Any]
    settings: list[Setting]


#: builds one row (or none, when it is not wanted) from its method's engine
RowBuilder = Callable[[Planned, MethodEngine], None]


@dataclass(frozen=True)
class Family:
    """A plugin method's rows, built in order: its own and those on its engines that
    ``--methods`` names apart (``rows``); ``sized`` replaces the tree sweep's engine and settings."""

    rows: tuple[str, ...]
    builders: tuple[RowBuilder, ...]
    sized: Callable[[dict[str, Any], Planned], tuple[dict[str, Any], list[Setting]]] | None = None


def plugin_rows(planned: Planned) -> None:
    for name, method in plugin_methods().items():
        method_rows(planned, name, method)


def method_rows(planned: Planned, name: str, method: Method) -> None:
    """``name``'s rows that are wanted: with or without the method's own, skipped without a needed draft."""
    family = FAMILIES.get(name, PLAIN)
    if not any(planned.wants(row) for row in (name, *family.rows)):
        return
    if method.needs_draft_model and not planned.options.draft:
        planned.skip(name, "plugin", "needs --draft")
        return
    sizes, settings = tree_sweep(method, planned.grid.tree)
    config = {"method": name, **sizes}
    if method.needs_draft_model:
        config.update(model=planned.options.draft, draft_dtype=planned.options.draft_dtype)
    if family.sized:
        config, settings = family.sized(config, planned)
    engine = MethodEngine(name, method, config, settings)
    for build in family.builders:
        build(planned, engine)


def own_row(planned: Planned, engine: MethodEngine) -> None:
    if planned.wants(engine.name):
        planned.add_plugin(engine.name, engine.name, engine.config, engine.settings)


def dsbd_row(planned: Planned, engine: MethodEngine) -> None:
    """``dsbd`` with its pruned settings (the rows on its engine start from its tree sweep's)."""
    if planned.wants("dsbd"):
        planned.add_plugin("dsbd", "dsbd", *dsbd_plan(engine.config, engine.settings, planned.grid))


def spec_beam_row(planned: Planned, engine: MethodEngine) -> None:
    if not planned.wants(SPEC_BEAM):
        return
    widths, depths = planned.options.beam_widths or planned.grid.beam, planned.options.beam_depths or (None,)
    settings = []
    for w, d in itertools.product(widths, depths):
        label, values = (f"w{w}", {"beam_width": w}) if d is None else (f"w{w}-d{d}", {"beam_width": w, "depth": d})
        settings.append(Setting(label, values, beam_width=w, speculative=True, beam_depth=d))
    kwargs = {**BEAM_ENGINE, "enable_chunked_prefill": False}
    spec = EngineSpec(SPEC_BEAM, SPEC_BEAM, "plugin", engine.config, settings, kwargs, greedy_only=True)
    planned.add(SPEC_BEAM, "plugin", [spec])


def dsbd_chain(planned: Planned, engine: MethodEngine) -> tuple[dict[str, Any], list[Setting]]:
    """``dsbd`` at ``max_width: 1``, a setting per K of ``draft_model``, on an engine at the largest."""
    ks = planned.options.draft_ks or planned.grid.draft
    config = {**engine.config, "num_speculative_tokens": max(ks), "max_nodes": max(ks), "max_width": 1}
    settings = [
        Setting(f"k{k}", {"num_speculative_tokens": k}, {"num_speculative_tokens": k, "max_nodes": k}) for k in ks
    ]
    return config, settings


def dsbd_chain_row(planned: Planned, engine: MethodEngine) -> None:
    if planned.wants(DSBD_CHAIN):
        planned.add_plugin(DSBD_CHAIN, DSBD_CHAIN, *dsbd_chain(planned, engine))


def dsbd_chain_lookup_row(planned: Planned, engine: MethodEngine) -> None:
    if planned.wants(DSBD_CHAIN_LOOKUP):
        lookup_twin(planned, DSBD_CHAIN, *dsbd_chain(planned, engine))


def mcsd_stop_row(planned: Planned, engine: MethodEngine) -> None:
    """``mcsd`` with the ``--stop-model``, whenever one is given; its no-stop settings are the
    stop model's ablation on the same engine."""
    if planned.options.stop_model:
        config = {**engine.config, "stop_model": planned.options.stop_model}
        planned.add_plugin(MCSD_STOP, "mcsd-stop", config, engine.settings)


def mcsd_lookup_row(planned: Planned, engine: MethodEngine) -> None:
    """At least the node budget mcsd takes with the lookup on, as users get it."""
    if planned.wants(MCSD_LOOKUP):
        nodes = max(engine.config["max_nodes"], engine.method.drafter_class().defaults_for(LOOKUP_TWIN)["max_nodes"])
        lookup_twin(planned, "mcsd", {**engine.config, "max_nodes": nodes}, engine.settings)


def lookup_twin(planned: Planned, row: str, config: dict[str, Any], settings: list[Setting]) -> None:
    """``row`` + :data:`LOOKUP_SUFFIX`: ``row``'s engine with :data:`LOOKUP_TWIN`, at its settings
    with a stopping rule (without one, the draft runs every step: no lookup's gain)."""
    stopping = [s for s in settings if s.values.get("stop_threshold") != 0.0]
    planned.add_plugin(row + LOOKUP_SUFFIX, row + "-lookup", {**config, **LOOKUP_TWIN}, stopping)


def lookup_global_row(planned: Planned, engine: MethodEngine) -> None:
    if planned.wants(LOOKUP_GLOBAL):
        sizes, settings = tree_sweep(engine.method, planned.grid.lookup_global, {"scope": "global"})
        config = {**engine.config, **sizes, "scope": "global"}
        planned.add_plugin(LOOKUP_GLOBAL, "lookup_tree-global", config, settings)


def aded_corpus_row(planned: Planned, engine: MethodEngine) -> None:
    """The same method started from the ``--trigram`` matrix, as its own row."""
    if planned.options.trigram:
        config = {**engine.config, "trigram": planned.options.trigram}
        planned.add_plugin(ADED_CORPUS, "aded-corpus", config, engine.settings)


def mcsd_plan(config: dict[str, Any], planned: Planned) -> tuple[dict[str, Any], list[Setting]]:
    """The ``mcsd`` engine (sized for the grid's largest tree at the deepest of ``--mcsd-depths``,
    default ``(MCSD_DEPTH,)``) and its settings, each at every depth (labelled ``d8/k1``
    when more than one depth runs; requests lower the engine's depth)."""
    from vllm_specbeam.methods.mcsd.maths import level_sizes

    depths = planned.options.mcsd_depths or (MCSD_DEPTH,)
    k_configs = [list(k) for k in planned.grid.mcsd]
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


def mjsd_plan(config: dict[str, Any], planned: Planned) -> tuple[dict[str, Any], list[Setting]]:
    """The ``mjsd`` engine (sized for the grid's widest search and largest tree) and its settings."""
    grid = planned.grid
    settings = []
    for values in grid.mjsd:
        label = f"b{values['beam_width']}" + "".join(
            f"/{tag}{values[key]}" for key, tag in (("threshold", "tau"), ("num_beams_verified", "t")) if key in values
        )
        settings.append(Setting(label, dict(values), extra_args=dict(values)))
    widest = max(v["beam_width"] for v in grid.mjsd)
    nodes = MJSD_DEPTH * max(v.get("num_beams_verified", 1) for v in grid.mjsd)
    return {**config, "num_speculative_tokens": MJSD_DEPTH, "max_nodes": nodes, "beam_width": widest}, settings


#: a plugin method with its own row only
PLAIN = Family((), (own_row,))
#: the rows of plugin methods with more than their own
FAMILIES = {
    "lookup_tree": Family((LOOKUP_GLOBAL,), (own_row, lookup_global_row)),
    "dsbd": Family(
        (SPEC_BEAM, DSBD_CHAIN, DSBD_CHAIN_LOOKUP), (dsbd_row, spec_beam_row, dsbd_chain_row, dsbd_chain_lookup_row)
    ),
    "mcsd": Family((MCSD_STOP, MCSD_LOOKUP), (own_row, mcsd_stop_row, mcsd_lookup_row), mcsd_plan),
    "mjsd": Family((), (own_row,), mjsd_plan),
    "aded": Family((), (own_row, aded_corpus_row)),
}


# ---------------------------------------------------------------- rows across families
def vocab_twins(planned: Planned) -> None:
    """With ``--draft-vocab``: every plugin engine with a draft model (the speculative beam search's
    aside) again with that ``draft_vocab``, as ``<row>+vocab``; of a method named only as
    ``X+vocab``, only the twins stay. ValueError when such a method has none."""
    vocab, vocab_only = planned.options.draft_vocab, planned.vocab_only
    if not vocab:
        return
    drafting = [e for e in planned.engines if e.kind == "plugin" and e.method != SPEC_BEAM]
    for engine in [e for e in drafting if "model" in (e.speculative_config or {})]:
        config = {**(engine.speculative_config or {}), "draft_vocab": vocab}
        twin = replace(engine, id=engine.id + "-vocab", method=engine.method + VOCAB_SUFFIX, speculative_config=config)
        planned.add(twin.method, "plugin", [twin])
        if engine.method in vocab_only:
            planned.engines.remove(engine)
            planned.status.pop(engine.method, None)
    untwinned = vocab_only - {
        e.method.removesuffix(VOCAB_SUFFIX) for e in planned.engines if e.method.endswith(VOCAB_SUFFIX)
    }
    if untwinned:
        raise ValueError(
            f"{sorted(m + VOCAB_SUFFIX for m in untwinned)}: only plugin methods that draft with a model "
            "(and ran with --draft) have a draft-vocabulary row; name the method without +vocab"
        )


def beam_search_row(planned: Planned) -> None:
    """vLLM's ``LLM.beam_search``: under ``all`` beside a plugin beam method that runs, else when named."""
    options = planned.options
    runnable = [name for name, m in plugin_methods().items() if options.draft or not m.needs_draft_model]
    if planned.rows is None and BEAM_METHODS.isdisjoint(runnable):
        planned.skip("beam_search", "beam", "no plugin beam method available to compare with")
    elif planned.wants("beam_search"):
        settings = [Setting(f"w{w}", {"beam_width": w}, beam_width=w) for w in options.beam_widths or planned.grid.beam]
        engine = EngineSpec("beam_search", "beam_search", "beam", None, settings, BEAM_ENGINE, greedy_only=True)
        planned.add("beam_search", "beam", [engine])


def baseline_row(planned: Planned) -> None:
    """No speculation, last: it also scores every output under the target."""
    planned.add("none", "baseline", [EngineSpec("none", "none", "baseline", None, [Setting("-", {})])])


#: the families of rows, in the order their engines run
ROW_BUILDERS = (vllm_rows, plugin_rows, vocab_twins, beam_search_row, baseline_row)


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
