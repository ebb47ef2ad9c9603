"""A tiny Llama with random weights and an offline word-level tokenizer.

Built on the fly so the tests need no model hub. ``head_dim`` is 32 because
vLLM's CPU attention refuses smaller heads; two KV heads for four query heads
exercise grouped-query attention in the tree path.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_WORDS = 100


def build_tiny_model(path: Path, seed: int = 0, mixing: float = 0.004, word_prefix: str = "w", **shape: int) -> Path:
    """Write a loadable model directory to ``path`` and return it.

    Random weights, but shaped so greedy decoding behaves like a real model on
    code: the residual stream is dominated by the current token's embedding
    (attention and MLP outputs are scaled by ``mixing``), so the output falls
    into repeating cycles a lookup drafter can predict, while attention still
    changes the argmax often enough that the same token is followed by
    different tokens in different contexts (trees branch, and a wrong tree
    attention mask or position changes the output). Another ``seed`` gives a
    draft model for the same tokenizer; another ``word_prefix`` a model whose
    vocabulary does not match; ``shape`` overrides sizes of the config (a
    draft whose K/V differ from the target's).
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"{word_prefix}{i}": i + 3 for i in range(VOCAB_WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    # chat requests to the test servers: the messages' contents, space-separated
    fast.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
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
        initializer_range=0.5,
        torch_dtype="float32",
    )
    for name, value in shape.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(mixing)
            layer.mlp.down_proj.weight.mul_(mixing)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompt_text(words: list[int]) -> str:
    return " ".join(f"w{w}" for w in words)
