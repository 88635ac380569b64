"""``headprobe study heads|layouts``: train small models side by side (the run, its Result and the
Python function are in :mod:`headprobe.commands.study_core`, imported on first use: the flags are
built and checked before pandas, matplotlib and torch load).

* ``heads``: the same width (d_model 64) split into 1, 2, 4, 8, 16 heads; same data, same steps,
  several seeds.
* ``layouts``: the same width and heads as MHA, GQA, MQA and MLA at several latent ranks; each
  with its attention parameter count and KV cache per token (``headprobe.probe.layout.cost``, bf16, over all
  layers), the context-2048 cache, and the losses.

Every run is one :func:`headprobe.analyses.train.train` call (same data stream per seed). Default data
(``--corpus text+copy``): CPython's documentation text at character level, split by topic into
training and held-out text, with 3/4 of every batch copy sequences over the same 96 characters
(:func:`headprobe.analyses.train.mixed_batch`). The losses (nats/token, a token is a character) are the
held-out text loss (``eval_loss``), the in-context loss on held-out copy sequences (and on held-out
text) and the loss on the repeated half of ``[BOS] r r``.

As a library::

    import headprobe
    result = headprobe.study("layouts", steps=600, seeds=(0,), device="cpu")   # StudyConfig fields
    result.table                  # DataFrame, one row per run (results.csv)
    result.summary()              # what study.json holds
    result.save("study-layouts")

Outputs (``--out``, :meth:`StudyResult.save`): ``results.csv`` (one row per run), ``study.json``
(settings and the headline numbers; written last) and one figure (PNG + PDF).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from headprobe.analyses.train_config import N_CHARS, TrainConfig, refuse_copy_fraction
from headprobe.analyses.vocabulary import seed_error
from headprobe.commands import Command, lazy_names, resolve
from headprobe.options import out_as_it_was, say_replaced_and_kept
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import prepare_output_dir
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.layout.cost import AttentionLayout
from headprobe.settings import OUTPUT, Flags, ModelSettings, from_args, setting, shared

HELP = "train small models side by side: how many heads (study heads), MHA vs GQA vs MQA vs MLA (study layouts)"

_CORE = ("StudyResult", "run", "study", "run_study", "headline", "study_figure")
__all__ = ["HELP", "COMMAND", "StudyConfig", "FLAGS", "main", *_CORE]
__getattr__ = lazy_names(__name__, "headprobe.commands.study_core", _CORE)

CONTEXT = 2048  # tokens, for the per-request KV cache column
STUDIES = ("heads", "layouts")
MAX_PERIOD = 16  # longest repeated segment of a copy sequence (tokens): --seq-len must hold it twice after BOS
ONLY_FOR = {"n_heads": "layouts", "rope": "layouts", "ranks": "layouts", "n_heads_list": "heads"}
"""The settings one study only takes (another study refuses them)."""
DEFAULTS = {"n_heads": 8, "rope": 8, "ranks": (4, 6, 8, 16), "n_heads_list": (1, 2, 4, 8, 16), "copy_fraction": 0.75}
"""What a setting left None is in the study (and corpus) that takes it."""


def _ints(text: str | None, name: str) -> tuple[int, ...] | None:
    if text is None:  # not given: the study's default (StudyConfig.__post_init__)
        return None
    if name == "ranks" and text.strip().lower() == "none":  # layouts without an MLA variant
        return ()
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise HeadprobeError(f"--{name} must be a comma-separated list of integers, got {text!r}") from None


def _comma(values: Sequence[int]) -> str:
    return ",".join(map(str, values)) or "none"  # only --ranks may be empty


@dataclass(frozen=True)
class StudyConfig:
    """Settings of a study (recorded in study.json). Every model is a
    :class:`headprobe.analyses.train.TrainConfig` built by :meth:`base` and varied by :meth:`variants`.
    List fields accept any sequence of ints and are stored as tuples."""

    which: str = setting(
        help="heads: 1..16 heads at one width; layouts: MHA/GQA/MQA/MLA", positional=True, choices=STUDIES
    )
    """``"heads"``: ``d_model`` split into each count of ``n_heads_list`` heads (MHA).
    ``"layouts"``: ``n_heads`` heads as MHA, GQA (4 and 2 groups where they divide ``n_heads``), MQA
    and MLA at each rank of ``ranks``."""
    steps: int = setting(1200, "training steps per run (default %(default)s)", type=int)
    """Training steps per run."""
    corpus: str = setting(
        "text+copy",
        "text+copy: CPython documentation text (character level) mixed with copy sequences "
        "(default); copy: random-token copy sequences only, as headprobe train",
        choices=["text+copy", "copy"],
    )
    """``"text+copy"``: CPython documentation text (character level, 96 characters + BOS) mixed with
    copy sequences over the same characters; ``"copy"``: random-token copy sequences only (64
    words), as ``headprobe train``."""
    copy_fraction: float | None = setting(
        None, "text+copy only: the fraction of each batch that is copy sequences (default 0.75)", type=float
    )
    """``"text+copy"``: the fraction of each batch that is copy sequences (None: 0.75); refused with
    ``corpus="copy"``."""
    seq_len: int = setting(48, "tokens per sequence, BOS included; at least 33 (default %(default)s)", type=int)
    """Tokens per sequence, BOS included; at least ``2 * 16 + 1`` (a copied segment reaches 16 tokens)."""
    batch_size: int = setting(32, "sequences per step (default %(default)s)", type=int)
    """Sequences per step."""
    lr: float = setting(3e-3, "AdamW learning rate (default %(default)s)", type=float)
    """AdamW learning rate."""
    seeds: Sequence[int] = setting(
        (0, 1),
        "comma-separated seeds, each once (default %(default)s)",
        text=_comma,
        parse=lambda text: _ints(text, "seeds"),
    )
    """Training seeds: every variant is trained once per seed (non-negative, no seed twice)."""
    d_model: int = setting(64, "residual width of every model (default %(default)s)", type=int)
    """Residual width of every model."""
    n_heads: int | None = setting(None, "layouts only: query heads (default 8)", type=int)
    """``"layouts"``: query heads per layer (None: 8); refused by ``"heads"``."""
    n_heads_list: Sequence[int] | None = setting(
        None,
        "heads only: head counts (default 1,2,4,8,16)",
        text=_comma,
        parse=lambda text: _ints(text, "n-heads-list"),
    )
    """``"heads"``: the head counts (each must divide ``d_model``; None: 1, 2, 4, 8, 16); refused by ``"layouts"``."""
    ranks: Sequence[int] | None = setting(
        None,
        "layouts only: MLA latent ranks (default 4,6,8,16; none: no MLA variant)",
        text=_comma,
        parse=lambda text: _ints(text, "ranks"),
    )
    """``"layouts"``: MLA latent ranks (``kv_lora_rank``; None: 4, 6, 8, 16; empty: no MLA); refused by ``"heads"``."""
    rope: int | None = setting(
        None,
        "layouts only: MLA decoupled rotary width, even and positive (default 8; 4 gives the shared rotary key only "
        "2 frequencies and no previous-token head formed within the default steps)",
        type=int,
    )
    """``"layouts"``: MLA's decoupled rotary width (``qk_rope_head_dim``, even and positive: the
    models use rotary positions; None: 8; 4 gives the shared rotary key only 2 frequencies and no
    previous-token head formed within the default steps); refused by ``"heads"``."""
    eval_every: int = setting(200, "steps between evaluations (default %(default)s)", type=int)
    """Steps between evaluations."""
    device: str = shared(
        ModelSettings,
        "device",
        "auto",
        help="where to run (default auto: cuda when a GPU is present, else cpu); trains and scores in float32 (no --dtype)",
    )
    """``"auto"`` (cuda when a GPU is present), ``"cpu"`` or ``"cuda"``."""

    def __post_init__(self):
        for name in ("seeds", "n_heads_list", "ranks"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise HeadprobeError(f"--{name.replace('_', '-')} must be a sequence of integers, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        for name, default in DEFAULTS.items():  # a setting left None takes its default where it applies
            if getattr(self, name) is None and self._applies(name):
                object.__setattr__(self, name, default)

    def _applies(self, name: str) -> bool:
        """Whether setting ``name`` means something in this study and corpus."""
        if name == "copy_fraction":
            return self.corpus == "text+copy"
        return ONLY_FOR.get(name, self.which) == self.which

    def base(self) -> TrainConfig:
        """The training settings every variant shares (2 attention-only layers, no biases, segments
        of 4..16 tokens, detectors on a repeated block of 12)."""
        return TrainConfig(
            d_model=self.d_model,
            n_heads=self.n_heads if self.n_heads is not None else TrainConfig.n_heads,  # heads: each variant's own
            steps=self.steps,
            eval_every=self.eval_every,
            device=self.device,
            bias=False,
            corpus=self.corpus,
            copy_fraction=self.copy_fraction,  # None with corpus copy (DEFAULTS fills it for text+copy)
            n_words=N_CHARS if self.corpus == "text+copy" else TrainConfig.n_words,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            lr=self.lr,
            min_period=4,
            max_period=MAX_PERIOD,
            eval_period=12,
        )

    def variants(self) -> list[tuple[str, TrainConfig]]:
        """(label, config) of every model the study trains (seeds apart)."""
        return variants(self.which, self.base(), list(self.n_heads_list or ()), list(self.ranks or ()), self.rope or 0)

    def _refuse_shared_settings(self) -> None:
        """Refuse a bad value of a setting every variant shares (``--steps``, ``--eval-every``,
        ``--batch-size``, ``--d-model``, ``--lr``) as that flag's, before any variant is built: it was
        found building the first, "the 1 heads variant cannot be built: --steps must be a positive
        integer", as if the variant were at fault. (``--d-model``'s split into each variant's heads
        is the variant's.)"""
        for name in ("steps", "eval_every", "batch_size", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HeadprobeError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < float("inf")):
            raise HeadprobeError(f"--lr must be a positive number, got {self.lr!r}")

    def validate(self) -> None:
        """Raise :class:`HeadprobeError` (one line, naming the ``headprobe study`` flag) on settings
        that cannot run, including any variant's training settings or layout."""
        if self.which not in STUDIES:
            raise HeadprobeError(
                f"the study must be one of {', '.join(STUDIES)}, got {self.which!r}{did_you_mean(str(self.which), STUDIES)}"
            )
        for name in ONLY_FOR:
            if getattr(self, name) is not None and not self._applies(name):
                raise HeadprobeError(
                    f"--{name.replace('_', '-')} applies to study {ONLY_FOR[name]} only, not to study {self.which}"
                )
        refuse_copy_fraction(self.corpus, self.copy_fraction)
        self._refuse_shared_settings()
        for name, least in (("seeds", 0), ("n_heads_list", 1), ("ranks", 1)):
            values = getattr(self, name)
            if values is None:  # not this study's setting (refused above where given)
                continue
            flag = f"--{name.replace('_', '-')}"
            if (not values and name != "ranks") or any(
                not isinstance(v, int) or isinstance(v, bool) or v < least for v in values
            ):
                raise HeadprobeError(
                    f"{flag} must list at least one {'non-negative' if least == 0 else 'positive'} integer, "
                    f"got {','.join(map(str, values))!r}"
                )
            if name == "seeds" and (why := next(filter(None, map(seed_error, values)), None)):
                raise HeadprobeError(f"{flag}: each seed {why}")
            if len(set(values)) < len(values):
                twice = sorted({v for v in values if values.count(v) > 1})
                raise HeadprobeError(f"{flag} lists {','.join(map(str, twice))} more than once: give each value once")
        if self.rope is not None and (self.rope < 1 or self.rope % 2):
            raise HeadprobeError(
                f"--rope must be an even positive integer (MLA with rotary positions needs a rotary key), got {self.rope}"
            )
        if self.seq_len < 2 * MAX_PERIOD + 1:
            raise HeadprobeError(
                f"--seq-len must be at least {2 * MAX_PERIOD + 1} (BOS and a copied segment of up to "
                f"{MAX_PERIOD} tokens shown twice), got {self.seq_len}"
            )
        for label, cfg in self.variants():
            try:
                cfg.validate()
                cfg.model_config()
            except HeadprobeError as e:  # before any variant trains (16 heads of d_model 16 died after the others)
                raise HeadprobeError(f"the {label} variant cannot be built: {e}") from None


