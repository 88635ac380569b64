"""The verified-features matrix of docs/models.md: every registered family (and one bridge model)
x every feature, each cell what the code did when it was asked, on the family's tiny seeded
checkpoint (tests/zoo.py).

A cell is ``exact`` where the feature was compared with an independent reference and agreed
within the column's stated tolerance (:data:`FEATURES`: load = logits against Hugging Face's
eager model, decomposition = the per-head sum against the Hugging Face attention module's
output, ...), ``differs`` where it did not, ``runs`` where the command ran to the end and wrote
its files, ``refused`` where it raised :class:`~headprobe.probe.core.errors.HeadprobeError` (its
one line becomes a numbered note), and ``fails`` where anything else was raised (a bug). Nothing
here lists a state: each is measured by running the command as ``headprobe <command>`` would
(:func:`command`: the Config built from the flags' fields, its ``preflight``, the core's ``run``
on the loaded model, the result's ``save``), at the smallest settings.

``tests/test_models_matrix.py`` compares the rendered matrix with docs/models.md and rewrites it
with ``HEADPROBE_REGENERATE=1``; ``python tests/models_matrix.py`` prints it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zoo

START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"
"""The markers around the generated section of docs/models.md."""
MADE_WITH = "made with "
"""How the one line that names the versions and the date starts (the staleness check skips it)."""
DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
REGENERATE = "HEADPROBE_REGENERATE=1 .venv/bin/python -m pytest tests/test_models_matrix.py"

LOGIT_TOL = 1e-4
"""Largest |logit difference| (or |hidden-state difference|, encoders) against Hugging Face."""
DECOMPOSITION_TOL = 1e-4
"""Largest relative error ``||sum_h result_h + b_O - HF||/||HF||`` per layer."""
SAME_TOL = 1e-5
"""Largest |difference| between two headprobe computations that must agree (streamed vs pattern
statistics, a split model vs the whole one, a reloaded pruned model vs the masked one)."""

BRIDGE_ROW = ("gpt2", "transformer-lens")
"""The one row on TransformerLens' TransformerBridge: the tiny GPT-2, loaded with ``--backend transformer-lens``."""

