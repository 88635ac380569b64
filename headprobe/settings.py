"""The settings several commands share, each declared once: a frozen dataclass field with its
default and its help, from which the command-line flag is generated.

Three groups (tuned-lens' composed settings, ``scripts/ingredients.py``, done with the standard
library):

* :class:`ModelSettings` -- which model and how it is loaded (``--model --device --dtype --backend
  --no-bos --device-map --max-memory``);
* :class:`DataSettings` -- the natural-text and repeated-random-token sets (``--text --seq-len
  --n-natural --n-repeated --period --seed``);
* :class:`OutputSettings` -- where the files go (``--out --overwrite --formats``).

A command's Config derives from the groups it takes (``class ScanConfig(ModelSettings,
DataSettings)``): dataclass inheritance composes their fields into one flat, frozen record, so
``config.seq_len``, the Python API's keywords (``headprobe.scan(model, seq_len=64)``) and
summary.json's ``config`` stay flat. A command that needs another default redeclares the field
with the default alone (``seq_len: int | None = None``); its help is still the group's. A command
that takes only some of a group's fields (``kv`` has natural text but no repeated tokens) does not
compose the group -- it would gain settings it ignores -- but declares each with :func:`shared`
(``seq_len: int = shared(DataSettings, "seq_len", 1024)``): the group's help, flag, type and
checks, its own default; a field added to the group does not reach it. The
command's own settings are fields made with :func:`setting` too, and :func:`add_flags` turns any
of these dataclasses into argparse flags; :func:`from_args` builds it back from the parsed flags.

Nothing here imports torch (flag and config errors come before torch loads; ``headprobe budget``
starts without it): dtypes are names until :func:`headprobe.options.torch_dtype`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from headprobe.analyses.vocabulary import (
    DEFAULT_PERIOD,
    DEFAULT_SEQ_LEN,
    FIGURE_FORMATS,
    MIN_PERIOD,
    MIN_SEQ_LEN,
    MIN_WINDOW_TOKENS,
    NO_FIGURES,
    PERIOD_TARGET,
    SEED_MAX,
    SEQ_LEN_CLASH,
    parse_figure_formats,
    seed_error,
)
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.vocabulary import (  # defined once there (torch-free)
    BACKENDS,
    DEVICE_MAPS,
    DEVICES,
    DTYPE_ALIASES,
    DTYPES,
    refuse_lacking,
    unsupported_dtype,
)

DEFAULT_MODEL = "smollm2-135m"


FLOAT16_BRIDGE = (
    "--dtype float16 runs only on the native backend: TransformerLens' bridge computes q k^T in "
    "float16, which overflows (65504) to NaN patterns on models with large queries and keys; "
    "use --dtype bfloat16 (float32's range) or --backend native"
)
"""Why float16 is refused on the TransformerLens bridge (its attention code is not ours to patch)."""


def device_map_float32_only(backend: str) -> str:
    """Why ``--device-map`` with ``--dtype`` other than float32 is refused on ``backend`` (one without
    ``splits_after_load``): the sentence :func:`~headprobe.probe.core.vocabulary.refuse_lacking` ends."""
    return (
        f"--device-map on the {backend} backend loads float32 only (transformers splits the model "
        "as it loads, before any cast): use --dtype float32 or --backend native"
    )


def positive_int(text: str) -> int:
    """argparse ``type`` for counts and lengths: an integer >= 1 (else a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def number(text: str) -> float:
    """argparse ``type`` for a real-valued setting (a fraction, a learning rate, a tolerance): a finite
    number; ``nan``, ``inf`` and ``1e999`` are refused (a one-line usage error), since no range check
    compares NaN as out of range and infinity reaches torch's optimisers and samplers as a crash."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def seed(text: str) -> int:
    """argparse ``type`` for a seed: an integer from 0 to :data:`SEED_MAX` (else a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {SEED_MAX}, got {text!r}") from None
    if why := seed_error(value):
        raise argparse.ArgumentTypeError(why)
    return value


def probability(text: str) -> float:
    """argparse ``type`` for a significance level: a number strictly between 0 and 1 (else a
    one-line usage error, ``(see headprobe scan --help)`` like every other flag's)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1 (exclusive), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {value}")
    return value


def dtype_name(text: Any) -> str:
    """argparse ``type`` for ``--dtype``: torch's name (``bfloat16``), a short alias (``bf16``) or,
    from Python, a ``torch.dtype`` (``torch.bfloat16``), returned as torch's name."""
    if type(text).__module__ == "torch" and type(text).__name__ == "dtype":  # torch.float16: "torch.float16"
        text = str(text)
    if not isinstance(text, str):
        raise argparse.ArgumentTypeError(
            f"dtype must be a name such as float32 or a torch.dtype, got {text!r} ({type(text).__name__})"
        )
    name = DTYPE_ALIASES.get(text.lower().removeprefix("torch."), text.lower().removeprefix("torch."))
    if name not in DTYPES:
        choices = f"{', '.join(DTYPES)} (or {', '.join(DTYPE_ALIASES)})"
        if unsupported_dtype(text):  # a real dtype, not a misspelling: no spelling suggestion
            raise argparse.ArgumentTypeError(f"dtype {text!r} is not supported: headprobe computes in {choices}")
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}{did_you_mean(text.lower(), (*DTYPES, *DTYPE_ALIASES))}; choose one of {choices}"
        )
    return name


