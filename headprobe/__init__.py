"""headprobe: find, verify and plot the attention heads of a transformer.

The public API (each name is imported on first use, so ``import headprobe`` stays light)::

    import headprobe
    model = headprobe.load_model("smollm2-135m")          # or any name/path load_model takes
    result = headprobe.scan(model, types=("induction",))   # ScanResult: .table (DataFrame), .save(out)
    cap = headprobe.capture_heads(model, tokens)           # patterns, z, per-head results
    model = headprobe.wrap(hf_model, tokenizer)            # a transformers model in memory (left untouched)

Every command of the ``headprobe`` CLI is a function here with the same settings as keyword
arguments (``scan``, ``ablate``, ``prune``, ``budget``, ``train``, ``study``); each returns a
result object whose ``save(out_dir)`` writes what the command writes. ``view(dir)`` writes the
offline viewer page ``dir/index.html`` (as ``headprobe view``); scan and ablate results show it
in Jupyter.

Subpackages: :mod:`headprobe.probe` (models, hook points, capture, loading, cost formulas),
:mod:`headprobe.analyses` (detectors, ablation engine, pruning, training, figures) and
:mod:`headprobe.commands` (one module per command: config, run, result, CLI flags).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # name: (module, attribute)
    "scan": ("headprobe.commands.scan", "scan"),
    "ablate": ("headprobe.commands.ablate", "ablate"),
    "prune": ("headprobe.commands.prune", "prune"),
    "budget": ("headprobe.commands.budget", "budget"),
    "train": ("headprobe.commands.train", "train"),
    "study": ("headprobe.commands.study", "study"),
    "view": ("headprobe.commands.view", "view"),
    "atlas": ("headprobe.commands.atlas", "atlas"),
    "patch": ("headprobe.commands.patch", "patch"),
    "circuit": ("headprobe.commands.circuit", "circuit"),
    "path_patch": ("headprobe.analyses.paths", "path_patch"),
    "edge_attribution": ("headprobe.analyses.paths", "edge_attribution"),
    "qk_attribution": ("headprobe.analyses.qk_attribution", "qk_attribution"),
    "kv": ("headprobe.commands.kv", "kv"),
    "load_model": ("headprobe.probe.loading", "load_model"),
    "wrap": ("headprobe.probe.loading", "wrap_model"),
    "LoadedModel": ("headprobe.probe.loading", "LoadedModel"),
    "capture_heads": ("headprobe.probe.capture", "capture_heads"),
    "stream_patterns": ("headprobe.probe.capture", "stream_patterns"),
    "SelfCheck": ("headprobe.probe.selfcheck", "SelfCheck"),
    "HeadprobeError": ("headprobe.probe.errors", "HeadprobeError"),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name == "__version__":  # read from the installed distribution on first use (importlib.metadata is slow)
        from importlib.metadata import PackageNotFoundError, version

        try:
            globals()["__version__"] = version("headprobe")
        except PackageNotFoundError:  # pragma: no cover - running from a checkout without installing
            globals()["__version__"] = "0+unknown"
        return globals()["__version__"]
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'headprobe' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
