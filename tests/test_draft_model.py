"""What every draft-model method checks of its draft at start-up: same tokenizer, its dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_specbeam.adapter.draft_model import _model_dtype
from vllm_specbeam.core.config import SpecbeamConfigError
from vllm_specbeam.draft_runtime.drafter import DraftModelError, check_draft_tokenizer, check_vocabularies


def test_vocabulary_mismatch_names_both_models(tmp_path: Path, tiny_model: str) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"v{i}": i + 3 for i in range(100)}}
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SpecbeamConfigError, match="do not tokenise identically") as error:
        check_draft_tokenizer(tiny_model, str(tmp_path / "other"))
    assert tiny_model in str(error.value) and str(tmp_path / "other") in str(error.value)
    check_draft_tokenizer(tiny_model, tiny_model)  # the same tokenizer passes
    with pytest.raises(DraftModelError, match="1 with different ids"):
        check_vocabularies("d", "t", {"a": 0, "b": 1}, {"a": 1, "b": 1})


def test_draft_dtype_follows_the_target_unless_told() -> None:
    assert _model_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert _model_dtype("checkpoint", torch.float32) == "auto"  # vLLM's name for the checkpoint's
    assert _model_dtype("float16", torch.float32) == torch.float16
