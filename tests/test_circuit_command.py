"""``headprobe circuit``: outputs, their identities against the functions, one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import zoo

import headprobe
from headprobe.analyses.circuit import parse_edge, path_patch_effects, prepare_runs
from headprobe.analyses.data import repeated_random_tokens
from headprobe.cli import main


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_tokenizer):
    return zoo.save_dir("llama", tiny_tokenizer, tmp_path_factory.mktemp("llama"))


@pytest.mark.figures
def test_cli_writes_edges_figure_and_summary(llama_dir, tmp_path, capsys):
    out = tmp_path / "c"
    assert (
        main(
            [
                "circuit",
                "--model",
                str(llama_dir),
                "--out",
                str(out),
                "--device",
                "cpu",
                "--n-seqs",
                "2",
                "--period",
                "6",
                "--steps",
                "3",
                "--verify",
                "6",
                "--receivers",
                "1.0:k,logits",
                "--qk-head",
                "1.3",
            ]
        )
        == 0
    )
    edges = pd.read_csv(out / "edges.csv")
    H = 4
    assert len(edges) == 3 * H * H + 2 * H  # 2 layers: layer-0 senders into layer-1 q/k/v, every head into the logits
    assert list(edges.columns) == ["edge", "sender", "receiver", "input", "score", "exact"]
    assert edges["exact"].notna().sum() == 12 and edges["exact"].head(6).notna().all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agreement"]["n_edges"] == 12 and summary["baseline_error"] < 1e-4
    assert summary["qk_attribution"]["identity_error"] < 1e-4
    # the exact effects written are those of path patching itself
    model = headprobe.load_model(str(llama_dir), device="cpu")
    clean, corr = (repeated_random_tokens(model, 2, 6, s) for s in (0, 1))
    runs = prepare_runs(model, clean.tokens, corr.tokens, first=clean.start + 6)
    row = edges.dropna(subset=["exact"]).iloc[0]
    e = parse_edge(row["edge"])
    want = path_patch_effects(model, runs, [e.sender], e.receiver, "k" if e.receiver is None else e.input)[0]
    assert row["exact"] == pytest.approx(want, rel=1e-4, abs=1e-7)
    paths = pd.read_csv(out / "path_patching.csv")
    assert set(paths["receiver"]) == {"1.0:k", "logits"} and len(paths) == H + 2 * H
    qk = pd.read_csv(out / "qk_attribution.csv")
    assert qk["key_side"].sum() == pytest.approx(summary["qk_attribution"]["score"], rel=1e-3)
    # the bias-free Llama: no b_O, k/q bias rows of zeros; embed, layer 0's 4 heads and its MLP
    assert list(qk["component"].sort_values()) == sorted(["embed", "0.0", "0.1", "0.2", "0.3", "mlp 0"]), qk
    assert (out / "circuit.png").is_file()
    # scripts/redraw_figures.py redraws circuit.png from the saved edges.csv and summary.json as the
    # command drew it (the CSV's 6 significant digits move line widths by less than a pixel)
    import importlib.util
    import shutil
    from pathlib import Path

    from matplotlib.testing.compare import compare_images

    spec = importlib.util.spec_from_file_location("redraw", Path(__file__).parents[1] / "scripts" / "redraw_figures.py")
    redraw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(redraw)
    again = tmp_path / "again"
    shutil.copytree(out, again)
    redraw.redraw_circuit(again)
    assert compare_images(str(out / "circuit.png"), str(again / "circuit.png"), tol=0.5) is None
    # --receivers draws its sweep (path_patching.png), and the redraw draws it again from path_patching.csv;
    # --check compares circuit runs (no model needed)
    assert compare_images(str(out / "path_patching.png"), str(again / "path_patching.png"), tol=0.5) is None
    assert redraw._kind(out) == "circuit" and redraw.check_run(out, redraw.REDRAWS["circuit"]) == []
    said = capsys.readouterr().out
    assert "largest edges (score, exact):" in said  # verified: the exact column is there
    assert "Spearman" in said
    # the last line names every file written but the figures, read from the folder itself
    files = [p.name for p in out.iterdir() if not p.name.startswith(".")]  # not the run's own record
    tables = [f for f in files if not f.endswith((".png", ".pdf", ".svg"))]
    wrote = said.strip().splitlines()[-1]
    assert wrote.startswith(f"wrote {len(files)} files") and all(name in wrote for name in tables), (files, wrote)
    _check_viewer_section(out, summary, H, tmp_path, capsys)


def _check_viewer_section(out, summary, H, tmp_path, capsys):
    """``headprobe view SCAN --circuit OUT``: the page carries the run's figure byte for byte, its
    top edges, sweeps and QK attribution as summary.json has them; a circuit of a larger model
    than the table (a head it does not have) is refused in one line and no page is written."""
    import base64
    import re

    scan = tmp_path / "scan"
    scan.mkdir()
    pd.DataFrame(
        {
            "layer": np.repeat([0, 1], H),
            "head": np.tile(np.arange(H), 2),
            "kv_head": np.tile(np.arange(H) // 2, 2),
            "induction": np.linspace(0, 1, 2 * H),
        }
    ).to_csv(scan / "head_scores.csv", index=False)
    assert main(["view", str(scan), "--circuit", str(out)]) == 0
    page = (scan / "index.html").read_text()
    data = json.loads(re.search(r'id="headprobe-data">(.*?)</script>', page, re.S).group(1))["circuit"]
    assert [e["edge"] for e in data["edges"]] == [e["edge"] for e in summary["top_edges"]]
    assert [e["score"] for e in data["edges"]] == pytest.approx([e["score"] for e in summary["top_edges"]], abs=1e-4)
    mime, b64 = data["image"].split(",", 1)
    figure = out / ("circuit.svg" if "svg" in mime else "circuit.png")
    assert base64.b64decode(b64) == figure.read_bytes()
    assert set(data["receivers"]) == {"1.0:k", "logits"}
    assert data["qk"]["head"] == summary["qk_attribution"]["head"] and data["agreement"]["n_edges"] == 12
    small = tmp_path / "small"
    small.mkdir()
    pd.read_csv(scan / "head_scores.csv").query("layer == 0").assign(layer=0).to_csv(
        small / "head_scores.csv", index=False
    )
    capsys.readouterr()
    assert main(["view", str(small), "--circuit", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "outside the table" in err and not (small / "index.html").exists()
    assert main(["view", str(scan), "--circuit", str(small)]) == 2
    assert "no summary.json" in capsys.readouterr().err


def test_the_function_and_public_api(llama_dir):
    r = headprobe.circuit(str(llama_dir), device="cpu", n_seqs=1, period=5, steps=2, verify=0, top=5)
    assert r.agreement is None and r.edges["exact"].isna().all()
    # unverified, the report's header names no exact column and no line ends in the empty one
    lines = r.report().splitlines()
    assert "largest edges (score):" in lines and not any(x.endswith(" ") for x in lines)
    model = headprobe.load_model(str(llama_dir), device="cpu")
    clean, corr = (repeated_random_tokens(model, 1, 5, s).tokens for s in (0, 1))
    single = headprobe.path_patch(model, clean, corr, (0, 1), (1, 2), "v")
    many = headprobe.path_patch(model, clean, corr, [(0, 1), (0, 2)], (1, 2), "v")
    assert single == pytest.approx(many[0])
    scores = headprobe.edge_attribution(model, clean, corr, method="eap")
    assert scores.head_scores.shape == (3, 2, 4, 2, 4)
    assert headprobe.qk_attribution(model, clean, 1, 0, 4, 2).identity_error < 1e-4


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--method", "atp"], "invalid choice"),
        (["--receivers", "1.0:z"], "is not L.H:q"),
        (["--qk-head", "x"], "is not of the form layer.head"),
        (["--period", "3"], "at least 4"),
        (["--receivers", "7.0:k"], "head 7.0 is out of range: the model has"),
        (["--qk-head", "9.1"], "head 9.1 is out of range: the model has"),
        (["--backend", "transformer-lens"], "native backend"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(llama_dir, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(
            main(
                [
                    "circuit",
                    "--model",
                    str(llama_dir),
                    "--out",
                    str(tmp_path / "o"),
                    "--device",
                    "cpu",
                    "--verify",
                    "0",
                    "--steps",
                    "1",
                    *flags,
                ]
            )
        )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert e.value.code == 2 and "Traceback" not in err and len(errors) == 1 and message in errors[0], err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_is_not_refused(llama_dir, dtype):
    """The resumed forwards reproduce the clean run bitwise (both on the fused kernel), and the
    tolerance scales with the dtype (bfloat16 was refused at 4e-4 nats/token against a float32 1e-4)."""
    r = headprobe.circuit(str(llama_dir), device="cpu", dtype=dtype, n_seqs=3, period=6, steps=2, verify=2, top=5)
    s = r.summary()
    assert (
        s["dtype"] == dtype and s["baseline_error"] <= s["baseline_tolerance"] and dtype in s["baseline_tolerance_rule"]
    )
    assert r.edges["exact"].notna().sum() == 4


def test_one_sequence_over_the_memory_budget_is_refused_before_running(llama_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(
            main(
                [
                    "circuit",
                    "--model",
                    str(llama_dir),
                    "--out",
                    str(tmp_path / "o"),
                    "--device",
                    "cpu",
                    "--memory-gb",
                    "0.000001",
                    "--verify",
                    "0",
                    "--steps",
                    "1",
                ]
            )
        )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert e.value.code == 2 and "Traceback" not in err and len(errors) == 1 and "working memory" in errors[0], err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_the_default_budget_is_capped_on_a_cpu_only(llama_dir, monkeypatch, no_stated_budget):
    """Without --memory-gb or a stated budget, a CPU takes at most 1 GiB (DEFAULT_BUDGET) and a GPU
    80% of its free memory, as other commands: one 4,096-token sequence of this model (about
    1.1 GiB to score, row_bytes) is refused on the CPU and planned whole on a GPU with 100 GiB free."""
    import torch

    from headprobe.analyses import circuit as circuit_analysis
    from headprobe.probe.core import memory
    from headprobe.probe.core.errors import HeadprobeError

    model = headprobe.load_model(str(llama_dir), device="cpu")
    scoring, patching = circuit_analysis.row_bytes(model, 4096)
    assert circuit_analysis.DEFAULT_BUDGET < scoring < 100 * 2**30 * memory.HEADROOM / 8
    monkeypatch.setattr(memory, "free_bytes", lambda device: 100 * 2**30)
    with pytest.raises(HeadprobeError, match="more than the budget of 1 GiB"):
        circuit_analysis.plan_rows(model, 8, 4096)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))  # as on a GPU
    budget = 100 * 2**30 * memory.HEADROOM
    want = (min(8, int(budget // scoring)), min(circuit_analysis.MAX_STACK, int(budget // patching)))
    assert circuit_analysis.plan_rows(model, 8, 4096) == want and want[0] == 8


def test_circuit_help_states_its_own_memory_budget(llama_dir, monkeypatch, no_stated_budget, capsys):
    """``circuit --help``'s --memory-budget said the shared "80 percent of the device's free memory",
    while circuit takes at most 1 GiB of it on a CPU (DEFAULT_BUDGET) and a stated budget as stated:
    its help names the cap and --memory-gb, and a stated 2 GiB plans beyond the cap."""
    import re

    from headprobe.analyses import circuit as circuit_analysis
    from headprobe.probe.core import memory

    assert main(["circuit", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    flag = re.search(r"--memory-budget SIZE (.*?) --out OUT", text).group(1)
    assert f"on a CPU at most {circuit_analysis.DEFAULT_BUDGET / 2**30:g} GiB" in flag and "--memory-gb wins" in flag
    model = headprobe.load_model(str(llama_dir), device="cpu")
    scoring, _ = circuit_analysis.row_bytes(model, 4096)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 100 * 2**30)
    memory.set_budget("3GiB")
    assert circuit_analysis.plan_rows(model, 8, 4096)[0] == int(3 * 2**30 // scoring) >= 2


def test_scoring_in_chunks_equals_the_whole_batch(llama_dir):
    """RunChunks (one sequence at a time) gives the batch's EAP-IG scores, exact effects and sweeps:
    the per-sequence mean metric makes every quantity a weighted sum over chunks."""
    from headprobe.analyses import circuit as circuit_analysis

    model = headprobe.load_model(str(llama_dir), device="cpu")
    clean, corr = (repeated_random_tokens(model, 3, 6, s) for s in (0, 1))
    first = clean.start + 6
    whole = prepare_runs(model, clean.tokens, corr.tokens, first=first)
    chunks = circuit_analysis.RunChunks(model, clean.tokens, corr.tokens, rows=1, stack_rows=2, first=first)
    a, b = (circuit_analysis.edge_scores(model, r, "eap-ig", 3) for r in (whole, chunks))
    np.testing.assert_allclose(b.head_scores, a.head_scores, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(b.logit_scores, a.logit_scores, rtol=1e-5, atol=1e-8)
    senders = [(0, h) for h in range(4)]
    np.testing.assert_allclose(
        path_patch_effects(model, chunks, senders, (1, 2), "k"),
        path_patch_effects(model, whole, senders, (1, 2), "k"),
        rtol=1e-5,
        atol=1e-8,
    )
    assert chunks.clean_metric() == pytest.approx(float(whole.clean_metric.mean()), rel=1e-6)
    assert circuit_analysis.baseline_error(model, chunks, [1]) <= 1e-6


def _error_line(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(list(argv)))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert e.value.code == 2 and "Traceback" not in err and len(errors) == 1, err
    return errors[0]


def test_a_head_out_of_range_is_refused_in_show_and_patchs_words(llama_dir, tmp_path, capsys):
    """``circuit --receivers 1.4:k`` on a model of 4 heads a layer said "receiver 1.4 is not a head
    after layer 0", where show and patch say "head 1.4 is out of range"; circuit checks a head name
    with the same function now, receivers and --qk-head alike, and says only what is its own (a
    receiver in layer 0) in its own words."""
    model = ["--model", str(llama_dir), "--device", "cpu", "--out", str(tmp_path / "o")]
    show = _error_line(capsys, "show", *model, "--head", "1.4", "--prompt", "a b c d")
    patch = _error_line(capsys, "patch", *model, "--heads", "1.4")
    assert show == patch == "headprobe: error: head 1.4 is out of range: the model has 2 layers of 4 heads (0-indexed)"
    assert _error_line(capsys, "circuit", *model, "--receivers", "1.4:k") == show
    assert _error_line(capsys, "circuit", *model, "--receivers", "L1H4:k") == show.replace("1.4", "L1H4")
    assert _error_line(capsys, "circuit", *model, "--qk-head", "1.4") == show
    layer0 = _error_line(capsys, "circuit", *model, "--receivers", "0.1:k")
    assert "receiver 0.1 is in layer 0" in layer0 and "out of range" not in layer0
    assert not (tmp_path / "o").exists()


def test_a_receiver_named_twice_is_path_patched_once():
    """``--receivers logits,logits`` wrote every sender's path-patching row twice (and ran it twice);
    ``1.0:k`` and ``L1H0:k`` are one receiver, its q input another."""
    from headprobe.commands.circuit import parse_receivers

    assert parse_receivers("logits,1.0:k,logits,L1H0:k,1.0:q", 2, 4) == [(None, "logits"), ((1, 0), "k"), ((1, 0), "q")]


def test_a_refused_sequence_states_its_need_readably(llama_dir, no_stated_budget):
    """The refusal's numbers read back (parse_bytes) to row_bytes' need and the stated budget, the
    need larger than the budget: a 20 KB budget is not refused for needing "0.00 GiB"."""
    import re

    from headprobe.analyses import circuit as circuit_analysis
    from headprobe.probe.core import memory
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.core.sizes import parse_bytes

    model = headprobe.load_model(str(llama_dir), device="cpu")
    need = max(circuit_analysis.row_bytes(model, 13))
    for stated, budget in (("20KB", None), (None, 20e3)):
        memory.set_budget(stated)
        with pytest.raises(HeadprobeError) as e:
            circuit_analysis.plan_rows(model, 2, 13, budget)
        msg = str(e.value)
        got = re.search(r"needs about (\S+ \S+) of working memory", msg)
        assert got and parse_bytes(got.group(1)) == pytest.approx(need, rel=0.01), msg
        shown = re.search(r"(?:budget|budget of) (\S+ [KMG]i?B)", msg)
        assert shown and parse_bytes(shown.group(1)) == pytest.approx(20e3, rel=0.01) and 20e3 < need, msg


def test_a_backend_without_path_patching_is_refused_before_the_load(llama_dir, tmp_path, monkeypatch, capsys):
    """``--backend transformer-lens`` was refused after the model loaded (31 s for SmolLM2-135M):
    the backend's capability flag alone decides it, so no loader runs (each fails the test here)."""
    from headprobe import options

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the backend was checked")

    monkeypatch.setattr(options, "load_for", no_load)
    monkeypatch.setattr(options, "load_model", no_load)
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        raise SystemExit(
            main(["circuit", "--model", str(llama_dir), "--out", str(out), "--backend", "transformer-lens"])
        )
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert e.value.code == 2 and err == [
        "headprobe: error: path patching and edge attribution need the native backend (--backend native), "
        "not transformer-lens (the transformer-lens backend lacks path_patching)"
    ]
    assert not out.exists()