_CUDA_INDEX = re.compile(r"^cuda:\d+$")


def check_device(device: Any, indexed: bool = False) -> None:
    """``--device`` (``device=``) among :data:`DEVICES`, or, where ``indexed`` (``load_model``),
    ``cuda:N`` too. Whether the GPU is there is :func:`headprobe.options.check_device_present`'s.

    Raises:
        HeadprobeError: one line naming the choices.
    """
    if isinstance(device, str) and (device in DEVICES or (indexed and _CUDA_INDEX.match(device))):
        return
    choices = ", ".join(DEVICES) + (", cuda:N" if indexed else "")
    raise HeadprobeError(f"--device {device!r} is not one of {choices}{did_you_mean(str(device), DEVICES)}")


_SIZE = re.compile(r"^\d+(\.\d+)?\s*([KMGT]i?B)?$", re.IGNORECASE)
_MEMORY_DEVICE = re.compile(r"^(cpu|disk|mps|(cuda:)?\d+)$")


def parse_max_memory(text: str) -> dict[int | str, int | str]:
    """argparse ``type`` for ``--max-memory``: ``DEVICE=SIZE,...`` (``cpu=2GiB,cuda:0=10GiB,disk=100GB``)
    as accelerate's ``max_memory`` dict: devices ``cpu``, ``disk``, ``mps``, ``cuda:N`` or ``N``
    (GPU N, an int key), sizes in bytes or with a unit (``KB MB GB TB``, ``KiB MiB GiB TiB``).
    A device not named gets nothing, except disk, which is unlimited unless named."""
    out: dict[int | str, int | str] = {}
    for part in text.split(","):
        device, eq, size = (x.strip() for x in part.partition("="))
        if not eq or not _MEMORY_DEVICE.match(device) or not _SIZE.match(size):
            raise argparse.ArgumentTypeError(
                f"bad --max-memory entry {part.strip()!r}: expected DEVICE=SIZE with DEVICE one of "
                f"cpu, disk, mps, cuda:N and SIZE like 2GiB or 500MB, e.g. cpu=2GiB,cuda:0=10GiB"
            )
        key: int | str = int(device.removeprefix("cuda:")) if device[-1].isdigit() else device
        if key in out:
            raise argparse.ArgumentTypeError(f"--max-memory names {device} twice")
        out[key] = int(size) if size.isdigit() else size.replace(" ", "").upper().replace("IB", "iB")
    return out


def max_memory_dict(max_memory: dict | str | None) -> dict | None:
    """``--max-memory``'s text parsed (:func:`parse_max_memory`), a dict or None as given.

    Raises:
        HeadprobeError: bad text (one line).
    """
    if not isinstance(max_memory, str):
        return max_memory
    try:
        return parse_max_memory(max_memory)
    except argparse.ArgumentTypeError as e:
        raise HeadprobeError(str(e)) from None


@dataclass(frozen=True)
class Needs:
    """Where a setting acts: only where setting ``field`` of the same Config holds one of ``values``
    (``contains``: a list setting, such as prune's ``methods``, holds one of them; ``values`` empty:
    any value but None). A flag given where it would do nothing is refused before any work
    (:func:`refuse_inert`), so ``--steps`` with ``--method eap`` is not accepted in silence. A
    Config without ``field`` (a command that shares the setting but always runs it) never refuses.
    ``field`` may also name a property of the Config that several settings decide (``atlas``'s
    ``trains_toy``: ``toy`` in ``--models``, or ``--models`` left out without ``--checkpoints``);
    ``said`` then words the condition and the fix, as the refusal's end (``"when ...: add ..."``).
    """

    field: str
    values: tuple = ()
    contains: bool = False
    said: str = ""

    def met(self, config) -> bool:
        """Whether ``config`` (a Config holding ``field``) is where the setting acts."""
        value = getattr(config, self.field)
        if not self.values:
            return value is not None
        if self.contains:
            items = value.split(",") if isinstance(value, str) else (value or ())
            return any(v in items for v in self.values)
        return value in self.values

    def line(self, config, name: str) -> str:
        """The refusal of setting ``name`` of ``config`` given where it does nothing: one line naming
        its flag and the flag (and value) it needs."""
        cls = type(config)
        flag, other = flag_names(cls).get(name, name), flag_names(cls).get(self.field, self.field)
        if self.said:
            return f"{flag} only acts {self.said}"
        value = getattr(config, self.field)
        switch = switch_value(cls, self.field)
        if switch:  # a store_true/store_false flag: with it, or without it
            if self.values[0] == (switch == "=True"):
                return f"{flag} only acts with {other}: add {other} or leave {flag} out"
            return f"{flag} only acts without {other}: leave one of them out"
        shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        if not self.values:
            return f"{flag} only acts with {other}: add {other} or leave {flag} out"
        if self.values == (None,):
            return f"{flag} only acts without {other}, not with {other} {shown}: leave one of them out"
        wanted = " or ".join(str(v) for v in self.values if v is not None)
        where = f"with {wanted} in {other}" if self.contains else f"with {other} {wanted}"
        if None in self.values:  # a None default among the values: without the flag, too
            where = f"without {other} or {where}"
        now = f"not without {other}" if value is None else f"not {other} {shown}"
        return f"{flag} only acts {where}, {now}: leave {flag} out or change {other}"


