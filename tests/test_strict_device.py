"""Every command runs as on a GPU: under tests/strict_device.py's second device on the CPU, where
a move to the model's device copies (an inference tensor when made inside inference_mode) and a
tensor made without the model's device cannot meet the model's tensors. A command registered in
headprobe.commands.COMMANDS without a run here fails test_every_command_runs_under_strict_device."""

from __future__ import annotations

import json
import os
import time
import traceback

import pytest
import torch
from strict_device import DEVICE, DeviceMismatch, StrictDevice, strict_device
from zoo import tiny_train_flags

from headprobe.cli import main
from headprobe.commands import COMMANDS

DATA = ["--n-natural", "3", "--seq-len", "16", "--n-repeated", "2", "--period", "6"]
SCAN = [*DATA, "-k", "2", "--n-random", "2"]


# ---- the mechanism catches both kinds ---------------------------------------------------------


def test_a_host_index_on_device_tensors_fails():
    with StrictDevice():
        x = torch.arange(12.0).reshape(3, 4).to(DEVICE)
        assert x.device == DEVICE
        with pytest.raises(DeviceMismatch, match="gather"):
            x.gather(1, torch.arange(2)[None].expand(3, -1))
        with pytest.raises(DeviceMismatch, match="indexed by a tensor on the host"):
            x[torch.arange(2)]
        with pytest.raises(DeviceMismatch, match="numpy"):
            x.numpy()
        i = torch.arange(2, device=x.device)  # what the code must do
        assert torch.equal(x.gather(1, i[None].expand(3, -1)).cpu(), torch.tensor([[0.0, 1], [4, 5], [8, 9]]))
        assert torch.equal(x[i].cpu(), x.cpu()[:2])
        assert (x * torch.tensor(2.0)).device == DEVICE  # a 0-dim host tensor is a scalar, as on CUDA


def test_a_random_draw_on_the_device_fails():
    """A GPU's generator draws other numbers than the CPU's for the same seed: draws are made on
    the host (a seeded CPU generator) and moved, never drawn on the device."""
    with StrictDevice():
        p = torch.softmax(torch.arange(6.0), dim=0).to(DEVICE)
        with pytest.raises(DeviceMismatch, match="multinomial: random numbers drawn on"):
            torch.multinomial(p, 2, generator=torch.Generator(device=p.device).manual_seed(0))
        with pytest.raises(DeviceMismatch, match="random numbers drawn on"):
            torch.rand(3, device=DEVICE)
        with pytest.raises(DeviceMismatch, match="random numbers drawn on"):
            torch.empty(3).to(DEVICE).uniform_()
        u = torch.rand(3, generator=torch.Generator().manual_seed(0)).to(DEVICE)  # what the code must do
        assert u.device == DEVICE and torch.equal(u.cpu(), torch.rand(3, generator=torch.Generator().manual_seed(0)))
        assert torch.multinomial(p.cpu(), 2, generator=torch.Generator().manual_seed(0)).shape == (2,)


def test_a_move_inside_inference_mode_is_an_inference_copy():
    w = torch.nn.Parameter(torch.randn(10, 4))
    tokens = torch.tensor([[1], [2]])
    with StrictDevice() as mode:
        mode.put(w)
        with torch.inference_mode():
            on_device = tokens.to(DEVICE)
            assert on_device is not tokens and on_device.is_inference() and on_device.to(DEVICE) is on_device
        y = torch.randn(2, 4).to(DEVICE).requires_grad_()
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            torch.einsum("bd,bkd->bk", y, w[on_device])
        (g,) = torch.autograd.grad(torch.einsum("bd,bkd->bk", y, w[on_device.clone()]).sum(), y)
        assert g.device == DEVICE and torch.equal(g.cpu(), w.detach().cpu()[tokens[:, 0]])


# ---- every command ----------------------------------------------------------------------------


