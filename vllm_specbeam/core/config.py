"""The plugin's methods, their options, and their validation.

Users write one flat JSON object, exactly where vLLM expects it::

    --speculative-config '{"method": "lookup_tree", "num_speculative_tokens": 4, "max_nodes": 16}'

For tree methods ``num_speculative_tokens`` is the draft *depth*. Every check
here runs in the front end, before the engine starts, so a typo is a one-line
error message and not a traceback from inside vLLM; the same checks run again
for per-request overrides (``SamplingParams.extra_args``), failing only that
request.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_specbeam.core.drafter import TreeDrafter


class SpecbeamConfigError(ValueError):
    """A speculative-config or per-request option the plugin cannot use."""


@dataclass(frozen=True)
class Option:
    """One user-facing option: its default, type and valid range."""

    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] | None = None
    #: False for options that shape engine-wide state (files, models)
    per_request: bool = True
    #: also takes :data:`AUTO` (then the default may be it; other values are ``kind``)
    auto: bool = False
    #: the type of its values other than :data:`AUTO` (``None``: the default's, ``int`` if that is :data:`AUTO`)
    kind: type[Any] | None = None

    def check(self, name: str, value: Any) -> Any:
        if self.auto and value == AUTO:
            return value
        if name == "max_nodes" and value == AUTO:
            raise SpecbeamConfigError(
                f"option {name!r} cannot be {AUTO!r} for this method (only methods whose trees the "
                f"per-step budget may cut take it: {sorted(m for m, e in METHODS.items() if e.prunable)}); "
                f"give a number"
            )
        kind = self.kind or (int if self.auto else type(self.default))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not kind:
            raise SpecbeamConfigError(
                f"option {name!r} must be {'an' if kind is int else 'a'} {kind.__name__}, "
                f"got {value!r} ({type(value).__name__})"
            )
        if self.choices is not None and value not in self.choices:
            raise SpecbeamConfigError(f"option {name!r} must be one of {list(self.choices)}, got {value!r}")
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise SpecbeamConfigError(f"option {name!r} must be in [{self.low}, {self.high}], got {value!r}")
        return value


#: ``"max_nodes": "auto"``: each step's nodes chosen by :mod:`vllm_specbeam.core.budget`
AUTO = "auto"

#: Options every tree method has.
TREE_OPTIONS: dict[str, Option] = {
    "num_speculative_tokens": Option(4, "draft depth: tokens along one branch", 1, 32),
    "max_nodes": Option(16, "node budget of one draft tree (all branches together)", 1, 128),
}
#: Options of methods whose trees the per-step budget may cut.
BUDGET_OPTIONS: dict[str, Option] = {
    "max_nodes": Option(
        AUTO,
        "nodes of one draft tree: auto (chosen each step from measured step costs and the request's "
        "acceptance, up to auto_max_nodes) or a fixed number (per request under auto: that request's cap)",
        1,
        128,
        auto=True,
    ),
    "auto_max_nodes": Option(16, "most nodes the auto budget keeps in one tree (KV slots reserved per step)", 1, 128),
}


#: Who drafts from whose text in a cross-request index (``lookup_tree``'s global scope, the global lookup).
INDEX_ISOLATION = Option(
    "salt",
    "cross-request index: salt (a request drafts only from, and feeds only, finished requests with its "
    "cache_salt, as vLLM's prefix cache shares blocks; requests without one share one partition) or none "
    "(one index for all requests, whatever their salt)",
    choices=("salt", "none"),
    per_request=False,
)

#: Options of draft-model methods whose trees start with lookup branches (``mcsd``, ``dsbd``).
LOOKUP_OPTIONS: dict[str, Option] = {
    "lookup": Option(
        "off",
        "start each tree with lookup_tree's branches, the draft model drafting only what they leave: "
        "off, request (the request's own tokens) or global (also finished requests', engine-wide index)",
        choices=("off", "request", "global"),
        per_request=False,
    ),
    "lookup_depth": Option(
        24,
        "deepest lookup branch, as lookup_tree's global scope (a lowered num_speculative_tokens lowers it too)",
        1,
        64,
    ),
    "index_isolation": INDEX_ISOLATION,
}

#: the options that bound how deep a tree drafts (a request near its ``max_tokens`` lowers each)
DEPTH_OPTIONS = ("num_speculative_tokens", "lookup_depth")


def node_cap(options: Mapping[str, Any]) -> int:
    """The most nodes a tree may have under these options: ``max_nodes``, or
    ``auto_max_nodes`` when the budget is automatic."""
    return int(options["auto_max_nodes"] if options["max_nodes"] == AUTO else options["max_nodes"])


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Method:
    """A method name users can pass, and where its drafter lives."""

    drafter: str  # "module:Class"
    needs_draft_model: bool = False
    #: acceptance rules ("module:Class") for temperature 0, for sampling, and
    #: for sampling when the draft is a single chain (None: the sampling rule)
    greedy_verifier: str = "vllm_specbeam.core.verifiers.greedy:GreedyTreeVerifier"
    sampling_verifier: str = "vllm_specbeam.core.verifiers.rejection:RejectionTreeVerifier"
    chain_verifier: str | None = "vllm_specbeam.core.verifiers.block:BlockVerifier"
    #: its drafts are deterministic and its verifiers take any subtree: the
    #: per-step budget may cut them (``"max_nodes": "auto"``, the default)
    prunable: bool = False

    def drafter_class(self) -> type[TreeDrafter]:
        return _load(self.drafter)

    def verifiers(self) -> tuple[Any, Any, Any]:
        """(greedy, sampling, chain-sampling or None) rule instances."""
        chain = None if self.chain_verifier is None else _load(self.chain_verifier)()
        return _load(self.greedy_verifier)(), _load(self.sampling_verifier)(), chain

    def options(self) -> dict[str, Option]:
        budget = BUDGET_OPTIONS if self.prunable else {}
        return {**TREE_OPTIONS, **budget, **getattr(self.drafter_class(), "OPTIONS", {})}

    def check(self, options: dict[str, Any], startup: bool = False) -> dict[str, Any]:
        """Checks that involve several options at once; with ``startup``, also
        the drafter's checks of files and models (once per engine, never per
        request: per-request overrides cannot change engine-wide options)."""
        if node_cap(options) < options["num_speculative_tokens"]:
            name = "auto_max_nodes" if options["max_nodes"] == AUTO else "max_nodes"
            raise SpecbeamConfigError(
                f"{name}={node_cap(options)} cannot hold one branch of depth "
                f"num_speculative_tokens={options['num_speculative_tokens']}; raise {name} or lower the depth"
            )
        drafter = self.drafter_class()
        drafter.check_options(options)
        if startup:
            drafter.check_startup(options)
        return options


METHODS: dict[str, Method] = {
    "lookup_tree": Method("vllm_specbeam.methods.lookup_tree.drafter:LookupTreeDrafter", prunable=True),
    "dsbd": Method(
        "vllm_specbeam.methods.dsbd.drafter:DsbdDrafter",
        needs_draft_model=True,
        greedy_verifier="vllm_specbeam.methods.dsbd.verifier:DsbdGreedyVerifier",
        sampling_verifier="vllm_specbeam.methods.dsbd.verifier:DsbdVerifier",
        chain_verifier=None,
    ),
    "mcsd": Method("vllm_specbeam.methods.mcsd.drafter:McsdDrafter", needs_draft_model=True),
    "mjsd": Method(
        "vllm_specbeam.methods.mjsd.drafter:MjsdDrafter",
        needs_draft_model=True,
        greedy_verifier="vllm_specbeam.methods.mjsd.verifier:MjsdGreedyVerifier",
        sampling_verifier="vllm_specbeam.methods.mjsd.verifier:MjsdVerifier",
        chain_verifier=None,
    ),
    "aded": Method("vllm_specbeam.methods.aded.drafter:AdedDrafter", prunable=True),
}

#: Keys of vLLM's own SpeculativeConfig that the plugin forwards or uses as is.
VLLM_KEYS = ("method", "model")


@dataclass(frozen=True)
class SpecbeamConfig:
    """A validated plugin configuration; travels to vLLM's workers as a plain
    dict (:mod:`vllm_specbeam.adapter.engine_config`)."""

    method: str
    options: dict[str, Any] = field(default_factory=dict)
    draft_model: str | None = None

    @property
    def depth(self) -> int:
        return self.options["num_speculative_tokens"]

    @property
    def max_nodes(self) -> int:
        """The most nodes of one tree (what vLLM reserves slots for)."""
        return node_cap(self.options)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "options": dict(self.options), "draft_model": self.draft_model}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpecbeamConfig:
        return cls(data["method"], dict(data["options"]), data.get("draft_model"))

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
        """The options for one request: engine defaults plus its ``extra_args``.

        Only this method's options are read from ``extra_args``; other keys
        belong to other plugins or to vLLM's logits processors and pass, unless
        they are plainly meant for this plugin (:func:`_reject_misdirected`).
        Depth and node budget (and a drafter's ``CAPPED_BY_ENGINE`` options)
        can only be lowered per request: the engine's KV and metric sizes
        follow them.
        """
        options = dict(self.options)
        if not overrides:
            return options
        method = METHODS[self.method]
        specs = method.options()
        for name, value in overrides.items():
            if name not in specs:
                _reject_misdirected(self.method, name, specs)
                continue
            if not specs[name].per_request:
                raise SpecbeamConfigError(
                    f"option {name!r} is engine-wide and cannot be set per request; "
                    f"set it in the engine's speculative config"
                )
            options[name] = specs[name].check(name, value)
        method.check(options)
        for name in ("num_speculative_tokens", "max_nodes", *method.drafter_class().CAPPED_BY_ENGINE):
            size, engine = options[name], self.options[name]
            if name == "max_nodes":  # "auto" stands for its cap
                size, engine = node_cap(options), node_cap(self.options)
            if size > engine:
                raise SpecbeamConfigError(
                    f"per-request {_setting(name, options)} exceeds the engine's {_setting(name, self.options)}; "
                    f"start the engine with a larger value or lower it for this request"
                )
        return options


def _setting(name: str, options: Mapping[str, Any]) -> str:
    """``max_nodes=8``, or ``max_nodes=auto (auto_max_nodes=48)``: what a size check names."""
    if name == "max_nodes" and options[name] == AUTO:
        return f"max_nodes={AUTO} (auto_max_nodes={options['auto_max_nodes']})"
    return f"{name}={options[name]}"


def _reject_misdirected(method: str, name: str, specs: Mapping[str, Option]) -> None:
    """An unknown per-request key fails the request when it is another plugin
    method's option (``beam_width`` sent to a ``lookup_tree`` engine) or a
    near miss of one of this method's (``max_node``): silently ignoring it
    would run the request with settings its sender did not ask for."""
    per_request = sorted(key for key, spec in specs.items() if spec.per_request)
    owners = sorted(other for other, entry in METHODS.items() if name in entry.options())
    if owners:
        raise SpecbeamConfigError(
            f"per-request option {name!r} belongs to {owners}, not to {method!r}, which this engine runs; "
            f"{method!r} takes {per_request}"
        )
    close = difflib.get_close_matches(name, list(specs), n=1, cutoff=0.8)
    if close:
        raise SpecbeamConfigError(
            f"unknown per-request option {name!r} for {method!r}: did you mean {close[0]!r}? "
            f"{method!r} takes {per_request}"
        )


def is_plugin_method(speculative_config: Mapping[str, Any] | None) -> bool:
    if not speculative_config:
        return False
    return speculative_config.get("method") in METHODS


def parse(
    speculative_config: Mapping[str, Any], target_tokenizer: str | None = None, target_model: str | None = None
) -> SpecbeamConfig:
    """Validate a user's speculative config for one of the plugin's methods.

    ``target_tokenizer`` (the target model's tokenizer name or path) fills the
    ``tokenizer`` option of drafters that check vocabularies, and
    ``target_model`` the ``target_model`` option of those that check files
    trained for a target, unless the user set them, so those checks run
    here, before the engine starts.
    """
    user = {k.replace("-", "_"): v for k, v in speculative_config.items()}
    name = user.pop("method")
    method = METHODS[name]
    draft_model = user.pop("model", None)
    if method.needs_draft_model and not draft_model:
        raise SpecbeamConfigError(
            f'speculative method {name!r} needs a draft model: add "model": "<path or hub name>" '
            f"to the speculative config"
        )
    if draft_model and not method.needs_draft_model:
        raise SpecbeamConfigError(
            f'speculative method {name!r} uses no draft model; remove "model" from the speculative config'
        )
    specs = method.options()
    user.pop("draft_model", None)  # given as "model", like vLLM's draft methods
    unknown = sorted(set(user) - set(specs))
    if unknown:
        raise SpecbeamConfigError(
            f"unknown option(s) {unknown} for speculative method {name!r}; valid options: "
            f"{sorted([*VLLM_KEYS, *specs]) if method.needs_draft_model else sorted(['method', *specs])}"
        )
    defaults = {key: spec.default for key, spec in specs.items()}
    defaults.update(method.drafter_class().defaults_for(user))
    options = {key: spec.check(key, user.get(key, defaults[key])) for key, spec in specs.items()}
    for filled, value in (("tokenizer", target_tokenizer), ("target_model", target_model)):
        if filled in options and not options[filled] and value:
            options[filled] = value
    if "draft_model" in options and draft_model:
        options["draft_model"] = draft_model
    return SpecbeamConfig(name, method.check(options, startup=True), draft_model)
