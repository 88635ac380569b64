"""Progress bars in a log: on a stream that is not a terminal (``2>log``, a pipe, pytest's capture)
each outermost bar writes whole lines (one per phase, one at its end), nested bars nothing, and no
line carries a ``\\r`` redraw or a cursor move; on a terminal the bar stays tqdm's live one."""

from __future__ import annotations

import io

from tqdm.auto import tqdm

from headprobe.cli import main


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _nested_run(stream) -> None:
    """An outer bar over 3 steps, each with an inner bar of 4 and a note between them."""
    from headprobe.probe.core.progress import progress_bar

    for i in progress_bar(range(3), desc="outer", unit="step", file=stream):
        for _ in progress_bar(range(4), desc="inner", file=stream):
            pass
        tqdm.write(f"note {i}", file=stream)


def test_a_log_gets_one_whole_line_per_outer_bar_and_none_of_the_nested_ones():
    from headprobe.probe.core.progress import progress_bar

    log = io.StringIO()
    _nested_run(log)
    bar = progress_bar(total=10, desc="counted", file=log)  # counted by hand, its total shrunk on the way
    bar.update(4)
    bar.total = 5
    bar.set_description("second phase")  # a new phase: the first one's line
    bar.set_description("third phase")  # nothing counted in the second: no line
    bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text, repr(text)
    lines = text.splitlines()
    assert lines[:3] == ["note 0", "note 1", "note 2"], lines
    assert lines[3].startswith("outer: 100%") and " 3/3 [" in lines[3], lines
    assert lines[4].startswith("counted:  80%") and " 4/5 [" in lines[4], lines
    assert lines[5].startswith("third phase: 100%") and " 5/5 [" in lines[5] and len(lines) == 6, lines
    assert text.endswith("\n")


def test_a_terminal_keeps_the_live_bar_and_no_progress_prints_nothing():
    from headprobe.probe.core.progress import progress_bar

    screen = _Terminal()
    _nested_run(screen)
    assert screen.getvalue().count("\r") > 3 and "inner" in screen.getvalue()  # the check above can fail
    quiet = io.StringIO()
    for _ in progress_bar(range(3), desc="outer", file=quiet, progress=False):
        pass
    assert quiet.getvalue() == ""


def test_ablate_with_stderr_to_a_file_leaves_whole_lines(tiny_dir, text_file, tmp_path, capsys):
    """``headprobe ablate ... 2>log``: each sweep's bar is one line ending in its count, with no
    half-drawn bar (a ``\\r``-separated fragment) before it."""
    out = tmp_path / "ablate"
    small = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "--device", "cpu"]
    assert main(["ablate", "--model", str(tiny_dir), "--out", str(out), "--text", str(text_file), *small]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, repr(err)
    sweeps = [line for line in err.splitlines() if line.startswith("ablation sweep")]
    assert [line.split(":")[0] for line in sweeps] == ["ablation sweep (natural)", "ablation sweep (repeated)"], err
    assert all(" 100%|" in line and " 1/1 [" in line for line in sweeps), sweeps


def test_a_sweep_of_several_chunks_to_a_log_file_is_one_line_per_task(tiny_tokenizer, text_file, tmp_path):
    """``headprobe ablate ... 2>log`` (a real file, in a process of its own) on a 6-layer model: the
    sweep runs in two chunks of layers (``CHUNK_LAYERS`` 5), where a live bar would redraw between
    them; the log holds one whole line per task's sweep, at 2/2."""
    import subprocess
    import sys

    import zoo

    from headprobe.commands.ablate_core import CHUNK_LAYERS

    model = tmp_path / "deep"
    zoo.make_checkpoint("llama", tiny_tokenizer, num_hidden_layers=CHUNK_LAYERS + 1).hf_model.save_pretrained(model)
    tiny_tokenizer.save_pretrained(model)
    small = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "--device", "cpu"]
    argv = ["ablate", "--model", str(model), "--out", str(tmp_path / "o"), "--text", str(text_file), *small]
    log = tmp_path / "log"
    with log.open("w") as err:
        subprocess.run([sys.executable, "-m", "headprobe", *argv], stderr=err, stdout=subprocess.DEVNULL, check=True)
    text = log.read_text(encoding="utf-8")
    assert "\r" not in text and "\x1b" not in text, repr(text)
    bars = [line for line in text.splitlines() if "%|" in line]
    assert [b.split(":")[0] for b in bars] == ["ablation sweep (natural)", "ablation sweep (repeated)"], text
    assert all(" 100%|" in b and " 2/2 [" in b for b in bars), bars


