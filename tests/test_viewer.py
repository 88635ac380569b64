"""The head viewer (``headprobe view``, ``scan --html``): the data it stores and embeds, checked
against the model's own capture and hand-made arrays; and the page itself in headless Chromium
(driven by Playwright, opened from file://, no request may leave it). The browser tests skip
only when Playwright or a chromium executable is missing (``.ci/run`` installs Debian's chromium)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from test_loading import assert_one_line_error, run_cli

from headprobe.analyses import viewer
from headprobe.commands import view
from headprobe.commands.scan import ScanConfig, run
from headprobe.probe.core.errors import HeadprobeError

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "figures" / "smollm2-135m"


@pytest.fixture(scope="module")
def tiny_scan_dir(tiny_llama_gqa_native, tmp_path_factory):
    """A scan of the tiny GQA Llama (2 layers x 8 heads, 2 KV heads) without the ablation check,
    saved with --html and without its figures (both take 20 s here and are tested in test_scan.py)."""
    g = torch.Generator().manual_seed(0)
    text = tmp_path_factory.mktemp("text") / "words.txt"
    text.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (800,), generator=g).tolist()), encoding="utf-8")
    cfg = ScanConfig(
        model="tiny", n_natural=2, seq_len=24, n_repeated=2, period=8, k=3, n_random=2, text=str(text), verify=False
    )
    result = run(tiny_llama_gqa_native, cfg, progress=False)
    out = tmp_path_factory.mktemp("scan")
    paths = result.save(out, overwrite=True, html=True, formats="none")
    assert {p.name for p in paths} == {"head_scores.csv", "patterns.npz", "index.html", "summary.json"}
    return out, result


# ----------------------------------------------------------------------------- data, no browser


def test_head_patterns_are_the_models_patterns_and_survive_the_npz(tiny_llama_gqa_native, tiny_scan_dir):
    from headprobe import capture_heads

    out, result = tiny_scan_dir
    for name, ts in (("natural", result.natural), ("repeated", result.repeated)):
        ex = result.patterns[name]
        cap = capture_heads(tiny_llama_gqa_native, ts.tokens[:1])  # the reference: a plain capture, every layer
        ref = torch.stack([cap["pattern"][layer][0] for layer in range(2)]).float().numpy()
        assert ex["pattern"].shape == ref.shape == (2, 8, ts.tokens.shape[1], ts.tokens.shape[1])
        np.testing.assert_allclose(ex["pattern"].astype(np.float32), ref, atol=1e-3)  # float16
        assert ex["ids"].tolist() == ts.tokens[0].tolist()
        assert ex["period"] == ts.period and ex["start"] == ts.start
    loaded = viewer.load_patterns(out / "patterns.npz")
    for name in ("natural", "repeated"):
        assert loaded[name]["labels"] == result.patterns[name]["labels"]
        err = np.abs(loaded[name]["pattern"] - result.patterns[name]["pattern"].astype(np.float32)).max()
        assert err <= 1 / 510 + 1e-3  # uint8 quantisation (+ float16 rounding of the in-memory copy)


def test_view_model_computes_the_scans_patterns_and_names_the_model(
    tiny_llama_gqa_native, tiny_scan_dir, tmp_path, monkeypatch, capsys
):
    """``view DIR --model`` on a scan without patterns.npz: the model's line first, as every command
    that loads a model prints, then the patterns the scan itself saved (its own capture)."""
    from headprobe import options

    out, _ = tiny_scan_dir
    d = tmp_path / "scan"
    shutil.copytree(out, d)
    (d / "patterns.npz").unlink()
    monkeypatch.setattr(options, "load_for", lambda cfg: tiny_llama_gqa_native)
    assert view.run(view.ViewConfig(dir=str(d), model="tiny")) == d / "index.html"
    assert capsys.readouterr().out.splitlines()[0] == options.describe_model(tiny_llama_gqa_native)
    again, saved = viewer.load_patterns(d / "patterns.npz"), viewer.load_patterns(out / "patterns.npz")
    for name in ("natural", "repeated"):
        assert again[name]["labels"] == saved[name]["labels"]
        assert np.abs(again[name]["pattern"] - saved[name]["pattern"]).max() <= 2 / 255


def test_pattern_encoding_round_trips_within_half_a_step():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7), size=(2, 3, 7)).astype(np.float32)  # [layer, head, q, k], rows sum to 1
    back = viewer.decode_pattern(viewer.encode_pattern(p), p.shape)
    assert np.abs(back - p).max() <= 1 / 510 + 1e-7
    exact = np.arange(256, dtype=np.float32).reshape(1, 1, 16, 16) / 255
    np.testing.assert_array_equal(viewer.decode_pattern(viewer.encode_pattern(exact), exact.shape), exact)


def _table(n_layers: int, n_heads: int, n_kv: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    layer, head = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    return pd.DataFrame(
        {
            "layer": layer.ravel(),
            "head": head.ravel(),
            "kv_head": head.ravel() // (n_heads // n_kv),
            "induction": rng.random(n_layers * n_heads),
            "previous_token": rng.random(n_layers * n_heads),
        }
    )


def test_page_data_keeps_every_head_and_no_label_can_end_the_script():
    table = _table(3, 4, 2).sample(frac=1, random_state=0)  # rows in any order
    p = np.full((3, 4, 3, 3), 1 / 3, dtype=np.float32)
    labels = ["</script><b>", "a", '"q"']
    check = {
        "head_type": "induction",
        "kind": "zero",
        "task": "repeated",
        "top_heads": ["2.1", "0.3"],
        "top_effect": 0.7,
        "random_mean": 0.1,
        "random_max": 0.2,
        "p_value": 1 / 6,
        "confirmed": True,
        "top_effect_ci95": [0.5, 0.9],
        "p_adjusted": 0.2,
        "draws": 5,
        "tested": True,
        "alpha": 0.25,
        "correction": "bh",
        "min_effect": 0.05,
    }
    page = viewer.build_page(
        table,
        {"model": "toy", "layout": {"n_kv_heads": 2}, "ablations": [check]},
        {"natural": {"labels": labels, "pattern": p, "period": None, "start": 0}},
    )
    assert page.count("</script>") == 2  # the data tag's and the code's, none from the label
    data = json.loads(re.search(r'id="headprobe-data">(.*?)</script>', page, re.S).group(1))
    assert data["patterns"]["natural"]["labels"] == labels
    assert data["verdicts"] == [
        {
            "head_type": "induction",
            "kind": "zero",
            "task": "repeated",
            "heads": ["2.1", "0.3"],
            "effect": 0.7,
            "random_mean": 0.1,
            "random_max": 0.2,
            "p_value": 0.166667,
            "p_adjusted": 0.2,
            "draws": 5,
            "tested": True,
            "alpha": 0.25,
            "correction": "bh",
            "min_effect": 0.05,
            "ci95": [0.5, 0.9],
            "confirmed": True,
            "exceedances": None,
            "p_bound": False,
            "p_min": None,
            "stop": None,
            "evidence": "p = 0.167 (5 control sets)",
            "unit": "nats/token",  # a row that names no metric is a loss's
            "verdict": "CONFIRMED",
        }
    ]
    # the page shows 3 decimals of what the data keeps: a rounding of a rounding (0.076531 -> 0.0765 ->
    # 0.076) would show a number that is not the value's; each kept value rounds as the value does
    near = {**check, "p_value": 0.06122449, "p_adjusted": 0.07653061, "top_effect": 0.0946489}
    kept = viewer.viewer_data(table, {"model": "toy", "ablations": [near]})["verdicts"][0]
    assert [f"{kept[k]:.3f}" for k in ("p_value", "p_adjusted", "effect")] == ["0.061", "0.077", "0.095"]
    no_verdict = {**check, "confirmed": None}
    page = viewer.build_page(
        table, {"model": "toy", "ablations": [no_verdict], "warnings": ["natural task: unknown text"]}
    )
    data = json.loads(re.search(r'id="headprobe-data">(.*?)</script>', page, re.S).group(1))
    assert data["verdicts"][0]["verdict"] == "no verdict" and data["verdicts"][0]["confirmed"] is None
    assert data["warnings"] == ["natural task: unknown text"]
    assert (data["n_layers"], data["n_heads"], data["group_size"]) == (3, 4, 2)
    ref = table.sort_values(["layer", "head"])
    assert [r[3] for r in data["rows"]] == pytest.approx(ref["induction"].round(5).tolist())
    assert [m["column"] for m in data["maps"]] == ["previous_token", "induction"]  # the registry's order
    assert "http" not in re.sub(r'id="headprobe-data">.*?</script>', "", page, flags=re.S).replace("http-equiv", "")
    with pytest.raises(ValueError, match="layers"):
        viewer.build_page(table, None, {"natural": {"labels": labels, "pattern": p[:2], "period": None}})


def test_view_cli_bad_input_is_one_line_and_writes_nothing(tmp_path):
    rc, _, err = run_cli("view", str(tmp_path / "missing"))
    assert_one_line_error(rc, err, "not a directory")
    (tmp_path / "other.txt").write_text("x")
    rc, _, err = run_cli("view", str(tmp_path))
    assert_one_line_error(rc, err, "head_scores.csv")
    assert not (tmp_path / "index.html").exists()
    # a patterns file that does not match its tokens, and one that is not an archive at all
    _table(1, 2, 1).to_csv(tmp_path / "head_scores.csv", index=False)
    np.savez(
        tmp_path / "patterns.npz",
        natural_pattern=np.zeros((1, 2, 3, 3), np.uint8),
        natural_ids=np.arange(4),
        natural_labels=np.array(list("abcd")),
        natural_period=-1,
        natural_start=0,
    )
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="does not match 4 tokens"):
        view.run(view.ViewConfig(dir=str(tmp_path)))
    (tmp_path / "patterns.npz").write_bytes(b"not a zip")
    with pytest.raises(HeadprobeError, match="cannot read"):
        view.run(view.ViewConfig(dir=str(tmp_path)))
    assert not (tmp_path / "index.html").exists()


@pytest.mark.parametrize(
    "damage, said",
    [
        ("cut mid-row", "line 17 has fewer fields than its header: the file is cut"),
        ("a kv_head in words", "has a kv_head that is not a whole number >= 0 (line 3)"),
        ("a negative layer", "has a layer that is not a whole number >= 0 (line 2)"),
        ("patterns.npz not an archive", "not an .npz archive"),
    ],
)
def test_view_names_a_cut_or_odd_table_or_patterns_file_in_one_line(tmp_path, capsys, damage, said):
    """What a copy cut short, or a table edited by hand, looks like to view: one line naming the file
    and what is wrong (pandas read a cut row as NaN and the page failed later on ``int('abc')``;
    numpy said to load a non-archive "unsafely" with ``allow_pickle``), and no page."""
    from headprobe.cli import main

    text = _table(2, 8, 2).to_csv(index=False)
    if damage == "cut mid-row":
        text = text[: text.rindex("\n", 0, -1) + 6]  # the last row cut after a few characters
    elif damage == "a kv_head in words":
        lines = text.splitlines()
        lines[2] = ",".join(["0", "1", "abc", *lines[2].split(",")[3:]])
        text = "\n".join(lines) + "\n"
    elif damage == "a negative layer":
        text = text.replace("\n0,0,", "\n-1,0,", 1)
    (tmp_path / "head_scores.csv").write_text(text)
    if damage == "patterns.npz not an archive":
        (tmp_path / "patterns.npz").write_text("hello\n")
    assert main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and said in err[0] and "unsafely" not in err[0], err
    assert not (tmp_path / "index.html").exists()


def test_view_without_patterns_says_so_and_merges_an_ablate_run(tiny_scan_dir, tmp_path):
    out, result = tiny_scan_dir
    d = tmp_path / "scan"
    d.mkdir()
    for f in ("head_scores.csv", "summary.json"):
        shutil.copy(out / f, d)
    abl = tmp_path / "ablate"
    abl.mkdir()
    t = _table(2, 8, 2)[["layer", "head", "kv_head"]].assign(
        natural_loss_delta=np.linspace(-0.1, 0.5, 16), repeated_loss_delta=0.0
    )
    t.to_csv(abl / "head_ablation.csv", index=False)
    import headprobe

    page = headprobe.view(d, ablation=abl).read_text()
    data = json.loads(re.search(r'id="headprobe-data">(.*?)</script>', page, re.S).group(1))
    assert data["patterns"] == {} and "patterns.npz is missing" in page
    assert "natural_loss_delta" in data["columns"] and "natural_loss_delta" in [m["column"] for m in data["maps"]]
    assert "repeated_loss_delta" in [m["column"] for m in data["maps"]]
    assert data["rows"][15][3 + data["columns"].index("natural_loss_delta")] == pytest.approx(0.5)


def test_view_says_where_a_merged_ablate_run_differs_from_the_scan(tiny_scan_dir, tmp_path, capsys):
    """The merged table mixed a scan (its seq_len, period, ...) with an ablate run of other settings
    without a word: a NOTE names each difference; the same settings say nothing; another model, or
    an --ablation folder without head_ablation.csv, is one line naming what is wrong."""
    out, _ = tiny_scan_dir
    scan = json.loads((out / "summary.json").read_text())
    d = tmp_path / "scan"
    d.mkdir()
    for f in ("head_scores.csv", "summary.json"):
        shutil.copy(out / f, d)

    def ablate_run(name, **change):
        abl = tmp_path / name
        abl.mkdir()
        # pandas' index column too ("Unnamed: 0" read back, no identifier): the page took it for an attribute name
        _table(2, 8, 2)[["layer", "head", "kv_head"]].assign(natural_loss_delta=0.1).to_csv(abl / "head_ablation.csv")
        summary = {"model": scan["model"], "config": {**scan["config"]}}
        summary.update({k: v for k, v in change.items() if k == "model"})
        summary["config"].update({k: v for k, v in change.items() if k != "model"})
        (abl / "summary.json").write_text(json.dumps(summary))
        return abl

    from headprobe.cli import main

    assert main(["view", str(d), "--ablation", str(ablate_run("same"))]) == 0
    assert "NOTE" not in capsys.readouterr().out
    other = ablate_run("other", seq_len=64, period=25)
    assert main(["view", str(d), "--ablation", str(other)]) == 0
    note = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("NOTE:")]
    assert len(note) == 1 and f"seq_len 64 vs {scan['config']['seq_len']}" in note[0]
    assert f"period 25 vs {scan['config']['period']}" in note[0] and "seed" not in note[0]
    with pytest.raises(HeadprobeError, match="is a run of another-model, the scan one of"):
        view.run(view.ViewConfig(dir=str(d), ablation=str(ablate_run("model", model="another-model"))))
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / "summary.json").write_text("{}")
    with pytest.raises(HeadprobeError, match="holds no head_ablation.csv") as e:
        view.run(view.ViewConfig(dir=str(d), ablation=str(kv)))
    assert "head_scores.csv" not in str(e.value)


def test_scan_result_shows_the_viewer_in_jupyter(tiny_scan_dir):
    _, result = tiny_scan_dir
    html = result._repr_html_()
    assert html.startswith("<iframe srcdoc=") and "data-head" not in html.split('"')[0]
    assert "&lt;canvas id=&quot;pattern&quot;" in html


# ----------------------------------------------------------------------------- in a real browser


def _chromium() -> str | None:
    for name in (os.environ.get("HEADPROBE_CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    exe = _chromium()
    if exe is None:
        pytest.skip(
            "no chromium executable found (apt-get install chromium, or set HEADPROBE_CHROMIUM); .ci/run installs it"
        )
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, path: Path):
    """A page at ``path`` (file://) that records every request and every script error."""
    # bypass_csp: Playwright's waits evaluate strings, which the page's CSP (no eval, no network) forbids;
    # the request listener below is the check that nothing leaves the page
    assert "default-src 'none'" in path.read_text(encoding="utf-8")
    page = browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)
    page.requests, page.errors = [], []
    page.on("request", lambda r: page.requests.append(r.url))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    return page


