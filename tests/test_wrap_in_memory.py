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


def test_wrap_warns_of_a_tokenizer_that_may_not_be_the_models(tmp_path, capsys):
    """docs/padding.md wrapped ``AutoTokenizer.from_pretrained(path)``: transformers 5 gives a directory
    whose tokenizer_config.json names the generic class the family's own (Qwen2Tokenizer), other tokens
    than ``--model path``'s, silently. ``headprobe.load_tokenizer(path)`` gives load_model's tokens; a
    tokenizer with more tokens than the embedding has rows gets one WARNING line, the model's own none."""
    from conftest import make_tiny_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel
    from zoo import save_dir

    path = save_dir("qwen2", make_tiny_tokenizer(tmp_path / "tok"), tmp_path / "qwen2")
    hf = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(headprobe.HeadprobeError, match=r"load_tokenizer\(.*\) gives the one --model uses"):
        headprobe.wrap(hf, AutoTokenizer.from_pretrained(path))  # encodes every text to nothing here
    capsys.readouterr()
    wrapped = headprobe.wrap(hf, headprobe.load_tokenizer(str(path)))
    assert "WARNING" not in capsys.readouterr().err
    assert (
        wrapped.to_tokens("t1 t2 t3").tolist()
        == headprobe.load_model(str(path), quiet=True).to_tokens("t1 t2 t3").tolist()
    )
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=1)
    small = GPT2LMHeadModel(cfg).eval()
    headprobe.wrap(small, in_memory_tokenizer())  # 256 tokens for 128 rows
    err = capsys.readouterr().err.splitlines()
    assert [x for x in err if x.startswith("WARNING")] == [
        "WARNING: headprobe.wrap: the tokenizer has 256 tokens, more than the model's embedding of 128 rows: it may "
        "not be the model's (ids >= 128 are refused); pass the model's own tokenizer"
    ], err


def test_wrap_says_when_a_tokenizer_has_far_fewer_tokens_or_no_bos(capsys):
    """walk-api wrapped a 256-row GPT-2 with a tokenizer of far fewer tokens and no BOS: it ran with
    no word, BOS silently off (first-token scores then read a real word). Now a tokenizer under 90% of
    the embedding's rows gets the WARNING, and BOS asked for but absent a NOTE; prepend_bos=False, or
    a tokenizer with BOS and every row, gets neither."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>"] + [f"w{i}" for i in range(99)]  # 100 tokens, no BOS
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    no_bos = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    model = tiny("gpt2")  # 256 rows
    wrapped = headprobe.wrap(model, no_bos)
    err = capsys.readouterr().err.splitlines()
    assert not wrapped.prepend_bos and wrapped.to_tokens("w1 w2").tolist() == [[2, 3]]
    assert [x for x in err if x.startswith(("WARNING", "NOTE"))] == [
        "WARNING: headprobe.wrap: the tokenizer has 100 tokens for the model's embedding of 256 rows (39%; a model's "
        "own leaves at most a few rows of padding unused): it may not be the model's; pass the model's own tokenizer",
        f"NOTE: headprobe.wrap: {wrapped.spec.name}'s tokenizer has no BOS token: sequences start with the text's "
        "first token, not BOS (first-token and attention-sink scores read that token); pass prepend_bos=False "
        "(--no-bos) to say so",
    ], err
    headprobe.wrap(model, no_bos, prepend_bos=False)
    assert "NOTE" not in capsys.readouterr().err
    headprobe.wrap(model, in_memory_tokenizer())  # 256 tokens with BOS for 256 rows
    assert not [x for x in capsys.readouterr().err.splitlines() if x.startswith(("WARNING", "NOTE"))]
