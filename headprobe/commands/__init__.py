"""The ``headprobe`` subcommands, one module each, registered once in :data:`COMMANDS`.

A command is a module ``headprobe/commands/<name>.py`` (or a package, where its flags must be
checked before torch loads: ``commands/<name>/__init__.py`` light, ``core.py`` the computation)
that defines ``COMMAND = Command(...)``, and one entry here: ``COMMANDS.register("<name>",
"headprobe.commands.<name>:COMMAND")``. ``headprobe <name>`` (:mod:`headprobe.cli`), its
``--help`` and the Python function ``headprobe.<name>`` (:mod:`headprobe`) are read from that
entry; nothing else lists the commands. Listing the names imports no command module.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from headprobe.probe.registry import Registry


@dataclass(frozen=True)
class Command:
    """One ``headprobe`` subcommand.

    Attributes:
        help: one line, shown by ``headprobe --help`` and as the command's description.
        add_arguments: adds the command's flags to its parser (shared ones generated from
            :mod:`headprobe.settings`).
        main: ``main(args) -> exit status``: maps the parsed flags to the command's Config and runs it;
            raises :class:`~headprobe.probe.errors.HeadprobeError` for bad input (one line, exit 2).
        api: the Python function ``headprobe.<name>`` (same settings as keyword arguments), the
            function itself or ``"module:attr"`` imported on first use; None: no Python function.
        epilog: usage notes printed after the flags in ``--help``, kept as written (line breaks).
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    main: Callable[[argparse.Namespace], int]
    api: Callable[..., Any] | str | None = None
    epilog: str | None = None

    def function(self) -> Callable[..., Any] | None:
        """The Python function (:attr:`api`), imported now where it is a ``"module:attr"`` string."""
        if isinstance(self.api, str):
            module, _, attr = self.api.partition(":")
            return getattr(importlib.import_module(module), attr)
        return self.api


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