SCAN = dict(seq_len=16, n_natural=2, n_repeated=2, period=6, pattern_len=0)
"""The smallest scan: 2 natural and 2 repeated sequences of 16 and 13 tokens."""
VERIFY = dict(verify=True, k=2, n_random=2, keep_n_random=True)
"""Verdicts from 2 control sets per head type (they can confirm nothing at that size, but they run)."""
DATA = dict(seq_len=16, n_natural=2, n_repeated=2, period=6)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One measured state: ``exact`` / ``differs`` (with the tolerance), ``runs``, ``refused`` or
    ``fails`` (with the one line that said why)."""

    state: str
    tol: float | None = None
    reason: str | None = None

    def text(self, note: int | None) -> str:
        if self.state in ("exact", "differs"):
            tol = short(self.tol)
            return f"exact (≤ {tol})" if self.state == "exact" else f"**differs** (> {tol})"
        if self.state == "runs":
            return "runs"
        return f"{'refused' if self.state == 'refused' else '**fails**'} ({note})"


def short(x: float) -> str:
    """A tolerance as the page writes it: ``1e-4``."""
    return f"{x:.0e}".replace("e-0", "e-")


def compared(error: float, tol: float) -> Cell:
    """``exact`` where ``error`` (finite) is within ``tol``, else ``differs``."""
    ok = error == error and error <= tol
    return Cell("exact" if ok else "differs", tol)


@dataclasses.dataclass
class Row:
    """What the features of one row share: its model directory, backend, Hugging Face reference
    model, the loaded float32 model (None where loading was refused) and the inputs."""

    label: str
    family: str
    backend: str
    dir: Path
    hf: torch.nn.Module
    text: Path
    prompts: Path
    work: Path
    encoder: bool
    model: object = None
    load_error: BaseException | None = None


def tokens(row: Row, batch: int = 2, pos: int = 12) -> torch.Tensor:
    """Seeded token ids of the tiny vocabulary (an encoder's framed by [CLS] ... [SEP])."""
    ids = torch.randint(0, 100, (batch, pos), generator=torch.Generator().manual_seed(1))
    if row.encoder:
        ids[:, 0], ids[:, -1] = 100, 101
    return ids


def command(name: str, row: Row, model=None, **fields):
    """``headprobe <name> --model DIR --device cpu --backend B [fields]`` as its ``main`` runs it
    (:func:`headprobe.options.run_command`): the Config from the fields, ``check_model`` and
    ``preflight`` before the model is used, the core's ``run`` on ``model`` (default: the row's
    float32 model, loaded once), the result saved into a fresh folder (``result.saved_in``).
    Returns the result.

    Raises:
        HeadprobeError: as the command would (its one line).
    """
    from headprobe.commands import COMMANDS
    from headprobe.options import check_model

    cmd = COMMANDS.get(name)
    config = cmd.config_class()(model=str(row.dir), device="cpu", backend=row.backend, **fields)
    check_model(config.model)
    config.preflight()
    loaded = row.model if model is None else model
    if loaded is None:
        raise row.load_error  # type: ignore[misc]  # the load's own refusal
    run = importlib.import_module(cmd.function().__module__).run
    result = run(loaded, config, progress=False)
    out = Path(tempfile.mkdtemp(dir=row.work))
    result.save(out, overwrite=True)
    result.saved_in = out
    return result


def load(row: Row, **kw):
    """``--model DIR --device cpu --backend B`` plus ``kw`` (``dtype``, ``device_map``, ``max_memory``), as the commands load."""
    from headprobe.options import load_model

    return load_model(str(row.dir), device=kw.pop("device", "cpu"), backend=row.backend, **kw)


# ---------------------------------------------------------------------------------------------
# The features: each measures one cell of a row
# ---------------------------------------------------------------------------------------------


def feature_load(row: Row) -> Cell:
    if row.model is None:
        raise row.load_error  # type: ignore[misc]
    x = tokens(row)
    with torch.no_grad():
        if row.encoder:
            want, got = row.hf(input_ids=x).last_hidden_state, row.model.final_residual(x)
        else:
            want, got = row.hf(x).logits, row.model.forward(x)
    return compared(float((got.float() - want.float()).abs().max()), LOGIT_TOL)


def feature_decomposition(row: Row) -> Cell:
    from headprobe.probe.hooks.capture import capture_heads

    if row.model is None:
        raise row.load_error  # type: ignore[misc]
    x = tokens(row)
    want = hf_attention_added(row.hf, zoo.tiny(row.family).attention_output, x)
    cap = capture_heads(row.model, x)
    worst = 0.0
    for layer, ref in want.items():
        got = cap["result"][layer].sum(dim=2) + cap["b_O"][layer]
        worst = max(worst, float((got.double() - ref.double()).norm() / ref.double().norm()))
    return compared(worst, DECOMPOSITION_TOL)


def hf_attention_added(hf_model, path: str, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Layer -> what the Hugging Face module at ``path`` (``{l}``: the layer) outputs: what the
    block adds to the residual stream from attention (a plain torch forward hook)."""
    out: dict[int, torch.Tensor] = {}
    handles = []
    for layer in range(hf_model.config.num_hidden_layers):

        def hook(mod, args, output, layer=layer):
            out[layer] = (output[0] if isinstance(output, tuple) else output).detach().clone()

        handles.append(hf_model.get_submodule(path.format(l=layer)).register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf_model(input_ids=x)
    finally:
        for h in handles:
            h.remove()
    return out


def feature_scan(row: Row) -> Cell:
    command("scan", row, text=str(row.text), verify=False, **SCAN)
    return Cell("runs")


def feature_verdicts(row: Row) -> Cell:
    result = command("scan", row, text=str(row.text), metrics=False, **SCAN, **VERIFY)
    assert result.verifications, "scan ran with verification but returned no verdicts"
    return Cell("runs")


def feature_ablate(row: Row) -> Cell:
    command("ablate", row, text=str(row.text), **DATA)
    return Cell("runs")


def feature_prune(row: Row) -> Cell:
    """``prune --method random --save-pruned``, then ``--model OUT/pruned_model`` loaded and its
    logits compared with the row's model with the same heads masked."""
    result = command(
        "prune",
        row,
        text=str(row.text),
        methods="random",
        n_seeds=1,
        step_fraction=0.5,
        save_pruned=True,
        save_fraction=0.25,
        **DATA,
    )
    return _reloaded(row, result)


def _reloaded(row: Row, result) -> Cell:
    from headprobe.commands.prune_core import run_names
    from headprobe.options import load_model

    out = result.saved_in
    spec = result.spec
    n = round(result.config.save_fraction * spec.n_layers * spec.n_heads)
    keep = result.runs[run_names(result.config)[0]].keep_mask_after(n, spec.n_layers, spec.n_heads)
    with contextlib.redirect_stderr(io.StringIO()):
        again = load_model(str(next(out.glob("pruned*"))), device="cpu")
    x = tokens(row)
    with torch.no_grad():
        masked = row.model.forward(x, head_mask=keep.to(torch.float32))
        got = again.forward(x)
    return compared(float((got - masked).abs().max()), SAME_TOL)


def feature_patch(row: Row) -> Cell:
    for site in ("q", "k", "v"):
        command("patch", row, prompts=str(row.prompts), site=site)
    return Cell("runs")


def feature_circuit(row: Row) -> Cell:
    command("circuit", row, n_seqs=1, period=4, steps=1, verify=1, top=4)
    return Cell("runs")


def feature_kv(row: Row) -> Cell:
    command(
        "kv",
        row,
        text=str(row.text),
        seq_len=16,
        block_len=2,
        sink=1,
        window=2,
        budgets=(0.5,),
        n_random=1,
        method="estimate",
    )
    return Cell("runs")


def feature_streamed(row: Row) -> Cell:
    """``scan --streaming on`` against ``--streaming off``: every number of head_scores.csv."""
    on = command("scan", row, text=str(row.text), verify=False, streaming="on", **SCAN).table
    off = command("scan", row, text=str(row.text), verify=False, streaming="off", **SCAN).table
    num = [c for c in off.select_dtypes("number").columns if c in on.columns]
    a, b = torch.tensor(on[num].to_numpy(float)), torch.tensor(off[num].to_numpy(float))
    both = ~a.isnan() & ~b.isnan()
    if (~a.isnan() & b.isnan()).any() or int(both.sum()) < int((~b.isnan()).sum()) // 2:
        return compared(float("inf"), SAME_TOL)  # a number from nothing, or most numbers missing
    return compared(float((a - b)[both].abs().max()), SAME_TOL)


def _dtype_scan(dtype: str) -> Callable[[Row], Cell]:
    def feature(row: Row) -> Cell:
        with contextlib.redirect_stderr(io.StringIO()):
            model = load(row, dtype=dtype)
        command("scan", row, model=model, text=str(row.text), dtype=dtype, **SCAN, **VERIFY)
        return Cell("runs")

    feature.__doc__ = f"``scan --dtype {dtype}`` (verification on)."
    return feature


def feature_device_map(row: Row) -> Cell:
    """``--device-map sequential --max-memory cpu=HALF`` on a CPU-only machine: half the weights'
    bytes in CPU memory, the rest offloaded to disk; logits against the whole model's."""
    if row.model is None:
        raise row.load_error  # type: ignore[misc]
    half = sum(p.numel() * p.element_size() for p in row.hf.parameters()) // 2
    with contextlib.redirect_stderr(io.StringIO()):
        split = load(row, device="auto", device_map="sequential", max_memory={"cpu": half})
    placed = set((split.device_map or {}).values())
    assert "disk" in placed, f"nothing offloaded: {split.device_map}"
    x = tokens(row)
    with torch.no_grad():
        diff = float((split.forward(x) - row.model.forward(x)).abs().max())
    return compared(diff, SAME_TOL)


@dataclasses.dataclass(frozen=True)
class Feature:
    """One column: its header, what it runs and what ``exact`` is measured against."""

    name: str
    measure: Callable[[Row], Cell]
    what: str


FEATURES = (
    Feature(
        "load",
        feature_load,
        f"`--model DIR` loaded as the commands load it; logits (encoders: the last hidden "
        f"state) against Hugging Face's eager model, max abs ≤ {short(LOGIT_TOL)} (each family's tiny model; the bridge row: "
        f"TransformerLens' bridge around the Hugging Face model)",
    ),
    Feature(
        "decomposition",
        feature_decomposition,
        f"`capture_heads`: per-head results summed with `b_O` against the "
        f"output of the Hugging Face attention module (or post-attention norm), relative ≤ {short(DECOMPOSITION_TOL)}",
    ),
    Feature("scan", feature_scan, "`scan --no-verify` (scores and metrics)"),
    Feature("verdicts", feature_verdicts, "`scan` with verification: `--top-k 2 --n-random 2 --keep-n-random`"),
    Feature("ablate", feature_ablate, "`ablate` (zero ablation of every head, exact sweep)"),
    Feature(
        "prune + reload",
        feature_prune,
        "`prune --method random --save-pruned --save-fraction 0.25`, then the "
        f"saved `pruned_model/` loaded with `--model` and compared with the model with those heads masked, ≤ {short(SAME_TOL)}",
    ),
    Feature("patch q/k/v", feature_patch, "`patch --prompts FILE --site q`, `k` and `v` (2 prompt pairs)"),
    Feature("circuit", feature_circuit, "`circuit --out circuit-out --n-seqs 1 --period 4 --steps 1 --verify 1`"),
    Feature("kv", feature_kv, "`kv --seq-len 16 --method estimate` (one budget, one random policy)"),
    Feature(
        "streamed",
        feature_streamed,
        "`scan --no-verify --streaming on` against `--streaming off`: every number "
        f"the streamed head_scores.csv has (at least half of the other's; a metric that needs the pattern is NaN "
        f"when streamed, as docs/scan.md says), ≤ {short(SAME_TOL)}",
    ),
    Feature("fp16", _dtype_scan("float16"), "`scan --dtype float16` with verification"),
    Feature("bf16", _dtype_scan("bfloat16"), "`scan --dtype bfloat16` with verification"),
    Feature(
        "device map",
        feature_device_map,
        "`--device-map sequential` with half the weights' bytes allowed in CPU "
        f"memory, the rest offloaded to disk (no GPU here; two GPUs are not tested); logits against the whole "
        f"model's, ≤ {short(SAME_TOL)}",
    ),
)
"""The columns, in order."""


# ---------------------------------------------------------------------------------------------
# Computing and rendering
# ---------------------------------------------------------------------------------------------


def rows() -> list[tuple[str, str, str]]:
    """(label, family, backend) of every row: each registered family on ``--backend auto``, then :data:`BRIDGE_ROW`."""
    from headprobe.probe.model.families import FAMILIES

    family, backend = BRIDGE_ROW
    return [(name, name, "auto") for name in FAMILIES.names()] + [(f"{family} ({backend} bridge)", family, backend)]


@dataclasses.dataclass
class Matrix:
    """The measured cells, ``cells[label][feature name]``, and the seconds each row took."""

    cells: dict[str, dict[str, Cell]]
    seconds: dict[str, float]
    feature_seconds: dict[str, float]


def compute(root: Path, only: list[str] | None = None) -> Matrix:
    """Measure every cell (``only``: those rows' labels), working in ``root``."""
    from conftest import make_tiny_tokenizer

    from headprobe.probe.core.errors import HeadprobeError

    tok = make_tiny_tokenizer(root / "tok")
    enc_tok = zoo.encoder_tokenizer(root / "enc_tok")
    text = root / "words.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (2000,), generator=g).tolist()), encoding="utf-8")
    prompts = root / "pairs.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(
                {"clean": f"t1 t2 t{3 + i} t4", "corrupted": f"t5 t6 t{7 + i} t8", "correct": " t9", "wrong": " t10"}
            )
            for i in range(2)
        )
        + "\n",
        encoding="utf-8",
    )
    cells: dict[str, dict[str, Cell]] = {}
    seconds: dict[str, float] = {}
    feature_seconds = {f.name: 0.0 for f in FEATURES}
    for label, family, backend in rows():
        if only is not None and label not in only:
            continue
        t0 = time.perf_counter()
        encoder = zoo.FAMILIES.get(family).encoder
        tokenizer = enc_tok if encoder else tok
        folder = root / family
        if not folder.exists():
            with contextlib.redirect_stderr(io.StringIO()):
                zoo.save_dir(family, tokenizer, folder)
        work = root / "work" / re.sub(r"\W+", "_", label)
        work.mkdir(parents=True)
        row = Row(
            label,
            family,
            backend,
            folder,
            zoo.make_checkpoint(family, tokenizer).hf_model,
            text,
            prompts,
            work,
            encoder,
        )
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                row.model = load(row)
        except HeadprobeError as e:
            row.load_error = e
        cells[label] = {}
        for f in FEATURES:
            t1 = time.perf_counter()
            cells[label][f.name] = measure(f, row, root, HeadprobeError)
            feature_seconds[f.name] += time.perf_counter() - t1
        seconds[label] = time.perf_counter() - t0
    return Matrix(cells, seconds, feature_seconds)


