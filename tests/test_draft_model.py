"""The shared draft-model runtime: incremental cache, rollback, freeing, vocabulary check, shared beams."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_specbeam.draft_model import DraftModelError, DraftModelRuntime, check_vocabularies

CONTEXT = [(7 * i) % 97 + 3 for i in range(40)]
ATOL = 1e-4


@pytest.fixture(scope="module")
def runtime(tiny_model: str) -> DraftModelRuntime:
    return DraftModelRuntime(tiny_model, target_tokenizer=tiny_model)


def full_logits(runtime: DraftModelRuntime, tokens: list[int]) -> torch.Tensor:
    """The reference: the whole sequence encoded from scratch, no cache."""
    with torch.inference_mode():
        return runtime.model(torch.tensor([tokens])).logits[0, -1].float()


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
    """Four beams add four cache rows to one batch-1 cache, never four copies of the context."""
    runtime.sync("share", CONTEXT)
    runtime.extend("share", [5, 6, 7, 8], [-1, -1, -1, -1])
    runtime.extend("share", [9, 9, 9, 9], [0, 1, 2, 3])
    layer = runtime._sequences["share"].cache.layers[0]
    assert layer.keys.shape[0] == 1 and layer.keys.shape[-2] == len(CONTEXT) + 8
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
