"""A checkpoint records what its run was computed from (fingerprints of the weights, the tokenizer
and the text, beside the settings): a run interrupted, the model at the same ``--model`` path
replaced by other weights, then rerun with the same flags is refused in one line naming what
differs, and with ``--overwrite`` starts over to the results of a fresh run on the new model (it
resumed and mixed the two models' ablations). Scan, ablate and prune alike."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from headprobe.cli import main
from headprobe.probe.core.io import CHECKPOINT_NAME, RunCheckpoint

SMALL = [
    "--n-natural",
    "3",
    "--seq-len",
    "16",
    "--n-repeated",
    "2",
    "--period",
    "6",
    "--device",
    "cpu",
    "--threads",
    "1",
]
COMMANDS = {  # the flags, the saves after which the run is interrupted (in the middle of its work), the table compared
    "scan": (
        ["-k", "2", "--n-random", "9", "--no-metrics", "--types", "induction,previous_token,first_token"],
        8,
        "head_scores.csv",
    ),
    "ablate": ([], 1, "head_ablation.csv"),
    "prune": (["--method", "michel"], 3, "pruning_curve.csv"),
}


@pytest.fixture(scope="module")
def other_weights_dir(tiny_dir, tmp_path_factory):
    """The tiny Llama's config and tokenizer with other (seed 1) random weights."""
    from transformers import AutoConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("other-weights")
    shutil.copytree(tiny_dir, d, dirs_exist_ok=True)
    torch.manual_seed(1)
    LlamaForCausalLM(AutoConfig.from_pretrained(tiny_dir)).save_pretrained(d)
    return d


def _interrupted(monkeypatch, argv: list[str], after: int) -> None:
    """Run ``argv`` and interrupt it (Ctrl-C) right after its ``after``-th checkpoint save."""
    save, saves = RunCheckpoint.save, []

    def interrupting(self, state):
        save(self, state)
        saves.append(1)
        if len(saves) >= after:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(RunCheckpoint, "save", interrupting)
        assert main(argv) == 130


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_checkpoint_of_other_weights_is_refused_or_started_over(
    command, tiny_dir, other_weights_dir, text_file, tmp_path, monkeypatch, capsys
):
    flags, after, table = COMMANDS[command]
    model = tmp_path / "model"  # the path the user passes, whose weights are replaced
    shutil.copytree(tiny_dir, model)
    args = ["--model", str(model), "--text", str(text_file), *SMALL, *flags]
    cut = tmp_path / "cut"
    _interrupted(monkeypatch, [command, "--out", str(cut), *args], after)
    checkpoint = (cut / CHECKPOINT_NAME).read_text()

    shutil.rmtree(model)
    shutil.copytree(other_weights_dir, model)
    capsys.readouterr()
    assert main([command, "--out", str(cut), *args]) == 2
    line = _error_line(capsys)
    assert "computed from other model weights" in line and "--overwrite" in line and "tokenizer" not in line, line
    assert (cut / CHECKPOINT_NAME).read_text() == checkpoint and not (cut / table).exists()  # left as it was
    assert set(json.loads(checkpoint)["inputs"]) == {"text", "weights", "tokenizer"}

    assert main([command, "--out", str(cut), "--overwrite", *args]) == 0
    out = capsys.readouterr().out
    assert "starting over" in out and "resuming" not in out, out
    assert main([command, "--out", str(tmp_path / "fresh"), *args]) == 0
    assert (cut / table).read_text() == (tmp_path / "fresh" / table).read_text()
    assert not (cut / CHECKPOINT_NAME).exists()


def test_a_checkpoint_of_another_text_or_tokenizer_is_refused(tiny_dir, text_file, tmp_path, monkeypatch, capsys):
    """The text is checked before the model loads; a tokenizer with the same size and other ids
    (a permuted vocabulary) after it; the same inputs still resume."""
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from headprobe.probe.model.tokenizers import _word_level_tokenizer

    model, text = tmp_path / "model", tmp_path / "words.txt"
    shutil.copytree(tiny_dir, model)
    shutil.copy(text_file, text)
    args = ["--model", str(model), "--text", str(text), *SMALL]
    cut = tmp_path / "cut"
    _interrupted(monkeypatch, ["ablate", "--out", str(cut), *args], 1)
    checkpoint = (cut / CHECKPOINT_NAME).read_text()

    text.write_text(" ".join(reversed(text_file.read_text().split())), encoding="utf-8")
    capsys.readouterr()
    assert main(["ablate", "--out", str(cut), *args]) == 2
    assert "computed from another text" in _error_line(capsys)

    shutil.copy(text_file, text)
    permuted = _word_level_tokenizer({f"t{i}": 99 - i for i in range(100)}, tmp_path / "tok", WhitespaceSplit())
    permuted.save_pretrained(model)
    assert main(["ablate", "--out", str(cut), *args]) == 2
    assert "computed from another tokenizer" in _error_line(capsys)
    assert (cut / CHECKPOINT_NAME).read_text() == checkpoint

    shutil.rmtree(model)
    shutil.copytree(tiny_dir, model)
    assert main(["ablate", "--out", str(cut), *args]) == 0
    assert "resuming from" in capsys.readouterr().out


def test_a_checkpoint_of_other_settings_is_refused_naming_the_flags(tmp_path):
    """The refusal names each differing setting as the flag a user typed (``--fixed-draws``, given
    or not; ``--no-verify``), not the config's field (``sequential: True there, False now``)."""
    from types import SimpleNamespace

    from headprobe.commands.scan import ScanConfig
    from headprobe.options import _resume, checkpoint_key
    from headprobe.probe.core.errors import HeadprobeError

    RunCheckpoint(tmp_path, checkpoint_key(ScanConfig())).save({"verification": {}})
    now = ScanConfig(sequential=False, verify=False, types=("induction",))
    with pytest.raises(HeadprobeError) as refused:
        _resume(str(tmp_path), False, now, SimpleNamespace(), sharded=False, main_rank=True)
    said = str(refused.value)
    assert "--fixed-draws: not given there, given now" in said, said
    assert "--no-verify: not given there, given now" in said, said
    assert "--types: default there, induction now" in said, said  # not the default's every type, encoders' too
    assert "sequential:" not in said and " verify:" not in said and "--overwrite" in said


def test_a_built_in_model_name_in_another_case_resumes_the_run(tmp_path):
    """Model names are case-insensitive (``--model smollm2-135M`` loads smollm2-135m): a checkpoint
    saved under one spelling resumes under another, and records the canonical name. Old code: the key
    held the raw text, refused with "--model: SmolLM2-135M there, smollm2-135m now". A path stays as
    written (another case is another folder on most file systems)."""
    from types import SimpleNamespace

    from headprobe.commands.scan import ScanConfig
    from headprobe.options import _resume, checkpoint_key

    RunCheckpoint(tmp_path, checkpoint_key(ScanConfig(model="SmolLM2-135M"))).save({"verification": {"x": 1}})
    for spelling in ("smollm2-135m", "smollm2-135M"):
        saved, *_ = _resume(str(tmp_path), False, ScanConfig(model=spelling), SimpleNamespace(), False, True)
        assert saved == {"verification": {"x": 1}}
    assert json.loads((tmp_path / CHECKPOINT_NAME).read_text())["key"]["model"] == "smollm2-135m"
    assert checkpoint_key(ScanConfig(model="GPT2"))["model"] == "gpt2"
    path = tmp_path / "Tiny"
    assert checkpoint_key(ScanConfig(model=str(path)))["model"] == str(path)