def refuse_inert(config, given) -> None:
    """Refuse the settings among ``given`` (field names the user set, at any value: a flag given on
    the command line, :func:`given_on_command_line`; a keyword passed to a Python function,
    :func:`given_in_python`) that do nothing with the rest of ``config``: each setting
    declared with ``needs`` (:class:`Needs`) whose condition ``config`` does not meet. Called once,
    before any work, for every command (:meth:`headprobe.commands.Command.execute` and
    :func:`headprobe.options.config_and_model`).

    Raises:
        HeadprobeError: one line naming the first such flag and the flag (and value) it needs.
    """
    cls = type(config)
    fields = getattr(cls, "__dataclass_fields__", {})
    for name in given:
        needs = _meta(cls, name).get("needs") if name in fields else None
        if needs is not None and decides(cls, needs.field) and not needs.met(config):
            raise HeadprobeError(needs.line(config, name))


def decides(cls, name: str) -> bool:
    """Whether Config ``cls`` holds ``name``, a :class:`Needs`' ``field``: a field, or a property."""
    return name in getattr(cls, "__dataclass_fields__", {}) or isinstance(getattr(cls, name, None), property)


GIVEN_KEY = "_given"
"""The parsed namespace's entry listing the options given on the command line (their ``dest``), set
by :class:`headprobe.cli.OneLineErrorParser` as argparse takes each one (:func:`given_on_command_line`)."""


def given_on_command_line(args: argparse.Namespace) -> list[str]:
    """The options of ``args`` given on the command line (their ``dest``): each one whose flag, in any
    of its spellings (``--steps 5``, ``--steps=5``, ``-k 3``, ``-k3``), the parsed words held, at any
    value, its default included (no abbreviations: ``allow_abbrev`` is off); none where ``args`` was
    not parsed by headprobe's parser (a namespace made by hand)."""
    return list(getattr(args, GIVEN_KEY, None) or ())


def given_in_python(cls, fields: dict[str, Any]) -> list[str]:
    """The keywords of a command's Python function (``fields``: exactly those passed, as its
    ``**fields`` receives them) that are fields of ``cls``, whatever their value: passing a
    setting's default where it does nothing is refused as the flag is."""
    names = {f.name for f in dataclasses.fields(cls)}
    return [k for k in fields if k in names]


