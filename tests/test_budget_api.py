"""``headprobe budget`` as a library (BudgetConfig -> run -> BudgetResult, ``headprobe.budget``),
its ``--dtype`` names, its new layout flags, and its import cost (no torch without ``--model``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import headprobe
from headprobe.cli import main
from headprobe.commands import budget
from headprobe.commands.budget import BudgetConfig, BudgetResult
from headprobe.probe.layout import cost
from headprobe.probe.layout.cost import AttentionLayout

ROOT = Path(__file__).resolve().parents[1]


def cli(capsys, *argv):
    code = main(["budget", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------
# Config -> run -> Result
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, argv",
    [
        (dict(preset="llama3-8b", seq_len=32768), ["--preset", "llama3-8b", "--seq-len", "32768"]),
        (dict(preset="llama3-8b", compare=True), ["--preset", "llama3-8b", "--compare"]),
        (
            dict(d_model=4096, n_layers=32, n_heads=32, flops_table=()),
            ["--d-model", "4096", "--n-layers", "32", "--n-heads", "32", "--flops-table"],
        ),
        (
            dict(preset="deepseek-v3", flops_table=(100, 200), as_mha=True),
            ["--preset", "deepseek-v3", "--flops-table", "100", "200", "--as-mha"],
        ),
        (
            dict(recommend=True, d_model=4096, n_layers=32, seq_len=131072, kv_limit="256MiB"),
            ["--recommend", "--d-model", "4096", "--n-layers", "32", "--seq-len", "131072", "--kv-limit", "256MiB"],
        ),
    ],
)
def test_library_result_is_what_the_cli_prints(capsys, fields, argv):
    result = headprobe.budget(**fields)
    assert isinstance(result, BudgetResult)
    code, out, _ = cli(capsys, *argv)
    assert result.format() + "\n" == out and result.exit_code == code
    code, out, _ = cli(capsys, *argv, "--json")
    assert result.summary() == json.loads(out) == result.to_dict()


def test_result_tables_are_dataframes():
    import pandas as pd

    rep = budget.budget(preset="llama3-8b", seq_len=32768)
    t = rep.table
    assert isinstance(t, pd.DataFrame) and list(t.columns) == ["quantity", "value"]
    assert (
        t.set_index("quantity")["value"]["kv_bytes_per_request"]
        == 4 * cost.GIB
        == rep.to_dict()["kv_bytes_per_request"]
    )
    cmp = budget.budget(preset="llama3-8b", compare=True).table
    assert list(cmp["n_kv_heads"]) == [32, 16, 8, 4, 2, 1]
    flops = budget.budget(preset="llama3-8b", flops_table=(1024, 8192)).table
    assert list(flops["seq_len"]) == [1024, 8192] and (flops["scores"] == [4 * T**2 * 4096 for T in (1024, 8192)]).all()
    rec = budget.budget(recommend=True, params="8B", seq_len=8192, kv_limit=2 * cost.GIB).table
    assert len(rec) == 1 and rec["n_kv_heads"][0] == 8 and bool(rec["fits"][0])
    assert rep.check_table is None


def test_config_is_frozen_and_every_field_documented():
    cfg = BudgetConfig(preset="llama3-8b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_len = 5  # type: ignore[misc]
    doc = BudgetConfig.__doc__.split("Attributes:")[1]
    lines = [line.strip() for line in doc.splitlines() if line.strip()]
    for f in dataclasses.fields(BudgetConfig):
        assert sum(line.startswith(f"{f.name}: ") for line in lines) == 1, f.name


def test_main_only_maps_flags():
    """Every BudgetConfig field is a flag of the same name, with the same default."""
    from headprobe.cli import build_parser
    from headprobe.commands import resolve

    args = build_parser().parse_args(["budget"])
    for f in dataclasses.fields(BudgetConfig):
        assert hasattr(args, f.name), f.name
        assert getattr(args, f.name) == f.default, f.name
    assert args._run == budget.COMMAND.execute and resolve(budget.COMMAND.run) is budget.main


def test_library_errors_are_headprobe_errors():
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="dtype 'fp4' is not supported"):
        BudgetConfig(dtype="fp4")
    with pytest.raises(HeadprobeError, match="separate modes"):
        budget.budget(preset="llama3-8b", compare=True, recommend=True)
    with pytest.raises(TypeError):
        budget.budget(presett="llama3-8b")


# ---------------------------------------------------------------------------------------------
# --dtype
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "torch_name, short",
    [
        ("bfloat16", "bf16"),
        ("float32", "fp32"),
        ("float16", "fp16"),
        ("torch.bfloat16", "bf16"),
        ("half", "fp16"),
        ("float8_e4m3fn", "fp8"),
        ("int8", "int8"),
        ("FP8", "fp8"),
    ],
)
def test_dtype_accepts_torch_names(capsys, torch_name, short):
    code, out, _ = cli(capsys, "--preset", "llama3-8b", "--dtype", torch_name, "--json")
    _, ref, _ = cli(capsys, "--preset", "llama3-8b", "--dtype", short, "--json")
    assert code == 0 and json.loads(out) == json.loads(ref)
    assert json.loads(out)["kv_bytes_per_token"] == 128 * cost.KIB // 2 * cost.DTYPE_BYTES[short]


def test_dtype_bad_name_is_one_line(capsys):
    code = main(["budget", "--preset", "llama3-8b", "--dtype", "float64"])  # argparse's usage error
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert (
        err.startswith("headprobe: error: ") and "dtype 'float64' is not supported" in err and "did you mean" not in err
    )


# ---------------------------------------------------------------------------------------------
# Layout flags for QK-norm, sliding windows and MLA's value width
# ---------------------------------------------------------------------------------------------


def test_sliding_window_flags_gemma2_9b(capsys):
    # google/gemma-2-9b config.json: hidden_size 3584, 42 layers, 16 heads, 8 KV heads, head_dim 256,
    # sliding_window 4096 on every other layer (layer_types: sliding, full, ...).
    code, out, _ = cli(
        capsys,
        "--d-model",
        "3584",
        "--n-layers",
        "42",
        "--n-heads",
        "16",
        "--n-kv-heads",
        "8",
        "--d-head",
        "256",
        "--sliding-window",
        "4096",
        "--global-every",
        "2",
        "--seq-len",
        "8192",
        "--json",
    )
    r = json.loads(out)
    per_position_per_layer = 2 * 8 * 256 * 2  # K and V, 8 heads of 256, bf16
    assert code == 0 and r["layout"]["windows"] == [4096, None] * 21
    assert r["kv_bytes_per_request"] == 21 * (4096 + 8192) * per_position_per_layer
    assert r["kv_bytes_per_token"] == 42 * per_position_per_layer  # per token inside every window
    _, text, _ = cli(
        capsys,
        "--d-model",
        "3584",
        "--n-layers",
        "42",
        "--n-heads",
        "16",
        "--n-kv-heads",
        "8",
        "--d-head",
        "256",
        "--sliding-window",
        "4096",
        "--global-every",
        "2",
    )
    assert "21 of 42 layers sliding-window (4,096 positions)" in text
    _, out, _ = cli(capsys, "--preset", "llama3-8b", "--sliding-window", "4096", "--json", "--seq-len", "100")
    assert json.loads(out)["kv_bytes_per_request"] == cost.kv_bytes_per_request(cost.preset("llama3-8b"), 100)


def test_qk_norm_and_qk_nope_head_dim_flags(capsys):
    _, out, _ = cli(capsys, "--preset", "llama3-8b", "--qk-norm", "per_head", "--json")
    assert (
        json.loads(out)["attn_params_per_layer"] == cost.attention_params_per_layer(cost.preset("llama3-8b")) + 2 * 128
    )
    _, out, _ = cli(capsys, "--preset", "deepseek-v3", "--d-head", "64", "--qk-nope-head-dim", "128", "--json")
    ds = cost.preset("deepseek-v3")
    # W_UKV loses 128 * 64 outputs of the 512-wide latent, W_O 128 * 64 inputs of the 7168-wide output.
    assert json.loads(out)["attn_params_per_layer"] == cost.attention_params_per_layer(ds) - 128 * 64 * (512 + 7168)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--preset", "llama3-8b", "--global-every", "2"], "--global-every needs --sliding-window"),
        (
            ["--preset", "llama3-8b", "--sliding-window", "0"],
            "argument --sliding-window: must be a positive integer, got 0",
        ),
        (
            ["--d-model", "128", "--n-layers", "2", "--n-heads", "8", "--qk-norm", "full", "--kv-lora-rank", "64"],
            "qk_norm describes",
        ),
    ],
)
def test_new_flags_bad_input_one_line(capsys, argv, fragment):
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and fragment in err


def test_windows_survive_overrides_but_not_a_new_layer_count():
    from headprobe.probe.core.errors import HeadprobeError

    base = AttentionLayout(d_model=64, n_layers=2, n_heads=4, windows=(8, None))
    lay = budget.layout_from_config(BudgetConfig(n_kv_heads=2), base)
    assert lay.windows == (8, None) and lay.n_kv_heads == 2
    with pytest.raises(HeadprobeError, match="--sliding-window"):
        budget.layout_from_config(BudgetConfig(n_layers=4), base)
    assert budget.layout_from_config(BudgetConfig(n_layers=4, sliding_window=8), base).windows == (8,) * 4


# ---------------------------------------------------------------------------------------------
# Import cost
# ---------------------------------------------------------------------------------------------


def test_budget_modules_import_no_heavy_library():
    code = (
        "import sys, headprobe.commands.budget, headprobe.probe.layout.cost\n"
        "print([m for m in ('torch', 'transformers', 'pandas', 'matplotlib', 'transformer_lens') if m in sys.modules])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_budget_runs_without_heavy_libraries():
    """A whole report, not just the import: running run() without --model loads none of them."""
    code = (
        "import sys\nfrom headprobe.commands.budget import budget\n"
        "r = budget(preset='llama3-8b', compare=True); r.format(); r.to_dict()\n"
        "print([m for m in ('torch', 'transformers', 'pandas', 'matplotlib') if m in sys.modules])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _heavy_imports(*argv: str, module: str = "headprobe") -> list[str]:
    """The heavy libraries ``python -X importtime -m MODULE ARGV`` imports (importtime lists
    every module a process imports on stderr, one line each)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return sorted(imported & {"torch", "transformers", "pandas", "matplotlib", "transformer_lens", "numpy"})


@pytest.mark.parametrize(
    "argv",
    [
        ("budget", "--preset", "llama3-8b"),
        ("budget", "--preset", "llama3-8b", "--json"),
        ("budget", "--preset", "llama3-8b", "--compare"),
        ("--version",),
    ],
)
def test_the_budget_command_line_imports_no_heavy_library(argv):
    """The whole command line (headprobe.cli, its parser, the report) without --model loads
    neither torch nor pandas (0.1-0.4 s and 20 MB instead of 5-7 s and 330 MB); --version neither."""
    assert _heavy_imports(*argv) == []


def test_the_import_probe_sees_torch():
    """The probe above is not vacuous: it sees torch where a module imports it (the model interface;
    kv's flags, which imported it, no longer do)."""
    assert "torch" in _heavy_imports(module="headprobe.probe.backends.base")
