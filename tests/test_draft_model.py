"""The shared draft-model runtime: incremental cache, rollback, freeing, vocabulary check, shared beams, batching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tree_path

from vllm_specbeam.draft_runtime import hf as draft_model
from vllm_specbeam.draft_runtime.hf import (
    MAX_PADDING,
    DraftModelError,
    DraftModelRuntime,
    check_vocabularies,
    placement,
)

CONTEXT = [(7 * i) % 97 + 3 for i in range(40)]
PROMPT = [(11 * i) % 97 + 3 for i in range(90)]  # longer than a short feed by more than MAX_PADDING
ATOL = 1e-4


@pytest.fixture(scope="module")
def runtime(tiny_model: str) -> DraftModelRuntime:
    return DraftModelRuntime(tiny_model, target_tokenizer=tiny_model)


def full_logits(runtime: DraftModelRuntime, tokens: list[int]) -> torch.Tensor:
    """The reference: the whole sequence encoded from scratch, no cache."""
    with torch.inference_mode():
        return runtime.model(torch.tensor([tokens])).logits[0, -1].float()


def count_forwards(runtime: DraftModelRuntime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Batch sizes of the runtime's model forwards from now on (not the references' uncached ones)."""
    sizes: list[int] = []
    forward = runtime.model.forward

    def counted(*args: object, **kwargs: torch.Tensor) -> object:
        if "past_key_values" in kwargs:
            sizes.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(runtime.model, "forward", counted)
    return sizes


def test_incremental_cache_matches_full_encoding(runtime: DraftModelRuntime) -> None:
    runtime.sync("inc", CONTEXT[:12])
    for end in (13, 20, 40):  # one token, then several at once
        logits = runtime.sync("inc", CONTEXT[:end])
        torch.testing.assert_close(logits, full_logits(runtime, CONTEXT[:end]), atol=ATOL, rtol=0)
        assert runtime.cached_tokens("inc") == end
    runtime.remove(["inc"])


def test_tree_nodes_see_only_their_ancestors(runtime: DraftModelRuntime) -> None:
    runtime.sync("tree", CONTEXT[:20])
    first = runtime.extend("tree", [5, 6, 5], [-1, -1, -1])  # duplicates are separate beams
    second = runtime.extend("tree", [8, 9], [1, 2])
    for logits, path in [(first[0], [5]), (first[1], [6]), (second[0], [6, 8]), (second[1], [5, 9])]:
        torch.testing.assert_close(logits, full_logits(runtime, CONTEXT[:20] + path), atol=ATOL, rtol=0)
    runtime.remove(["tree"])


def test_rollback_to_the_accepted_prefix(runtime: DraftModelRuntime) -> None:
    runtime.sync("roll", CONTEXT[:20])
    runtime.extend("roll", [5, 6], [-1, 0])
    committed = CONTEXT[:20] + [5, 11]  # the first node accepted, then a correction
    logits = runtime.sync("roll", committed)
    torch.testing.assert_close(logits, full_logits(runtime, committed), atol=ATOL, rtol=0)
    assert runtime.cached_tokens("roll") == len(committed)
    diverged = CONTEXT[:10] + [4, 4]  # e.g. preempted and resumed with another history
    logits = runtime.sync("roll", diverged)
    torch.testing.assert_close(logits, full_logits(runtime, diverged), atol=ATOL, rtol=0)
    assert runtime.cached_tokens("roll") == len(diverged)
    runtime.remove(["roll"])


def test_remove_frees_and_caps_bound_the_cache(tiny_model: str) -> None:
    rt = DraftModelRuntime(tiny_model, max_tokens_per_request=30, max_total_tokens=50)
    rt.sync("a", CONTEXT[:20])
    rt.sync("b", CONTEXT[:20])
    assert rt.live_requests == 2
    rt.sync("c", CONTEXT[:20])  # 60 rows > 50: the least recently drafted ("a") goes
    assert rt.live_requests == 2 and rt.cached_tokens("a") == 0
    assert rt.sync("b", CONTEXT[:28], reserve=4) is None  # 32 > 30: no draft, cache freed
    assert rt.live_requests == 1
    rt.remove(["c", "unknown"])
    assert rt.live_requests == 0


