"""No command writes a bare NaN or Infinity: every JSON file each command writes (summary.json,
study.json, checkpoints, the viewer page's inlined data, ``budget --json``) parsed by a parser that
rejects them, on tiny models with small settings; the degenerate cases that used to write NaN (a
model whose W_O is zero for ablate, corrupted prompts equal to clean for patch) say why a value is
null; and patch refuses a float16 overflow with one line, as scan and ablate do."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import zoo

from headprobe.cli import main
from headprobe.probe.core.io import ENVELOPE_KEYS, device_name, finite_json, write_json

SMALL = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "--device", "cpu"]
STUDY = ["study", "heads", "--steps", "2", "--eval-every", "2", "--seeds", "0", "--d-model", "16", "--device", "cpu"]
STUDY += ["--n-heads-list", "1,2", "--corpus", "copy"]  # the tiny heads study, two heads counts on the copy corpus


def _reject(word: str):
    raise ValueError(f"bare {word} in JSON")


def strict_loads(text: str):
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (RFC 8259 has none of them)."""
    return json.loads(text, parse_constant=_reject)


def test_strict_parser_rejects_what_pythons_json_writes_for_nan():
    assert strict_loads('{"a": [1.5, null]}') == {"a": [1.5, None]}
    for bad in (json.dumps(float("nan")), json.dumps([float("inf")]), json.dumps({"x": -float("inf")})):
        with pytest.raises(ValueError, match="bare"):
            strict_loads(bad)


def test_write_json_turns_every_non_finite_float_into_null(tmp_path):
    obj = {"nan": float("nan"), "deep": [{"inf": float("inf")}, (np.float64("-inf"), 2.5)], "ok": 1, "s": "NaN"}
    write_json(tmp_path / "x.json", obj)
    assert strict_loads((tmp_path / "x.json").read_text()) == {
        "nan": None,
        "deep": [{"inf": None}, [None, 2.5]],
        "ok": 1,
        "s": "NaN",
    }
    assert finite_json([1.0, float("nan")]) == [1.0, None] and obj["nan"] != obj["nan"]  # the caller's object untouched


def _json_texts(out: Path) -> dict[str, str]:
    """Every JSON text under ``out``: each ``*.json`` file and each viewer page's inlined data."""
    texts = {str(p.relative_to(out)): p.read_text(encoding="utf-8") for p in sorted(out.rglob("*.json"))}
    for page in sorted(out.rglob("*.html")):
        for i, m in enumerate(
            re.finditer(r'<script type="application/json"[^>]*>(.*?)</script>', page.read_text(encoding="utf-8"), re.S)
        ):
            texts[f"{page.relative_to(out)}#{i}"] = m.group(1)
    return texts


@pytest.fixture(scope="module")
def models(tiny_tokenizer, tmp_path_factory):
    """Model directories: a tiny Llama (2 layers x 4 heads), the same with W_O zero in every layer, and
    the same with its last MLP scaled up so that float16 overflows (float32 is fine)."""
    root = tmp_path_factory.mktemp("json-models")

    def save(name, change=None):
        ckpt = zoo.make_checkpoint("llama", tiny_tokenizer)
        if change is not None:
            with torch.no_grad():
                change(ckpt.hf_model.model)
        ckpt.hf_model.save_pretrained(root / name)
        tiny_tokenizer.save_pretrained(root / name)
        return str(root / name)

    def zero_wo(m):
        for layer in m.layers:
            layer.self_attn.o_proj.weight.zero_()

    def overflow(m):
        mlp = m.layers[-1].mlp
        mlp.gate_proj.weight.mul_(10)
        mlp.up_proj.weight.mul_(1e3)
        mlp.down_proj.weight.mul_(1e3)

    return {"llama": save("llama"), "zero_wo": save("zero_wo", zero_wo), "overflow": save("overflow", overflow)}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Prompt-pair files for patch: ``distinct`` (corrupted differs from clean) and ``same`` (equal)."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("json-prompts")
    pairs = []
    for _ in range(4):
        a, b = rng.choice(100, 2, replace=False)
        pairs.append(
            {
                "clean": " ".join(f"t{j}" for j in rng.integers(0, 100, 7)),
                "corrupted": " ".join(f"t{j}" for j in rng.integers(0, 100, 7)),
                "correct": f" t{a}",
                "wrong": f" t{b}",
            }
        )
    (root / "distinct.jsonl").write_text("\n".join(map(json.dumps, pairs)), encoding="utf-8")
    (root / "same.jsonl").write_text(
        "\n".join(json.dumps({**p, "corrupted": p["clean"]}) for p in pairs), encoding="utf-8"
    )
    return {"distinct": str(root / "distinct.jsonl"), "same": str(root / "same.jsonl")}