def layout_of(cfg: TrainConfig) -> AttentionLayout:
    """The :class:`~headprobe.probe.layout.attention.AttentionLayout` of the model a training config builds
    (:attr:`TransformerConfig.layout <headprobe.probe.model.config.TransformerConfig.layout>`), costed
    with a bf16 cache (2 bytes per element).

    Raises:
        HeadprobeError: a layout the transformer cannot build (see ``TrainConfig.model_config``).
    """
    return dataclasses.replace(cfg.model_config().layout, bytes_per_element=2)


def variants(
    which: str, base: TrainConfig, n_heads_list: list[int], ranks: list[int], rope: int
) -> list[tuple[str, TrainConfig]]:
    """(label, config) of every model the study trains (seeds apart)."""
    if which == "heads":
        return [(f"{h} heads", dataclasses.replace(base, n_heads=h, n_kv_heads=None)) for h in n_heads_list]
    H = base.n_heads
    out = [("MHA", dataclasses.replace(base, n_kv_heads=None))]
    out += [(f"GQA {g} groups", dataclasses.replace(base, n_kv_heads=g)) for g in (4, 2) if 1 < g < H and H % g == 0]
    out.append(("MQA", dataclasses.replace(base, n_kv_heads=1)))
    out += [
        (f"MLA r={r}", dataclasses.replace(base, n_kv_heads=None, kv_lora_rank=r, qk_rope_head_dim=rope)) for r in ranks
    ]
    return out


