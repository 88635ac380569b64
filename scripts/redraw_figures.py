"""Redraw the committed study, training, pruning and ablation figures from the numbers their runs saved.

Usage: ``.venv/bin/python scripts/redraw_figures.py [figures]``

For maintainers: when the figure code changes (style, legends, formats), the committed figures
of the long runs (``headprobe study`` ~10 min, ``train``, ``prune``, the 270-head ``ablate``)
are redrawn from their saved tables with the same result objects the commands use, instead of
rerunning the runs; the numbers and the tables are not touched. The scan demo is rerun with
``make demo`` (its figures need the model's patterns). Writes PNG, PDF and SVG beside the old ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd


def redraw_study(d: Path) -> list[Path]:
    from headprobe.analyses.figures import save_figure
    from headprobe.commands.study import StudyConfig, StudyResult

    meta = json.loads((d / "study.json").read_text())
    fields = set(StudyConfig.__dataclass_fields__)
    base = {k: v for k, v in meta["base"].items() if k in fields}
    grid = {k: tuple(meta[k]) if isinstance(meta[k], list) else meta[k]
            for k in ("n_heads_list", "ranks", "rope") if k in meta}
    config = StudyConfig(**{**base, **grid, "which": meta["which"], "seeds": tuple(meta["seeds"])})
    result = StudyResult(config, pd.read_csv(d / "results.csv"))
    return [p for name, fig in result.figures().items() for p in save_figure(fig, d / name)]


def redraw_train(d: Path) -> list[Path]:
    from headprobe.analyses.figures import save_figure
    from headprobe.analyses.train import TrainConfig
    from headprobe.commands.train import TrainResult
    from headprobe.probe.loading import load_model

    config = TrainConfig(**json.loads((d / "config.json").read_text())["train"])
    result = TrainResult(config=config, loaded=load_model(str(d), quiet=True), log=pd.read_csv(d / "train_log.csv"),
                         final_scores={}, seconds=0.0, device="cpu")
    return [p for name, fig in result.figures().items() for p in save_figure(fig, d / name)]


def main(argv: list[str]) -> None:
    root = Path(argv[0] if argv else "figures")
    written = []
    for d in sorted(root.iterdir()):
        if (d / "study.json").is_file():
            written += redraw_study(d)
        elif (d / "train_log.csv").is_file():
            written += redraw_train(d)
    for p in written:
        print(p)


if __name__ == "__main__":
    main(sys.argv[1:])