def test_an_error_after_a_log_bar_starts_on_its_own_line_without_a_blank_one():
    """The CLI puts a newline before its error line when a bar is still drawn; a log's bar has drawn
    nothing, so none (a blank line in the log), while a terminal's live bar still gets one."""
    from headprobe.cli import _own_line
    from headprobe.probe.core.progress import progress_bar

    log_bar = progress_bar(total=3, desc="log", file=io.StringIO())
    assert _own_line("headprobe: error: x") == "headprobe: error: x"
    live = progress_bar(total=3, desc="live", file=_Terminal())
    assert _own_line("headprobe: error: x") == "\nheadprobe: error: x"
    live.close()
    log_bar.close()


_KERNEL_WITHOUT_IPYWIDGETS = """
import sys, types
sys.modules["ipykernel.zmqshell"] = types.ModuleType("ipykernel.zmqshell")  # what tqdm.autonotebook looks for
ipython = types.ModuleType("IPython")
ipython.get_ipython = type("ZMQInteractiveShell", (), {})  # a Jupyter kernel's shell
sys.modules["IPython"] = ipython
sys.modules["ipywidgets"] = None  # not installed: import fails
"""


def _in_a_kernel(code: str) -> tuple[str, str]:
    """(stdout, stderr) of ``code`` run in a new process that looks like a Jupyter kernel without ipywidgets."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-W", "default", "-c", _KERNEL_WITHOUT_IPYWIDGETS + code],
        capture_output=True,
        text=True,
        check=True,
    )
    return p.stdout, p.stderr


def test_a_notebook_without_ipywidgets_gets_line_bars_and_no_ipywidgets_warning():
    """In Jupyter without ipywidgets, ``tqdm.auto`` warns ``IProgress not found`` at its first import
    (huggingface_hub's, when transformers loads) and chooses tqdm's plain bar; after ``import
    headprobe`` no warning, and a bar on the kernel's stderr (no terminal) is a LineBar."""
    _, err = _in_a_kernel("import huggingface_hub.utils.tqdm")
    assert "IProgress not found" in err  # the simulated kernel does warn: the check below can fail
    code = "import headprobe, huggingface_hub.utils.tqdm\n"
    code += "from headprobe.probe.core.progress import progress_bar\n"
    code += "bar = progress_bar(total=2, desc='phase'); bar.update(2); bar.close(); print(type(bar).__name__)"
    out, err = _in_a_kernel(code)
    assert "IProgress" not in err and "Warning" not in err, err
    assert out.split() == ["LineBar"] and err.startswith("phase: 100%") and " 2/2 [" in err, (out, err)


def _counted_on_a_fake_clock(monkeypatch, steps: int, seconds_a_step: float, total: int | None) -> list[str]:
    """The lines of a log's bar counted ``steps`` times, ``seconds_a_step`` apart on tqdm's clock."""
    import tqdm.std

    from headprobe.probe.core.progress import LineBar, progress_bar

    now = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])  # every bar's clock (tqdm's _time, set at its start)
    log = io.StringIO()
    bar = progress_bar(total=total, desc="phase", unit="set", file=log)
    assert isinstance(bar, LineBar)
    for _ in range(steps):
        now[0] += seconds_a_step
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text, repr(text)
    return text.splitlines()