def measure(f: Feature, row: Row, root: Path, refusal: type) -> Cell:
    """One cell: the feature's own state, ``refused`` with its one line, or ``fails`` with the error's type and line."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return f.measure(row)
    except refusal as e:
        return Cell("refused", reason=clean(str(e), root))
    except Exception as e:  # a bug: said, not hidden
        return Cell("fails", reason=clean(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", root))


def clean(message: str, root: Path) -> str:
    """The message with paths under the working folder or the temporary folder replaced by ``DIR``
    (the same on every machine), one line."""
    for folder in (str(root), tempfile.gettempdir()):
        message = re.sub(re.escape(folder) + r"[^\s:,;)'\"]*", "DIR", message)
    return " ".join(message.split())


def versions() -> str:
    import transformers

    return (
        f"{MADE_WITH}transformers {transformers.__version__}, torch {torch.__version__} "
        f"on {time.strftime('%Y-%m-%d', time.gmtime())}."
    )


def render(matrix: Matrix, made_with: str | None = None) -> str:
    """The generated section, markers included: the table, the columns' meaning, the numbered reasons."""
    reasons: list[str] = []
    lines = [
        START,
        "",
        "## Verified features",
        "",
        "Generated by `tests/test_models_matrix.py` (the cells are measured, nothing here is typed by hand): each "
        "registered family's tiny seeded checkpoint (`tests/zoo.py`, 2 layers) on `--backend auto`, and the tiny "
        "GPT-2 on TransformerLens' bridge, run through each command as its `main` runs it, at the smallest settings. "
        f"Regenerate with `{REGENERATE}`.",
        "",
        made_with or versions(),
        "",
        "| family | " + " | ".join(f.name for f in FEATURES) + " |",
        "|---|" + "---|" * len(FEATURES),
    ]
    for label, row in matrix.cells.items():
        texts = []
        for f in FEATURES:
            cell = row[f.name]
            note = None
            if cell.reason is not None:
                if cell.reason not in reasons:
                    reasons.append(cell.reason)
                note = reasons.index(cell.reason) + 1
            texts.append(cell.text(note))
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    lines += [
        "",
        "*exact (≤ tol)*: compared with the reference below and within that tolerance; *runs*: the command "
        "ran to the end and wrote its files; *refused (n)*: it stopped with the one-line error n below; "
        "**fails**: anything else was raised (a bug).",
        "",
        "Columns:",
        "",
    ]
    lines += [f"- **{f.name}**: {f.what}" for f in FEATURES]
    if reasons:
        lines += ["", "Why cells are refused (or fail):", ""]
        lines += [f"{i}. {r.replace('|', '/')}" for i, r in enumerate(reasons, 1)]
    return "\n".join([*lines, "", END])


