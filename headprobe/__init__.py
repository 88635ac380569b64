"""headprobe: find, verify and plot the attention heads of a transformer.

The public API (each name is imported on first use, so ``import headprobe`` stays light)::

    import headprobe
    model = headprobe.load_model("smollm2-135m")          # or any name/path load_model takes
    result = headprobe.scan(model, types=("induction",))   # ScanResult: .table (DataFrame), .save(out)
    cap = headprobe.capture_heads(model, tokens)           # patterns, z, per-head results
    model = headprobe.wrap(hf_model, tokenizer)            # a transformers model in memory (left untouched)

Every command of the ``headprobe`` CLI is a function here with the same settings as keyword
arguments (``scan``, ``ablate``, ``prune``, ``budget``, ``train``, ``study``, ...; ``import``, a Python
keyword, as ``headprobe.import_heads``); each returns a
result object whose ``save(out_dir)`` writes what the command writes. ``view(dir)`` writes the
offline viewer page ``dir/index.html`` (as ``headprobe view``); scan and ablate results show it
in Jupyter.

Subpackages: :mod:`headprobe.probe` (models, hook points, capture, loading, cost formulas),
:mod:`headprobe.analyses` (detectors, ablation engine, pruning, training, figures) and
:mod:`headprobe.commands` (one module per command: config, run, result, CLI flags).
"""

from __future__ import annotations

import importlib
import importlib.util
import os


def _find_floors_beside() -> None:
    """Where this folder is imported from a source checkout's root (``python -m headprobe`` there,
    ``torchrun -m headprobe``) with headprobe installed without ``-e``, ``headprobe.probe`` and
    ``headprobe.analyses`` are the checkout's ``probe/`` and ``analyses/``: the folders beside this
    one, which ``pyproject.toml``'s ``package-dir`` installs as those subpackages. An installed
    copy holds them inside, and an editable install's finder maps them: nothing is added then."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    floors = ("probe", "analyses")
    if any(os.path.isdir(os.path.join(here, f)) for f in floors):
        return
    if not all(os.path.isfile(os.path.join(root, f, "__init__.py")) for f in floors):
        return
    if importlib.util.find_spec(f"{__name__}.probe") is None:
        __path__.append(root)


_find_floors_beside()

if "ipykernel.zmqshell" in __import__("sys").modules:  # a Jupyter kernel: tqdm.auto without its ipywidgets warning
    from headprobe.probe.core.progress import quiet_notebook_tqdm

    quiet_notebook_tqdm()

_EXPORTS = {
    # name: (module, attribute); the commands' functions come from headprobe.commands.COMMANDS
    "path_patch": ("headprobe.analyses.circuit", "path_patch"),
    "edge_attribution": ("headprobe.analyses.circuit", "edge_attribution"),
    "qk_attribution": ("headprobe.analyses.qk_attribution", "qk_attribution"),
    "load_model": ("headprobe.options", "load_model"),
    "wrap": ("headprobe.probe.backends.wrapping", "wrap_model"),
    "load_tokenizer": ("headprobe.probe.backends.loading", "load_tokenizer"),
    "LoadedModel": ("headprobe.probe.backends.loading", "LoadedModel"),
    "capture_heads": ("headprobe.probe.hooks.capture", "capture_heads"),
    "patterns_by_layer": ("headprobe.probe.hooks.capture", "patterns_by_layer"),
    "SelfCheck": ("headprobe.probe.hooks.selfcheck", "SelfCheck"),
    "HeadprobeError": ("headprobe.probe.core.errors", "HeadprobeError"),
    # ``import`` is a Python keyword (``headprobe.import(...)`` is a syntax error): its function by its own name
    "import_heads": ("headprobe.commands.import_heads_core", "import_heads"),
}

# ``__all__`` is computed on use (:func:`__getattr__`): these names and every registered command.


def __getattr__(name: str):
    if name == "__all__":  # every registered command, one registered at run time too
        return _public_names()
    if name == "__version__":  # read from the installed distribution on first use (importlib.metadata is slow)
        from importlib.metadata import PackageNotFoundError, version

        try:
            globals()["__version__"] = version("headprobe")
        except PackageNotFoundError:  # pragma: no cover - running from a checkout without installing
            globals()["__version__"] = "0+unknown"
        return globals()["__version__"]
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attr)
    else:
        value = _command_function(name)
    globals()[name] = value
    return value


def _command_function(name: str):
    """The Python function of command ``name`` (:data:`headprobe.commands.COMMANDS`).

    Raises:
        AttributeError: no such command, or the command has no Python function.
    """
    from headprobe.commands import COMMANDS

    function = COMMANDS.get(name).function() if name in COMMANDS else None
    if function is None:
        raise AttributeError(f"module 'headprobe' has no attribute {name!r}")
    return function


def _public_names() -> list[str]:
    """``__version__``, the exported names and every command in :data:`headprobe.commands.COMMANDS`."""
    from headprobe.commands import COMMANDS

    return ["__version__", *_EXPORTS, *COMMANDS.names()]


def __dir__() -> list[str]:
    return sorted(_public_names())
