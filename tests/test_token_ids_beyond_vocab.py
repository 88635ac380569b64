"""A tokenizer with more tokens than the model's embedding has rows (a special token added after
the model was made: id 101 on the tiny 101-row Llama) is refused in one line naming the id and the
model's vocabulary, before the user's tokens are run (the forward ended in ``IndexError: index out
of range in self``)."""

from __future__ import annotations

import json
import shutil

import pytest

from headprobe.cli import main

EXTRA = "<extra>"


@pytest.fixture(scope="module")
def added_token_dir(tiny_dir, tmp_path_factory):
    """The tiny model directory with ``<extra>`` added to its tokenizer as a special token (id 101,
    one past the 101 rows of the embedding)."""
    from transformers import AutoConfig, AutoTokenizer

    d = tmp_path_factory.mktemp("added-token") / "model"
    shutil.copytree(tiny_dir, d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.add_special_tokens({"additional_special_tokens": [EXTRA]})
    tok.save_pretrained(d)
    rows = AutoConfig.from_pretrained(d).vocab_size
    assert tok.convert_tokens_to_ids(EXTRA) == rows == len(tok) - 1  # one id beyond the embedding's rows
    return d


def _refused(argv, capsys, out):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert e.value.code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert "token id 101" in lines[0] and EXTRA in lines[0], err
    assert "vocabulary of 101 tokens" in lines[0], err
    assert not out.exists()
    return lines[0]


def test_show_refuses_a_prompt_token_beyond_the_embedding(added_token_dir, tmp_path, capsys):
    out = tmp_path / "o"
    _refused(
        [
            "show",
            "--model",
            str(added_token_dir),
            "--head",
            "1.1",
            "--prompt",
            f"t1 t2 {EXTRA} t3",
            "--out",
            str(out),
            "--device",
            "cpu",
        ],
        capsys,
        out,
    )


@pytest.mark.parametrize("where", ["clean", "correct"])
def test_patch_refuses_a_prompt_or_answer_token_beyond_the_embedding(added_token_dir, tmp_path, capsys, where):
    pair = {"clean": "t1 t2 t3", "corrupted": "t4 t2 t3", "correct": " t5", "wrong": " t6"}
    pair[where] = f"t1 {EXTRA} t3" if where == "clean" else f" {EXTRA}"
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in (pair, pair)), encoding="utf-8")
    out = tmp_path / "o"
    line = _refused(
        ["patch", "--model", str(added_token_dir), "--prompts", str(f), "--out", str(out), "--device", "cpu"],
        capsys,
        out,
    )
    assert "prompt pair 1" in line


def test_the_token_sets_refuse_a_text_token_beyond_the_embedding(added_token_dir):
    """Scan, ablate and prune draw windows of the text: an added token there is refused alike, and
    the same text without it gives the windows."""
    from headprobe.analyses.data import natural_text_tokens
    from headprobe.probe.backends.loading import load_model
    from headprobe.probe.core.errors import HeadprobeError

    model = load_model(str(added_token_dir), device="cpu")
    words = " ".join(f"t{i % 100}" for i in range(64))
    assert natural_text_tokens(model, 2, 8, 0, text=words).tokens.max() < 101
    with pytest.raises(HeadprobeError, match=r"token id 101 \('<extra>'\), outside the model's vocabulary of 101"):
        natural_text_tokens(model, 2, 8, 0, text=" ".join([f"{EXTRA} {w}" for w in words.split()]))