def _argv(name: str, models, prompts, text: str) -> list[str]:
    t = ["--text", text]
    return {
        "scan": ["scan", "--model", models["llama"], *t, *SMALL, "-k", "2", "--n-random", "2", "--html"],
        "ablate": ["ablate", "--model", models["llama"], *t, *SMALL],
        "ablate_zero_wo": ["ablate", "--model", models["zero_wo"], *t, *SMALL],
        "ablate_estimate": ["ablate", "--model", models["zero_wo"], *t, *SMALL, "--estimate", "attribution"],
        "scan_one_sequence": [
            "scan",
            "--model",
            models["llama"],
            *t,
            *SMALL,
            "-k",
            "2",
            "--n-random",
            "2",
            "--html",
            "--n-natural",
            "1",
            "--n-repeated",
            "1",
            "--no-metrics",
        ],
        "prune": [
            "prune",
            "--model",
            models["llama"],
            *t,
            *SMALL,
            "--step-fraction",
            "0.5",
            "--l0-steps",
            "2",
            "--l0-lambdas",
            "10",
            "--n-seeds",
            "1",
            "--save-pruned",
            "--save-fraction",
            "0.5",
        ],
        "patch": ["patch", "--model", models["llama"], "--prompts", prompts["distinct"], "--device", "cpu"],
        "patch_same": ["patch", "--model", models["llama"], "--prompts", prompts["same"], "--device", "cpu"],
        "train": [
            "train",
            *zoo.tiny_train_flags(4, 2, n_eval=4),
        ],
        "study": STUDY,
        "atlas": [
            "atlas",
            "--models",
            models["llama"],
            models["zero_wo"],
            *t,
            *SMALL,
            "-k",
            "2",
            "--n-random",
            "2",
            "--pattern-len",
            "0",
            "--no-model-figures",
            "--types",
            "induction,previous_token",
        ],
        "show": [
            "show",
            "--model",
            models["llama"],
            "--head",
            "1.1",
            "--prompt",
            "t1 t2 t3 t1 t2 t3",
            "--device",
            "cpu",
        ],
        "circuit": [
            "circuit",
            "--model",
            models["llama"],
            "--n-seqs",
            "1",
            "--period",
            "5",
            "--steps",
            "2",
            "--verify",
            "3",
            "--qk-head",
            "1.0",
            "--device",
            "cpu",
        ],
        "circuit_zero_wo": [
            "circuit",
            "--model",
            models["zero_wo"],
            "--n-seqs",
            "1",
            "--period",
            "5",
            "--steps",
            "2",
            "--verify",
            "3",
            "--device",
            "cpu",
        ],
        "kv": [
            "kv",
            "--model",
            models["llama"],
            *t,
            "--seq-len",
            "48",
            "--block-len",
            "8",
            "--n-random",
            "1",
            "--device",
            "cpu",
        ],
        "kv_zero_wo": [
            "kv",
            "--model",
            models["zero_wo"],
            *t,
            "--seq-len",
            "48",
            "--block-len",
            "8",
            "--n-random",
            "1",
            "--method",
            "measured",
            "--loss-tolerance",
            "0.01",
            "--device",
            "cpu",
        ],
    }[name]


COMMANDS = [
    "scan",
    "scan_one_sequence",
    "ablate",
    "ablate_zero_wo",
    "ablate_estimate",
    "prune",
    "patch",
    "patch_same",
    "train",
    "study",
    "atlas",
    "show",
    "circuit",
    "circuit_zero_wo",
    "kv",
    "kv_zero_wo",
]
_RUNS: dict[str, Path] = {}


@pytest.fixture
def run_command(models, prompts, text_file, tmp_path_factory):
    """``run_command(name)``: run command ``name`` once per session into its own directory, which it returns."""

    def go(name: str) -> Path:
        if name not in _RUNS:
            out = tmp_path_factory.mktemp(f"json-{name}") / "out"
            with pytest.MonkeyPatch.context() as mp:  # scan's figures (20 s here) hold no JSON; test_scan.py tests them
                mp.setattr("headprobe.commands.scan.figure_makers", lambda result: {})
                assert main([*_argv(name, models, prompts, str(text_file)), "--out", str(out)]) == 0, name
            _RUNS[name] = out
        return _RUNS[name]

    return go


