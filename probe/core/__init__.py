"""What every floor above shares, torch-free where it can be: the error type, the registry, atomic files, head names, ablation kinds and the probe floor's vocabulary."""
