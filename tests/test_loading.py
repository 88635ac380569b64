"""Model loading: the offline failure path is one clear line, and bad model paths are refused."""

import os
import subprocess
import sys

import pytest

from headprobe.probe.backends.loading import load_model
from headprobe.probe.core.errors import HeadprobeError


def run_cli(*args, env=None, cwd=None, python=()):
    """Run ``headprobe`` as a user would, ``python`` the interpreter's own flags (``("-X",
    "importtime")``: :func:`imported_modules`); returns (exit code, stdout, stderr)."""
    full_env = {**os.environ, **(env or {})}
    p = subprocess.run(
        [sys.executable, *python, "-m", "headprobe.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=300,
    )
    return p.returncode, p.stdout, p.stderr


def imported_modules(stderr: str) -> tuple[set[str], str]:
    """The modules a ``python -X importtime`` process imported (its stderr lists each on a line of
    its own) and the rest of its stderr."""
    lines = stderr.splitlines(keepends=True)
    imported = {x.rsplit("|", 1)[-1].strip() for x in lines if x.startswith("import time:")}
    return imported, "".join(x for x in lines if not x.startswith("import time:"))


def assert_one_line_error(rc, stderr, *fragments):
    assert rc == 2, stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("headprobe: error:")]
    assert len(lines) == 1, stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_gpt2_offline_and_uncached_is_one_clear_line(tmp_path):
    rc, _, err = run_cli(
        "scan",
        "--model",
        "gpt2",
        "--out",
        str(tmp_path / "out"),
        env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"},
    )
    assert_one_line_error(rc, err, "gpt2", "not in the local Hugging Face cache", "HF_HOME", "--model PATH")
    assert not (tmp_path / "out").exists(), "nothing may be written when the model cannot load"


def test_missing_path_and_directory_without_weights(tmp_path):
    with pytest.raises(HeadprobeError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(HeadprobeError, match="has no weights"):
        load_model(str(tmp_path))
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0" * 10)
    with pytest.raises(HeadprobeError, match="not a .gguf"):
        load_model(str(bad))


def test_corrupt_gguf_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    rc, _, err = run_cli("scan", "--model", str(bad), "--out", str(tmp_path / "out"))
    assert_one_line_error(rc, err, "cannot load model")


def test_local_directory_loads_through_the_bridge(tmp_path, tiny_tokenizer):
    """A Hugging Face model directory (here a random GPT-2 saved to disk) is accepted as a path."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=101, n_positions=32)).eval()
    hf.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), backend="transformer-lens")
    assert (model.spec.n_layers, model.spec.n_heads, model.spec.kind) == (1, 2, "MHA")
    tokens = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(model.forward(tokens), hf(tokens).logits, atol=1e-5, rtol=0)


def test_auto_says_why_it_leaves_the_native_model(tmp_path, tiny_tokenizer, capsys):
    """A Llama with dynamic rotary scaling, which the native model does not implement: ``auto``
    takes the bridge and says why in one NOTE line (it took it silently: the header said only
    ``TransformerLens backend``); a plain Llama loads natively with no such line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    small = dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=101)
    for name, rope in [("scaled", {"rope_type": "dynamic", "factor": 2.0}), ("plain", None)]:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**small, rope_scaling=rope)).save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
    capsys.readouterr()
    assert load_model(str(tmp_path / "scaled")).backend == "transformer-lens"
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("NOTE:")]
    assert len(notes) == 1 and "bridge" in notes[0] and "rope_type=dynamic" in notes[0], notes
    assert load_model(str(tmp_path / "plain")).backend == "native"
    assert "NOTE:" not in capsys.readouterr().err
    load_model(str(tmp_path / "scaled"), quiet=True)
    assert "NOTE:" not in capsys.readouterr().err


def test_exactly_one_bos(tiny_gpt2):
    toks = tiny_gpt2.to_tokens("t1 t2")
    assert toks.tolist() == [[100, 1, 2]]  # [batch, pos], as TransformerLens
    assert tiny_gpt2.to_tokens("<|endoftext|> t1").tolist() == [[100, 1]]  # already there: not doubled


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "required: COMMAND"),
        (["scna"], "invalid choice: 'scna'"),
        (["scan", "--modle", "x", "--out", "o"], "unrecognized arguments: --modle"),
        (["budget", "--preset", "gpt2-small", "--seq-len", "abc"], "must be a positive integer, got 'abc'"),
    ],
)
def test_usage_errors_are_one_line(argv, fragment, capsys):
    """argparse's own errors follow the one-line rule too (no usage block), in process."""
    from headprobe.cli import main

    code = main(argv)  # argparse's SystemExit becomes main's return value
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("headprobe") and ": error: " in err and fragment in err and "--help" in err


