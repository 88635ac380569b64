"""``headprobe train``, the run (flags and ``main`` in :mod:`headprobe.commands.train`): grow induction heads from scratch in a small native transformer.

The model (default: 2 layers, attention-only, MHA; ``--n-kv-heads`` for GQA/MQA) is trained on
random token sequences in which a random segment starts repeating part-way through, so the
only way to beat ``ln(n_words)`` nats is in-context copying. Every ``eval_every`` steps it logs
every head's induction and previous-token score, the in-context loss (Olsson et al. 2022), the
loss on the repeated half of repeated random tokens and the held-out loss (the data, the loop
and the evaluation are :mod:`headprobe.analyses.train`).

As a library::

    import headprobe
    result = headprobe.train(steps=300, n_kv_heads=2, device="cpu")   # TrainConfig fields
    result.log                    # DataFrame, one row per evaluation
    result.summary()              # what summary.json holds
    result.save("run-gqa")        # the files below

Outputs (``--out``, :meth:`TrainResult.save`): ``train_log.csv`` (one row per evaluation),
``summary.json`` (written last: a directory holding it is complete), the figure
``training.<format>`` for each of ``--formats`` and a headprobe checkpoint (``headprobe_model.pt``,
``config.json``, tokenizer files) that ``headprobe scan --model OUT`` reads; with ``--save-every N`` also
``checkpoints/step-NNNNNN/``, the same kind of checkpoint at step 0 and every N steps (for
``headprobe atlas --checkpoints OUT``: head types over training).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from headprobe.analyses import figures
from headprobe.analyses.outputs import WritesOutputs
from headprobe.analyses.statistics import interval_rule
from headprobe.analyses.train import (
    COPIES_IN_CONTEXT,
    INDUCTION_FORMED,
    TrainConfig,
    TrainRun,
    copying_floor,
    induction_formed,
    phase_change_interval,
    training_tokenizer,
)
from headprobe.analyses.train import (
    train as train_model,
)
from headprobe.options import notes_flags, reports_for_readers
from headprobe.probe.core.io import cpu_kernels, summary_envelope
from headprobe.probe.core.reprs import CompactRepr
from headprobe.probe.hooks.ablation import format_head
from headprobe.probe.model.checkpoint import NATIVE_WEIGHTS, save_native_state

__all__ = ["TrainConfig", "TrainResult", "run", "train"]


@dataclass(repr=False)
class TrainResult(CompactRepr, TrainRun, WritesOutputs):
    """A finished ``headprobe train`` run: the trained model and its log
    (fields of :class:`headprobe.analyses.train.TrainRun`: ``config``, ``loaded``, ``log``
    (DataFrame), ``final_scores``, ``seconds``, ``device``), with the command's outputs."""

    def summary(self) -> dict:
        """The content of summary.json: layout, parameter count, final losses (nats/token), top
        heads, the phase change (:func:`headprobe.analyses.train.phase_change_interval`: the steps between which
        it happened, the later one, and the evaluation interval), seed,
        self-check, config, the training time (``timings_s.train_s``) and package versions."""
        log, cfg = self.log, self.config
        steps, icl = log["step"].to_numpy(), log["in_context_loss"].to_numpy()
        formed_by_step = _formed_by_step(log)
        between = phase_change_interval(steps, icl, formed_by_step)
        formed = log.index[formed_by_step > INDUCTION_FORMED]
        top = np.unravel_index(np.argmax(self.final_scores["induction"]), self.final_scores["induction"].shape)
        top_prev = np.unravel_index(
            np.argmax(self.final_scores["previous_token"]), self.final_scores["previous_token"].shape
        )
        last = log.iloc[-1]
        formed_by = induction_formed(self.final_scores["induction_per_sequence"])
        return summary_envelope(
            {
                "layout": self.loaded.spec.kind,
                "n_params": self.loaded.n_params,
                "final": {
                    "train_loss": round(float(last["train_loss"]), 4),
                    "eval_loss": round(float(last["eval_loss"]), 4),
                    "in_context_loss": round(float(last["in_context_loss"]), 4),
                    "in_context_loss_ci95": _ci95(last),
                    "repeated_loss": round(float(last["repeated_loss"]), 4),
                    "top_induction_head": format_head((int(top[0]), int(top[1]))),
                    "top_induction_score": round(float(self.final_scores["induction"].max()), 4),
                    "top_induction_score_ci95": _rounded(formed_by["ci95"]),
                    "top_previous_token_head": format_head((int(top_prev[0]), int(top_prev[1]))),
                    "top_previous_token_score": round(float(self.final_scores["previous_token"].max()), 4),
                },
                "chance_loss_nats": round(math.log(cfg.n_words), 4),
                "first_step_induction_formed": int(log.loc[formed[0], "step"]) if len(formed) else None,
                "phase_change_step": between[1] if between else None,
                "phase_change_between": list(between) if between else None,
                "phase_change_rule": "the in-context loss's steepest fall between consecutive evaluations, among the "
                "(at most 3) intervals where its 3-point running mean falls fastest: phase_change_between its two "
                "evaluation steps, phase_change_step the later (the first evaluation that shows the change; "
                "evaluated every eval_every steps, so located no finer); none unless induction formed "
                "(induction_formed_rule) at some evaluation, the first being first_step_induction_formed",
                "eval_every": cfg.eval_every,
                "induction_formed": formed_by["formed"],
                "induction_formed_rule": f"the top induction head's 95% lower bound (final.top_induction_score_ci95, "
                f"over the {cfg.n_eval} repeated sequences) above {INDUCTION_FORMED}; its mean alone, the largest of "
                "the heads' noisy means, leans upward",
                "copies_in_context": bool(last["in_context_loss"] <= copying_floor(cfg.n_words)),
                "copies_in_context_rule": f"final in-context loss at or below -{COPIES_IN_CONTEXT} ln(n_words) nats",
                "interval_rule": interval_rule(
                    "held-out copy sequences", over=f"the {cfg.n_eval} held-out copy sequences"
                )
                + ": final.in_context_loss_ci95, and train_log.csv's in_context_loss_ci95_low/high",
                "seed": cfg.seed,
                "dtype": str(self.loaded.dtype).removeprefix("torch."),
                **cpu_kernels(self.device),
            },
            model=self.loaded.spec.name,
            precision=self.loaded.spec.precision,
            device=self.device,
            self_check=self.loaded.self_check.to_dict(),
            config=cfg,
            timings_s={"train_s": self.seconds},
        )

    def figures(self) -> dict:
        """``{"training": Figure}``: max induction and previous-token score, in-context and
        training loss against step, the phase change marked (:func:`headprobe.analyses.figures.training_curves`)."""
        log, spec = self.log, self.loaded.spec
        kv = spec.n_kv_heads
        shared = not spec.layout.is_mla and kv != spec.n_heads  # GQA, MQA: say how many KV heads
        heads = f"{spec.n_heads} heads" + (f" on {kv} KV head{'s' * (kv > 1)}" if shared else "")
        title = (
            f"{spec.n_layers}-layer attention-only {spec.kind} ({heads}, d_model {spec.d_model})"
            if self.config.mlp is None
            else f"{spec.n_layers}-layer {spec.kind} ({heads})"
        )
        s = self.summary()
        if s["phase_change_step"] is None and s["copies_in_context"]:  # the closing line's case, on the figure too
            title += "\ncopies in context without an induction stripe"
        steps, icl = log["step"].to_numpy(), log["in_context_loss"].to_numpy()
        fig = figures.training_curves(
            steps,
            log["max_induction"].to_numpy(),
            log["max_previous_token"].to_numpy(),
            icl,
            log["train_loss"].to_numpy(),
            phase_change_interval(steps, icl, _formed_by_step(log)),
            title,
        )
        return {"training": fig}

    def outputs(self) -> dict[str, Any]:
        """save's files: train_log.csv, the checkpoint (config.json, headprobe_model.pt, tokenizer files,
        snapshots), training.<format> for each of ``formats`` and, last, summary.json."""

        def model_files(out: Path) -> list[Path]:  # the checkpoint headprobe.load_model reads, and the snapshots
            tokenizer_files = self.loaded.tokenizer.save_pretrained(out)
            self.loaded.save(out, {"train": asdict(self.config)})
            written = [out / "config.json", out / "headprobe_model.pt"]
            written += sorted({Path(f) for f in tokenizer_files if Path(f).is_file()} - set(written))
            return written + self.save_snapshots(out / CHECKPOINTS)

        return dict(
            summary=self.summary(),
            figures=self.figures,
            extra=model_files,
            tables={"train_log.csv": self.log.to_csv(index=False, float_format="%.5f")},
            models=(".",),  # the folder is the trained model: an earlier training's may be replaced
        )

    def save_snapshots(self, out_dir: Path) -> list[Path]:
        """Write every snapshot (``save_every``) as a headprobe checkpoint directory
        ``out_dir/step-NNNNNN/`` (weights, config.json with the training settings and ``"step"``,
        tokenizer files), each loadable by ``headprobe.load_model`` like the final model. Returns the paths."""
        written: list[Path] = []
        model_cfg = self.config.model_config()
        for step, state in sorted(self.snapshots.items()):
            d = out_dir / snapshot_dir_name(step)
            d.mkdir(parents=True, exist_ok=True)
            files = self.loaded.tokenizer.save_pretrained(d)
            save_native_state(state, model_cfg, d, {"train": asdict(self.config), "step": step})
            written += [d / NATIVE_WEIGHTS, d / "config.json"] + sorted(Path(f) for f in files if Path(f).is_file())
        return written

    @reports_for_readers("train")
    def report(self) -> str:
        """The lines ``headprobe train`` prints at the end: parameters, time, losses, top head, phase change."""
        s = self.summary()
        if s["phase_change_step"] is not None:
            before, after = s["phase_change_between"]
            formed = (
                f"induction formed first at step {s['first_step_induction_formed']} (top head's 95% lower bound "
                f"> 0.5); phase change between steps "
                f"{before} and {after} (evaluated every {s['eval_every']})"
            )
        elif s["copies_in_context"]:  # copying learned by a circuit without the induction score's stripe
            formed = (
                f"no induction head formed, yet the in-context loss says the model copies (at or below "
                f"-{COPIES_IN_CONTEXT} ln {self.config.n_words} = {copying_floor(self.config.n_words):.2f}): "
                "by a circuit without the induction stripe (docs/train.md)"
            )
        else:
            formed = "no induction head formed (the top head's 95% lower bound never passed 0.5): no phase change yet"
        return (
            f"trained {s['n_params']} parameters in {self.seconds:.1f} s on {s['device']}; final loss "
            f"{s['final']['train_loss']:.3f} (chance {s['chance_loss_nats']:.3f}), in-context loss (late - early) "
            f"{s['final']['in_context_loss']:+.3f} {figures.format_ci(s['final']['in_context_loss_ci95'], '+.3f')}"
            f" (95% CI over {self.config.n_eval} held-out sequences)\n"
            f"top induction head {s['final']['top_induction_head']} (layer.head), induction score "
            f"{s['final']['top_induction_score']:.2f}; {formed}"
        )