def _assert_offline(page):
    assert page.requests, "the page itself should be a file: request"
    bad = [u for u in page.requests if not u.startswith(("file:", "data:", "blob:"))]
    assert not bad, f"requests left the page: {bad}"
    assert not page.errors, page.errors


def _click_head(page, head: str):
    page.click(f'[data-head="{head}"]')
    page.wait_for_function(f'document.getElementById("pattern").dataset.head === "{head}"', timeout=5000)
    return page.eval_on_selector(
        "#pattern",
        "c => ({rows: +c.dataset.rows, cols: +c.dataset.cols, start: +c.dataset.start,"
        " example: c.dataset.example, labels: JSON.parse(c.dataset.labels)})",
    )


def test_page_in_chromium_on_a_tiny_scan(browser, tiny_scan_dir, tmp_path):
    out, result = tiny_scan_dir
    page = _open(browser, out / "index.html")
    assert page.locator("[data-head]").count() == 2 * 8
    page.select_option("#map-select", label="induction score")
    shown = _click_head(page, "1.5")
    ex = result.patterns["repeated"]
    n = len(ex["labels"])
    assert (shown["rows"], shown["cols"], shown["example"]) == (n, n, "repeated")
    assert shown["labels"] == ex["labels"]
    # hover one cell: the tooltip shows that head's weight there (quantised to 1/255)
    q, k = n - 1, n - 1 - 8 + 1
    box = page.eval_on_selector("#pattern", "c => { const r = c.getBoundingClientRect(); return [r.x, r.y, r.width]; }")
    cell = (box[2] - 96 - 8) / n
    page.mouse.move(box[0] + 96 + (k + 0.5) * cell, box[1] + 8 + (q + 0.5) * cell)
    tip = page.inner_text("#tooltip")
    assert f"query {q} " in tip and f"key {k} " in tip
    weight = float(re.search(r"weight ([0-9.]+)", tip).group(1))
    assert weight == pytest.approx(float(ex["pattern"][1, 5, q, k]), abs=1 / 255)
    # sorting by a score puts its top head first; the layer filter hides layer 0
    page.click('#head-table th[data-col="induction"]')
    first = page.eval_on_selector("#head-table tbody tr", "tr => tr.dataset.row")
    best = result.table.loc[result.table["induction"].idxmax()]
    assert first == f"{int(best['layer'])}.{int(best['head'])}"
    page.fill("#layer-min", "1")
    assert page.locator("#score-map tbody tr:visible").count() == 1
    assert page.locator("#head-table tbody tr:visible").count() == 8
    page.screenshot(path=str(tmp_path / "tiny.png"))
    _assert_offline(page)
    # the same view inside Jupyter's output: a sandboxed srcdoc iframe
    nb = browser.new_page(bypass_csp=True)
    nb.set_content(f"<html><body>{result._repr_html_()}</body></html>")
    frame = nb.frame_locator("iframe")
    assert frame.locator("[data-head]").count() == 2 * 8
    frame.locator('[data-head="0.2"]').click()
    frame.locator('#pattern[data-head="0.2"]').wait_for(timeout=5000)
    assert json.loads(frame.locator("#pattern").get_attribute("data-labels")) == result.patterns["natural"]["labels"]