def test_beams_share_the_prefix(runtime: DraftModelRuntime) -> None:
    """Four beams add four rows to the request's one buffer, never four copies of the context."""
    runtime.sync("share", CONTEXT)
    runtime.extend("share", [5, 6, 7, 8], [-1, -1, -1, -1])
    runtime.extend("share", [9, 9, 9, 9], [0, 1, 2, 3])
    seq = runtime._sequences["share"]
    config = runtime.model.config
    assert seq.kv.shape[:3] == (config.num_hidden_layers, 2, config.num_key_value_heads)  # no beam dimension
    assert runtime.cached_tokens("share") == len(CONTEXT) + 8
    runtime.remove(["share"])


def test_vocabulary_mismatch_names_both_models(tmp_path: Path, tiny_model: str) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"v{i}": i + 3 for i in range(100)}}
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(DraftModelError, match="do not tokenise identically") as error:
        DraftModelRuntime(tiny_model, target_tokenizer=str(tmp_path / "other"))
    assert tiny_model in str(error.value) and str(tmp_path / "other") in str(error.value)
    with pytest.raises(DraftModelError, match="1 with different ids"):
        check_vocabularies("d", "t", {"a": 0, "b": 1}, {"a": 1, "b": 1})


def test_logits_are_padded_to_the_target_width(tiny_model: str) -> None:
    """A target whose embedding has padding rows: the draft never proposes them."""
    rt = DraftModelRuntime(tiny_model, target_vocab_size=128)
    logits = rt.sync("pad", CONTEXT[:5])
    assert logits.shape == (128,) and torch.isinf(logits[103:]).all() and torch.isfinite(logits[:103]).all()


# ---------------------------------------------------------------- batching
# Three requests: cached 12, 20 and 0 tokens before the step, fed 1, 7 and 30 tokens by it.
STEP = {"a": CONTEXT[:13], "b": CONTEXT[5:32], "c": CONTEXT[10:40]}
DEPTHS = [  # per depth: (tokens, parents) of each request; trees of different widths
    {"a": ([5, 6, 5], [-1, -1, -1]), "b": ([7], [-1]), "c": ([8, 9], [-1, -1])},
    {"a": ([8, 9], [1, 2]), "b": ([3, 4], [0, 0]), "c": ([1], [1])},
    {"a": ([2], [4]), "c": ([6, 7, 8], [2, 2, 2])},  # "b" stops drafting
]