def test_wrapping_prints_nothing_on_stdout(tiny_tokenizer, capfd):
    """A command's stdout is its report: the bridge's own "Moving model to device" must not reach it."""
    from zoo import make_checkpoint

    from headprobe.probe.backends.wrapping import wrap

    for backend in ("transformer-lens", "native"):
        wrap(make_checkpoint("llama", tiny_tokenizer), backend=backend)
        assert capfd.readouterr().out == "", backend


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_directory_loads_with_the_tokenizer_it_saved(family, tiny_tokenizer, tmp_path):
    """transformers maps a qwen2 directory to Qwen2Tokenizer even when the directory saved a plain
    tokenizer.json tokenizer, and that class encodes "t1 t2 t3" to nothing: the directory's own
    tokenizer must come back, token for token."""
    from zoo import save_dir

    model = load_model(str(save_dir(family, tiny_tokenizer, tmp_path / family)), quiet=True)
    want = [tiny_tokenizer.bos_token_id, *tiny_tokenizer("t1 t2 t3", add_special_tokens=False)["input_ids"]]
    assert model.to_tokens("t1 t2 t3").tolist() == [want] and len(want) == 4


def test_a_registered_name_that_is_also_a_folder_here_says_which_loads(tmp_path, tiny_tokenizer, capsys, monkeypatch):
    """``--model gpt2`` where ./gpt2 exists loaded the folder without a word (the hub's GPT-2 is meant as
    often); ``smollm2-135m`` beside a folder of that name loaded the embedded model while the checks before
    the load read the folder's config.json. Now one NOTE line says which loads and how to name the other,
    and the checks before the load read what loads. No NOTE for ./gpt2 or for a name without such a folder."""
    import json

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from headprobe import options

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=101, n_positions=32)).save_pretrained("gpt2")
    tiny_tokenizer.save_pretrained("gpt2")
    capsys.readouterr()
    model = load_model("gpt2")
    assert (model.spec.n_layers, model.spec.n_heads) == (1, 2)  # the folder's random GPT-2, not the hub's 12 x 12
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("NOTE:")]
    assert notes == [
        "NOTE: --model gpt2 is the folder ./gpt2 here, not headprobe's openai-community/gpt2; "
        "for that model give openai-community/gpt2"
    ], notes
    load_model("./gpt2")
    assert "NOTE:" not in capsys.readouterr().err
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4})
    )
    from headprobe.probe.backends.sources import folder_or_name_note

    assert folder_or_name_note("smollm2-135m") == (
        "--model smollm2-135m is the embedded smollm2-135m, not the folder ./smollm2-135m here; "
        "give ./smollm2-135m for the folder"
    )
    assert options.peek_layout("smollm2-135m") == options.SMOLLM2_LAYOUT  # what loads: the embedded model
    assert options.peek_layout("./smollm2-135m") == (2, 4)
    assert folder_or_name_note("distilgpt2") is None  # no such folder here


def test_a_folder_without_tokenizer_files_is_refused_at_load(tmp_path, tiny_tokenizer, capsys):
    """config.json and weights only: transformers built a Qwen2Tokenizer of one token that encodes any
    text to nothing, so the load succeeded and scan blamed the text ("the text has 0 tokens"). Now the
    load refuses in one line (exit 2, no output folder) and says how to supply a tokenizer; a
    tokenizer of one token handed to headprobe.wrap is refused too."""
    from transformers import AutoTokenizer
    from zoo import make_checkpoint

    import headprobe
    from headprobe.cli import main

    hf = make_checkpoint("qwen2", tiny_tokenizer).hf_model
    hf.save_pretrained(tmp_path / "notok")
    with pytest.raises(HeadprobeError, match=r"notok has no tokenizer \(no tokenizer.json, .*save_pretrained"):
        load_model(str(tmp_path / "notok"), quiet=True)
    code = main(["scan", "--model", str(tmp_path / "notok"), "--no-verify", "--out", str(tmp_path / "o")])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("headprobe: error:")]
    assert code == 2 and len(err) == 1 and "has no tokenizer" in err[0] and not (tmp_path / "o").exists(), err
    one = AutoTokenizer.from_pretrained(tmp_path / "notok")  # what transformers gives such a folder
    assert len(one) < 2
    with pytest.raises(HeadprobeError, match=r"tokenizer \(Qwen2Tokenizer, 1 tokens for an embedding of 101 rows\)"):
        headprobe.wrap(hf, one)