def test_show_page_in_chromium_is_about_the_prompt(browser, tiny_dir, tiny_scan_dir, tmp_path):
    """Show's page names the pattern as the user's prompt (it said "the
    repeated-random-token example"), offers no example buttons (both were there, disabled) and no
    section of scan verdicts; a scan's page keeps its two examples and says it has no verdicts.
    Writes tmp_path/show.png."""
    from headprobe.commands.show import ShowConfig
    from headprobe.commands.show import run as show

    prompt = "t1 t2 t3 t4 t5 t1 t2 t3 t4 t5"
    result = show(ShowConfig(model=str(tiny_dir), head="1.5", prompt=prompt, out=str(tmp_path / "show"), device="cpu"))
    page = _open(browser, tmp_path / "show" / "index.html")
    page.wait_for_function('document.getElementById("pattern").dataset.head === "1.5"', timeout=5000)  # opened on it
    n = len(result.labels)
    assert page.inner_text("#pattern-title") == f"Head 1.5 (kv_head 1) on your prompt ({n} tokens)"
    assert int(page.eval_on_selector("#pattern", "c => c.dataset.rows")) == n
    assert page.locator("button.ex:visible").count() == 0 and not page.locator("#example-choice").is_visible()
    assert not page.locator("#verdict-section").is_visible()
    body = page.inner_text("body")
    assert "verdict" not in body.lower() and "example" not in body
    page.screenshot(path=str(tmp_path / "show.png"), full_page=True)
    _assert_offline(page)

    out, _ = tiny_scan_dir  # scan --no-verify: both examples, and the page says why there is no verdict
    page = _open(browser, out / "index.html")
    assert page.locator("button.ex:visible:enabled").count() == 2
    assert "no scan verdicts" in page.inner_text("#verdict-section")
    page.select_option("#map-select", label="induction score")
    _click_head(page, "1.5")
    assert page.inner_text("#pattern-title") == "Head 1.5 (kv_head 1) on the repeated-random-token example"
    page.click('button.ex[data-example="natural"]')
    page.wait_for_function('document.getElementById("pattern").dataset.example === "natural"', timeout=5000)
    assert page.inner_text("#pattern-title") == "Head 1.5 (kv_head 1) on the natural-text example"
    _assert_offline(page)


