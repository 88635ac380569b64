"""``headprobe show``: one head's pattern on the user's text, equal to the model's own pattern."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_loading import assert_one_line_error, run_cli

from headprobe.commands.show import ShowConfig, run
from headprobe.probe.core.io import OUTPUTS_NAME

PROMPT = "t1 t2 t3 t4 t5 t1 t2 t3 t4 t5"


@pytest.mark.all_figure_formats  # checks the PDF/SVG files
def test_show_draws_the_heads_own_pattern(tiny_dir, tmp_path):
    import headprobe

    result = run(ShowConfig(model=str(tiny_dir), head="L1H5", prompt=PROMPT, out=str(tmp_path / "o"), device="cpu"))
    assert result.head == (1, 5)
    model = headprobe.load_model(str(tiny_dir), quiet=True)
    tokens = model.to_tokens(PROMPT)
    ref = headprobe.capture_heads(model, tokens, layers=[1])["pattern"][1][0, 5].float().numpy()
    assert result.pattern.dtype == np.float32
    np.testing.assert_allclose(result.pattern, ref, rtol=1e-6, atol=1e-7)  # the head's own, not the page's float16
    assert len(result.labels) == tokens.shape[1] and result.labels[1] == "t1"
    names = sorted(p.name for p in result.paths)
    assert names == ["index.html", "pattern_1.5.pdf", "pattern_1.5.png", "pattern_1.5.svg"]
    page = (tmp_path / "o" / "index.html").read_text()
    data = json.loads(re.search(r'id="headprobe-data">(.*?)</script>', page, re.S).group(1))
    assert data["selected"] == "1.5" and data["n_layers"] * data["n_heads"] == len(data["rows"])


def test_show_takes_a_loaded_model_as_every_command_function_does(tiny_dir, tmp_path):
    """``headprobe.show(loaded, ...)`` draws what ``show(path, ...)`` draws (it took a name only)."""
    import headprobe

    model = headprobe.load_model(str(tiny_dir), quiet=True)
    by_model = headprobe.show(model, head="1.5", prompt=PROMPT, out=tmp_path / "a")
    by_name = headprobe.show(str(tiny_dir), head="1.5", prompt=PROMPT, out=tmp_path / "b", device="cpu")
    np.testing.assert_array_equal(by_model.pattern, by_name.pattern)
    assert by_model.labels == by_name.labels and [p.name for p in by_model.paths] == [p.name for p in by_name.paths]


def test_show_with_no_figures_draws_none_and_writes_the_page(tiny_dir, tmp_path, monkeypatch):
    """The suite's ``--formats none``: the pattern figure is not drawn, the page is written."""
    from headprobe.analyses import figures as figs

    monkeypatch.setattr(figs, "pattern_plot", lambda *a, **k: pytest.fail("drawn with --formats none"))
    result = run(ShowConfig(model=str(tiny_dir), head="1.5", prompt=PROMPT, out=str(tmp_path / "o"), device="cpu"))
    assert [p.name for p in result.paths] == ["index.html"] and sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        OUTPUTS_NAME,
        "index.html",
    ]


def test_show_refuses_bad_heads_and_prompts_in_one_line(tiny_dir, tmp_path):
    rc, _, err = run_cli(
        "show", "--model", str(tiny_dir), "--head", "7.0", "--prompt", PROMPT, "--out", str(tmp_path / "a")
    )
    assert_one_line_error(rc, err, "out of range")
    assert not (tmp_path / "a").exists()  # nothing half-written
    rc, _, err = run_cli("show", "--head", "1.1,1.2", "--prompt", "x", "--out", str(tmp_path / "b"))
    assert_one_line_error(rc, err, "one head")
    rc, _, err = run_cli(
        "show", "--model", str(tiny_dir), "--head", "1.1", "--prompt", "  ", "--out", str(tmp_path / "c")
    )
    assert_one_line_error(rc, err, "prompt is empty")