@pytest.mark.parametrize("family", ["mamba", "rwkv"])
def test_a_model_without_attention_is_refused_at_load(family, tmp_path, tiny_tokenizer, capsys):
    """A Mamba checkpoint got the header "2 layers x 1 heads (MHA, 1 KV head)" and then a
    TransformerLens KeyError about hook names; now one line at load says it has no attention layers.
    RWKV (whose time mixing is named ``RwkvSelfAttention``) passed the module-name check the same way."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM, RwkvConfig, RwkvForCausalLM

    from headprobe.cli import main

    torch.manual_seed(0)
    if family == "mamba":
        hf = MambaForCausalLM(MambaConfig(vocab_size=101, hidden_size=16, num_hidden_layers=2, state_size=4))
        why = ""
    else:
        cfg = RwkvConfig(
            vocab_size=101, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16, intermediate_size=32
        )
        hf = RwkvForCausalLM(cfg)
        assert any(type(m).__name__ == "RwkvSelfAttention" for m in hf.modules())
        why = " (its *SelfAttention modules are RWKV's time mixing, a recurrence with no attention pattern)"
    hf.save_pretrained(tmp_path / family)
    tiny_tokenizer.save_pretrained(tmp_path / family)
    want = f"{tmp_path / family} ({type(hf).__name__}) has no attention layers: headprobe studies attention heads{why}"
    with pytest.raises(HeadprobeError) as e:
        load_model(str(tmp_path / family), quiet=True)
    assert str(e.value) == want
    code = main(["scan", "--model", str(tmp_path / family), "--no-verify", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and f"headprobe: error: {want}" in err.splitlines() and "NOTE" not in err, err


def test_auto_says_it_took_the_bridge_for_an_architecture_the_native_model_lacks(capsys):
    """Bloom is no registered family: the NOTE said "use --backend transformer-lens", advice to do what
    auto had just done; it says that auto took the bridge, and why."""
    from transformers import BloomConfig

    from headprobe.probe.backends.loading import _say_why_not_native

    _say_why_not_native(BloomConfig(vocab_size=101, hidden_size=16, n_layer=1, n_head=2))
    err = capsys.readouterr().err.strip()
    assert err.startswith("NOTE: --backend auto took TransformerLens' bridge") and "'bloom'" in err, err
    assert "use --backend transformer-lens" not in err and "did you mean" not in err and "\n" not in err


def test_a_gated_model_without_access_says_how_to_get_it(monkeypatch):
    """transformers' refusal of a gated repository (Llama 3, Gemma) without access, an OSError raised
    from huggingface_hub's GatedRepoError, is one line that says where to ask for access and how
    to log in, not the hub's HTTP error cut at 300 characters."""
    import httpx
    from huggingface_hub.errors import GatedRepoError

    from headprobe.probe.backends import hf_checkpoint

    name = "meta-llama/Meta-Llama-3-8B"
    response = httpx.Response(
        401, request=httpx.Request("GET", f"https://huggingface.co/{name}/resolve/main/config.json")
    )

    def refused(*args, **kwargs):
        try:
            raise GatedRepoError("401 Client Error. Cannot access gated repo for url ...", response=response)
        except GatedRepoError as e:  # what transformers.utils.hub raises from it
            raise OSError(f"You are trying to access a gated repo.\nMake sure to have access to it at {name}.") from e

    monkeypatch.setattr(hf_checkpoint, "_resolve", lambda n: (n, "float32", {"source": n, "local_only": False}))
    monkeypatch.setattr(hf_checkpoint, "_load_source", refused)  # as if the hub answered (it cannot here)
    with pytest.raises(HeadprobeError) as e:
        hf_checkpoint.load_checkpoint(name)
    said = str(e.value)
    assert "\n" not in said and f"{name} is gated" in said and f"https://huggingface.co/{name}" in said, said
    assert "hf auth login" in said and "HF_TOKEN" in said and "--model PATH" in said, said

    def other(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(hf_checkpoint, "_load_source", other)  # any other failure keeps the general line
    with pytest.raises(HeadprobeError, match="cannot load model .*: OSError: disk on fire$"):
        hf_checkpoint.load_checkpoint(name)