HOSTILE_LABELS = [
    "-->",
    "<!--",
    "<script>",
    "window.__pwned = 1",
    "</script>",
    "<!--<script>",
    "<script>window.__pwned = 2</script>",
    "</SCRIPT >",
    "<img src=x onerror='window.__pwned = 3'>",
    "]]>",
    "&lt;",
    "__DATA__",
    "\u2028",
    '"\\',
]
"""Token strings that end a script element, or keep it open (``<!--`` then ``<script>`` with no ``-->``
after them: the HTML parser's double-escaped state, in which the closing tag does not close), or
would run as markup if the data were ever parsed as HTML."""


def test_hostile_token_text_neither_breaks_the_page_nor_runs(browser, tmp_path):
    """The page's own script runs and a click draws the pattern with the tokens as given, while no
    script from the data runs (each would set window.__pwned)."""
    n = len(HOSTILE_LABELS)
    p = np.tril(np.ones((n, n), np.float32))
    p = np.broadcast_to(p / p.sum(-1, keepdims=True), (1, 2, n, n))
    page_path = tmp_path / "index.html"
    page_path.write_text(
        viewer.build_page(
            _table(1, 2, 1), {"model": "<!--<script>__DATA__"}, {"natural": {"labels": HOSTILE_LABELS, "pattern": p}}
        ),
        encoding="utf-8",
    )
    inlined = re.search(r'id="headprobe-data">(.*?)</script>', page_path.read_text(encoding="utf-8"), re.S).group(1)
    assert "<" not in inlined and json.loads(inlined)["patterns"]["natural"]["labels"] == HOSTILE_LABELS
    page = _open(browser, page_path)
    assert page.locator("[data-head]").count() == 2  # drawn by the page's script
    assert page.inner_text("#title") == "headprobe: <!--<script>__DATA__"
    shown = _click_head(page, "0.1")
    assert shown["rows"] == n and shown["labels"] == HOSTILE_LABELS
    assert page.evaluate("window.__pwned") is None
    _assert_offline(page)


