"""The ``headprobe`` subcommands, one module each, registered once in :data:`COMMANDS`.

A command is a light module ``headprobe/commands/<name>.py`` -- its frozen Config dataclass, whose
:func:`~headprobe.settings.setting` fields are the flags, and ``COMMAND = Command(HELP,
config=<Config>, run="headprobe.commands.<name>:main", api=...)`` -- that imports no torch, so a bad
flag or value is refused before torch loads. Where the computation needs torch it is the sibling
module ``headprobe/commands/<name>_core.py`` (``run``, the Result, the Python function), which
imports the light module and is imported only on first use: by the run target, by
``Command.api``'s ``"module:attr"`` and by the light module's :func:`lazy_names` (``from
headprobe.commands.scan import ScanResult`` still works). One entry here registers it:
``COMMANDS.register("<name>", "headprobe.commands.<name>:COMMAND")``. ``headprobe <name>``
(:mod:`headprobe.cli`), its ``--help`` and the Python function ``headprobe.<name>``
(:mod:`headprobe`) are read from that entry; nothing else lists the commands. Listing the names
imports no command module.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from headprobe.probe.core.registry import Registry


def resolve(spec: Any) -> Any:
    """``"module:attr"`` imported now; anything else as it is."""
    if isinstance(spec, str):
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module), attr)
    return spec


def lazy_names(module: str, core: str, names: Sequence[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for light module ``module`` that imports its sibling ``core`` (it
    needs torch) on first use of one of ``names`` (``"core"``: the module itself)."""

    def __getattr__(name: str):
        if name == "core":
            return importlib.import_module(core)
        if name in names:
            return getattr(importlib.import_module(core), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


@dataclass(frozen=True)
class Command:
    """One ``headprobe`` subcommand.

    Attributes:
        help: one line, shown by ``headprobe --help`` and as the command's description.
        config: the command's Config dataclass (or ``"module:Config"``): its
            :func:`~headprobe.settings.setting` fields are the flags (:func:`~headprobe.settings.add_layout`),
            and :func:`~headprobe.settings.from_args` builds it from them, its checks refusing bad values.
        run: ``"module:attr"`` of ``attr(args, config) -> exit status``, imported only once the flags
            parsed and the Config was made (it may import torch); ``args`` holds the flags that are
            not the Config's (``--out``).
        flags: the flag blocks in ``--help`` order (:class:`~headprobe.settings.Flags`,
            :data:`~headprobe.settings.OUTPUT`); empty: every setting of ``config``.
        api: the Python function ``headprobe.<name>`` (same settings as keyword arguments), the
            function itself or ``"module:attr"`` imported on first use; None: no Python function.
        epilog: usage notes printed after the flags in ``--help``: kept as written where they span
            several lines, else wrapped as argparse wraps text.
        check: ``"module:attr"`` of ``attr(args, config) -> None``: the command's own checks of its
            flags that read no file and load no model (raising ``HeadprobeError``), made after the
            Config's and before :attr:`run` (by :meth:`checked_config`); None: the Config's suffice.
    """

    help: str
    config: type | str
    run: str
    flags: Sequence[Any] = ()
    api: Callable[..., Any] | str | None = None
    epilog: str | None = None
    check: str | None = None

    def config_class(self) -> type | None:
        """The Config dataclass (:attr:`config`), imported now where it is a ``"module:Config"`` string."""
        return resolve(self.config)

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's flags to its parser."""
        from headprobe import settings

        settings.add_layout(parser, self.config_class(), self.flags)

    def checked_config(self, args: argparse.Namespace) -> Any:
        """The Config of the parsed flags ``args``, checked as far as the flags alone decide: made
        (its own checks), the flags given where they do nothing refused
        (:func:`~headprobe.settings.refuse_inert`), then :attr:`check`. Reads no file (beyond what
        a Config's own checks read) and loads no model: :func:`headprobe.cli.check_argv` stops here.

        Raises:
            HeadprobeError: a bad value, or a flag that does nothing with the others.
        """
        from headprobe import settings

        config = settings.from_args(self.config_class(), args)
        settings.refuse_inert(config, settings.given_on_command_line(args))
        if self.check is not None:
            resolve(self.check)(args, config)
        return config

    def execute(self, args: argparse.Namespace) -> int:
        """Run the command on its parsed flags: the Config made and checked (:meth:`checked_config`),
        then the run target imported and called.

        Raises:
            HeadprobeError: a bad value (the Config's checks), a flag that does nothing with the
                others, or bad input found by the run.
        """
        return resolve(self.run)(args, self.checked_config(args))

    def function(self) -> Callable[..., Any] | None:
        """The Python function (:attr:`api`), imported now where it is a ``"module:attr"`` string."""
        return resolve(self.api)


COMMANDS: Registry[Command] = Registry("command", hint="see headprobe --help")
"""Command name -> its :class:`Command` (lazy ``"module:COMMAND"`` targets), in ``--help`` order."""

COMMANDS.register("scan", "headprobe.commands.scan:COMMAND")
COMMANDS.register("budget", "headprobe.commands.budget:COMMAND")
COMMANDS.register("ablate", "headprobe.commands.ablate:COMMAND")
COMMANDS.register("prune", "headprobe.commands.prune:COMMAND")
COMMANDS.register("train", "headprobe.commands.train:COMMAND")
COMMANDS.register("study", "headprobe.commands.study:COMMAND")
COMMANDS.register("view", "headprobe.commands.view:COMMAND")
COMMANDS.register("show", "headprobe.commands.show:COMMAND")
COMMANDS.register("atlas", "headprobe.commands.atlas:COMMAND")
COMMANDS.register("patch", "headprobe.commands.patch:COMMAND")
COMMANDS.register("circuit", "headprobe.commands.circuit:COMMAND")
COMMANDS.register("kv", "headprobe.commands.kv:COMMAND")
COMMANDS.register("export", "headprobe.commands.export:COMMAND")
COMMANDS.register("import", "headprobe.commands.import_heads:COMMAND")
COMMANDS.register("robustness", "headprobe.commands.robustness:COMMAND")
COMMANDS.register("diff", "headprobe.commands.diff:COMMAND")