FLAGS = (Flags(only=("which",)), OUTPUT, Flags(skip=("which",)))
"""``headprobe study``'s flags in ``--help`` order."""


def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """The :class:`StudyConfig` of parsed ``headprobe study`` flags (lists are comma-separated)."""
    return from_args(StudyConfig, args)


def check(args: argparse.Namespace, config: StudyConfig) -> None:
    """:meth:`StudyConfig.validate`, before any work (:attr:`Command.check`)."""
    config.validate()


def main(args: argparse.Namespace, config: StudyConfig) -> int:
    prepare_output_dir(args.out, args.overwrite, create=False)  # fail before training, leave nothing behind
    result = resolve("headprobe.commands.study_core:run")(config, progress=True)
    with out_as_it_was(args.out):
        result.save(args.out, overwrite=args.overwrite)
    print(result.report())
    print(f"wrote results.csv, study.json and the figure to {Path(args.out)}/")
    say_replaced_and_kept(args.out)
    return 0


COMMAND = Command(
    HELP,
    config=StudyConfig,
    run="headprobe.commands.study:main",
    flags=FLAGS,
    api="headprobe.commands.study_core:study",
    check="headprobe.commands.study:check",
)
"""``headprobe study``, registered in :data:`headprobe.commands.COMMANDS`."""