def test_circuit_section_in_chromium(browser, tmp_path):
    """A circuit run's section: its figure loads (a data: image, no request), its edges table has
    one row per edge given, a head named in an edge is a link that selects that head on the map,
    and a hostile edge text stays text. The circuit's numbers against a real run: test_circuit_command."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1])
    fig.savefig(tmp_path / "circuit.png")
    fig.set_size_inches(3, 2)
    fig.savefig(tmp_path / "path_patching.png")  # 300 px wide: told apart from the graph's 200
    plt.close(fig)
    summary = {
        "method": "eap-ig",
        "n_edges": 3,
        "metric": "loss",
        "task": "repeated",
        "agreement": {"n_edges": 2, "spearman": 0.95, "top_k": 2, "top_k_recall": 0.5},
        "top_edges": [
            {"edge": "0.1 -> 1.0:k", "score": 0.5, "exact": 0.4},
            {"edge": "1.1 -> logits", "score": -0.2, "exact": None},
        ],
        "receivers": {"1.0:k": [{"sender": "0.1", "effect": 0.4, "score": 0.5}]},
        "qk_attribution": {
            "head": "1.0",
            "q_pos": 3,
            "k_pos": 1,
            "score": 2.0,
            "identity_error": 1e-7,
            "key_side_top": {"0.1": 1.5, "<img src=x onerror=window.__pwned=1>": 0.5},
            "query_side_top": {"mlp 0": 2.0},
        },
    }
    circuit = viewer.circuit_data(summary, tmp_path / "circuit.png", tmp_path / "path_patching.png")
    p = np.broadcast_to(np.tril(np.ones((4, 4), np.float32)) / np.arange(1, 5)[:, None], (2, 2, 4, 4))
    page_path = tmp_path / "index.html"
    page_path.write_text(
        viewer.build_page(_table(2, 2, 1), None, {"natural": {"labels": list("abcd"), "pattern": p}}, circuit=circuit),
        encoding="utf-8",
    )
    page = _open(browser, page_path)
    assert page.is_visible("#circuit-section")
    assert page.eval_on_selector("#circuit-figure", "i => i.complete && i.naturalWidth") == 200
    assert page.eval_on_selector("#circuit-pp-figure", "i => i.complete && i.naturalWidth") == 300
    assert page.locator("#circuit-tables table").first.locator("tbody tr").count() == 2
    assert "Spearman 0.950, top-2 recall 0.500" in page.inner_text("#circuit-note")
    page.locator("#circuit-tables span", has_text="0.1").first.click()
    page.wait_for_function('document.getElementById("pattern").dataset.head === "0.1"', timeout=5000)
    assert page.evaluate("window.__pwned") is None
    _assert_offline(page)
    with pytest.raises(ValueError, match="outside the table"):
        viewer.build_page(_table(1, 2, 1), circuit=circuit)


def test_a_2048_token_example_stays_responsive(browser, tmp_path):
    n, L, H = 2048, 1, 2
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    p = np.stack([np.where(k == np.maximum(q - 1, 0), 1.0, 0.0), np.where(k <= q, 1.0 / (q + 1), 0.0)])[None]
    labels = [f"w{i}" for i in range(n)]
    page_path = tmp_path / "index.html"
    page_path.write_text(viewer.build_page(_table(L, H, 1), None, {"natural": {"labels": labels, "pattern": p}}))
    assert page_path.stat().st_size < 200_000  # 8 MB of uint8 weights, deflated
    page = _open(browser, page_path)
    t0 = time.perf_counter()
    shown = _click_head(page, "0.0")
    first_draw = time.perf_counter() - t0
    assert shown["rows"] == 128 and shown["labels"] == labels[:128]  # the default window
    page.eval_on_selector("#win-start", "e => { e.value = 1000; e.dispatchEvent(new Event('input')); }")
    page.wait_for_function('document.getElementById("pattern").dataset.start === "1000"', timeout=5000)
    assert page.eval_on_selector("#pattern", "c => JSON.parse(c.dataset.labels)[0]") == "w1000"
    t0 = time.perf_counter()
    page.select_option("#win-size", "2048")
    page.wait_for_function('document.getElementById("pattern").dataset.rows === "2048"', timeout=5000)
    full_draw = time.perf_counter() - t0
    assert first_draw < 3 and full_draw < 3, (first_draw, full_draw)
    _assert_offline(page)


@pytest.mark.skipif(not (DEMO / "patterns.npz").exists(), reason="the committed demo's patterns.npz is absent")
def test_committed_demo_viewer_in_chromium(browser, tmp_path):
    """The issue's acceptance check on the committed SmolLM2 scan (no model loaded): 270 heads, a
    click draws that head's pattern with the real tokens. Writes tmp_path/viewer.png."""
    d = tmp_path / "demo"
    d.mkdir()
    for f in ("head_scores.csv", "summary.json", "patterns.npz"):
        shutil.copy(DEMO / f, d)
    assert view.run(view.ViewConfig(dir=str(d))) == d / "index.html"
    page = _open(browser, d / "index.html")
    assert page.locator("[data-head]").count() == 30 * 9
    page.select_option("#map-select", label="induction score")
    shown = _click_head(page, "18.6")
    ex = viewer.load_patterns(d / "patterns.npz")["repeated"]
    assert shown["rows"] == len(ex["labels"]) == 101 and shown["labels"] == ex["labels"]
    # the type's map marks the heads its tested check ablated (summary.json), and says so under the map
    summary = json.loads((d / "summary.json").read_text())
    tested = next(a for a in summary["ablations"] if a["head_type"] == "induction" and a["tested"])
    marked = page.eval_on_selector_all("#score-map td.ablated", "tds => tds.map((t) => t.dataset.head)")
    assert sorted(marked) == sorted(tested["top_heads"]) and len(marked) == 10
    assert page.inner_text("#map-note").startswith(
        f"○ the 10 heads the ablation check ablated for induction ({tested['kind']}"
    )
    page.select_option("#map-select", label="previous-token score")
    other = next(a for a in summary["ablations"] if a["head_type"] == "previous_token" and a["tested"])
    marked = page.eval_on_selector_all("#score-map td.ablated", "tds => tds.map((t) => t.dataset.head)")
    assert sorted(marked) == sorted(other["top_heads"]) != sorted(tested["top_heads"])
    page.select_option("#map-select", label="induction score")
    page.screenshot(path=str(tmp_path / "viewer.png"))
    _assert_offline(page)