def test_show_draws_a_window_of_a_long_prompt(tiny_dir, tmp_path, monkeypatch):
    """Past MAX_TOKENS the figure is the window of the last queries against the sink and the last
    keys, equal to those cells of the whole pattern; the page keeps the first MAX_TOKENS tokens."""
    import headprobe
    from headprobe.commands import show

    monkeypatch.setattr(show, "MAX_TOKENS", 16)
    monkeypatch.setattr(show, "LONG_WINDOW", 8)
    prompt = " ".join(f"t{(7 * i) % 50}" for i in range(40))
    result = run(ShowConfig(model=str(tiny_dir), head="L1H2", prompt=prompt, out=str(tmp_path / "o"), device="cpu"))
    model = headprobe.load_model(str(tiny_dir), quiet=True)
    tokens = model.to_tokens(prompt)
    n = tokens.shape[1]
    full = headprobe.capture_heads(model, tokens, layers=[1])["pattern"][1][0, 2].float().numpy()
    rows, cols = list(range(n - 8, n)), [0, 1, 2, 3, n - 4, n - 3, n - 2, n - 1]
    assert result.pattern.shape == (8, 8)
    np.testing.assert_allclose(result.pattern, full[rows][:, cols], atol=1e-6)
    page = (tmp_path / "o" / "index.html").read_text()
    assert f"first 16 of {n} tokens" in page


def test_show_page_lists_the_models_columns_with_repeat_scores_in_the_pngs_colours(tiny_dir, tmp_path):
    """A decoder's page has no next-token or last-token column (encoder-only, all 0 before); it has
    duplicate-token and induction on the prompt (here a repeated block: scan's block scores, from the
    model's own pattern); its pattern is drawn in the PNG's colour map, masked keys in the PNG's grey."""
    import matplotlib

    import headprobe
    from headprobe.analyses import figures as figs
    from headprobe.analyses.detectors import duplicate_token_score, induction_score

    run(ShowConfig(model=str(tiny_dir), head="1.5", prompt=PROMPT, out=str(tmp_path / "o"), device="cpu"))
    page = (tmp_path / "o" / "index.html").read_text()
    data = json.loads(re.search(r'id="headprobe-data">(.*?)</script>', page, re.S).group(1))
    assert "next_token" not in data["columns"] and "last_token" not in data["columns"]
    assert {"previous_token", "duplicate_token", "induction"} <= set(data["columns"])
    model = headprobe.load_model(str(tiny_dir), quiet=True)
    tokens = model.to_tokens(PROMPT)
    ids = tokens[0].tolist()
    start = int(ids[0] == model.tokenizer.bos_token_id)
    period = ids[start:].index(ids[start], 1)  # "t1" again: a repeated block of `period` tokens
    assert (
        ids[start : start + period] == ids[start + period : start + 2 * period]
        and len(set(ids[start : start + period])) == period
    )
    pattern = headprobe.capture_heads(model, tokens, layers=[1])["pattern"][1].float()
    row = next(r for r in data["rows"] if r[:2] == [1, 5])
    col = {c: row[3 + i] for i, c in enumerate(data["columns"])}
    assert col["induction"] == pytest.approx(float(induction_score(pattern, period, start)[5]), abs=2e-3)
    assert col["duplicate_token"] == pytest.approx(float(duplicate_token_score(pattern, period, start)[5]), abs=2e-3)
    png = figs.pattern_plot(np.eye(3), ["a", "b", "c"], "t", causal=True).axes[0].images[0].cmap
    assert data["pattern_cmap"] == png.name
    ref = matplotlib.colormaps[data["pattern_cmap"]]
    assert data["colormaps"][data["pattern_cmap"]][255] == matplotlib.colors.to_hex(ref(1.0))
    assert data["masked_color"] == matplotlib.colors.to_hex(png.get_bad())


