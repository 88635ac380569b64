"""Every command's outputs on a tiny zoo model, written by one commit and compared with another's:
a refactor of the commands (settings, runner, writer, registry) must leave them equal.

``run DIR`` runs every command (scan, ablate, ablate --estimate, prune, patch, show, view,
atlas, train, study, budget, kv, circuit) through ``python -m headprobe`` -- only the command line, so it runs
unchanged on a commit before or after a refactor -- on tiny seeded random-init checkpoints of
tests/zoo.py (Llama with GQA, GPT-2), with fixed seeds, PNG figures only, on the CPU, into
``DIR/<command>/`` (stdout and the exit status in ``DIR/<command>.log``). ``diff A B`` compares
two such folders: JSON and CSV numerically (absolute and relative tolerance 1e-6) after dropping
timings, package versions, paths, dates and the command line (its --out); ``.npz`` arrays exactly; PNG/PDF/SVG/HTML ignored (HTML
embeds the same JSON); files present in one folder only are reported. Exit status 1 when
anything differs.

usage (from the repository root, a checkout of each commit in turn):
    OMP_NUM_THREADS=1 .venv/bin/python scripts/compare_outputs.py run /tmp/before
    OMP_NUM_THREADS=1 .venv/bin/python scripts/compare_outputs.py run /tmp/after
    .venv/bin/python scripts/compare_outputs.py diff /tmp/before /tmp/after
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

TOL = 1e-6
#: keys whose values depend on the run, not on the computation (matched against every key of the JSON)
VOLATILE = re.compile(
    r"(^|_)(s|seconds|time|timings?|timings_s|versions?|date|created|path|paths|out|dir|model_dir"
    r"|source|host|python|torch|elapsed|command|peak_memory)$|_s$",
    re.IGNORECASE,
)
SMALL = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "--device", "cpu"]
SCAN = [*SMALL, "-k", "3", "--n-random", "2"]
TRAIN = [
    "--d-model",
    "16",
    "--n-heads",
    "2",
    "--n-words",
    "16",
    "--seq-len",
    "33",
    "--max-period",
    "12",
    "--eval-period",
    "8",
    "--n-eval",
    "8",
    "--steps",
    "4",
    "--eval-every",
    "2",
    "--device",
    "cpu",
]


def _models(root: Path) -> dict[str, Path]:
    """The tiny checkpoints (Hugging Face directories) and the text and prompt files."""
    sys.path.insert(0, "tests")
    import numpy as np
    import torch
    import zoo
    from conftest import make_tiny_tokenizer

    tok = make_tiny_tokenizer(root / "tokenizer")
    made = {f: zoo.save_dir(f, tok, root / f) for f in ("llama", "gpt2")}
    g = torch.Generator().manual_seed(0)
    text = root / "text.txt"
    text.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (2000,), generator=g).tolist()), encoding="utf-8")
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(6):
        n = 6 if i % 2 else 9
        a, b = rng.choice(100, 2, replace=False)
        pairs.append(
            {
                "clean": " ".join(f"t{j}" for j in rng.integers(0, 100, n)),
                "corrupted": " ".join(f"t{j}" for j in rng.integers(0, 100, n)),
                "correct": f" t{a}",
                "wrong": f" t{b}",
            }
        )
    prompts = root / "pairs.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    return {**made, "text": text, "prompts": prompts}


def commands(m: dict[str, Path], out: Path) -> dict[str, list[str]]:
    """Output folder name -> the ``headprobe`` arguments that write it."""
    llama, gpt2, text = str(m["llama"]), str(m["gpt2"]), str(m["text"])
    return {
        "scan": ["scan", "--model", llama, "--text", text, *SCAN, "--html", "--out", str(out / "scan")],
        "scan_gpt2": [
            "scan",
            "--model",
            gpt2,
            "--text",
            text,
            *SCAN,
            "--types",
            "induction,previous-token",
            "--out",
            str(out / "scan_gpt2"),
        ],
        "ablate": ["ablate", "--model", llama, "--text", text, *SMALL, "--kind", "mean", "--out", str(out / "ablate")],
        "ablate_atp": [
            "ablate",
            "--model",
            llama,
            "--text",
            text,
            *SMALL,
            "--estimate",
            "atp",
            "--out",
            str(out / "ablate_atp"),
        ],
        "prune": [
            "prune",
            "--model",
            llama,
            "--text",
            text,
            *SMALL,
            "--method",
            "michel,random",
            "--n-seeds",
            "2",
            "--step-fraction",
            "0.25",
            "--max-fraction",
            "0.5",
            "--per-layer",
            "--out",
            str(out / "prune"),
        ],
        "patch": [
            "patch",
            "--model",
            llama,
            "--prompts",
            str(m["prompts"]),
            "--device",
            "cpu",
            "--out",
            str(out / "patch"),
        ],
        "show": [
            "show",
            "--model",
            llama,
            "--head",
            "1.1",
            "--prompt",
            "t1 t2 t3 t4 t1 t2 t3 t4",
            "--device",
            "cpu",
            "--out",
            str(out / "show"),
        ],
        "view": ["view", str(out / "view")],  # a copy of scan's folder (view writes into it)
        "atlas": ["atlas", "--models", llama, gpt2, "--text", text, *SCAN, "--out", str(out / "atlas")],
        "train": ["train", *TRAIN, "--seed", "3", "--out", str(out / "train")],
        "study": [
            "study",
            "heads",
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--seeds",
            "0",
            "--d-model",
            "16",
            "--n-heads-list",
            "1,2",
            "--device",
            "cpu",
            "--out",
            str(out / "study"),
        ],
        "budget": ["budget", "--model", llama, "--seq-len", "64", "--json"],
        "kv": [
            "kv",
            "--model",
            llama,
            "--text",
            text,
            "--seq-len",
            "64",
            "--block-len",
            "4",
            "--sink",
            "2",
            "--window",
            "8",
            "--budgets",
            "0.5",
            "--n-random",
            "2",
            "--device",
            "cpu",
            "--out",
            str(out / "kv"),
        ],
        "circuit": [
            "circuit",
            "--model",
            llama,
            "--n-seqs",
            "2",
            "--period",
            "6",
            "--steps",
            "2",
            "--verify",
            "6",
            "--receivers",
            "1.0:k,logits",
            "--qk-head",
            "1.3",
            "--device",
            "cpu",
            "--out",
            str(out / "circuit"),
        ],
    }


def run(out: Path) -> int:
    """Run every command into ``out`` (which must not exist); returns the number that failed."""
    out.mkdir(parents=True)
    m = _models(out / "_inputs")
    env = {
        **os.environ,
        "HEADPROBE_FIGURE_FORMATS": "png",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    failed = 0
    for name, argv in commands(m, out).items():
        if name == "view":
            shutil.copytree(out / "scan", out / "view", ignore=shutil.ignore_patterns("index.html"))
        proc = subprocess.run([sys.executable, "-m", "headprobe", *argv], capture_output=True, text=True, env=env)
        (out / f"{name}.log").write_text(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}", encoding="utf-8")
        if name == "budget":
            (out / "budget").mkdir()
            (out / "budget" / "budget.json").write_text(proc.stdout, encoding="utf-8")
        print(f"{name}: exit {proc.returncode}", flush=True)
        failed += proc.returncode != 0
    shutil.rmtree(out / "_inputs")
    return failed


def _strip(value):
    """``value`` (parsed JSON) without run-dependent keys; strings that look like paths become ``<path>``."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not VOLATILE.search(str(k))}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    if isinstance(value, str) and ("/" in value and ("tmp" in value or value.startswith("/"))):
        return "<path>"
    return value


