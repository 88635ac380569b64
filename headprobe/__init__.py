"""headprobe: find, verify and plot the attention heads of a transformer.

Subpackages: :mod:`headprobe.probe` (models, hook points, capture, loading, cost formulas),
:mod:`headprobe.analyses` (detectors, ablation engine, pruning, training, figures) and
:mod:`headprobe.commands` (one module per ``headprobe`` subcommand).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("headprobe")
except PackageNotFoundError:  # pragma: no cover - running from a checkout without installing
    __version__ = "0+unknown"