@pytest.mark.skipif(not (DEMO / "patterns.npz").exists(), reason="the committed demo's patterns.npz is absent")
def test_the_demo_with_its_ablate_and_circuit_runs_fits_a_1400_px_window(browser, tmp_path):
    """``view`` of the committed scan with its ablate and circuit runs scrolled sideways at 1,400 px (the verdict
    table's "heads ablated" column ran past the page), and the circuit graph, squeezed by its neighbour, was about
    230 px wide, its labels unreadable: the page fits the window and the graph keeps its 520 px."""
    d = tmp_path / "demo"
    d.mkdir()
    for f in ("head_scores.csv", "summary.json", "patterns.npz"):
        shutil.copy(DEMO / f, d)
    runs = DEMO.parent
    view.run(
        view.ViewConfig(
            dir=str(d), ablation=str(runs / "smollm2-135m-ablate"), circuit=str(runs / "smollm2-135m-circuit")
        )
    )
    page = _open(browser, d / "index.html")
    page.set_viewport_size({"width": 1400, "height": 1000})
    assert page.is_visible("#circuit-section") and page.is_visible("#verdict-section")
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    assert page.eval_on_selector("#circuit-figure", "i => i.getBoundingClientRect().width") >= 500
    _assert_offline(page)


_REASON = (
    "10 control sets: its smallest p-value 1/11 = 0.091 cannot reach alpha = 0.05 after bh over 5 tests; "
    "not run: none of them was ablated, as they could decide nothing"
)
_TYPES = ("previous-token", "induction", "duplicate-token", "first-token", "positional")