def section(doc: str) -> str:
    """The generated section of ``doc`` (markers included).

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start, end = doc.find(START), doc.find(END)
    if start < 0 or end < start:
        raise ValueError(f"docs/models.md has no {START} ... {END} section")
    return doc[start : end + len(END)]


def without_versions(text: str) -> str:
    """``text`` without its :data:`MADE_WITH` line (versions and date change without the matrix changing)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith(MADE_WITH))


def replace_section(doc: str, new: str) -> str:
    """``doc`` with its generated section replaced by ``new``.

    Raises:
        ValueError: ``doc`` has no section (:func:`section`).
    """
    old = section(doc)
    return doc.replace(old, new)


def stale(doc: str, rendered: str) -> str | None:
    """Why ``doc``'s section is not ``rendered`` (the first line that differs, versions line aside),
    or None where it is current."""
    try:
        have = without_versions(section(doc)).splitlines()
    except ValueError as e:
        return str(e)
    want = without_versions(rendered).splitlines()
    for i, (a, b) in enumerate(zip(have, want)):
        if a != b:
            return f"line {i + 1} of the section is {a!r}, the code gives {b!r}"
    if len(have) != len(want):
        return f"the section has {len(have)} lines, the code gives {len(want)}"
    return None


if __name__ == "__main__":
    import os
    import sys

    from headprobe.analyses.vocabulary import FIGURE_FORMATS_ENV, NO_FIGURES

    os.environ.setdefault(FIGURE_FORMATS_ENV, NO_FIGURES)  # as the test suite runs it (tests/conftest.py)

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        m = compute(Path(tmp), sys.argv[1:] or None)
        print(render(m))
        print(f"\n{time.perf_counter() - t:.1f} s; rows: " + ", ".join(f"{k} {v:.1f}" for k, v in m.seconds.items()))
        print("features: " + ", ".join(f"{k} {v:.1f}" for k, v in m.feature_seconds.items()))