def _runs(tiny_dir, text_file, prompts, out):
    """``{command: [argv, ...]}``: each command at tiny settings, in an order where later runs read
    earlier outputs (view and export read the scan, import the export)."""
    model = ["--model", str(tiny_dir), "--device", "cpu"]
    text = ["--text", str(text_file)]
    return {
        "scan": [
            ["scan", *model, *text, "--out", str(out / "scan"), *SCAN],
            [
                "scan",
                *model,
                *text,
                "--out",
                str(out / "scan_stream"),
                *SCAN,
                "--streaming",
                "on",
                "--correction",
                "holm",
                "--types",
                "induction",
            ],
            [
                "scan",
                *model,
                "--backend",
                "transformer-lens",
                *text,
                "--out",
                str(out / "scan_tl"),
                *SCAN,
                "--types",
                "induction,previous_token",
            ],
        ],
        "ablate": [
            ["ablate", *model, *text, "--out", str(out / "ablate"), *DATA],
            ["ablate", *model, *text, "--out", str(out / "ablate_atp"), *DATA, "--estimate", "atp"],
            ["ablate", *model, *text, "--out", str(out / "ablate_2nd"), *DATA, "--estimate", "second-order"],
        ],
        "prune": [
            [
                "prune",
                *model,
                *text,
                "--out",
                str(out / "prune"),
                *DATA,
                "--n-seeds",
                "1",
                "--l0-lambdas",
                "1",
                "--l0-steps",
                "2",
                "--step-fraction",
                "0.5",
                "--save-pruned",
                "--per-layer",
            ]
        ],
        "patch": [
            ["patch", *model, "--prompts", str(prompts), "--out", str(out / f"patch_{site}"), "--site", site]
            for site in ("z", "q", "resid")
        ],
        "circuit": [
            [
                "circuit",
                *model,
                "--out",
                str(out / "circuit"),
                "--n-seqs",
                "2",
                "--period",
                "6",
                "--steps",
                "2",
                "--verify",
                "4",
                "--top",
                "5",
                "--qk-head",
                "1.3",
            ]
        ],
        "kv": [
            ["kv", *model, *text, "--out", str(out / "kv"), "--seq-len", "64", "--n-random", "1", "--budgets", "0.5"]
        ],
        "robustness": [
            [
                "robustness",
                *model,
                *text,
                "--out",
                str(out / "robustness"),
                *SCAN,
                "--kinds",
                "zero",
                "--control-seeds",
                "1",
                "--n-boot",
                "10",
            ]
        ],
        "diff": [
            [
                "diff",
                str(tiny_dir),
                str(tiny_dir),
                "--requantize-b",
                "int8",
                "--device",
                "cpu",
                *text,
                "--out",
                str(out / "diff"),
                *DATA,
                "-k",
                "2",
            ]
        ],
        "atlas": [
            [
                "atlas",
                "--models",
                str(tiny_dir),
                "--device",
                "cpu",
                *text,
                "--out",
                str(out / "atlas"),
                *SCAN,
                "--types",
                "induction",
                "--pattern-len",
                "0",
                "--no-model-figures",
            ]
        ],
        "show": [["show", *model, "--out", str(out / "show"), "--head", "1.2", "--prompt", "t1 t2 t3 t4 t1 t2 t3"]],
        "view": [["view", str(out / "scan")]],
        "export": [["export", "--from", str(out / "kv"), "--out", str(out / "export")]],
        "import": [
            ["import", *model, *text, "--heads-file", str(out / "export"), "--seq-len", "64", "--n-random", "2", "--kv"]
        ],
        "train": [
            [
                "train",
                "--out",
                str(out / "train"),
                *tiny_train_flags(4, 2),
            ]
        ],
        "study": [
            [
                "study",
                "layouts",
                "--out",
                str(out / "study"),
                "--steps",
                "2",
                "--eval-every",
                "2",
                "--seeds",
                "0",
                "--d-model",
                "16",
                "--n-heads",
                "4",
                "--ranks",
                "2",
                "--rope",
                "2",
                "--device",
                "cpu",
            ]
        ],
        "budget": [["budget", "--model", str(tiny_dir)]],  # its live check loads the model on the host (no --device)
    }


@pytest.fixture(scope="module")
def strict_runs(tiny_dir, text_file, tmp_path_factory):
    """Every run of :func:`_runs` under :func:`strict_device`: ``{command: [(exit status or the
    traceback, tensors moved to the device, seconds), ...]}``."""
    from test_patch import _pairs

    out = tmp_path_factory.mktemp("strict")
    prompts = out / "pairs.jsonl"
    prompts.write_text("\n".join(json.dumps(vars(p)) for p in _pairs(4)) + "\n", encoding="utf-8")
    results: dict[str, list] = {}
    for name, argvs in _runs(tiny_dir, text_file, prompts, out).items():
        for argv in argvs:
            t0 = time.perf_counter()
            with strict_device() as mode:
                try:
                    status: int | str = main(argv)
                except Exception:  # reported by the command's test
                    status = traceback.format_exc(limit=-6)
            results.setdefault(name, []).append((status, mode.moves, time.perf_counter() - t0))
    return results


def test_every_command_runs_under_strict_device(tiny_dir, text_file, tmp_path):
    covered = set(_runs(tiny_dir, text_file, tmp_path / "p", tmp_path))
    missing = sorted(set(COMMANDS.names()) - covered)
    assert not missing, f"commands with no run under strict_device in tests/test_strict_device.py: {', '.join(missing)}"


ON_HOST = {"view", "export", "budget"}  # read files; budget's live check loads on the host


@pytest.mark.parametrize("command", sorted(COMMANDS.names()))
def test_command_runs_as_on_a_gpu(strict_runs, command):
    for status, moves, _ in strict_runs[command]:
        assert status == 0, status
        assert (moves == 0) == (command in ON_HOST)  # the model really was on the second device


def test_no_command_turns_tf32_on(strict_runs):
    """float32 matmuls stay float32 on a GPU (TF32 rounds to 10 mantissa bits): no command sets it."""
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.get_float32_matmul_precision() == "highest"


def test_the_suite_and_its_subprocesses_run_on_the_cpu():
    """tests/conftest.py hides any GPU (its references are CPU computations): in this process and
    in a command a test starts, as on a GPU machine where ``make test`` runs the suite."""
    import subprocess
    import sys

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
    child = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.split() == ["False", "0"]
