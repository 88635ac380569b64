"""``headprobe train``: grow induction heads from scratch in a small native transformer (the run,
its Result and the Python function are in :mod:`headprobe.commands.train_core`, imported on first
use: the flags are built and checked before torch loads)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from headprobe.analyses.train_config import CORPORA, WARMUP, TrainConfig
from headprobe.commands import Command, lazy_names, resolve
from headprobe.options import out_as_it_was, say_replaced_and_kept
from headprobe.probe.core.io import prepare_output_dir
from headprobe.settings import OUTPUT, DataSettings, Flags, ModelSettings, from_args, setting, shared

HELP = "train a small attention-only transformer from scratch and watch induction heads form (phase change)"

_CORE = ("run", "train", "TrainResult", "CHECKPOINTS", "snapshot_dir_name")

__all__ = ["HELP", "COMMAND", "TrainConfig", "TrainFlags", "FLAGS", "config_from_args", "main", *_CORE]

__getattr__ = lazy_names(__name__, "headprobe.commands.train_core", _CORE)

_T = TrainConfig  # every default below is TrainConfig's


@dataclass(frozen=True)
class TrainFlags(TrainConfig):
    """:class:`~headprobe.analyses.train_config.TrainConfig` (below the settings, so it declares no
    flags) with the flags of ``headprobe train``: the same fields and defaults, each made a
    :func:`~headprobe.settings.setting`; :func:`config_from_args` hands the run a plain TrainConfig."""

    n_layers: int = setting(_T.n_layers, "blocks (default %(default)s)", type=int)
    d_model: int = setting(_T.d_model, "residual width (default %(default)s)", type=int)
    n_heads: int = setting(_T.n_heads, "query heads per layer (default %(default)s)", type=int)
    n_kv_heads: int | None = setting(_T.n_kv_heads, "key/value heads (default: n_heads, MHA; 1: MQA)", type=int)
    mlp: str | None = setting(
        _T.mlp,
        "add GELU MLPs (default: attention-only)",
        choices=("none", "gelu"),
        parse=lambda word: None if word in (None, "none") else word,
    )
    positional: str = setting(
        _T.positional,
        "position encoding: learned embeddings or rotary (default %(default)s)",
        choices=("learned", "rotary"),
    )
    n_words: int = setting(_T.n_words, "random-token vocabulary (default %(default)s)", type=int)
    seq_len: int = setting(_T.seq_len, "tokens per sequence, BOS included (default %(default)s)", type=int)
    min_period: int = setting(_T.min_period, "shortest repeated segment (default %(default)s)", type=int)
    max_period: int = setting(_T.max_period, "longest repeated segment (default %(default)s)", type=int)
    periodic: bool = setting(
        _T.periodic,
        "periodic: the segment repeats to the end of each sequence (default); pair: it reappears once",
        flag="--data",
        choices=("periodic", "pair"),
        text=lambda periodic: "periodic" if periodic else "pair",
        parse=lambda word: word == "periodic",
    )
    batch_size: int = setting(_T.batch_size, "sequences per optimiser step (default %(default)s)", type=int)
    steps: int = setting(_T.steps, "optimiser steps (default %(default)s)", type=int)
    lr: float = setting(_T.lr, "AdamW learning rate (default %(default)s)", type=float)
    weight_decay: float = setting(_T.weight_decay, "AdamW weight decay (default %(default)s)", type=float)
    warmup: int | None = setting(
        _T.warmup, f"linear warm-up steps, at most --steps (default {WARMUP}, or --steps if fewer)", type=int
    )
    eval_every: int = setting(_T.eval_every, "steps between head scores (default %(default)s)", type=int)
    n_eval: int = setting(_T.n_eval, "sequences per evaluation set (default %(default)s)", type=int)
    eval_period: int = setting(
        _T.eval_period, "repeated block length for the detectors (default %(default)s)", type=int
    )
    seed: int = shared(DataSettings, "seed", _T.seed)
    device: str = shared(
        ModelSettings,
        "device",
        _T.device,
        help=(
            "where to run (default auto: cuda when a GPU is present, else cpu); trains in float32 "
            "(no --dtype: small models train in full precision)"
        ),
    )
    corpus: str = setting(
        _T.corpus,
        "copy: random-token copy sequences only; text+copy: mix in CPython's documentation at "
        "character level, so the model can be scanned on natural text (needs --n-words 96) (default "
        "%(default)s)",
        choices=CORPORA,
    )
    copy_fraction: float | None = setting(
        _T.copy_fraction,
        "text+copy only: the fraction of each batch that is copy sequences (default 0.5)",
        type=float,
    )
    bias: bool = setting(
        _T.bias,
        "no biases in the attention projections (the atlas's toy model trains without them)",
        flag="--no-bias",
        action="store_false",
    )
    save_every: int = setting(
        _T.save_every,
        "also save the weights at step 0 and every N steps as checkpoints/step-NNNNNN/ "
        "(for headprobe atlas --checkpoints; default 0: only the final model)",
        type=int,
    )


FLAGS = (OUTPUT, Flags(skip=("seed", "device")), Flags(only=("seed", "device")))
"""``headprobe train``'s flags in ``--help`` order."""


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``headprobe train`` flags (``--mlp none`` is None,
    ``--data periodic|pair`` is ``periodic``)."""
    return plain(from_args(TrainFlags, args))


def plain(config: TrainConfig) -> TrainConfig:
    """``config`` as a :class:`TrainConfig` (a :class:`TrainFlags` made from the flags is one with flags)."""
    return TrainConfig(**{f.name: getattr(config, f.name) for f in fields(TrainConfig)})


def check(args: argparse.Namespace, config: TrainConfig) -> None:
    """The training settings and the layout they build, before any work (:attr:`Command.check`).

    Raises:
        HeadprobeError: as ``TrainConfig.validate`` and ``TrainConfig.model_config``.
    """
    cfg = plain(config)
    cfg.validate()
    cfg.model_config()  # layout errors before any work


def main(args: argparse.Namespace, config: TrainConfig) -> int:
    cfg = plain(config)  # checked by check()
    prepare_output_dir(
        args.out, args.overwrite, create=False, models=(".",)
    )  # fail before training, leave nothing behind
    result = resolve("headprobe.commands.train_core:run")(cfg, progress=True)
    with out_as_it_was(args.out):
        paths = result.save(args.out, overwrite=args.overwrite)
    out = Path(args.out)
    print(f"\n{result.report()}")
    print(f"wrote {len(paths)} files to {out}/ (headprobe scan --model {out} reads the checkpoint)")
    say_replaced_and_kept(out)
    return 0


COMMAND = Command(
    HELP,
    config=TrainFlags,
    run="headprobe.commands.train:main",
    flags=FLAGS,
    api="headprobe.commands.train_core:train",
    check="headprobe.commands.train:check",
)
"""``headprobe train``, registered in :data:`headprobe.commands.COMMANDS`."""
