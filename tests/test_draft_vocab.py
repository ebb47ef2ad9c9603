"""The draft vocabulary (draft_runtime/vocab.py): the corpus's most frequent tokens, refused for another tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vllm_specbeam.core.corpus import load_tokenizer
from vllm_specbeam.draft_runtime import vocab


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """w5 said 6 times, w7 4 times, w3 and w9 twice each, w1 once, in a text file and a JSONL file."""
    (tmp_path / "a.txt").write_text("w5 w5 w7 w9\nw5 w3 w7\n")
    records = [{"text": "w5 w7 w3 w5"}, {"text": "w9 w1 w5 w7"}, {"other": "w2 w2 w2 w2"}]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_keeps_the_most_frequent_tokens_and_the_special_ones(tiny_model: str, corpus: Path) -> None:
    tokenizer = load_tokenizer(tiny_model)

    def ids(words: list[str]) -> list[int]:
        return [tokenizer.convert_tokens_to_ids(w) for w in words]

    built = vocab.build([corpus], tokenizer, size=3, progress=False)
    # w5, w7, then the tie w3 / w9 goes to the lower id; <unk>, <s>, </s> always kept
    assert built.ids.tolist() == sorted(ids(["w5", "w7", "w3"]) + tokenizer.all_special_ids)
    assert built.meta["stats"]["tokens"] == 15 and built.meta["stats"]["distinct_tokens"] == 5
    assert built.meta["stats"]["corpus_coverage"] == pytest.approx(12 / 15)
    everything = vocab.build([corpus], tokenizer, size=100, progress=False)  # no token the corpus never used
    assert everything.ids.tolist() == sorted(ids(["w1", "w3", "w5", "w7", "w9"]) + tokenizer.all_special_ids)


def test_saved_vocabulary_loads_and_checks_its_tokenizer(tiny_model: str, corpus: Path, tmp_path: Path) -> None:
    from tiny_model import build_tiny_model

    built = vocab.build([corpus], load_tokenizer(tiny_model), size=3, progress=False)
    loaded = vocab.load(built.save(tmp_path / "v"))
    assert np.array_equal(loaded.ids, built.ids) and loaded.meta["tokenizer"] == built.meta["tokenizer"]
    loaded.check_tokenizer(load_tokenizer(tiny_model), tmp_path / "v")
    other = load_tokenizer(str(build_tiny_model(tmp_path / "other", word_prefix="v")))
    with pytest.raises(vocab.DraftVocabularyError, match=r"was built with tokenizer .* rebuild it"):
        loaded.check_tokenizer(other, tmp_path / "v")
    with pytest.raises(vocab.DraftVocabularyError, match=r"not a draft vocabulary directory .* draft-vocab build"):
        vocab.load(tmp_path / "missing")
    np.save(tmp_path / "v" / vocab.IDS_FILE, np.array([4, 2, 9]))
    with pytest.raises(vocab.DraftVocabularyError, match="sorted distinct token ids"):
        vocab.load(tmp_path / "v")


def test_command_line_builds_and_reports(tiny_model: str, corpus: Path, tmp_path: Path, capsys) -> None:
    from vllm_specbeam.adapter.cli import main

    out = tmp_path / "cli"
    assert main(["draft-vocab", "build", "--tokenizer", tiny_model, "--size", "2", "--out", str(out), str(corpus)]) == 0
    assert "5 of 103 tokens" in capsys.readouterr().out  # 2 kept and the 3 special tokens
    assert vocab.load(out).meta["requested_size"] == 2
    assert main(["draft-vocab", "build", "--tokenizer", tiny_model, "--out", str(out), "/nonexistent"]) == 1
    assert "corpus path /nonexistent does not exist" in capsys.readouterr().err
