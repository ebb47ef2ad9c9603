"""Bad speculative configs fail at start-up with a message that names the
problem and the fix, before any engine process starts."""

from __future__ import annotations

import pytest

from vllm_specbeam.core.config import SpecbeamConfigError, parse


def engine_config(model: str, spec: dict, **engine: object):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specbeam.adapter.plugin import register

    register()  # what vLLM's plugin loader does in every process
    args = EngineArgs(model=model, dtype="float32", max_model_len=256, speculative_config=spec, **engine)
    return args.create_engine_config()


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"method": "lookup_tree", "max_node": 8},
            r"unknown option\(s\) \['max_node'\] for speculative method 'lookup_tree'; valid options: .*'max_nodes'",
        ),
        (
            {"method": "lookup_tree", "num_speculative_tokens": "4"},
            r"option 'num_speculative_tokens' must be an int, got '4' \(str\)",
        ),
        (
            {"method": "lookup_tree", "num_speculative_tokens": 0},
            r"option 'num_speculative_tokens' must be in \[1, 32\], got 0",
        ),
        (
            {"method": "lookup_tree", "num_speculative_tokens": 8, "max_nodes": 4},
            r"max_nodes=4 cannot hold one branch of depth num_speculative_tokens=8",
        ),
        (
            {"method": "lookup_tree", "prompt_lookup_min": 6, "prompt_lookup_max": 3},
            r"prompt_lookup_min=6 must not exceed prompt_lookup_max=3",
        ),
        (
            {"method": "lookup_tree", "model": "some/draft"},
            r"speculative method 'lookup_tree' uses no draft model; remove \"model\"",
        ),
        (
            {"method": "mjsd", "model": "some/draft", "beam_width": 2, "num_beams_verified": 3},
            r"mjsd: num_beams_verified=3 exceeds beam_width=2; verify at most beam_width beams or raise beam_width",
        ),
        (
            {"method": "mjsd", "model": "some/draft", "verify": "exact"},
            r"option 'verify' must be one of \['joint', 'block'\], got 'exact'",
        ),
        ({"method": "aded", "trigram": "/nonexistent/matrix"}, r"aded: .*nonexistent"),
        (
            {"method": "lookup_tree", "scope": "global", "index_isolation": "tenant"},
            r"option 'index_isolation' must be one of \['salt', 'none'\], got 'tenant'",
        ),
    ],
)
def test_startup_errors_name_problem_and_fix(tiny_model, spec, message):
    with pytest.raises(SpecbeamConfigError, match=message):
        engine_config(tiny_model, spec)


def test_draft_model_problems(tiny_model, tiny_draft, tmp_path):
    from tiny_model import build_tiny_model

    with pytest.raises(SpecbeamConfigError, match=r"'dsbd' needs a draft model: add \"model\""):
        engine_config(tiny_model, {"method": "dsbd"})
    with pytest.raises(SpecbeamConfigError, match=r"cannot load the draft model's tokenizer from '/nonexistent/draft'"):
        engine_config(tiny_model, {"method": "dsbd", "model": "/nonexistent/draft"})
    other = str(build_tiny_model(tmp_path / "other-vocab", word_prefix="v"))
    with pytest.raises(SpecbeamConfigError, match=r"do not tokenise identically: 100 tokens only in the draft"):
        engine_config(tiny_model, {"method": "dsbd", "model": other})
    config = engine_config(tiny_model, {"method": "dsbd", "model": tiny_draft, "max_width": 2})
    assert config.additional_config["specbeam"]["options"]["draft_model"] == tiny_draft
    # The draft runs in vLLM's worker, on the target's device, its K/V in vLLM's cache: the options
    # of the former Hugging Face runtime (its device, its cache caps) are unknown options now.
    for option, value in [("max_cache_tokens_total", 4096), ("draft_device", "cpu")]:
        with pytest.raises(SpecbeamConfigError, match=rf"unknown option\(s\) \['{option}'\] .*valid options: \["):
            engine_config(tiny_model, {"method": "dsbd", "model": tiny_draft, option: value})


def test_draft_vocabulary_problems(tiny_model, tiny_draft, tmp_path):
    from tiny_model import build_tiny_model

    from vllm_specbeam.core.corpus import load_tokenizer
    from vllm_specbeam.draft_runtime import vocab

    spec = {"method": "mcsd", "model": tiny_draft}
    missing = tmp_path / "missing"
    with pytest.raises(SpecbeamConfigError, match=r"not a draft vocabulary directory .*draft-vocab build"):
        engine_config(tiny_model, {**spec, "draft_vocab": str(missing)})
    (tmp_path / "corpus.txt").write_text("v1 v2 v2")
    other = load_tokenizer(str(build_tiny_model(tmp_path / "other-vocab", word_prefix="v")))
    vocab.build([tmp_path / "corpus.txt"], other, progress=False).save(tmp_path / "other")
    with pytest.raises(SpecbeamConfigError, match=r"was built with tokenizer .*rebuild it: vllm-specbeam draft-vocab"):
        engine_config(tiny_model, {**spec, "draft_vocab": str(tmp_path / "other")})
    (tmp_path / "corpus.txt").write_text("w1 w2 w2")
    vocab.build([tmp_path / "corpus.txt"], load_tokenizer(tiny_model), progress=False).save(tmp_path / "ours")
    config = engine_config(tiny_model, {**spec, "draft_vocab": str(tmp_path / "ours")})
    assert config.additional_config["specbeam"]["options"]["draft_vocab"] == str(tmp_path / "ours")
    with pytest.raises(SpecbeamConfigError, match="'draft_vocab' is engine-wide and cannot be set per request"):
        parse({"method": "mcsd", "model": tiny_draft}).with_overrides({"draft_vocab": "x"})


