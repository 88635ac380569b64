"""One live run per output folder (:mod:`headprobe.probe.core.outlock`): a run claims its ``--out`` at
its start; a second run into the same folder while the first lives is refused before any work (one
line, exit 2, nothing written), and nothing it does touches the first run's files; a claim dies with
its process (SIGKILL included), and one process never refuses itself (commands run inside others).

The holders are other processes, as in the report: ``study heads --out D`` started while another run
into D (which did not exist yet) trained passed its start checks, trained, and was refused at the
end ("not empty"); two runs with ``--overwrite`` removed each other's staging folders mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import zoo

from headprobe.analyses.outputs import write_outputs
from headprobe.cli import main
from headprobe.probe.core.errors import HeadprobeError

_SLOW_SCAN = """
import sys, time
import headprobe.options as options
from headprobe.cli import main

def slow_load(config):  # the run is under way: --out checked, the model loading
    print("loading", flush=True)
    time.sleep(600)

options.load_for = slow_load
sys.exit(main(["scan", "--model", sys.argv[1], "--out", sys.argv[2], "--text", sys.argv[3], "--device", "cpu"]))
"""
"""A real ``headprobe scan`` into ``argv[2]`` that stays at its model's loading until it is killed."""

_STAGING_WRITER = """
import sys, time
from headprobe.probe.core.io import staging

with staging(sys.argv[1]) as tmp:  # a run's write under way: its files staged, not yet moved in
    (tmp / "heads.csv").write_text("half of a table")
    print(tmp, flush=True)
    time.sleep(600)
"""

_CLAIM = """
import sys
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.outlock import claim_output

try:
    claim_output(sys.argv[1])
except HeadprobeError as e:
    print(e)
    sys.exit(2)
"""
"""Another process's check of a claim on ``argv[1]``: exit 2 and the refusal where it is claimed."""


def _start(tmp_path, script: str, *args) -> tuple[subprocess.Popen, str]:
    """``script`` run in another process with ``args``, once it printed its first line (returned)."""
    path = tmp_path / "holder.py"
    path.write_text(textwrap.dedent(script))
    p = subprocess.Popen([sys.executable, str(path), *map(str, args)], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()  # type: ignore[union-attr]
    assert line, "the holder ended before it got under way"
    return p, line


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL


def _other_claims(tmp_path, out) -> subprocess.CompletedProcess:
    script = tmp_path / "claim.py"
    script.write_text(textwrap.dedent(_CLAIM))
    env = {k: v for k, v in os.environ.items() if k != "RANK"}  # a process of its own, not a torchrun rank
    return subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120, env=env)


def _scan(tiny_dir, text_file, out):
    return main(["scan", "--model", str(tiny_dir), "--out", str(out), "--text", str(text_file), *zoo.TINY_SCAN_FLAGS])


def test_a_second_run_into_a_folder_being_written_is_refused_at_its_start(tiny_dir, text_file, tmp_path, capsys):
    """The first scan into D (not there yet) is loading its model; a second scan, and a study that
    would train for minutes, are refused before any work, in one line naming the first run's pid, and
    write nothing. Once the first is killed (SIGKILL: no finally runs), a new run goes ahead."""
    out = tmp_path / "D"
    first, _ = _start(tmp_path, _SLOW_SCAN, tiny_dir, out, text_file)
    try:
        assert _scan(tiny_dir, text_file, out) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"headprobe: error: another headprobe run (pid {first.pid}) is writing to {out}; "
            "wait for it to finish or choose another --out"
        ]
        study = ["study", "heads", "--out", str(out), "--overwrite", "--seeds", "0", "--steps", "5"]
        assert main(study) == 2
        assert f"(pid {first.pid}) is writing to {out}" in capsys.readouterr().err
        assert not out.exists()  # nothing written, not even the folder
    finally:
        _kill(first)
    assert _scan(tiny_dir, text_file, out) == 0  # the killed run's claim went with it
    assert (out / "summary.json").is_file()


def test_a_write_never_removes_a_live_runs_staging_folder(tmp_path):
    """A run with --overwrite into D while another run's files are staged there: the old staging()
    removed every staging folder in D, the other run's mid-write. Now the second is refused and the
    first's staged files stay; a staging folder left by a killed run is removed by the next write."""
    out = tmp_path / "D"
    out.mkdir()
    first, staged = _start(tmp_path, _STAGING_WRITER, out)
    try:
        with pytest.raises(HeadprobeError, match=rf"another headprobe run \(pid {first.pid}\) is writing to"):
            write_outputs(out, overwrite=True, summary={"run": 2}, tables={"heads.csv": "mine"})
        assert (out / os.path.basename(staged) / "heads.csv").read_text() == "half of a table"
        assert not (out / "summary.json").exists()
    finally:
        _kill(first)
    assert os.path.isdir(staged)  # killed mid-write: its staging folder is left
    write_outputs(out, overwrite=True, summary={"run": 2}, tables={"heads.csv": "mine"})
    assert sorted(p.name for p in out.iterdir()) == [".headprobe-outputs.json", "heads.csv", "summary.json"]


def test_a_process_never_refuses_itself_and_lets_go_when_its_run_ends(tmp_path):
    """Commands run inside others (an atlas's scans into its subfolders, a study's trainings) claim
    folders their own process claims already, or folders inside them: no refusal, no deadlock. Within
    the run another process is refused; once the run's scope ends, it is not."""
    from headprobe.probe.core.outlock import claim_output, output_claims

    out = tmp_path / "D"
    with output_claims():
        assert claim_output(out)
        with output_claims():
            assert claim_output(out) and claim_output(tmp_path / "D" / "toy") and claim_output(f"{tmp_path}/./D")
            write_outputs(out, overwrite=False, summary={"inner": True})
            write_outputs(out / "toy", overwrite=False, summary={"inner": True})
        refused = _other_claims(tmp_path, out)  # the inner scope ended; the outer still holds D
        assert refused.returncode == 2 and refused.stdout.splitlines() == [
            f"another headprobe run (pid {os.getpid()}) is writing to {out}; "
            "wait for it to finish or choose another --out"
        ]
        assert _other_claims(tmp_path, out / "toy").returncode == 0  # the inner run's claim was let go
    assert _other_claims(tmp_path, out).returncode == 0


def test_a_folder_is_one_claim_however_it_is_spelt(tmp_path):
    """``D``, ``D/.``, ``x/../D`` and a symlink to D are one folder, one lock file; another is another."""
    from headprobe.probe.core.outlock import lock_path

    (tmp_path / "D").mkdir()
    (tmp_path / "x").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "D")
    same = {lock_path(p) for p in (tmp_path / "D", f"{tmp_path}/D/.", tmp_path / "x" / ".." / "D", tmp_path / "link")}
    assert len(same) == 1 and None not in same
    assert lock_path(tmp_path / "x") not in same


def test_only_torchrun_rank_0_claims(tmp_path, monkeypatch):
    """Every rank of a torchrun run checks --out; only rank 0 writes the outputs and claims it."""
    from headprobe.probe.core.outlock import claim_output, output_claims

    with output_claims():
        monkeypatch.setenv("RANK", "1")
        assert not claim_output(tmp_path / "D")
        assert _other_claims(tmp_path, tmp_path / "D").returncode == 0
        monkeypatch.setenv("RANK", "0")  # the check can fail: rank 0's claim refuses the other process
        assert claim_output(tmp_path / "D")
        assert _other_claims(tmp_path, tmp_path / "D").returncode == 2