def _formed_by_step(log) -> np.ndarray:
    """Per log row, the score whose passing 0.5 says an induction head formed: the top head's lower 95%
    bound (``top_induction_ci95_low``, :func:`headprobe.analyses.train.induction_formed`); a
    train_log.csv written before that column, its largest mean score (``max_induction``)."""
    col = "top_induction_ci95_low" if "top_induction_ci95_low" in log.columns else "max_induction"
    return log[col].to_numpy(dtype=float)


def _rounded(ci: tuple[float, float]) -> list[float] | None:
    """``[lo, hi]`` to 4 decimals; None (JSON null) where there is no interval (NaN: one sequence)."""
    return [round(ci[0], 4), round(ci[1], 4)] if np.isfinite(ci).all() else None


def _ci95(row) -> list[float] | None:
    """``[lo, hi]`` of a log row's in-context-loss interval, 4 decimals; None (JSON null) where there
    is none (one evaluation sequence, or a log written before the interval was)."""
    lo, hi = (float(row.get(f"in_context_loss_ci95_{b}", float("nan"))) for b in ("low", "high"))
    return _rounded((lo, hi))


CHECKPOINTS = "checkpoints"
"""The subdirectory of a train run's output that holds the snapshots (``--save-every``)."""


def snapshot_dir_name(step: int) -> str:
    """``step-000100``: the directory name of the snapshot taken after ``step`` optimiser steps
    (zero-padded, so names sort in step order)."""
    return f"step-{step:06d}"