@pytest.mark.parametrize("name", COMMANDS)
def test_every_json_a_command_writes_is_strict(name, run_command):
    out = run_command(name)
    texts = _json_texts(out)
    assert texts, f"{name} wrote no JSON"
    assert name == "show" or "summary.json" in texts or "study.json" in texts
    for file, text in texts.items():
        strict_loads(text)  # raises on a bare NaN / Infinity, naming it
        assert not re.search(r"\bNaN\b|\bInfinity\b", text.replace('"NaN"', "")), file


def test_view_of_a_scan_writes_strict_data(run_command):
    out = run_command("scan")
    (out / "index.html").unlink()
    assert main(["view", str(out)]) == 0
    assert strict_loads(_json_texts(out)["index.html#0"])["n_heads"] == 4


def test_budget_json_is_strict(capsys):
    assert main(["budget", "--preset", "llama3-8b", "--seq-len", "8192", "--json"]) == 0
    strict_loads(capsys.readouterr().out)


def test_ablate_of_a_zero_wo_model_says_why_its_correlations_are_null(run_command):
    """W_O = 0: every head's ablation changes nothing, so every effect (and importance) is the same and
    Spearman's rho is undefined (it was NaN in summary.json): null, with the reason."""
    s = strict_loads((run_command("ablate_zero_wo") / "summary.json").read_text())
    assert all(
        v == 0 for t in ("natural", "repeated") for v in (e["loss_delta"] for e in s["top_heads_by_loss_delta"][t])
    )
    nulls = [
        *(f"{t}.{k}" for t, d in s["spearman_with_exact_sweep"].items() for k, v in d.items() if v is None),
        *(
            ["induction_score_vs_repeated_loss_delta"]
            if s["spearman_induction_score_vs_repeated_loss_delta"] is None
            else []
        ),
    ]
    assert len(nulls) == 9 and sorted(s["spearman_null_reasons"]) == sorted(nulls)
    assert all("the same for every head" in why for why in s["spearman_null_reasons"].values())
    ok = strict_loads((run_command("ablate") / "summary.json").read_text())  # a sound model: every rho, no reasons
    assert ok["spearman_null_reasons"] == {} and None not in ok["spearman_with_exact_sweep"]["natural"].values()


def test_scan_of_a_zero_wo_model_says_why_its_compositions_are_null(run_command, models):
    """W_O = 0: K-composition ||W_QK^T W_OV|| / (||W_QK|| ||W_OV||) is 0/0 for every pair (it was NaN)."""
    out = run_command("atlas")
    atlas = strict_loads((out / "summary.json").read_text())
    s = strict_loads((out / atlas["models"][models["zero_wo"]]["dir"] / "summary.json").read_text())
    k = s["metrics"]["k_composition_previous_token_to_induction"]
    assert k["pairs"] and set(k["pairs"].values()) == {None} and "0/0" in k["pairs_null_reason"]
    assert k["pairs_stats"] == {"n": 0} and k["pairs_percentile_in_all"] is None
    ok = strict_loads((out / atlas["models"][models["llama"]]["dir"] / "summary.json").read_text())
    assert "pairs_null_reason" not in ok["metrics"]["k_composition_previous_token_to_induction"]


def test_patch_of_identical_prompts_says_why_normalised_effects_are_null(run_command):
    """Corrupted = clean: every effect is 0 and the normaliser 0, so effect / normaliser is 0/0."""
    s = strict_loads((run_command("patch_same") / "summary.json").read_text())
    assert s["normaliser"] == 0 and s["clean_logit_diff"] == s["corrupted_logit_diff"]
    assert all(h["effect"] == 0 and h["normalized"] is None for h in s["top_heads"]) and len(s["top_heads"]) == 8
    assert "normaliser 0" in s["normalized_null_reason"]
    assert "normalized_null_reason" not in strict_loads((run_command("patch") / "summary.json").read_text())