def setting(
    default: Any = dataclasses.MISSING,
    help: str | Callable[[], str] = "",
    *,
    flag: str | None = None,
    short: str | None = None,
    aliases: tuple[str, ...] = (),
    type: Any = None,
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    metavar: str | None = None,
    action: str | None = None,
    required: bool = False,
    nargs: str | None = None,
    positional: bool = False,
    exclusive: str | None = None,
    text: Callable[[Any], str] | None = None,
    parse: Callable[[Any], Any] | None = None,
    kw_only: bool = False,
    needs: Needs | None = None,
    hints: dict[str, tuple[str, str]] | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag: its ``default``, its ``help`` (argparse's
    ``%(default)s`` allowed) and how the flag reads it. ``flag`` defaults to ``--field-name``
    (``aliases``: more long names); ``action="store_false"`` with ``flag="--no-bos"`` makes a switch
    that turns the field off; ``positional``: an argument without a flag (``headprobe study heads``);
    ``exclusive``: flags sharing this name are mutually exclusive (``required``: one of them must be
    given); ``kw_only``: the dataclass field is keyword-only (a required field after defaulted
    ones). ``help`` and ``choices`` may be
    functions, called when the flag is made (a registry that grows at run time). ``text`` writes the
    default as the flag's text (``(1, 3)`` -> ``"1,3"``) and ``parse`` turns the flag's value into
    the field's (:func:`from_args`). The help is the field's documentation (:func:`field_help`).
    A ``type=float`` flag reads its value with :func:`number` (a finite float). ``needs``: the
    setting acts only where another setting holds a value (:class:`Needs`); given elsewhere it is
    refused (:func:`refuse_inert`). ``hints``: words that are not ``choices`` but name one
    (``kvpress`` -> duo), suggested in the refusal (:func:`~headprobe.probe.core.registry.did_you_mean`)."""
    meta = {
        "help": help,
        "flag": flag,
        "short": short,
        "aliases": tuple(aliases),
        "type": type,
        "choices": choices,
        "metavar": metavar,
        "action": action,
        "required": required,
        "nargs": nargs,
        "positional": positional,
        "exclusive": exclusive,
        "text": text,
        "parse": parse,
        "needs": needs,
        "hints": hints,
    }
    return field(
        default=default, kw_only=kw_only, metadata={k: v for k, v in meta.items() if v not in (None, False, ())}
    )


def shared(
    group, name: str, default: Any = dataclasses.MISSING, *, help: str | None = None, needs: Needs | None = None
) -> Any:
    """Field ``name`` of settings ``group`` (:class:`DataSettings`, ...) for a Config that takes only
    some of the group's fields: the group's declaration -- help, flag, type, choices, so
    :func:`add_flags` makes the same flag -- with ``default`` (else the group's). Its value is
    checked by :func:`check_settings` as a composed field is (the Config's ``__post_init__`` must
    call it, e.g. through :class:`ModelSettings`'). ``help``: the command's own text for the flag.
    ``needs``: where the setting acts in this Config alone (:class:`Needs`); a Config that composes
    the group redeclares the field with it (``view``'s ``device`` acts only with ``--model``), and the
    field keeps its place in the field order.

    Raises:
        KeyError: ``group`` has no field ``name``.
    """
    f = group.__dataclass_fields__[name]
    metadata = {**f.metadata, **({} if help is None else {"help": help}), **({} if needs is None else {"needs": needs})}
    return field(default=f.default if default is dataclasses.MISSING else default, metadata=metadata)


def _meta(cls, name: str) -> dict:
    """The flag metadata of field ``name`` of ``cls``: the nearest declaration in the MRO that has a
    help (a subclass that redeclares a field for another default keeps the group's help)."""
    for klass in cls.__mro__:
        f = getattr(klass, "__dataclass_fields__", {}).get(name)
        if f is not None and "help" in f.metadata:
            return dict(f.metadata)
    return {}


def _default_text(meta: dict, default: Any) -> Any:
    """The flag's default: the field's, written by the setting's ``text`` where it has one."""
    if "text" in meta and default is not None and default is not dataclasses.MISSING:
        return meta["text"](default)
    return default


def field_help(cls, name: str) -> str:
    """The documentation of setting ``name`` of dataclass ``cls`` (its flag's help, ``%(default)s``
    filled in with the field's default); ``""`` for a field that is not a flag."""
    meta = _meta(cls, name)
    f = cls.__dataclass_fields__[name]
    text = meta.get("help", "")
    text = text() if callable(text) else text
    return text.replace("%(default)s", str(_default_text(meta, f.default)))


def flag_names(cls) -> dict[str, str]:
    """Field name -> the long flag :func:`add_flags` gives it (a positional argument: its name),
    for every flag field of ``cls``."""

    def name(f):
        meta = _meta(cls, f.name)
        return f.name if meta.get("positional") else meta.get("flag") or "--" + f.name.replace("_", "-")

    return {f.name: name(f) for f in dataclasses.fields(cls) if _meta(cls, f.name)}


def flag_spellings(cls) -> dict[str, tuple[str, ...]]:
    """Field name -> every long spelling of its flag (:func:`flag_names`' first, then its aliases),
    for every flag field of ``cls``."""
    return {name: (flag, *_meta(cls, name).get("aliases", ())) for name, flag in flag_names(cls).items()}


def switch_value(cls, name: str) -> str:
    """``"=True"`` or ``"=False"``: the value the ``store_true`` or ``store_false`` flag of field
    ``name`` of ``cls`` sets (``--no-bos`` is ``prepend_bos=False``); ``""`` for any other flag."""
    return {"store_true": "=True", "store_false": "=False"}.get(_meta(cls, name).get("action") or "", "")


def _flag_call(name: str, meta: dict, default: Any, help: str | Callable[[], str]) -> tuple[list[str], dict[str, Any]]:
    """``(names, keywords)`` of the ``add_argument`` call that makes the flag of field ``name``."""
    kwargs: dict[str, Any] = {"help": help() if callable(help) else help}
    if meta.get("positional"):
        names = [name]
    else:
        long = meta.get("flag") or "--" + name.replace("_", "-")
        names = [*([meta["short"]] if meta.get("short") else []), long, *meta.get("aliases", ())]
        kwargs["dest"] = name
    if meta.get("action"):
        kwargs["action"] = meta["action"]
    else:
        if not meta.get("positional") or default is not None:
            kwargs["default"] = default
        for key in ("type", "choices", "metavar", "nargs"):
            if key in meta:
                kwargs[key] = meta[key]() if key == "choices" and callable(meta[key]) else meta[key]
        if kwargs.get("type") is float:  # every real-valued flag refuses nan and inf (number's docstring)
            kwargs["type"] = number
    if meta.get("required") and not meta.get("exclusive"):  # an exclusive one: its group is required
        kwargs["required"] = True
    return names, kwargs


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls,
    *,
    group=None,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
) -> None:
    """Add a flag for each :func:`setting` field of dataclass ``cls`` (in field order, or ``only``'s), generated
    from the field: its name (``seq_len`` -> ``--seq-len``, or the field's ``flag``), default (the
    one ``cls`` declares), type, choices and help. ``group`` (a settings class ``cls`` composes,
    e.g. :class:`DataSettings`): only the fields it declares, so a field added to the group reaches
    every command that composes it. ``only``/``skip`` pick fields; ``defaults``/``helps`` replace a
    field's default or help for this parser alone (a command that documents a default of its own).
    A name in ``only`` that is not a field of ``cls`` raises ``KeyError`` (a misspelt block).
    Fields with the same ``exclusive`` name go in one mutually exclusive group of ``parser``
    (required where one of them is ``required``)."""
    defaults, helps = defaults or {}, helps or {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := [n for n in only or () if n not in fields]:
        raise KeyError(f"{cls.__name__} has no field {', '.join(unknown)}")
    if group is not None:
        names = tuple(f.name for f in dataclasses.fields(group))
        only = names if only is None else tuple(n for n in only if n in names)
    exclusive = vars(parser).setdefault("_exclusive_settings", {})
    for f in (fields[n] for n in (fields if only is None else only) if n in fields):
        meta = _meta(cls, f.name)
        if not meta or f.name in skip:
            continue
        default = defaults.get(f.name, _default_text(meta, f.default if f.default is not dataclasses.MISSING else None))
        flags, kwargs = _flag_call(f.name, meta, default, helps.get(f.name, meta["help"]))
        target = parser
        if meta.get("exclusive"):
            if meta["exclusive"] not in exclusive:  # made once: an empty group breaks argparse's usage line
                exclusive[meta["exclusive"]] = parser.add_mutually_exclusive_group()
            target = exclusive[meta["exclusive"]]
            target.required = target.required or bool(meta.get("required"))
        action = target.add_argument(*flags, **kwargs)
        if meta.get("hints"):  # read by the parser's choice check (headprobe.cli)
            vars(action)["hints"] = meta["hints"]


def from_args(cls, args: argparse.Namespace, **changes):
    """An instance of dataclass ``cls`` from the parsed flags (every field ``args`` has, through the
    setting's ``parse`` where it has one), with ``changes`` applied; the dataclass's own checks run
    (``__post_init__``)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.init and hasattr(args, f.name):
            parse = _meta(cls, f.name).get("parse")
            values[f.name] = getattr(args, f.name) if parse is None else parse(getattr(args, f.name))
    return cls(**{**values, **changes})


@dataclass(frozen=True)
class Flags:
    """One block of a command's flags, in ``--help`` order (:func:`add_layout`): the flags of the
    :func:`setting` fields of ``settings`` (None: the command's Config), as :func:`add_flags`
    makes them with the same ``group``, ``only`` (in its order), ``skip``, ``helps`` and
    ``defaults``; ``title``: under a heading of their own in ``--help`` (an argument group)."""

    settings: Any = None
    group: Any = None
    only: tuple[str, ...] | None = None
    skip: tuple[str, ...] = ()
    helps: dict[str, str] | None = None
    defaults: dict[str, Any] | None = None
    title: str | None = None


def add_layout(parser: argparse.ArgumentParser, config, layout: Sequence[Flags] = ()) -> None:
    """The flags of a command whose Config is ``config``: each block of ``layout`` in turn (empty:
    every setting field of ``config``, in field order)."""
    for block in layout or (Flags(),):
        target = parser.add_argument_group(block.title) if block.title else parser
        add_flags(
            target,
            block.settings or config,
            group=block.group,
            only=block.only,
            skip=block.skip,
            helps=block.helps,
            defaults=block.defaults,
        )


MODEL_HELP = (
    f"{DEFAULT_MODEL} (default, embedded 4-bit weights), gpt2 or another Hugging Face name, "
    "a local Hugging Face directory, a .gguf file or a headprobe checkpoint directory; a .gguf file "
    f"({DEFAULT_MODEL}'s too) is dequantized once into $HEADPROBE_CACHE (default ~/.cache/headprobe, "
    "or $XDG_CACHE_HOME/headprobe; about 540 MB for SmolLM2-135M; off: no cache)"
)


@dataclass(frozen=True)
class ModelSettings:
    """Which model a command runs and how it is loaded (:func:`headprobe.options.load_model`).
    Invalid values raise :class:`~headprobe.probe.core.errors.HeadprobeError` when the config is made
    (:func:`check_settings`). Every field's help is its documentation (``--help``)."""

    model: str = setting(DEFAULT_MODEL, MODEL_HELP)
    """Model name or path (see :func:`headprobe.probe.backends.loading.load_model`)."""
    device: str = setting("auto", "where to run (default auto: cuda when a GPU is present, else cpu)", choices=DEVICES)
    """``auto``, ``cpu`` or ``cuda``; applies when the model is loaded by name (a loaded model runs
    where it is: another device is refused, and its own is recorded; its dtype likewise)."""
    dtype: str = setting(
        "float32",
        "compute precision of weights and activations (default %(default)s; bf16/fp16/fp32 "
        "accepted); attention softmax and losses stay float32; float16 needs the native backend",
        type=dtype_name,
        metavar="{" + ",".join(DTYPES) + "}",
    )
    """Compute precision (``float32``, ``bfloat16``, ``float16``, or bf16/fp16/fp32), stored as torch's name."""
    backend: str = setting(
        "auto",
        "native: headprobe's own transformer; transformer-lens: TransformerLens' TransformerBridge around "
        "the Hugging Face model (default auto: native where it supports the architecture)",
        choices=BACKENDS,
    )
    """``auto`` (native where supported), ``native`` or ``transformer-lens``."""
    prepend_bos: bool = setting(
        True,
        "do not put BOS in front of sequences (an encoder: neither [CLS] nor [SEP])",
        flag="--no-bos",
        action="store_false",
    )
    """Put the tokenizer's BOS token first (once) where the model has one."""
    device_map: str | None = setting(
        None,
        "split a model too large for one device over the GPUs, CPU memory and disk (accelerate; "
        "the bridge in float32 only): auto/balanced spread the blocks evenly over the GPUs, sequential fills each in turn; "
        "the embedding and unembedding stay on the first device; replaces --device (leave it at auto) "
        "(default: none, one device)",
        choices=DEVICE_MAPS,
    )
    """``auto``, ``balanced`` or ``sequential``: split the model over devices; None: one device."""
    max_memory: str | dict | None = setting(
        None,
        "what --device-map may put on each device, e.g. cpu=2GiB,cuda:0=10GiB,disk=100GB (default: the "
        "free memory of every GPU and the CPU; disk unlimited unless named)",
        metavar="DEVICE=SIZE,...",
    )
    """Per-device budget for ``device_map`` (a dict, or ``--max-memory``'s text); None: what is free."""
    threads: int | None = setting(
        None,
        "torch CPU threads (default: OMP_NUM_THREADS if set, else the cores that are "
        "idle now, at least 1; the header prints the number and why)",
        type=positive_int,
        metavar="N",
    )
    """torch's intra-op CPU threads (:func:`headprobe.options.choose_threads`); None: the default rule."""
    memory_budget: str | None = setting(
        None,
        "working memory batched work may fill beyond the weights, e.g. 4GiB (2^30 bytes each) or 500MB (10^6 each; "
        "a bare number is bytes) (default: "
        "$HEADPROBE_MEMORY_BUDGET, else 80 percent of the device's free memory); batch sizes are planned from it and "
        "the header prints them; a budget above the free memory, or work that cannot fit, is refused before it starts",
        metavar="SIZE",
    )
    """Working-memory budget (``4GiB``; :mod:`headprobe.probe.core.memory`); None: the environment's, else free memory."""

    def __post_init__(self):
        check_settings(self)


@dataclass(frozen=True)
class DataSettings:
    """The natural-text and repeated-random-token sets a command runs the model on
    (:mod:`headprobe.analyses.data`). Checked as :class:`ModelSettings` is."""

    text: str | None = setting(None, "UTF-8 text file for natural text (default: CPython's pydoc_data.topics)")
    """A UTF-8 file to use instead of the Python documentation text."""
    seq_len: int | None = setting(
        128, "natural-text sequence length in tokens (default %(default)s)", type=positive_int
    )
    """Natural-text sequence length in tokens, BOS included (>= 2)."""
    n_natural: int = setting(8, "natural-text sequences (default %(default)s)", type=positive_int)
    """Natural-text sequences (>= 1)."""
    n_repeated: int = setting(8, "repeated random sequences (default %(default)s)", type=positive_int)
    """Repeated-random-token sequences of the induction task (>= 1)."""
    period: int | None = setting(50, "length of the repeated random block (default %(default)s)", type=positive_int)
    """Length S of the repeated block ``[BOS] r_1..r_S r_1..r_S`` (>= 2; Olsson et al. 2022)."""
    seed: int = setting(0, "seeds data windows, random tokens and draws (default %(default)s)", type=seed)
    """Seeds the window choice, the random tokens and any random draw of the command."""

    def __post_init__(self):
        check_settings(self)


FITTED_HELP = {
    "seq_len": f"natural-text sequence length in tokens (default {DEFAULT_SEQ_LEN}, or the model's context if shorter)",
    "period": (
        f"length of the repeated random block (default {DEFAULT_PERIOD}, or what fits the model's context twice; "
        "for a model headprobe train made, its eval period when that is outside the periods it was trained on)"
    ),
}
"""The help of :func:`context_fitted`'s ``--seq-len`` and ``--period``."""


def context_fitted(name: str) -> Any:
    """:class:`DataSettings`' ``seq_len`` or ``period`` for a Config whose default fits the model's
    context: None, resolved once the model is loaded by :func:`headprobe.analyses.data.fit_lengths`
    (``scan``, ``import``, ``ablate``, ``prune``, ``robustness``, ``diff``), with the help that says so."""
    return shared(DataSettings, name, None, help=FITTED_HELP[name])


@dataclass(frozen=True)
class OutputSettings:
    """Where a command writes its files: not part of its Config (the Config is what is computed,
    recorded in summary.json and the checkpoint's key; the same run may be written anywhere)."""

    out: str = setting(
        dataclasses.MISSING, "output directory (must be empty or absent unless --overwrite)", required=True
    )
    """The output directory (must be empty or absent unless ``overwrite``)."""
    overwrite: bool = setting(False, "replace files in a non-empty output directory", action="store_true")
    """Replace files in a non-empty output directory."""
    formats: str | None = setting(
        None,
        f"figure formats, comma-separated, of {','.join(FIGURE_FORMATS)}, or "
        f"{NO_FIGURES} for no figures (default: $HEADPROBE_FIGURE_FORMATS, or all three)",
        metavar="FMT[,FMT...]",
    )
    """Figure formats (None: :func:`headprobe.analyses.vocabulary.figure_formats`, all unless the
    environment says; ``none``: no figures)."""

    def __post_init__(self):
        if self.formats is not None:
            asked = parse_figure_formats(str(self.formats), "--formats ")
            if asked is None:
                raise HeadprobeError(
                    f"--formats {self.formats!r}: choose from {', '.join(FIGURE_FORMATS)} "
                    f"(comma-separated) or {NO_FIGURES}"
                )
            object.__setattr__(self, "formats", ",".join(asked) or NO_FIGURES)


OUTPUT = Flags(OutputSettings)
"""The flags of :class:`OutputSettings` (``--out --overwrite --formats``), a block of a command's layout."""


def check_device_map(device: str | None, device_map: str | dict | None, max_memory: dict | str | None) -> None:
    """``--device-map`` among :data:`DEVICE_MAPS`, ``--max-memory`` only with it, and ``--device``
    left at ``auto`` (or ``cpu``) with it: the map places the model itself.

    Raises:
        HeadprobeError: one line naming the flag.
    """
    if isinstance(device_map, str) and device_map not in DEVICE_MAPS:  # a dict: a hand map, checked on dispatch
        raise HeadprobeError(
            f"--device-map {device_map!r} is not one of {', '.join(DEVICE_MAPS)}{did_you_mean(device_map, DEVICE_MAPS)}"
        )
    if max_memory is not None and device_map is None:
        raise HeadprobeError("--max-memory needs --device-map (auto, balanced or sequential)")
    if device_map is not None and device not in (None, "auto", "cpu"):
        raise HeadprobeError(
            f"--device-map places the model itself: leave --device at auto, not {device} "
            f"(keep the model off the GPU with --max-memory cpu=SIZE)"
        )


THREADS_PER_CPU = 4
"""``--threads`` may ask for this many threads per CPU of the machine (:func:`max_threads`): more
than one per core only slows torch's kernels (README, "On a machine shared with other jobs"), and
a benchmark of oversubscription needs a few times the cores, not thousands of threads, which the
OpenMP runtime cannot start (``libgomp: Thread creation failed``, exit 1, or a ``MemoryError``)."""


def max_threads() -> int:
    """The most ``--threads`` a command takes: :data:`THREADS_PER_CPU` times ``os.cpu_count()``."""
    import os

    return THREADS_PER_CPU * (os.cpu_count() or 1)


def check_settings(cfg) -> None:
    """Check and normalise the shared fields a config has (in place, on a frozen dataclass, from its
    ``__post_init__``): the types of number settings (:func:`check_numbers`), ``dtype`` to torch's
    name, ``text`` to a str, counts (``n_natural``, ``n_repeated``) >= 1, ``threads`` from 1 to
    :func:`max_threads`, ``seq_len`` >= what the config's measures need where set (:func:`seq_len_floor`,
    2 at least), ``period`` >= ``MIN_PERIOD``, ``device`` (:func:`check_device`) and ``backend`` among their
    choices, ``float16`` only on a backend with ``half_precision`` (:data:`FLOAT16_BRIDGE`, torch-free),
    ``max_memory`` readable and only with ``device_map``, ``device_map`` with a dtype other than float32
    only on a backend with ``splits_after_load`` (:func:`device_map_float32_only`), ``memory_budget`` a size, or where
    left None ``$HEADPROBE_MEMORY_BUDGET`` (if set). Fields the config lacks, or leaves None, are skipped.

    Raises:
        HeadprobeError: one line naming the flag.
    """

    def has(name):
        return getattr(cfg, name, None) is not None

    check_numbers(cfg)
    if has("model") and isinstance(cfg.model, str) and not cfg.model.strip():  # not "model directory  has..."
        raise HeadprobeError("the model name is empty; give --model a name or a path")
    if has("dtype"):
        try:
            object.__setattr__(cfg, "dtype", dtype_name(cfg.dtype))
        except argparse.ArgumentTypeError as e:
            raise HeadprobeError(str(e)) from None
    if has("text"):
        object.__setattr__(cfg, "text", str(cfg.text))
    if has("memory_budget"):
        from headprobe.probe.core.sizes import parse_bytes

        parse_bytes(cfg.memory_budget, "--memory-budget")
    elif hasattr(cfg, "memory_budget"):  # no flag: $HEADPROBE_MEMORY_BUDGET, refused now, not after the load
        from headprobe.probe.core.memory import stated

        stated()
    for name in ("n_natural", "n_repeated", "threads"):
        if has(name) and getattr(cfg, name) < 1:
            raise HeadprobeError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if has("threads") and cfg.threads > (most := max_threads()):
        raise HeadprobeError(
            f"--threads {cfg.threads} is more than {THREADS_PER_CPU} per CPU of this machine ({most}): torch's kernels "
            f"run one thread per core, and thousands cannot start (the OpenMP runtime aborts); give at most {most}"
        )
    if has("seq_len") and cfg.seq_len < (least := seq_len_floor(cfg))[0]:
        raise HeadprobeError(f"--seq-len {cfg.seq_len} is too short: {least[1]}")
    if has("period") and cfg.period < MIN_PERIOD:
        raise HeadprobeError(
            f"--period {cfg.period} is too short: induction needs a repeated block of at least {MIN_PERIOD} tokens"
            + (
                f" (at {cfg.period} the token after a token's earlier occurrence is {PERIOD_TARGET[cfg.period]})"
                if cfg.period in PERIOD_TARGET
                else ""
            )
        )
    if has("device"):
        check_device(cfg.device)
    if has("backend") and cfg.backend not in BACKENDS:
        raise HeadprobeError(
            f"--backend {cfg.backend!r} is not one of {', '.join(BACKENDS)}{did_you_mean(str(cfg.backend), BACKENDS)}"
        )
    if has("backend") and getattr(cfg, "dtype", None) == "float16":  # torch-free (BACKEND_CAPABILITIES)
        refuse_lacking(cfg.backend, "half_precision", FLOAT16_BRIDGE)
    if has("max_memory"):  # kept as text (JSON keys stay as typed), checked now
        max_memory_dict(cfg.max_memory)
    check_device_map(getattr(cfg, "device", None), getattr(cfg, "device_map", None), getattr(cfg, "max_memory", None))
    if (
        has("backend")
        and getattr(cfg, "device_map", None) is not None
        and getattr(cfg, "dtype", None) not in (None, "float32")
    ):
        refuse_lacking(cfg.backend, "splits_after_load", device_map_float32_only(cfg.backend))  # torch-free too


def text_window_floor(prepend_bos: bool, extra: int = 0) -> int:
    """The fewest positions of a sequence holding a natural-text window of
    :data:`~headprobe.analyses.vocabulary.MIN_WINDOW_TOKENS` tokens, BOS before it unless
    ``--no-bos`` (``prepend_bos`` False), and ``extra`` more positions (``kv``'s planted blocks).
    An encoder's ``[CLS]`` and ``[SEP]`` take one position more, known once the model loads
    (:func:`headprobe.analyses.data.natural_text_tokens` refuses then)."""
    return int(bool(prepend_bos)) + MIN_WINDOW_TOKENS + extra


def text_window_reason(prepend_bos: bool) -> str:
    """What :func:`text_window_floor` counts, as a clause of a refusal."""
    bos = "BOS and " if prepend_bos else ""
    return (
        f"{bos}a natural-text window of {MIN_WINDOW_TOKENS} tokens: a window of one token is all one token, "
        "and the text's windows leave such windows out"
    )


def seq_len_floor(cfg) -> tuple[int, str]:
    """``(least, why)``: the fewest ``--seq-len`` positions ``cfg``'s measures need, and a clause
    saying what needs them and why, for the one refusal of :func:`check_settings`
    (``--seq-len N is too short: <why>``). In order: the config's own ``seq_len_floor()``
    method where it has one (``kv``: its planted blocks; ``import``: no head type scored); the
    head types' :data:`~headprobe.analyses.vocabulary.MIN_SEQ_LEN` in a config that scores them
    (a ``types`` field; below it two types' scores are one number, :data:`SEQ_LEN_CLASH`);
    where natural text is drawn (an ``n_natural`` field), :func:`text_window_floor`; else 2 (a
    score compares a position with an earlier one). Every floor is at least 2.
    """
    own = getattr(cfg, "seq_len_floor", None)
    if callable(own):
        return own()
    n = cfg.seq_len
    if hasattr(cfg, "types"):  # a command that scores head types
        clash = f" (at {n} {SEQ_LEN_CLASH[n]}, so the two are the same number)" if n in SEQ_LEN_CLASH else ""
        return MIN_SEQ_LEN, f"the head types' scores need at least {MIN_SEQ_LEN} positions{clash}"
    if hasattr(cfg, "n_natural"):  # losses on natural-text windows
        return losses_floor(cfg)
    return 2, "scores need at least 2 positions"


DEFAULT_BLOCK_LEN = 16
"""``--block-len``'s default: the long-range task's planted block, in tokens."""


def long_range_floor(block_len: int, prepend_bos: bool) -> tuple[int, str]:
    """``(least, why)``: the fewest ``--seq-len`` positions of the long-range task's sequence, a
    natural-text window (BOS before it unless ``--no-bos``) with a block of ``block_len`` tokens
    planted in it and repeated at the end (:func:`headprobe.analyses.data.long_range_tokens`), and
    a clause saying so (:func:`seq_len_floor`); ``kv`` and ``import --kv``."""
    block = max(block_len, 2)  # a shorter block is refused by its own check
    least = text_window_floor(prepend_bos, extra=2 * block)
    return least, (
        f"the long-range task needs at least {least} positions ({text_window_reason(prepend_bos)}; "
        f"and the planted block of --block-len {block} twice)"
    )


def losses_floor(cfg) -> tuple[int, str]:
    """:func:`seq_len_floor` of a config whose losses are read on natural-text windows (its
    ``prepend_bos``): :func:`text_window_floor` and why."""
    bos = getattr(cfg, "prepend_bos", True)
    least = text_window_floor(bos)
    return least, f"the losses need at least {least} positions ({text_window_reason(bos)})"


_INTEGER_TYPES = (int, positive_int, seed)
_NUMBER_TYPES = (float, probability, number)


def check_numbers(cfg) -> None:
    """Check that each setting of ``cfg`` whose flag reads an integer (``type`` ``int``,
    :func:`positive_int` or :func:`seed`) holds an integer, and each that reads a number (``float``,
    :func:`probability`, :func:`number`) a finite real number, where set (not None): from Python a
    value is not parsed by its flag (``n_natural="2"``, ``lr=float("nan")``); a seed must be in
    :func:`seed`'s range. NumPy integers are stored as ``int``.

    Raises:
        HeadprobeError: one line naming the setting, its flag and the type expected.
    """
    for f in dataclasses.fields(cfg):
        meta, value = _meta(type(cfg), f.name), getattr(cfg, f.name, None)
        kind = meta.get("type")
        if value is None or "parse" in meta or kind not in (*_INTEGER_TYPES, *_NUMBER_TYPES):
            continue
        integer = kind in _INTEGER_TYPES
        why: str | None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
            why = f"must be {'an integer' if integer else 'a number'}, got {value!r} ({type(value).__name__})"
        elif not integer and not math.isfinite(value):
            why = f"must be finite, got {value!r}"
        else:
            why = seed_error(value) if kind is seed else None
        if why:
            raise HeadprobeError(f"{f.name} ({flag_names(type(cfg)).get(f.name, f.name)}) {why}")
        if isinstance(value, numbers.Integral) and type(value) is not int:  # np.int64: JSON's int
            object.__setattr__(cfg, f.name, int(value))
