"""A tiny Llama with random weights and an offline word-level tokenizer.

Built on the fly so the tests need no model hub. ``head_dim`` is 32 because
vLLM's CPU attention refuses smaller heads; two KV heads for four query heads
exercise grouped-query attention in the tree path.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_WORDS = 500


def build_tiny_model(path: Path, seed: int = 0, init_std: float = 0.5) -> Path:
    """Write a loadable model directory to ``path`` and return it.

    A large ``init_std`` makes the random model confident and repetitive, like
    a real model on code: greedy continuations repeat n-grams with varying
    continuations, which is what the lookup drafters feed on.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(VOCAB_WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=init_std,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompt_text(words: list[int]) -> str:
    return " ".join(f"w{w}" for w in words)