def test_a_long_phase_in_a_log_writes_a_line_every_30_s_and_10_percent(monkeypatch):
    """A sign of life in a long phase: a line once both 30 s and 10% of the total have passed since
    the last one, with count/total, elapsed time and rate; the last line at the end as before."""
    lines = _counted_on_a_fake_clock(monkeypatch, 100, 1.0, total=100)  # 100 s: the seconds decide
    counts = [line.split("| ")[1].split(" [")[0] for line in lines]
    assert counts == ["30/100", "60/100", "90/100", "100/100"], lines
    assert lines[0].startswith("phase:  30%") and "[00:30<01:10" in lines[0] and "1.00set/s]" in lines[0], lines
    assert lines[-1].startswith("phase: 100%") and "[01:40<00:00" in lines[-1], lines
    lines = _counted_on_a_fake_clock(monkeypatch, 20, 10.0, total=100)  # a line per 10 s: 10% decides
    assert [line.split("| ")[1].split(" [")[0] for line in lines] == ["10/100", "20/100"], lines
    lines = _counted_on_a_fake_clock(monkeypatch, 10, 10.0, total=None)  # no total: every 30 s
    assert [line.split(" [")[0] for line in lines] == ["phase: 3set", "phase: 6set", "phase: 9set", "phase: 10set"]


def test_a_short_phase_in_a_log_still_writes_exactly_one_line(monkeypatch):
    lines = _counted_on_a_fake_clock(monkeypatch, 100, 0.25, total=100)  # 25 s
    assert len(lines) == 1 and lines[0].startswith("phase: 100%") and " 100/100 [00:25<00:00" in lines[0], lines


def test_a_step_longer_than_the_interval_writes_signs_of_life_while_it_runs(monkeypatch):
    """A single step longer than INTERVAL_S (a model load, one long forward) wrote nothing until it
    ended: the check ran only when the bar was counted. A daemon thread now writes the bar's line,
    elapsed time growing, every INTERVAL_S while neither a line nor a count came; a step shorter
    than INTERVAL_S writes nothing more, and after close nothing is written."""
    import time

    from headprobe.probe.core.progress import LineBar, progress_bar

    monkeypatch.setattr(LineBar, "INTERVAL_S", 0.2)
    log = io.StringIO()
    bar = progress_bar(total=2, desc="load", file=log, bar_format="{desc}: {n_fmt}/{total_fmt} {elapsed_s:.2f}s")
    time.sleep(0.05)  # a short step: no line
    bar.update(1)
    assert log.getvalue() == ""
    time.sleep(1.2)  # one long step, the bar not counted
    during = log.getvalue().splitlines()
    bar.update(1)
    bar.close()
    assert 2 <= len(during) <= 6 and all(line.startswith("load: 1/2 ") for line in during), during
    elapsed = [float(line.split()[-1].removesuffix("s")) for line in during]
    assert elapsed[0] >= 0.25 and all(b - a >= 0.19 for a, b in zip(elapsed, elapsed[1:])), elapsed
    time.sleep(0.3)
    lines = log.getvalue().splitlines()
    assert lines[:-1] == during and lines[-1].startswith("load: 2/2 "), lines  # close's line, then nothing


def test_circuit_counts_its_steps_and_patched_edges_in_whole_lines(tiny_dir, tmp_path, capsys):
    """``headprobe circuit ... 2>log`` printed nothing after its batch line for minutes on SmolLM2: the
    attribution steps, the verification's and the receivers' path-patched edges each get a bar, in a
    log one whole line ending at its full count (2 layers of 8 heads: 8 + 16 sender edges into 1.0:k
    and the logits); the Python function without ``progress`` writes none."""
    import headprobe

    small = ["--n-seqs", "2", "--period", "6", "--steps", "3", "--verify", "4", "--device", "cpu"]
    argv = ["circuit", "--model", str(tiny_dir), "--out", str(tmp_path / "c"), *small, "--receivers", "1.0:k,logits"]
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, repr(err)
    bars = [line for line in err.splitlines() if "%|" in line]
    want = {"edge attribution (eap-ig)": 3, "path patching 8 edges": 8, "path patching 2 receivers": 24}
    assert [b.split(":")[0] for b in bars] == list(want), err
    assert all(" 100%|" in b and f" {n}/{n} [" in b for b, n in zip(bars, want.values())), bars
    headprobe.circuit(str(tiny_dir), n_seqs=2, period=6, steps=2, verify=2, receivers="1.0:k", device="cpu")
    assert "%|" not in capsys.readouterr().err