def test_patch_refuses_a_float16_overflow_in_one_line(models, prompts, tmp_path, capsys):
    """The same model runs in float32; in float16 its last MLP overflows (65504). patch wrote 39 NaNs and
    exit 0; now, like scan and ablate, one line and exit 2, nothing written."""
    base = [
        "patch",
        "--model",
        models["overflow"],
        "--prompts",
        prompts["distinct"],
        "--device",
        "cpu",
        "--backend",
        "native",
    ]
    assert main([*base, "--out", str(tmp_path / "f32")]) == 0
    capsys.readouterr()
    assert main([*base, "--dtype", "float16", "--out", str(tmp_path / "f16")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert len(lines) == 1 and "NaN or Inf in float16" in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "f16").exists()
    assert (
        main(
            [
                "scan",
                "--model",
                models["overflow"],
                "--dtype",
                "float16",
                "--backend",
                "native",
                *SMALL,
                "--no-verify",
                "--out",
                str(tmp_path / "s16"),
            ]
        )
        == 2
    )  # scan's refusal, for comparison
    assert "NaN or Inf" in capsys.readouterr().err and not (tmp_path / "s16").exists()


def test_scan_of_one_sequence_says_why_its_intervals_are_null(run_command):
    """--n-natural 1 --n-repeated 1: a bootstrap over one sequence has no interval. Every score_ci95 and
    top_effect_ci95 was [null, null] with no reason, and ablation.caption.txt (and the terminal)
    said "[95% CI +nan, +nan]"; now null with the reason per task, and "n/a" in the text."""
    out = run_command("scan_one_sequence")
    s = strict_loads((out / "summary.json").read_text())
    cis = [
        *(e["score_ci95"] for entries in s["top_heads"].values() for e in entries if "score_ci95" in e),
        *(a["top_effect_ci95"] for a in s["ablations"]),
    ]
    assert cis and all(ci == [None, None] for ci in cis)
    assert set(s["interval_null_reasons"]) == {"natural", "repeated"}
    assert all("at least 2 sequences" in why for why in s["interval_null_reasons"].values())
    caption = (out / "ablation.caption.txt").read_text()
    assert "[95% CI n/a]" in caption and not re.search(r"\bnan\b|\binf\b", caption, re.I), caption
    assert "interval_null_reasons" not in strict_loads((run_command("scan") / "summary.json").read_text())


def test_format_interval_never_prints_nan():
    from headprobe.analyses.figures import format_interval

    assert (
        format_interval(float("nan"), float("nan"), "+.2f") == "[n/a]" and format_interval(None, 1.0, "+.2f") == "[n/a]"
    )
    assert format_interval(-0.5, 0.25, "+.2f", "95% CI ") == "[95% CI -0.50, +0.25]"


def test_circuit_of_a_zero_wo_model_says_why_its_correlations_are_null(run_command):
    """W_O = 0: every exact path-patching effect and every edge score is 0, so Spearman's and Pearson's
    correlations are undefined: they were null with no reason, and the terminal report raised a
    TypeError (formatting None) after summary.json was written; now null with the reason, exit 0."""
    s = strict_loads((run_command("circuit_zero_wo") / "summary.json").read_text())
    a = s["agreement"]
    assert a["spearman"] is None and a["pearson"] is None and {"spearman", "pearson"} <= set(a["null_reasons"])
    assert all("the same on every verified edge" in a["null_reasons"][k] for k in ("spearman", "pearson"))
    assert any(e["exact"] is None for e in s["top_edges"]) and "not path patched" in s["exact_null_reason"]
    ok = strict_loads((run_command("circuit") / "summary.json").read_text())["agreement"]
    # a healthy run's correlations are numbers (its recall is null only where it verified <= k edges)
    assert not {"spearman", "pearson"} & set(ok.get("null_reasons", {})) and ok["spearman"] is not None
    assert (ok["top_k_recall"] is None) == (ok["n_edges"] <= ok["top_k"])


def test_scan_of_a_pruned_model_writes_its_page_and_no_null_score(run_command, text_file, tmp_path):
    """A pruned model's removed heads have no score (NaN; pandas' NA in the integer columns): scan
    --html raised "boolean value of NA is ambiguous" in the viewer (no summary.json), and the
    metrics' top heads listed removed heads with "score": null; now the page is written and only
    heads with a score are listed."""
    model = run_command("prune") / "pruned_model"
    out = tmp_path / "scan"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("headprobe.commands.scan.figure_makers", lambda result: {})
        assert (
            main(
                [
                    "scan",
                    "--model",
                    str(model),
                    "--text",
                    str(text_file),
                    *SMALL,
                    "-k",
                    "1",
                    "--n-random",
                    "2",
                    "--html",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    texts = _json_texts(out)
    for text in texts.values():
        strict_loads(text)
    s = strict_loads(texts["summary.json"])
    assert s["removed_heads"] and s["metrics"]["top_heads"]
    assert all(
        e["score"] is not None and e["head"] not in s["removed_heads"]
        for entries in s["metrics"]["top_heads"].values()
        for e in entries
    )
    rows = strict_loads(texts["index.html#0"])["rows"]
    assert any(None in r for r in rows)  # the removed heads' cells: null on the page


def test_study_of_one_seed_says_why_its_spreads_are_null(run_command):
    """One seed: no standard deviation over seeds (pandas' std of one value is NaN): null, and why."""
    s = strict_loads((run_command("study") / "study.json").read_text())
    for row in s["per_variant"].values():
        assert row["eval_loss_sd"] is None and row["in_context_loss_sd"] is None and "one seed" in row["sd_null_reason"]


@pytest.mark.parametrize(
    "argv",
    [
        [
            "train",
            *zoo.tiny_train_flags(2, 2, n_eval=4),
            "--lr",
            "1e6",
        ],
        [*STUDY, "--lr", "1e6"],
    ],
    ids=["train", "study"],
)
def test_training_that_diverges_at_its_last_step_is_refused(argv, tmp_path, capsys):
    """An update that makes the weights (or the forward pass) NaN at the last step shows in no training
    loss: train wrote a NaN model and a summary of nulls with no reason, study wrote "loss nan" and
    nulls, both exit 0. Now both refuse it as train refused a NaN loss: one line, exit 2, nothing written."""
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "training diverged at step 2" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_budget_says_why_a_window_never_crosses_over(capsys):
    """A sliding window so small that the projections dominate at every length: crossover_seq_len is
    null (never), with the reason beside it; --json stays strict."""
    assert main(["budget", "--preset", "llama3-8b", "--sliding-window", "16", "--seq-len", "8192", "--json"]) == 0
    rows = strict_loads(capsys.readouterr().out)["windowed_layers"]
    assert rows[0]["crossover_seq_len"] is None and "projections dominate" in rows[0]["crossover_seq_len_null_reason"]
    assert (
        main(
            [
                "budget",
                "--preset",
                "llama3-8b",
                "--sliding-window",
                "8000",
                "--global-every",
                "2",
                "--seq-len",
                "8192",
                "--json",
            ]
        )
        == 0
    )
    assert all(
        "crossover_seq_len_null_reason" not in r for r in strict_loads(capsys.readouterr().out)["windowed_layers"]
    )


LOADS_A_MODEL = {
    "scan",
    "scan_one_sequence",
    "ablate",
    "ablate_zero_wo",
    "ablate_estimate",
    "prune",
    "patch",
    "patch_same",
    "circuit",
    "circuit_zero_wo",
    "kv",
    "kv_zero_wo",
}
"""The commands (of COMMANDS) that load one model: their summary's timings carry ``load_s``."""


@pytest.mark.parametrize("name", [c for c in COMMANDS if c != "show"])
def test_every_summary_has_the_common_envelope(name, run_command, models, prompts, text_file):
    """Every command's summary.json (study.json) has the keys they all share, built in one place:
    model, weights_precision, device, self_check, command (the words given to ``headprobe``, as
    typed), config, timings_s (with load_s wherever a model was loaded; no ``seconds`` of its own)
    and versions."""
    out = run_command(name)
    s = json.loads((out / ("study.json" if name == "study" else "summary.json")).read_text(encoding="utf-8"))
    assert set(ENVELOPE_KEYS) <= set(s), name
    assert s["command"] == [*_argv(name, models, prompts, str(text_file)), "--out", str(out)], s["command"]
    assert "seconds" not in s and "train_seconds" not in s
    assert s["device"] == "cpu" and isinstance(s["config"], dict) and s["config"] and "python" in s["versions"]
    assert s["device_name"] == device_name("cpu") and s["device_name"] and s["tf32"] is None
    assert all(isinstance(v, (int, float)) and v >= 0 for v in s["timings_s"].values()) and s["timings_s"]
    assert ("load_s" in s["timings_s"]) == (name in LOADS_A_MODEL), s["timings_s"]
    # the process's high-water mark (this worker's, which loaded torch: over 100 MiB), no GPU on the CPU
    assert s["peak_memory"]["host_rss_bytes"] > 100 * 2**20 and s["peak_memory"]["gpu_allocated_bytes"] is None
    if name in LOADS_A_MODEL or name == "train":  # one model: its name, precision and self-check
        assert s["model"] and s["weights_precision"] and s["self_check"]["ok"] is True, name
    else:  # an atlas of models, a study of trained ones: no one model
        assert s["model"] is None and s["weights_precision"] is None
    if name == "atlas":
        assert all("scan_s" in m["timings_s"] and "seconds" not in m for m in s["models"].values())


def test_peak_memory_is_the_processs_high_water_mark_in_bytes():
    """``host_rss_bytes`` is ``ru_maxrss`` read in bytes: about the resident set now (``/proc/self/status``
    VmRSS, kB) or more, at most the high-water mark read after (VmHWM); no GPU off CUDA."""
    from headprobe.probe.core.io import peak_memory

    def status(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    rss = status("VmRSS")
    got = peak_memory("cpu")
    # the kernel updates the mark lazily (it can trail the resident set by a few pages); KiB taken as bytes: 1024x off
    assert 0.9 * rss <= got["host_rss_bytes"] <= status("VmHWM") + 2**20 and got["gpu_allocated_bytes"] is None


def test_the_envelope_is_built_in_one_place():
    """A summary's own keys may not set the envelope's. ``command`` is the command line's words
    within :func:`command_line` (the CLI's run), null outside (a run from Python)."""
    from headprobe.probe.core.io import command_line, summary_envelope

    kw = dict(
        model="m", precision="float32", device="cpu", self_check=None, config={"a": 1}, timings_s={"load_s": 0.123}
    )
    s = summary_envelope({"x": 1}, **kw)
    assert list(s) == [
        "model",
        "weights_precision",
        "x",
        "device",
        "device_name",
        "tf32",
        "self_check",
        "command",
        "config",
        "timings_s",
        "peak_memory",
        "versions",
    ]
    assert [k for k in s if k != "x"] == list(ENVELOPE_KEYS)
    assert s["timings_s"] == {"load_s": 0.12} and s["command"] is None
    with command_line(("kv", "--model", "m", "--out", "o")):
        assert summary_envelope({}, **kw)["command"] == ["kv", "--model", "m", "--out", "o"]
    assert summary_envelope({}, **kw)["command"] is None  # the block's end restores it
    with pytest.raises(ValueError, match="model"):
        summary_envelope({"model": "other"}, **kw)


def test_tf32_is_recorded_for_cuda_runs():
    """summary.json's tf32: torch's flag for CUDA float32 matrix products where the run used CUDA
    (off by default; on after set_float32_matmul_precision("high")), null elsewhere."""
    from headprobe.probe.core.io import summary_envelope

    kw = dict(model="m", precision="float32", self_check=None, config={}, timings_s={})
    assert torch.backends.cuda.matmul.allow_tf32 is False  # torch's default
    assert summary_envelope({}, device="cuda:0", **kw)["tf32"] is False
    assert summary_envelope({}, device="cpu", **kw)["tf32"] is None
    torch.set_float32_matmul_precision("high")
    try:
        assert summary_envelope({}, device="cuda:0, cuda:1, cpu (--device-map)", **kw)["tf32"] is True
        assert summary_envelope({}, device=None, **kw)["tf32"] is None
    finally:
        torch.set_float32_matmul_precision("highest")
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_device_name_is_the_gpu_on_cuda_and_the_cpu_else(monkeypatch):
    """summary.json's device_name: torch.cuda's name of each CUDA device a run used (CUDA mocked
    here), the CPU's model name from /proc/cpuinfo on the CPU, null without a device."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    names = (
        [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        if cpuinfo.exists()
        else []
    )
    assert device_name("cpu") == (names[0] if names else platform.processor() or platform.machine())
    assert device_name(None) is None
    assert device_name("cuda:0") is None  # no GPU: nothing to name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: ["NVIDIA H200", "NVIDIA A100"][i])
    assert device_name("cuda:0") == "NVIDIA H200" and device_name("cuda") == "NVIDIA A100"
    assert device_name("cuda:0, cuda:1, cpu (--device-map)") == "NVIDIA H200, NVIDIA A100"
    assert device_name("auto") == "NVIDIA A100"
