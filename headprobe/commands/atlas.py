"""``headprobe atlas``: scan many models (or one model's training checkpoints) and show where
each head type sits across them.

Each model is scanned as ``headprobe scan`` does (one directory per model under ``OUT/models/``,
with everything scan writes), one after the other, the model freed before the next loads. The
run is resumable per model: a model whose directory holds a complete scan with the same settings
(``atlas_scan.json``, written after the scan's files) is not scanned again when the command is
started again -- after an interruption, or with ``--overwrite`` and more models to add to a
finished atlas (delete ``OUT/models/NAME`` to force a new scan). Every model is looked up before
anything runs: names that cannot be found (a missing path, a folder without config.json or weights;
a name not in the local cache that the hub does not hold, or any with the hub unreachable) are
refused together in one line. A model
that is found but fails (weights it cannot read, an architecture the self-check refuses, ...) is
recorded with its one-line error in summary.json and the others go on; when every model fails,
no atlas is written and the errors are one line (a ``toy`` model trained is kept in ``OUT/toy/``,
which the next atlas there reuses; nothing else the run added is left). Then it writes ``atlas.csv`` (every head of every
model, see :mod:`headprobe.analyses.atlas`), one figure per head type (``atlas_<type>``), the overview
figure ``atlas`` and, for checkpoints, ``over_training``.

Models: names and paths as ``--model`` takes them, plus ``toy``: a small attention-only model that
headprobe trains first (:data:`TOY_TRAIN`: CPython's documentation at character level mixed with
copy sequences, so it can be scanned on natural text), saved under ``OUT/toy/``. The default list runs offline: ``smollm2-135m``, ``all-minilm-l6-v2`` and ``toy``,
plus every model of :data:`CACHED_CANDIDATES` that the local Hugging Face cache holds.

``--checkpoints RUN`` scans the snapshots of a ``headprobe train --save-every N`` run
(``RUN/checkpoints/step-*``, in step order) instead: head types over training.

As a library::

    import headprobe
    result = headprobe.atlas(models=("smollm2-135m", "toy"), out="atlas")   # AtlasResult
    result.table            # atlas.csv as a DataFrame
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headprobe import options, settings
from headprobe.analyses.columns import select_head_types as select_detectors
from headprobe.commands import Command, lazy_names, resolve
from headprobe.options import positive_int
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import prepare_output_dir
from headprobe.settings import OUTPUT, DataSettings, Flags, ModelSettings, Needs, setting, shared

_CORE = ("AtlasResult", "toy_train_config", "run", "atlas")
"""Names of :mod:`headprobe.commands.atlas_core` (the scans and the atlas: torch), imported on first use."""

__getattr__ = lazy_names(__name__, "headprobe.commands.atlas_core", _CORE)

HELP = "scan many models (or a training run's checkpoints) and show where each head type sits across them"

TOY = "toy"
"""The model name that stands for a small model headprobe trains first (see the module docstring)."""
DEFAULT_MODELS = ("smollm2-135m", "all-minilm-l6-v2", TOY)
"""Models of the default atlas that need no network (the first two ship in PyPI wheels)."""
CACHED_CANDIDATES = (
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "distilgpt2",
    "EleutherAI/pythia-70m",
    "EleutherAI/pythia-160m",
    "EleutherAI/pythia-410m",
    "EleutherAI/pythia-1b",
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen3-0.6B",
    "meta-llama/Llama-3.2-1B",
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "HuggingFaceTB/SmolLM2-360M",
    "allenai/OLMo-2-0425-1B",
    "google/gemma-2-2b",
    "bert-base-uncased",
)
"""Models the default atlas adds when the local Hugging Face cache (``HF_HOME``) holds them."""

TOY_TRAIN: dict[str, Any] = dict(
    corpus="text+copy",
    n_heads=8,
    seq_len=48,
    min_period=4,
    max_period=23,
    eval_period=12,
    copy_fraction=0.75,
    bias=False,
    eval_every=200,
)
"""The ``toy`` model's training settings (``headprobe study``'s, with segments up to the 23 tokens
the scan repeats at this context length): 2 attention-only layers of 8 heads, d_model 64, 48-token
context, three quarters copy sequences and one quarter CPython documentation per batch. With 1200
steps its induction heads form between steps 800 and 1000 (about 40 s on 2 CPU cores)."""

FAMILIES = {"smollm2-135m": "llama", "all-minilm-l6-v2": "bert", TOY: "headprobe toy"}
MODELS_DIR, TOY_DIR, TABLE = "models", "toy", "atlas.csv"
SCAN_KEY = "atlas_scan.json"
"""Written into a model's directory after its scan: the model and scan settings. A later atlas with
the same ones reuses that scan instead of running it again."""


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def holds_only_toy(out: str | Path) -> bool:
    """``out`` holds nothing but a trained toy model (``toy/config.json`` with its training
    settings): what an atlas whose models all failed keeps (checked torch-free; :func:`run` reuses
    it without ``--overwrite`` where its settings are this atlas's)."""
    out = Path(out)
    if not out.is_dir() or [p.name for p in out.iterdir()] != [TOY_DIR]:
        return False
    return "train" in (_read_json(out / TOY_DIR / "config.json") or {})


def _model_names(values: Sequence[str] | None) -> tuple[str, ...] | None:
    """``--models a,b c`` (commas and spaces alike) as ``("a", "b", "c")``; None: not given."""
    return tuple(m.strip() for a in values for m in a.split(",") if m.strip()) if values else None


@dataclass(frozen=True)
class AtlasConfig(ModelSettings, DataSettings):
    """Settings of an atlas (all recorded in summary.json's ``config``): the shared
    :class:`~headprobe.settings.ModelSettings` and :class:`~headprobe.settings.DataSettings`
    composed (passed to every model's load and scan; ``seq_len`` and ``period`` None: as scan) and
    the atlas' own.

    Attributes:
        model: always None: an atlas takes ``models`` (a value is refused in one line).
        device: where each model is loaded (:func:`headprobe.options.load_model`, as the other settings below).
        dtype: each model's weights' dtype after its self-check.
        backend: each model's backend.
        prepend_bos: always true (no flag).
        device_map: how each model is split over devices, or None.
        max_memory: per device for ``device_map``.
        models: model names or paths (``toy``: train one first); None: :data:`DEFAULT_MODELS` plus
            the cached :data:`CACHED_CANDIDATES` (or none with ``checkpoints``).
        checkpoints: a ``headprobe train --save-every`` output directory: scan its snapshots in step order.
        n_random: the scan's (:class:`headprobe.commands.scan.ScanConfig`), as the seven below, the same for every
            model; each model's verdicts are corrected over that model's scan (its own family).
        keep_n_random: the scan's.
        alpha: the scan's.
        control: the scan's.
        correction: the scan's.
        k: the scan's.
        types: the scan's.
        pattern_len: the scan's.
        toy_steps: training steps of the ``toy`` model.
        metrics: compute the scan's reported head metrics (copying, sink rate, entropy, retrieval,
            DLA, composition) for every model too.
        model_figures: write each model's scan figures too (False: only its head_scores.csv,
            summary.json, patterns and viewer page; the atlas figures are always written).
    """

    model: str | None = None  # type: ignore[assignment]  # optional here (--models, --checkpoints), required by the other commands
    models: Sequence[str] | str | None = setting(
        None,
        f"models to scan: names, paths, or {TOY} (a small model trained first); default: {' '.join(DEFAULT_MODELS)} "
        "and the cached ones of GPT-2, Pythia, Qwen, Llama ...",
        nargs="+",
        metavar="MODEL",
        parse=_model_names,
    )
    checkpoints: str | None = setting(
        None,
        "scan the snapshots of a headprobe train --save-every run (RUN/checkpoints/step-*) in step order "
        "(default: none)",
        metavar="RUN",
    )
    seq_len: int | None = shared(
        DataSettings,
        "seq_len",
        None,
        help=("natural-text sequence length in tokens (default: as scan, 128 or the model's context)"),
    )
    period: int | None = shared(
        DataSettings,
        "period",
        None,
        help=("length of the repeated random block (default: as scan, 50 or what fits the context twice)"),
    )
    n_random: int = setting(
        50,
        "the most control sets of k heads a verdict's test ablates (default %(default)s, raised to what a verdict "
        "needs unless --keep-n-random; see scan)",
        type=positive_int,
    )
    keep_n_random: bool = setting(
        False,
        "keep --n-random where it is below the draws one verdict needs (a smaller, quicker atlas; see scan)",
        action="store_true",
    )
    alpha: float = setting(0.05, "significance level of the verdicts (default %(default)s)", type=settings.probability)
    control: str = setting(
        "layer-matched",
        "how control sets are drawn (default %(default)s; see scan)",
        choices=("layer-matched", "uniform"),
    )
    correction: str = setting(
        "bh", "multiple-testing correction over each model's verdicts (default %(default)s)", choices=("bh", "holm")
    )
    k: int | None = setting(
        None, "heads ablated per type (default: as scan)", flag="--top-k", short="-k", type=positive_int
    )
    types: Sequence[str] | str | None = setting(None, "head types (default: all)", metavar="TYPE[,TYPE...]")
    pattern_len: int = setting(
        64, "tokens of each head's pattern kept per model for headprobe view (default %(default)s; 0: none)", type=int
    )
    toy_steps: int = setting(
        1200,
        f"training steps of the {TOY} model, where one is among the models (default %(default)s)",
        type=positive_int,
        needs=Needs(
            "trains_toy",
            (True,),
            said=f"when {TOY} is among the models (named in --models, or --models left out without --checkpoints): "
            f"add {TOY} to --models or leave --toy-steps out",
        ),
    )
    model_figures: bool = setting(
        True,
        "write only each model's tables, patterns and viewer page, not its scan figures (faster)",
        flag="--no-model-figures",
        action="store_false",
    )
    metrics: bool = setting(
        True,
        "skip the scan's reported head metrics (copying, sink rate, entropy, retrieval, DLA, composition)",
        flag="--no-metrics",
        action="store_false",
    )

    def __post_init__(self):
        super().__post_init__()  # the shared settings' checks (headprobe.settings.check_settings)
        if self.model is not None:
            raise HeadprobeError("headprobe atlas takes --models (one or more), not --model")
        if isinstance(self.models, str):
            object.__setattr__(self, "models", tuple(m for m in re.split(r"[,\s]+", self.models) if m))
        elif self.models is not None:
            object.__setattr__(self, "models", tuple(self.models))
        if self.models is not None and not self.models:
            raise HeadprobeError("--models is empty; name at least one model")
        object.__setattr__(self, "types", select_detectors(self.types))
        if self.toy_steps < 1:
            raise HeadprobeError(f"--toy-steps must be a positive integer, got {self.toy_steps}")
        self.scan_config("smollm2-135m").preflight()  # the scan's own checks (n_random, k, text file, dtype ...)
        if self.trains_toy:
            self.check_toy_layout()
        if self.checkpoints is not None:
            snapshot_dirs(self.checkpoints)

    @property
    def trains_toy(self) -> bool:
        """Whether the run trains the :data:`TOY` model: named in ``models``, or ``models`` left to the
        defaults (which hold it) without ``checkpoints`` (whose snapshots are then the only models)."""
        if self.models is None:
            return self.checkpoints is None
        return TOY in self.models

    def check_toy_layout(self) -> None:
        """The scan's checks of ``seq_len``, ``period`` and ``k`` against the :data:`TOY` model's context
        and heads, known from :data:`TOY_TRAIN` before it trains (else a bad ``--seq-len`` failed only
        after the training).

        Raises:
            HeadprobeError: as :meth:`~headprobe.commands.scan.ScanConfig.preflight`, naming the toy.
        """
        from headprobe.analyses.train_config import TrainConfig

        n_heads = TOY_TRAIN.get("n_layers", TrainConfig.n_layers) * TOY_TRAIN["n_heads"]
        try:
            self.scan_config(TOY)._check_layout(n_heads, TOY_TRAIN["seq_len"])
        except HeadprobeError as e:
            raise HeadprobeError(f"the {TOY} model: {e}") from None

    def scan_config(self, model: str):
        """The :class:`~headprobe.commands.scan.ScanConfig` every model is scanned with."""
        from headprobe.commands.scan import ScanConfig

        shared = {
            f.name: getattr(self, f.name)
            for group in (ModelSettings, DataSettings)
            for f in dataclasses.fields(group)
            if f.name != "model"
        }
        return ScanConfig(
            model=model,
            **shared,
            n_random=self.n_random,
            keep_n_random=self.keep_n_random,
            alpha=self.alpha,
            control=self.control,
            correction=self.correction,
            k=self.k,
            types=self.types,
            pattern_len=self.pattern_len,
            metrics=self.metrics,
        )

    def model_list(self) -> list[tuple[str, str, int | None]]:
        """``(label, model, step)`` of every model to scan, in order: the checkpoints' snapshots
        (label ``step N``), then the models (or the defaults).

        Raises:
            HeadprobeError: a model named twice, or names that name no model (:func:`check_models_found`).
        """
        out: list[tuple[str, str, int | None]] = []
        if self.checkpoints is not None:
            out += [(f"step {step}", str(d), step) for step, d in snapshot_dirs(self.checkpoints)]
        models = self.models if self.models is not None else (() if self.checkpoints else default_models())
        out += [(m, m, None) for m in models]
        labels = [label for label, _, _ in out]
        if len(set(labels)) != len(labels):
            raise HeadprobeError(
                f"a model is named twice: {', '.join(sorted({x for x in labels if labels.count(x) > 1}))}"
            )
        check_models_found(models)
        return out


def check_models_found(models: Sequence[str]) -> None:
    """Refuse, before anything is trained, loaded or written, every model that cannot be found
    (:func:`headprobe.options.check_model`: an unknown name, a missing path, a folder without
    config.json or weights, a name not in the local cache that the hub does not hold or, with the
    hub unreachable, any name not in the local cache). A model found
    that then fails to load is left to the run, which records it as failed and goes on.

    Raises:
        HeadprobeError: one line naming each such model and why."""
    missing = []
    for m in models:
        if m != TOY:
            try:
                options.check_model(m)
            except HeadprobeError as e:
                missing.append((m, str(e).splitlines()[0]))
    if len(missing) == 1:
        raise HeadprobeError(missing[0][1])
    if missing:
        raise HeadprobeError(
            f"{len(missing)} of the models cannot be found, so nothing was scanned: "
            + "; ".join(f"{m}: {why}" for m, why in missing)
        )


def default_models() -> tuple[str, ...]:
    """:data:`DEFAULT_MODELS` plus the :data:`CACHED_CANDIDATES` the local Hugging Face cache holds."""
    from huggingface_hub import try_to_load_from_cache

    from headprobe.probe.backends.sources import ALIASES

    cached = [m for m in CACHED_CANDIDATES if isinstance(try_to_load_from_cache(ALIASES.get(m, m), "config.json"), str)]
    return (*DEFAULT_MODELS, *cached)


def snapshot_dirs(run: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every snapshot of a ``headprobe train --save-every`` run, in step order.

    Raises:
        HeadprobeError: ``run`` is not a folder, or has no ``checkpoints/step-*`` directories.
    """
    if not Path(run).is_dir():
        what = "not a folder" if Path(run).exists() else "no such folder"
        raise HeadprobeError(f"--checkpoints {run}: {what}; give the --out folder of headprobe train --save-every N")
    root = Path(run) / "checkpoints"
    found = sorted(
        (int(m.group(1)), d) for d in root.glob("step-*") if d.is_dir() and (m := re.fullmatch(r"step-(\d+)", d.name))
    )
    if not found:
        raise HeadprobeError(
            f"{run} has no checkpoints/step-* directories; train with headprobe train --save-every N --out {run}"
        )
    return found


WINDOWS_DEVICE = re.compile(r"(con|prn|aux|nul|com[1-9]|lpt[1-9])(\.|$)", re.IGNORECASE)
PLAIN_NAME = re.compile(r"[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9_-])?")
"""A model label kept as its own folder name (unless a :data:`WINDOWS_DEVICE` name such as
``con`` or ``nul.txt``): lower case, digits, ``.``, ``_``, ``-``, not hidden, not ending in ``.``."""
STEP_LABEL = re.compile(r"step (0|[1-9][0-9]*)")
"""The label of a training snapshot (:meth:`AtlasConfig.model_list`); its folder is ``step_N``."""
HASH_DIGITS = 10
RESERVED_NAME = re.compile(rf"step_[0-9]+|.*-[0-9a-f]{{{HASH_DIGITS}}}")
"""Folder names only :func:`slug` makes: snapshots' and hashed ones. A plain label of this form is hashed too."""


def slug(label: str) -> str:
    """The folder of model ``label`` under ``OUT/models/``: one-to-one, safe, and the same every run.

    A plain label (:data:`PLAIN_NAME`: ``smollm2-135m``, ``toy``) is its own folder, and a snapshot
    ``step N`` is ``step_N``. Any other label (a path, a Hugging Face name with ``/``, capitals,
    ``..``, ``con``, ...) becomes a readable part (runs of other characters as ``_``, at most its last 47
    characters, no leading or trailing ``.``/``_``/``-``; ``model_`` before a device name) plus ``-`` and the first
    :data:`HASH_DIGITS` hex digits of the label's SHA-256: ``x/llama`` -> ``x_llama-<hash>``, while
    ``x_llama`` stays ``x_llama``, and ``..`` -> ``model-<hash>``. The three forms cannot meet
    (:data:`RESERVED_NAME`), so two labels share a folder only if their hashes do (40 bits), even on
    a file system that ignores case; a folder name is never ``.``, ``..``, hidden, absolute or
    longer than 64 characters.
    """
    if PLAIN_NAME.fullmatch(label) and not RESERVED_NAME.fullmatch(label) and not WINDOWS_DEVICE.match(label):
        return label
    if m := STEP_LABEL.fullmatch(label):
        return f"step_{m.group(1)}"
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._-")[-47:].lstrip("._-") or "model"
    if WINDOWS_DEVICE.match(readable):
        readable = f"model_{readable}"
    return f"{readable}-{hashlib.sha256(label.encode('utf-8', 'surrogatepass')).hexdigest()[:HASH_DIGITS]}"


def family_of(model: str) -> str:
    """The architecture family of ``model`` (its config's ``model_type``: ``llama``, ``gpt2``, ``bert``
    ...), read from its config.json without loading weights; ``unknown`` where there is none."""
    if model.lower() in FAMILIES:
        return FAMILIES[model.lower()]
    path = Path(model).expanduser() / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        return "headprobe toy" if "format" in cfg else str(cfg.get("model_type", "unknown"))
    except (OSError, ValueError):
        pass
    try:
        from transformers import AutoConfig

        from headprobe.probe.backends.loading import ALIASES

        return AutoConfig.from_pretrained(ALIASES.get(model, model), local_files_only=True).model_type
    except Exception:
        return "unknown"


# --model is kept off --help (AtlasConfig refuses it in one line: an atlas takes --models); no --no-bos
FLAGS = (
    Flags(only=("models", "checkpoints")),
    OUTPUT,
    Flags(group=DataSettings),
    Flags(
        only=(
            "k",
            "n_random",
            "keep_n_random",
            "alpha",
            "control",
            "correction",
            "types",
            "pattern_len",
            "model_figures",
            "metrics",
            "toy_steps",
        )
    ),
    Flags(group=ModelSettings, skip=("prepend_bos",), helps={"model": argparse.SUPPRESS}),
)
"""``headprobe atlas``'s flags in ``--help`` order."""


def main(args: argparse.Namespace, config: AtlasConfig) -> int:
    config.model_list()
    prepare_output_dir(
        args.out, args.overwrite or holds_only_toy(args.out), create=False, resumable=True, models=(TOY_DIR,)
    )
    with options.out_as_it_was(args.out):
        result = resolve("headprobe.commands.atlas_core:run")(config, args.out, overwrite=args.overwrite, progress=True)
    print()
    print(result.report())
    print(
        f"\nwrote atlas.csv ({len(result.table)} heads), {len(result.files) - 2} figure files and summary.json to "
        f"{result.out}/ (each model's scan in {result.out}/{MODELS_DIR}/)"
    )
    options.say_replaced_and_kept(result.out)
    return 0  # every model failed: run raised, and wrote nothing


COMMAND = Command(
    HELP,
    config=AtlasConfig,
    run="headprobe.commands.atlas:main",
    flags=FLAGS,
    api="headprobe.commands.atlas_core:atlas",
)
"""``headprobe atlas``, registered in :data:`headprobe.commands.COMMANDS`."""
