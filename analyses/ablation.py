"""Losses, head ablation and verification of detected heads against a random-head control.

A detection is *verified* when ablating the top-k heads of a type raises the loss on the task
that defines the type clearly more than ablating k random heads does (see :func:`verify`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from probe.hooks import AblationKind, Head, format_head, head_ablation_hooks


def token_losses(logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos_minus_1"]:
    """Cross-entropy (nats) of predicting ``tokens[:, i+1]`` from ``logits[:, i]``."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return -logp.gather(-1, tokens[:, 1:, None].to(logp.device)).squeeze(-1)


def task_loss(logits: Tensor, tokens: Tensor, task: str, start: int, period: int | None) -> float:
    """Mean loss (nats/token) on a task.

    ``natural``: every next-token prediction. ``repeated``: predictions of the repeated half's
    tokens r_2..r_S (r_1 of the repeat cannot be predicted from context), i.e. targets at
    positions ``start + S + 1 .. start + 2S - 1``.
    """
    losses = token_losses(logits, tokens)
    if task == "repeated":
        losses = losses[:, start + period :]  # loss index i predicts position i + 1
    return float(losses.mean())


@torch.inference_mode()
def mean_z_from(z_by_layer: dict[int, Tensor], start: int) -> Float[Tensor, "layer head d_head"]:
    """Mean of each head's z over all real (non-BOS) positions of a reference batch."""
    return torch.stack([z_by_layer[layer][:, start:].float().mean(dim=(0, 1)) for layer in sorted(z_by_layer)])


@torch.inference_mode()
def ablated_loss(model, tokens: Tensor, heads: Sequence[Head], kind: AblationKind, mean_z: Tensor | None,
                 task: str, start: int, period: int | None) -> float:
    """Task loss with ``heads`` zero- or mean-ablated (at hook_z, before W_O)."""
    logits = model.forward(tokens, fwd_hooks=head_ablation_hooks(heads, kind, mean_z))
    return task_loss(logits, tokens, task, start, period)


@dataclass
class Verification:
    """Ablation evidence for one head type and one ablation kind (losses in nats/token).

    ``confirmed`` holds when the top-k effect exceeds every random draw's, is at least twice
    the mean random effect, and is at least ``min_effect`` nats.
    """

    head_type: str
    kind: str
    task: str
    k: int
    top_heads: list[str]
    clean_loss: float
    top_loss: float
    top_effect: float
    random_effects: list[float]
    random_mean: float
    random_max: float
    confirmed: bool
    random_heads: list[list[str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def is_confirmed(top_effect: float, random_effects: Sequence[float], min_effect: float = 0.05) -> bool:
    """The rule :class:`Verification` documents: top-k clearly beats the random control."""
    rand = torch.tensor(list(random_effects))
    return bool(
        top_effect >= min_effect
        and top_effect > float(rand.max())
        and top_effect >= 2 * max(float(rand.mean()), 0.0)
    )


def random_head_sets(n_layers: int, n_heads: int, k: int, n_draws: int, seed: int) -> list[list[Head]]:
    """``n_draws`` sets of ``k`` distinct heads, uniformly without replacement, seeded."""
    gen = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(n_draws):
        flat = torch.randperm(n_layers * n_heads, generator=gen)[:k].tolist()
        sets.append(sorted((i // n_heads, i % n_heads) for i in flat))
    return sets


def top_heads(scores: Float[Tensor, "layer head"], k: int) -> list[Head]:
    """The ``k`` heads with the highest scores, best first."""
    n_heads = scores.shape[1]
    idx = scores.flatten().argsort(descending=True)[:k].tolist()
    return [(i // n_heads, i % n_heads) for i in idx]


def names(heads: Sequence[Head]) -> list[str]:
    return [format_head(h) for h in heads]