def test_batched_steps_match_one_at_a_time_and_full_encoding(
    runtime: DraftModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    for req_id, before in [("a", CONTEXT[:12]), ("b", CONTEXT[5:25])]:
        runtime.sync(req_id, before)
        runtime.sync("1-" + req_id, before)
    forwards = count_forwards(runtime, monkeypatch)
    batched = runtime.sync_many([(r, tokens, 8) for r, tokens in STEP.items()])
    assert forwards == [3]
    alone = [runtime.sync("1-" + r, tokens, 8) for r, tokens in STEP.items()]
    for req_id, logits, single in zip(STEP, batched, alone):
        torch.testing.assert_close(logits, single, atol=ATOL, rtol=0)
        torch.testing.assert_close(logits, full_logits(runtime, STEP[req_id]), atol=ATOL, rtol=0)
        assert runtime.cached_tokens(req_id) == len(STEP[req_id])
    trees: dict[str, list[tuple[int, int]]] = {r: [] for r in STEP}
    for depth in DEPTHS:
        del forwards[:]
        batched = runtime.extend_many([(r, tokens, parents) for r, (tokens, parents) in depth.items()])
        assert forwards == [len(depth)]
        for (req_id, (tokens, parents)), logits in zip(depth.items(), batched):
            single = runtime.extend("1-" + req_id, tokens, parents)
            torch.testing.assert_close(logits, single, atol=ATOL, rtol=0)
            first = len(trees[req_id])
            trees[req_id] += zip(tokens, parents)
            for i in range(len(tokens)):
                reference = full_logits(runtime, STEP[req_id] + tree_path(trees[req_id], first + i))
                torch.testing.assert_close(logits[i], reference, atol=ATOL, rtol=0)
    for req_id in STEP:
        assert runtime.cached_tokens(req_id) == len(STEP[req_id]) + len(trees[req_id])
    runtime.remove([*STEP, *("1-" + r for r in STEP)])


def test_a_new_prompt_is_encoded_apart_from_short_feeds(
    runtime: DraftModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime.sync_many([("s1", CONTEXT[:20], 0), ("s2", CONTEXT[:30], 0)])
    forwards = count_forwards(runtime, monkeypatch)
    step = {"s1": CONTEXT[:21], "new": PROMPT, "s2": CONTEXT[:31]}
    results = runtime.sync_many([(r, tokens, 0) for r, tokens in step.items()])
    assert len(PROMPT) - 1 > MAX_PADDING and sorted(forwards) == [1, 2]  # the prompt alone, the short feeds together
    for (req_id, tokens), logits in zip(step.items(), results):
        torch.testing.assert_close(logits, full_logits(runtime, tokens), atol=ATOL, rtol=0)
        assert runtime.cached_tokens(req_id) == len(tokens)
    runtime.remove(step)


def test_a_long_prompt_is_fed_in_chunks(runtime: DraftModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(draft_model, "PREFILL_CHUNK", 32)
    runtime.sync("short", CONTEXT[:20])
    forwards = count_forwards(runtime, monkeypatch)
    step = {"long": PROMPT, "short": CONTEXT[:21]}
    results = runtime.sync_many([(r, tokens, 2) for r, tokens in step.items()])
    assert forwards == [1, 1, 2]  # 32 + 32 prompt tokens alone, then the last 26 beside the short feed
    for (req_id, tokens), logits in zip(step.items(), results):
        torch.testing.assert_close(logits, full_logits(runtime, tokens), atol=ATOL, rtol=0)
        assert runtime.cached_tokens(req_id) == len(tokens)
    nodes = runtime.extend_many([("long", [5, 6], [-1, -1]), ("short", [7], [-1])])
    torch.testing.assert_close(nodes[0][1], full_logits(runtime, PROMPT + [6]), atol=ATOL, rtol=0)
    torch.testing.assert_close(nodes[1][0], full_logits(runtime, CONTEXT[:21] + [7]), atol=ATOL, rtol=0)
    runtime.remove(step)


def test_rollback_after_a_batched_step(runtime: DraftModelRuntime) -> None:
    runtime.sync_many([("r1", CONTEXT[:20], 4), ("r2", CONTEXT[:30], 4)])
    runtime.extend_many([("r1", [5, 6], [-1, -1]), ("r2", [7], [-1])])
    runtime.extend_many([("r1", [8, 9], [0, 1]), ("r2", [4], [0])])
    assert runtime.cached_tokens("r1") == 24 and runtime.cached_tokens("r2") == 32
    step = {
        "r1": CONTEXT[:20] + [6, 9, 11],  # two nodes accepted (not the first ones drafted), then a correction
        "r2": CONTEXT[:10] + [4, 4],  # preempted and resumed with another history
    }
    results = runtime.sync_many([(r, tokens, 0) for r, tokens in step.items()])
    for (req_id, tokens), logits in zip(step.items(), results):
        torch.testing.assert_close(logits, full_logits(runtime, tokens), atol=ATOL, rtol=0)
        assert runtime.cached_tokens(req_id) == len(tokens)
    runtime.remove(step)


def test_total_cap_drops_requests_outside_the_step_first(tiny_model: str) -> None:
    rt = DraftModelRuntime(tiny_model, max_total_tokens=70)
    rt.sync("old", CONTEXT[:30])
    results = rt.sync_many([("a", CONTEXT[:20], 4), ("b", CONTEXT[:20], 4), ("c", CONTEXT[:30], 4)])
    # "old" goes for "a" and "b" (48 rows); "c" (34 more) does not fit beside them: undrafted
    assert [r is None for r in results] == [False, False, True]
    assert rt.live_requests == 2 and rt.cached_tokens("old") == 0 and rt.cached_tokens("c") == 0
    with pytest.raises(ValueError, match="twice"):
        rt.sync_many([("a", CONTEXT[:21], 0), ("a", CONTEXT[:22], 0)])


def test_placement_follows_the_target_unless_told() -> None:
    assert placement("auto", "auto", torch.device("cpu"), torch.bfloat16) == ("cpu", torch.bfloat16)
    assert placement("cuda:1", "checkpoint", "cuda:0", torch.float16) == ("cuda:1", "checkpoint")
    assert placement("auto", "float16", "cuda:0", torch.float32) == ("cuda:0", torch.float16)


def test_drafter_loads_the_draft_in_the_targets_dtype(tiny_model: str) -> None:
    from vllm_specbeam.core.config import parse
    from vllm_specbeam.methods.dsbd.drafter import DsbdDrafter

    options = parse({"method": "dsbd", "model": tiny_model}).options
    target = torch.nn.Linear(2, 2).to(torch.bfloat16)  # stands in for vLLM's target model
    drafter = DsbdDrafter(options)
    drafter.load_model(target)
    assert drafter.runtime.model.dtype == torch.bfloat16
    drafter = DsbdDrafter({**options, "draft_dtype": "float32"})
    drafter.load_model(target)
    assert drafter.runtime.model.dtype == torch.float32