def test_a_salted_index_needs_the_plugins_scheduler(tiny_model):
    """Only the plugin's scheduler hands each request's cache_salt to the workers: with another one,
    an index kept apart by salt is refused (every request would read the unsalted partition)."""
    spec = {"method": "lookup_tree", "scope": "global"}
    with pytest.raises(
        SpecbeamConfigError,
        match=r"scheduler_cls=my\.Scheduler was set: remove --scheduler-cls .* \"index_isolation\": \"none\"",
    ):
        engine_config(tiny_model, spec, scheduler_cls="my.Scheduler")
    for shared in ({**spec, "index_isolation": "none"}, {"method": "lookup_tree"}):  # no salt to carry
        assert engine_config(tiny_model, shared, scheduler_cls="my.Scheduler").scheduler_config.scheduler_cls
    with pytest.raises(SpecbeamConfigError, match="'index_isolation' is engine-wide and cannot be set per request"):
        parse(spec).with_overrides({"index_isolation": "none"})


def test_unknown_method_lists_vllm_and_plugin_methods(tiny_model):
    with pytest.raises(
        SpecbeamConfigError,
        match=r"unknown speculative method 'lookup_trees'; "
        r"vLLM's methods: \[.*'ngram'.*\]; vllm-specbeam's: \[.*'lookup_tree'",
    ):
        engine_config(tiny_model, {"method": "lookup_trees", "num_speculative_tokens": 2})


def test_valid_config_becomes_carrier_and_travels_in_additional_config(tiny_model):
    config = engine_config(tiny_model, {"method": "lookup_tree", "num_speculative_tokens": 3, "max_nodes": 9})
    assert config.speculative_config.method == "custom_class"
    assert config.speculative_config.num_speculative_tokens == 9  # node budget: a KV slot per node
    plugin = config.additional_config["specbeam"]
    assert plugin["method"] == "lookup_tree"
    assert plugin["options"]["num_speculative_tokens"] == 3


def test_per_request_overrides_are_checked():
    config = parse({"method": "aded", "num_speculative_tokens": 3, "max_nodes": 12})
    assert config.with_overrides({"iterations": 10, "unrelated_key": 1})["iterations"] == 10
    with pytest.raises(SpecbeamConfigError, match="'trigram' is engine-wide and cannot be set per request"):
        config.with_overrides({"trigram": "/tmp/x"})
    with pytest.raises(SpecbeamConfigError, match="per-request num_speculative_tokens=5 exceeds"):
        config.with_overrides({"num_speculative_tokens": 5})
    # keys meant for the plugin but not for this method fail; others (logits processors') pass
    with pytest.raises(SpecbeamConfigError, match=r"'beam_width' belongs to \['mjsd'\], not to 'aded'"):
        config.with_overrides({"beam_width": 2})
    with pytest.raises(SpecbeamConfigError, match="'iteration' for 'aded': did you mean 'iterations'"):
        config.with_overrides({"iteration": 10})
    assert config.with_overrides({"my_logits_processor_strength": 0.5}) == config.options


def test_start_up_checks_run_once_not_per_request(monkeypatch):
    """Files and models are checked at start-up only: the runner applies a
    request's overrides at every step, where loading a tri-gram matrix or a
    tokenizer would cost more than the step itself."""
    from vllm_specbeam.methods.aded.drafter import AdedDrafter
    from vllm_specbeam.methods.dsbd.drafter import DsbdDrafter

    calls = []
    monkeypatch.setattr(AdedDrafter, "check_startup", staticmethod(lambda options: calls.append(options)))
    config = parse({"method": "aded", "num_speculative_tokens": 3, "max_nodes": 12})
    assert len(calls) == 1
    for _ in range(3):
        config.with_overrides({"iterations": 10})
    assert len(calls) == 1
    monkeypatch.setattr(DsbdDrafter, "check_startup", staticmethod(lambda options: calls.append(options)))
    config = parse({"method": "dsbd", "model": "/d", "max_width": 3})
    assert len(calls) == 2
    with pytest.raises(SpecbeamConfigError, match="min_width=4 exceeds max_width=3"):  # cheap checks still run
        config.with_overrides({"min_width": 4})
    assert len(calls) == 2