def test_show_refuses_a_head_in_a_linear_attention_layer(tmp_path, tiny_tokenizer, capsys):
    """A hybrid's linear-attention layer has no pattern to draw (it drew rows summing to 0)."""
    from test_exchange import hybrid_dir

    from headprobe.cli import main

    model = hybrid_dir(tiny_tokenizer, tmp_path / "hybrid")
    capsys.readouterr()
    code = main(
        [
            "show",
            "--model",
            str(model),
            "--head",
            "0.1",
            "--prompt",
            PROMPT,
            "--out",
            str(tmp_path / "o"),
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("headprobe: error:")]
    assert code == 2 and len(errors) == 1 and "layer 0 has no heads (linear attention)" in errors[0], err
    assert "Traceback" not in err and not (tmp_path / "o").exists()
    assert (
        main(
            [
                "show",
                "--model",
                str(model),
                "--head",
                "1.1",
                "--prompt",
                PROMPT,
                "--out",
                str(tmp_path / "p"),
                "--device",
                "cpu",
            ]
        )
        == 0
    )  # a head of an attention layer is drawn


def test_show_prints_the_model_header_first_as_the_other_commands_do(tiny_dir, tmp_path, capsys):
    """The runner of the other commands prints ``describe_model`` of the model it loaded first
    (:func:`headprobe.options.run_command`); show prints the same line for the model it loads."""
    from headprobe import options
    from headprobe.cli import main

    argv = ["show", "--model", str(tiny_dir), "--head", "1.5", "--prompt", PROMPT, "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    config = ShowConfig(model=str(tiny_dir), head="1.5", prompt=PROMPT, out=str(tmp_path / "x"), device="cpu")
    header = options.describe_model(options.load_for(config))
    assert header.startswith(f"model {tiny_dir} on cpu") and "backend" in header
    assert lines[0] == header, lines
    assert lines[-1].startswith("head 1.5 on ") and header not in lines[1:]


@pytest.mark.figures  # draws the PNG
def test_a_long_prompts_figure_breaks_the_key_axis_and_names_the_keys_not_drawn(tiny_dir, tmp_path, monkeypatch):
    """Past MAX_TOKENS the figure's key axis said "key positions 0–39 of 40" while only the sink
    keys and the last keys were drawn, side by side: the kept ranges are separate panels now and
    the label says which keys are drawn and which are not."""
    from headprobe.analyses import figures as figs
    from headprobe.commands import show

    monkeypatch.setattr(show, "MAX_TOKENS", 16)
    monkeypatch.setattr(show, "LONG_WINDOW", 8)
    drawn = []
    plot = figs.pattern_plot
    monkeypatch.setattr(figs, "pattern_plot", lambda *a, **k: drawn.append(plot(*a, **k)) or drawn[-1])
    prompt = " ".join(f"t{(7 * i) % 50}" for i in range(40))
    result = run(ShowConfig(model=str(tiny_dir), head="1.2", prompt=prompt, out=str(tmp_path / "o"), device="cpu"))
    n = len(result.labels)
    assert (tmp_path / "o" / "pattern_1.2.png").is_file()
    (fig,) = drawn
    assert len([ax for ax in fig.axes if ax.images]) == 2
    text = fig.get_supxlabel()
    assert text.startswith(f"key position, 0–3 and {n - 4}–{n - 1} of {n}\n(4–{n - 5} not drawn)"), text


def test_prompt_file_makes_a_config_the_type_checks_accept(tiny_dir, tmp_path, capsys, monkeypatch):
    """``--prompt-file`` leaves ``--prompt`` None until main reads the file into the Config; the Config
    made from the flags said ``prompt: str``, so under the suite's type checks (jaxtyping and beartype,
    pyproject's addopts) the command ended in a TypeCheckError traceback before reading the file.
    Now it reads the file and reaches the model's load (stubbed), the file's text as the prompt."""
    from headprobe import options
    from headprobe.cli import main
    from headprobe.probe.core.errors import HeadprobeError

    seen = []

    def stop(config):
        seen.append(config.prompt)
        raise HeadprobeError("stub: the model would load now")

    monkeypatch.setattr(options, "load_for", stop)
    (tmp_path / "p.txt").write_text(PROMPT + "\n", encoding="utf-8")
    argv = ["show", "--model", str(tiny_dir), "--head", "1.1", "--prompt-file", str(tmp_path / "p.txt")]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "stub: the model would load now" in capsys.readouterr().err and seen == [PROMPT]


def test_show_summary_is_what_the_cli_builds_its_page_from(tiny_dir, tmp_path):
    """ShowResult had no ``summary()`` (docs/api.md's table said no): it now returns the dict
    index.html is built from; here against the page ``headprobe show`` wrote for the same input."""
    from headprobe.cli import main

    result = run(ShowConfig(model=str(tiny_dir), head="1.5", prompt=PROMPT, out=str(tmp_path / "api"), device="cpu"))
    argv = ["show", "--model", str(tiny_dir), "--head", "1.5", "--prompt", PROMPT, "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "cli"), "--formats", "none"]) == 0
    page = (tmp_path / "cli" / "index.html").read_text()
    data = json.loads(re.search(r'id="headprobe-data">(.*?)</script>', page, re.S).group(1))
    got = result.summary()
    assert set(got) == {"model", "weights_precision", "layout", "selected_head", "notes"}
    assert (got["model"], got["weights_precision"], got["selected_head"], got["notes"]) == (
        data["model"],
        data["weights"],
        data["selected"],
        data["notes"],
    )
    assert got["layout"] == {k: data[k] for k in ("n_layers", "n_heads", "n_kv_heads", "causal")}
    assert data["notes"] and data["selected"] == "1.5"  # not two empty pages agreeing
    got["notes"].append("changed")
    assert result.summary()["notes"] == data["notes"]  # a copy each time


def test_show_why_splits_the_score_of_the_key_the_head_attends_to_most(
    tiny_dir, tiny_llama_gqa_checkpoint, tmp_path, capsys
):
    """``--why Q``: QK attribution of the head's score at query Q (-1: the last) for the key it attends
    to most there: the key is the argmax of Hugging Face's own attention row (output_attentions), and
    why_<head>.csv's key and query sides each sum to the score (the identity); the terminal names the
    query, the key and the largest terms. A query outside the prompt: one line, exit 2, no folder."""
    import pandas as pd
    import torch

    from headprobe.cli import main

    argv = [
        "show",
        "--model",
        str(tiny_dir),
        "--head",
        "1.5",
        "--prompt",
        PROMPT,
        "--device",
        "cpu",
        "--formats",
        "none",
    ]
    assert main([*argv, "--why", "-1", "--out", str(tmp_path / "o")]) == 0
    said = capsys.readouterr().out
    csv = pd.read_csv(tmp_path / "o" / "why_1.5.csv")
    result = run(
        ShowConfig(model=str(tiny_dir), head="1.5", prompt=PROMPT, why=-1, out=str(tmp_path / "p"), device="cpu")
    )
    why = result.why
    hf = tiny_llama_gqa_checkpoint.hf_model
    ids = tiny_llama_gqa_checkpoint.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert ids == [int(w[1:]) for w in PROMPT.split()]  # t<i> is id i
    tokens = torch.tensor([hf.config.bos_token_id, *ids])[None]
    with torch.no_grad():
        row = hf(tokens, output_attentions=True).attentions[1][0, 5, -1]
    assert why.q_pos == tokens.shape[1] - 1 and why.k_pos == int(row.argmax()), (why.k_pos, row)
    assert csv["key_side"].sum() == pytest.approx(why.score, rel=1e-4, abs=1e-5)
    assert csv["query_side"].sum() == pytest.approx(why.score, rel=1e-4, abs=1e-5)
    assert (
        f"why 1.5 attends from {why.q_pos} (" in said and f"to {why.k_pos} (" in said and "key side, largest:" in said
    )
    rc, _, err = run_cli(*argv, "--why", "40", "--out", str(tmp_path / "bad"))
    assert_one_line_error(rc, err, "--why 40: the prompt has 11 tokens")
    assert not (tmp_path / "bad").exists()