def _close(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(a, b, rel_tol=TOL, abs_tol=TOL)
    return a == b


def _diff_json(a, b, where: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'after' if k not in a else 'before'}")
            else:
                _diff_json(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff_json(x, y, f"{where}[{i}]", out)
    elif not _close(a, b):
        out.append(f"{where}: {str(a)[:80]} != {str(b)[:80]}")


def _diff_file(a: Path, b: Path, roots: tuple[Path, Path]) -> list[str]:
    """The differences of two files of one name; ``roots``: the two run folders, whose paths
    inside the files (atlas names models by path) are replaced by ``<run>``."""
    import io

    import numpy as np
    import pandas as pd

    def text(path, root):
        return path.read_text(encoding="utf-8").replace(str(root.resolve()), "<run>").replace(str(root), "<run>")

    if a.suffix == ".json":
        out: list[str] = []
        _diff_json(_strip(json.loads(text(a, roots[0]))), _strip(json.loads(text(b, roots[1]))), a.name, out)
        return out
    if a.suffix == ".csv":
        x, y = pd.read_csv(io.StringIO(text(a, roots[0]))), pd.read_csv(io.StringIO(text(b, roots[1])))
        x, y = (t[[c for c in t.columns if not VOLATILE.search(c)]] for t in (x, y))
        if list(x.columns) != list(y.columns) or x.shape != y.shape:
            return [f"{a.name}: columns/shape {list(x.columns)} {x.shape} != {list(y.columns)} {y.shape}"]
        diffs = []
        for c in x.columns:
            if pd.api.types.is_numeric_dtype(x[c]) and pd.api.types.is_numeric_dtype(y[c]):
                if not np.allclose(x[c], y[c], rtol=TOL, atol=TOL, equal_nan=True):
                    diffs.append(f"{a.name}[{c}]: max |diff| {np.nanmax(np.abs(x[c] - y[c]))}")
            elif not x[c].astype(str).equals(y[c].astype(str)):
                diffs.append(f"{a.name}[{c}]: text differs")
        return diffs
    if a.suffix == ".npz":
        x, y = np.load(a), np.load(b)
        if sorted(x.files) != sorted(y.files):
            return [f"{a.name}: arrays {sorted(x.files)} != {sorted(y.files)}"]
        return [f"{a.name}[{k}] differs" for k in x.files if not np.array_equal(x[k], y[k])]
    return []


IGNORED = {".png", ".pdf", ".svg", ".html", ".log", ".safetensors", ".txt", ".pt"}
#: atlas names each model's folder after its path (``<run folder>_inputs_llama-<hash of the path>``)
_RUN_PATH = re.compile(r"[^/]*_inputs_(\w+)-[0-9a-f]{10}")


def diff(before: Path, after: Path) -> int:
    """Print every difference between two ``run`` folders; returns the number of differing files."""

    def files(root):
        return {
            Path(_RUN_PATH.sub(r"\1", str(p.relative_to(root)))): p
            for p in root.rglob("*")
            if p.is_file() and p.suffix not in IGNORED and "_inputs" not in p.relative_to(root).parts
        }

    pa, pb = files(before), files(after)
    fa, fb = set(pa), set(pb)
    bad = 0
    for rel in sorted(fa ^ fb):
        print(f"{rel}: only in {'before' if rel in fa else 'after'}")
        bad += 1
    for rel in sorted(fa & fb):
        lines = _diff_file(pa[rel], pb[rel], (before, after))
        for line in lines[:20]:
            print(f"{rel.parent}/{line}")
        bad += bool(lines)
    for log in sorted(before.glob("*.log")):
        other = after / log.name
        ea, eb = (
            log.read_text().split("\n", 1)[0],
            other.read_text().split("\n", 1)[0] if other.is_file() else "missing",
        )
        if ea != eb:
            print(f"{log.stem}: {ea} before, {eb} after")
            bad += 1
    print(f"{len(fa & fb)} files compared, {bad} differ")
    return bad


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        sys.exit(min(run(Path(sys.argv[2])), 1))
    if len(sys.argv) == 4 and sys.argv[1] == "diff":
        sys.exit(min(diff(Path(sys.argv[2]), Path(sys.argv[3])), 1))
    sys.exit(__doc__)
