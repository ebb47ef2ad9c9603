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


def test_mcsd_train_sizes_the_kv_cache_unless_the_engine_args_do():
    from vllm_specbeam.adapter.mcsd_train import COLLECT_KV_CACHE_BYTES, engine_kwargs

    assert engine_kwargs('{"max_model_len": 2048}') == {
        "max_model_len": 2048,
        "kv_cache_memory_bytes": COLLECT_KV_CACHE_BYTES,
    }
    assert engine_kwargs('{"kv_cache_memory_bytes": 1024}') == {"kv_cache_memory_bytes": 1024}
    assert engine_kwargs('{"gpu_memory_utilization": 0.5}') == {"gpu_memory_utilization": 0.5}


@pytest.mark.parametrize("engine_args", ["{max_model_len: 2048}", "[2048]"])
def test_mcsd_train_refuses_engine_args_that_are_not_a_json_object(tmp_path, engine_args):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n")
    argv = ["mcsd", "train", "--target", "t", "--draft", "d", "--prompts", str(prompts), "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="--engine-args"):
        main([*argv, "--engine-args", engine_args])