def _print_eval(row: dict, seconds: float) -> None:
    print(
        f"step {row['step']:5d}  loss {row['train_loss']:.3f}  in-context loss (late - early) {row['in_context_loss']:+.3f}  "
        f"max induction {row['max_induction']:.2f}  max prev-token {row['max_previous_token']:.2f}  "
        f"({seconds:.0f} s)",
        flush=True,
    )


def start_line(config: TrainConfig) -> str:
    """The line ``headprobe train`` prints before training: the layout, the data and how often a
    progress line follows, e.g. ``training 2 layers x 4 heads (4 KV heads), d_model 64, on copy data:
    1000 steps of 32 x 96 tokens; a line every 100 steps``."""
    c = config
    kv = c.n_heads if c.n_kv_heads is None else c.n_kv_heads
    return (
        f"training {c.n_layers} layers x {c.n_heads} heads ({kv} KV head{'s' * (kv != 1)}), d_model {c.d_model}, "
        f"on {c.corpus} data: {c.steps} steps of {c.batch_size} x {c.seq_len} tokens; a line every {c.eval_every} steps"
    )


def run(config: TrainConfig, progress: bool = False) -> TrainResult:
    """Train the model ``config`` describes (tokenizer from :func:`headprobe.analyses.train.training_tokenizer`).
    ``progress`` prints one line per evaluation. Deterministic given ``config.seed`` on one device.

    Raises:
        HeadprobeError: settings that cannot train (:meth:`TrainConfig.validate`,
            :meth:`TrainConfig.model_config`), no GPU for ``device="cuda"``, a diverged loss.
    """
    config.validate()
    config.model_config()  # layout errors (n_heads vs n_kv_heads, d_model vs n_heads) before any work
    from headprobe.probe.backends.loading import device_auto, require_gpu

    require_gpu(device_auto(config.device))  # refused before the plan line, as every other command's --device cuda
    if progress:  # the first evaluation line comes eval_every steps later (tens of seconds on a busy CPU)
        print(start_line(config), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = training_tokenizer(config, tmp)
        r = train_model(config, tokenizer, on_eval=_print_eval if progress else None)
    return TrainResult(**{f.name: getattr(r, f.name) for f in fields(TrainRun)})


@notes_flags("train")
def train(*, progress: bool = False, **config_fields) -> TrainResult:
    """``headprobe.train(steps=300, n_kv_heads=2, ...)``: :func:`run` on ``TrainConfig(**config_fields)``
    (see :class:`headprobe.analyses.train.TrainConfig` for every field and its default).

    Returns:
        TrainResult: the trained model (``loaded``), ``log`` (train_log.csv: one row per evaluation,
            losses in nats/token), ``final_scores`` (``[layer, head]``), ``seconds``; ``save(out)`` writes
            the checkpoint and what ``headprobe train`` writes.

    Raises:
        TypeError: an unknown field (naming the setting meant, :func:`headprobe.options.check_fields`).
        HeadprobeError: as :func:`run`; a message naming flags has a note giving their Python spelling (``e.__notes__``).
    """
    from headprobe.options import check_fields, config_inputs

    check_fields(
        TrainFlags, config_fields, "train", positional=(), accepts=train
    )  # TrainFlags: TrainConfig's fields, with flags
    config = TrainConfig(**config_fields)
    result = run(config, progress=progress)
    result.inputs = config_inputs(config)  # what result.save(overwrite=True) must not remove
    return result


from headprobe.commands.train import HELP, TrainFlags, config_from_args, main  # noqa: E402,F401 - the flags live there