@pytest.mark.parametrize("numbers", ["same", "each its own"])
def test_warnings_of_one_shape_are_one_block_in_chromium(browser, tmp_path, numbers):
    """A quick scan's page opened with five near-identical WARNING paragraphs (one per head type, each
    too few control sets), a third of the screen. Now the ``<type>: no verdict: <reason>`` lines of one
    shape are one block naming every type once: one line where the reasons are equal, a <details>
    listing each type's own reason where only the numbers differ; another warning stays its own line.
    Reference: the warnings written into summary.json. Writes tmp_path/warnings.png."""
    d = tmp_path / "demo"
    d.mkdir()
    for f in ("head_scores.csv", "summary.json", "patterns.npz"):
        shutil.copy(DEMO / f, d)
    summary = json.loads((d / "summary.json").read_text())
    reasons = [_REASON if numbers == "same" else _REASON.replace("10 control", f"{10 + i} control") for i in range(5)]
    task = "natural task: 40% of the text's tokens are unknown to the tokenizer; its scores describe that failure"
    summary["warnings"] = [task, *(f"{t}: no verdict: {r}" for t, r in zip(_TYPES, reasons, strict=True))]
    (d / "summary.json").write_text(json.dumps(summary))
    view.run(view.ViewConfig(dir=str(d)))
    page = _open(browser, d / "index.html")
    page.screenshot(path=str(tmp_path / "warnings.png"))
    warns = page.locator(".warn")
    assert warns.count() == 2  # the task's line and the types' block (five before)
    assert warns.nth(0).inner_text() == f"WARNING: {task}"
    group = warns.nth(1)
    text = group.inner_text()
    assert f"no verdict for 5 head types ({', '.join(_TYPES)})" in text
    if numbers == "same":
        assert text == f"WARNING: no verdict for 5 head types ({', '.join(_TYPES)}): {_REASON}"
        assert page.locator("details").count() == 0
    else:
        items = group.locator("li")
        assert group.evaluate("e => e.tagName") == "DETAILS" and items.count() == 5
        assert [items.nth(i).text_content() for i in range(5)] == [f"{t}: {r}" for t, r in zip(_TYPES, reasons)]
    _assert_offline(page)


ABLATE = ROOT / "figures" / "smollm2-135m-ablate"


