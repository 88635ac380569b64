"""``headprobe.wrap`` of a transformers model and tokenizer built in memory (from a config, never
saved): the TransformerLens bridge must wrap it without reaching for the Hugging Face Hub."""

import socket

import pytest
import torch

import headprobe


@pytest.fixture
def no_network(monkeypatch):
    """Every name lookup and connection is refused and recorded (a Hub request starts with one)."""
    tried: list[str] = []

    def refuse(*args, **kwargs):
        tried.append(repr(args[:2]))
        raise OSError("network access in a test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tried


def in_memory_tokenizer():
    """A word-level tokenizer over ``w0 .. w251`` built in memory (no ``name_or_path``), as in a notebook."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<bos>", "<eos>", "<unk>", "<pad>"] + [f"w{i}" for i in range(252)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )


def tiny(family: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=4, n_positions=64)).eval()
    # attention_bias: the native Llama refuses it, so auto takes the bridge
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        attention_bias=True,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize(("family", "backend"), [("llama-bias", "auto"), ("gpt2", "transformer-lens")])
def test_an_in_memory_model_wraps_on_the_bridge_without_the_hub(family, backend, no_network):
    """The bridge re-read the tokenizer from ``name_or_path``, which for a tokenizer built in memory
    headprobe set to the model's class name: ``HEAD https://huggingface.co/LlamaForCausalLM/...``, five
    retries (~30 s) and a transformers OSError. Now it wraps offline, and its logits are the HF model's."""
    hf = tiny(family)
    tok = in_memory_tokenizer()
    before = dict(tok.init_kwargs)
    model = headprobe.wrap(hf, tok, backend=backend)
    assert model.backend == "transformer-lens"
    assert no_network == [], no_network
    assert tok.init_kwargs == before  # the caller's tokenizer is left as it was
    tokens = model.to_tokens("w1 w2 w3 w1 w2")
    assert tokens[0, 0].item() == tok.bos_token_id and tokens.shape == (1, 6)
    with torch.no_grad():
        torch.testing.assert_close(model.forward(tokens), hf(tokens).logits, atol=1e-5, rtol=0)
