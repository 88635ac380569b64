"""The padding mask of a batch of sequences (``attention_mask``: 1 real token, 0 padding), read
alike by every backend's padded path (the native model's forward, the bridge, capture)."""

from typing import Any

from headprobe.probe.core.errors import InputValueError


def padding_mask(attention_mask: Any, what: str = "attention_mask") -> Any:
    """``attention_mask`` (1 real, 0 padding; integers or bools) as a bool tensor, refusing any other
    value: a 2 or 0.5 read as "real" where ``.to(bool)`` took it so (every backend's padding path).

    Raises:
        InputValueError: a value other than 0 and 1, naming ``what`` and the first such value.
    """
    import torch

    if attention_mask.dtype == torch.bool:
        return attention_mask
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bool(bad.any()):
        value = attention_mask[bad].flatten()[0].item()
        raise InputValueError(f"{what} must hold 1 (real token) or 0 (padding) only, got {value!r}")
    return attention_mask.to(torch.bool)
