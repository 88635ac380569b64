"""headprobe.analyses: detectors, ablation, pruning, figures and the ``headprobe`` CLI."""
