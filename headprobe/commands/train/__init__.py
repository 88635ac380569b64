"""``headprobe train``: grow induction heads from scratch in a small native transformer (the run,
its Result and the Python function are in :mod:`headprobe.commands.train.core`, imported on first
use: the flags are built and checked before torch loads)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from headprobe.analyses.train_config import CORPORA, TrainConfig
from headprobe.commands import Command
from headprobe.options import add_output_options, add_seed_option, kept_line, out_as_it_was
from headprobe.probe.io import prepare_output_dir
from headprobe.settings import ModelSettings, add_flags

HELP = "train a small attention-only transformer from scratch and watch induction heads form (phase change)"

_CORE = ("run", "train", "TrainResult", "CHECKPOINTS", "snapshot_dir_name")

__all__ = ["HELP", "COMMAND", "TrainConfig", "add_arguments", "config_from_args", "main", *_CORE]


def __getattr__(name: str):
    if name in _CORE:
        from headprobe.commands.train import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    add_output_options(p)
    p.add_argument("--n-layers", type=int, default=d.n_layers, help="blocks (default %(default)s)")
    p.add_argument("--d-model", type=int, default=d.d_model, help="residual width (default %(default)s)")
    p.add_argument("--n-heads", type=int, default=d.n_heads, help="query heads per layer (default %(default)s)")
    p.add_argument("--n-kv-heads", type=int, default=None, help="key/value heads (default: n_heads, MHA; 1: MQA)")
    p.add_argument("--mlp", choices=["none", "gelu"], default="none", help="add GELU MLPs (default: attention-only)")
    p.add_argument("--positional", choices=["learned", "rotary"], default=d.positional)
    p.add_argument("--n-words", type=int, default=d.n_words, help="random-token vocabulary (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence, BOS included (default %(default)s)")
    p.add_argument("--min-period", type=int, default=d.min_period, help="shortest repeated segment (default %(default)s)")
    p.add_argument("--max-period", type=int, default=d.max_period, help="longest repeated segment (default %(default)s)")
    p.add_argument("--data", choices=["periodic", "pair"], default="periodic",
                   help="periodic: the segment repeats to the end of each sequence (default); pair: it reappears once")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--steps", type=int, default=d.steps, help="optimiser steps (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps (default %(default)s)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between head scores (default %(default)s)")
    p.add_argument("--n-eval", type=int, default=d.n_eval, help="sequences per evaluation set (default %(default)s)")
    p.add_argument("--eval-period", type=int, default=d.eval_period, help="repeated block length for the detectors (default %(default)s)")
    p.add_argument("--corpus", choices=CORPORA, default=d.corpus,
                   help="copy: random-token copy sequences only; text+copy: mix in CPython's documentation at character "
                        "level, so the model can be scanned on natural text (needs --n-words 96) (default %(default)s)")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="also save the weights at step 0 and every N steps as checkpoints/step-NNNNNN/ "
                        "(for headprobe atlas --checkpoints; default 0: only the final model)")
    add_seed_option(p, d.seed)
    add_flags(p, ModelSettings, only=("device",), defaults={"device": d.device}, helps={
        "device": "auto: cuda when a GPU is present, else cpu; trains in float32 (no --dtype: small models train in full precision)"})


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``headprobe train`` flags (``--mlp none`` is None,
    ``--data periodic|pair`` is ``periodic``)."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    values["mlp"] = None if args.mlp == "none" else args.mlp
    values["periodic"] = args.data == "periodic"
    return TrainConfig(**values)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.validate()
    cfg.model_config()  # layout errors before any work
    prepare_output_dir(args.out, args.overwrite, create=False)  # fail before training, leave nothing behind
    from headprobe.commands.train.core import run

    result = run(cfg, progress=True)
    with out_as_it_was(args.out):
        paths = result.save(args.out, overwrite=args.overwrite)
    out = Path(args.out)
    print(f"\n{result.report()}")
    print(f"wrote {len(paths)} files to {out}/ (headprobe scan --model {out} reads the checkpoint)")
    if kept := kept_line(out):
        print(kept)
    return 0


COMMAND = Command(HELP, add_arguments, main, api="headprobe.commands.train.core:train")
"""``headprobe train``, registered in :data:`headprobe.commands.COMMANDS`."""