@pytest.mark.skipif(not (ABLATE / "head_ablation.csv").exists(), reason="the committed ablate run is absent")
def test_two_runs_maps_of_one_score_say_their_run_and_the_tooltip_shows_the_map(browser, tmp_path):
    """The committed scan with the committed ablate run merged: both carry an induction score (the
    ablate run's on its own repeated tokens: 17.4 is 0.73854 there, 0.74674 in the scan). The menu
    had two options both "induction score", and on the ablate run's map the tooltip led with the
    scan's number. Every option's label is its own, the two induction maps name their run, and
    hovering 17.4 on each map shows that map's value (from the CSVs, not the page's data) first."""
    d = tmp_path / "scan"
    d.mkdir()
    for f in ("head_scores.csv", "summary.json"):
        shutil.copy(DEMO / f, d)
    view.run(view.ViewConfig(dir=str(d), ablation=str(ABLATE)))
    page = _open(browser, d / "index.html")
    options = page.eval_on_selector_all("#map-select option", "os => os.map(o => o.textContent)")
    assert len(options) == len(set(options)), options
    assert "induction score (scan)" in options and "induction score (ablate run)" in options
    scan = pd.read_csv(DEMO / "head_scores.csv").set_index(["layer", "head"])
    abl = pd.read_csv(ABLATE / "head_ablation.csv").set_index(["layer", "head"])
    for label, value in (
        ("induction score (scan)", scan.loc[(17, 4), "induction"]),
        ("induction score (ablate run)", abl.loc[(17, 4), "induction_score"]),
        ("repeated loss increase when ablated (nats/token)", abl.loc[(17, 4), "repeated_loss_delta"]),
    ):
        page.select_option("#map-select", label=label)
        page.hover('[data-head="17.4"]')
        lines = page.inner_text("#tooltip").splitlines()
        assert lines[1] == f"{label}: {value:.4f}", lines[:3]
        assert float(page.get_attribute('[data-head="17.4"]', "data-value")) == pytest.approx(value, abs=1e-5)
    _assert_offline(page)


def test_view_reads_a_circuit_runs_path_patching_figure():
    """``view --circuit`` showed circuit.png only; a run with --receivers also drew path_patching
    (exact effects beside the scores): both are on the page, each its own file's bytes."""
    import base64

    from headprobe.commands.view import _read_circuit

    d = Path(__file__).resolve().parents[1] / "figures" / "smollm2-135m-circuit"
    data = _read_circuit(d)
    for key, name in (("image", "circuit"), ("path_image", "path_patching")):
        mime, b64 = data[key].split(",", 1)
        ext = "svg" if "svg" in mime else "png"
        assert base64.b64decode(b64) == (d / f"{name}.{ext}").read_bytes(), key


@pytest.mark.parametrize("causal", [False, True])
def test_an_encoders_pattern_is_drawn_whole_and_a_decoders_future_is_masked(browser, tmp_path, causal):
    """show's page of all-minilm-l6-v2 head 1.8, a next-token head (its PNG: 0.97 from "to" to the [SEP] after it),
    greyed the whole upper triangle as "future positions, masked": an encoder's queries read later keys, and that
    head's weight lies there. With summary.json's ``layout.causal`` false the page draws every cell and the
    tooltip gives the weight above the diagonal; a decoder's page masks it as before."""
    n = 6
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    nxt = np.where(k == np.minimum(q + 1, n - 1), 1.0, 0.0)  # each query on the next token: all above the diagonal
    p = np.stack([nxt, nxt])[None]
    summary = {"model": "enc", "layout": {"n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "causal": causal}}
    page_path = tmp_path / "index.html"
    page_path.write_text(
        viewer.build_page(_table(1, 2, 1), summary, {"natural": {"labels": [f"w{i}" for i in range(n)], "pattern": p}})
    )
    page = _open(browser, page_path)
    _click_head(page, "0.0")
    note = page.inner_text("#pattern-note")
    assert ("masked" in note) == causal and ("both ways" in note) != causal, note
    box = page.eval_on_selector("#pattern", "c => { const r = c.getBoundingClientRect(); return [r.x, r.y, r.width]; }")
    cell = (box[2] - 96 - 8) / n
    page.mouse.move(box[0] + 96 + (2 + 0.5) * cell, box[1] + 8 + (1 + 0.5) * cell)  # query 1 -> key 2: weight 1
    tip = page.inner_text("#tooltip")
    assert ("masked (future)" in tip) == causal and ("weight 1.000" in tip) != causal, tip
    _assert_offline(page)


@pytest.mark.parametrize(
    ("n_heads", "n_kv", "said"),
    [
        (4, 4, "4 heads, each its own KV head (multi-head attention)"),
        (4, 1, "4 heads, 1 KV head (multi-query attention)"),
        (4, 2, "4 heads, 2 KV heads (GQA groups of 2, separated by white lines)"),
    ],
)
def test_the_page_names_the_attention_kind_of_its_head_layout(browser, tmp_path, n_heads, n_kv, said):
    """walk 'bert': plain multi-head BERT read "12 KV heads (GQA groups of 1, separated by white lines)"."""
    summary = {"model": "m", "layout": {"n_layers": 1, "n_heads": n_heads, "n_kv_heads": n_kv}}
    page_path = tmp_path / "index.html"
    page_path.write_text(viewer.build_page(_table(1, n_heads, n_kv), summary, {}))
    page = _open(browser, page_path)
    assert f"1 layers × {said}" in page.inner_text("#meta")
