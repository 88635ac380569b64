"""The losses every backend and analysis reports: cross-entropies in nats (float32), the unit of every
loss headprobe reports. Re-exported by :mod:`headprobe.probe.backends.base`, where they were defined.

:func:`token_losses` and :func:`scored_loss` score logits ``[batch, pos, d_vocab]``;
:func:`cross_entropy_inplace` is the loss over ``[n, d_vocab]`` rows without a log-softmax copy;
:data:`LOSS_ROWS` bounds the rows unembedded at once (the model's own
:func:`~headprobe.probe.backends.base.chunked_token_losses`, which unembeds through it, stays beside
:class:`~headprobe.probe.backends.base.LoadedModel`).
"""

from __future__ import annotations

import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor


def token_losses(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"]
) -> Float[Tensor, "batch pos_minus_1"]:
    """Cross-entropy (nats) of predicting ``tokens[:, i+1]`` from ``logits[:, i]``."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return -logp.gather(-1, tokens[:, 1:, None].to(logp.device)).squeeze(-1)


def scored_loss(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"], first: int
) -> Float[Tensor, " batch"]:
    """Per-sequence mean cross-entropy (nats/token) of the predictions from index ``first`` on
    (index i predicts token i + 1)."""
    return token_losses(logits, tokens)[:, first:].mean(dim=1)


def cross_entropy_inplace(logits: Float[Tensor, "n d_vocab"], target: Int[Tensor, " n"]) -> Float[Tensor, " n"]:
    """``F.cross_entropy(logits, target, reduction="none")`` (nats), overwriting ``logits``.

    ``logsumexp(logits) - logits[target]`` with the exponentials taken in place, so the
    ``[n, d_vocab]`` log-softmax is never written: on a CPU the loss over a 49,152-token
    vocabulary then costs about a third of PyTorch's ``cross_entropy``. Float32 in and out.
    """
    picked = logits.gather(1, target[:, None])[:, 0]
    top = logits.amax(dim=1, keepdim=True)
    return logits.sub_(top).exp_().sum(dim=1).log_() + top[:, 0] - picked


LOSS_ROWS = 1024
"""Most positions (rows of ``[rows, d_vocab]`` logits) unembedded at once by the chunked losses
(:func:`~headprobe.probe.backends.base.chunked_token_losses`, the native backend's scored losses):
192 MiB of float32 logits for a 49,152-token vocabulary, whatever the sequence length (a whole
8,192-token sequence would be 1.5 GiB)."""
