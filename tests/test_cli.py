"""The ``vllm-specbeam`` command dispatches to its subcommands."""

from __future__ import annotations

import pytest

from vllm_specbeam.adapter.cli import main


def test_trigram_subcommand_builds_and_describes_a_matrix(tiny_model, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w1 w2 w3 w1 w2 w4 w1 w2 w3\n")
    out = tmp_path / "matrix"
    assert main(["trigram", "build", "--tokenizer", tiny_model, "--out", str(out), "--no-progress", str(corpus)]) == 0
    assert main(["trigram", "info", str(out)]) == 0
    assert "keys" in capsys.readouterr().out


def test_unknown_command_is_an_error(capsys):
    assert main(["serv"]) == 2
    assert "unknown command 'serv'" in capsys.readouterr().err


def test_serve_help_reaches_vllm(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    assert "usage: vllm serve" in capsys.readouterr().out
