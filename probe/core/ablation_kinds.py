"""The ablation kinds, each defined once: its name, the second input it needs, the check of that
input, and what it puts in place of an ablated head's ``z``.

A head is ablated at ``hook_z``, before W_O (``z`` ``[batch, pos, head, d_head]``, the head's
value-weighted sum; see :func:`headprobe.probe.hooks.ablation.head_ablation_hooks`): its ``z_h`` is
replaced by ``r_h``, which removes exactly its output contribution ``z_h W_O^(h)`` and keeps
``b_O``. Every user of a kind goes through :data:`KINDS`: the hooks, the exact sweep and the set
ablations of :mod:`headprobe.analyses.ablation` (which use ``(r_h - z_h) W_O^(h)``), attribution
patching and AtP* (:mod:`headprobe.analyses.attribution`, whose direction is ``r_h - z_h``),
activation patching (resample) and ``headprobe ablate --kind``. Adding a kind is one
:func:`register` call (or one entry below); nothing else names kinds. The unknown-name error is
the registry's (:class:`~headprobe.probe.core.registry.Registry`: one line, with did-you-mean).

Built-in kinds (the vocabulary of Heimersheim & Nanda 2024, "How to use and interpret activation
patching", arXiv 2404.15255, and Wang et al. 2022, arXiv 2211.00593, sec. 2.1):

* ``zero``: ``r_h = 0``;
* ``mean``: ``r_h`` = the head's mean ``z`` over a reference set of real tokens (``mean_z``
  ``[layer, head, d_head]``, e.g. from :func:`headprobe.analyses.ablation.mean_z_from`);
* ``resample``: ``r_h`` = the head's ``z`` on another input of the same shape (``source_z``
  ``{layer: [batch, pos, head, d_head]}``, captured by the engine from ``source_tokens``).

Pure Python at import (no torch): the command line reads the names and checks ``--kind``
before any heavy library loads; the replacements only call methods of the tensors they get.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

AblationKind = str
"""The name of a registered kind (a key of :data:`KINDS`)."""

NEEDS: dict[str, str] = {
    "mean_z": "each head's mean z over reference tokens",
    "source": "the input whose z replaces the head's",
}
"""The second inputs a kind can need, with what they are: ``mean_z`` (``[layer, head, d_head]``) or
``source`` (the source input: ``source_tokens`` in the engine, their ``source_z`` in the hooks)."""


@dataclass(frozen=True)
class AblationInputs:
    """The second inputs of a replacement (a kind reads the one it needs).

    Attributes:
        mean_z: ``[layer, head, d_head]`` each head's mean z over reference tokens.
        source_z: ``{layer: [batch, pos, head, d_head]}`` every head's z on the source input,
            the same ``batch`` as the z being ablated.
    """

    mean_z: Tensor | None = None
    source_z: Mapping[int, Tensor] | None = None

    def tiled(self, copies: int, layer: int) -> AblationInputs:
        """The inputs of ``layer`` for a batch repeated ``copies`` times along the batch axis (the
        engine's batched ablations: copy ``i`` is rows ``i * batch .. (i + 1) * batch - 1``); only
        that layer's source is tiled, so a hook holds one layer's copies at a time."""
        if self.source_z is None or copies == 1:
            return self
        z = self.source_z[layer]
        return AblationInputs(self.mean_z, {layer: z.repeat(copies, *(1,) * (z.dim() - 1))})


Replace = Callable[["Tensor", int, Any, AblationInputs], "Tensor"]
"""``replace(z, layer, heads, inputs) -> r``: ``z`` ``[batch, pos, k, d_head]`` holds the heads
``heads`` of ``layer`` (an index into the head axis: a list or tensor of head numbers, or
``slice(None)`` for all heads, in which case ``k = head``); ``r`` has z's dtype and device and
broadcasts to z's shape. It never edits ``z``."""


@dataclass(frozen=True)
class Kind:
    """One ablation kind.

    Attributes:
        name: its ``--kind`` name.
        replace: the replacement ``r_h`` of the ablated heads' z (:data:`Replace`).
        needs: the second input it needs, a key of :data:`NEEDS`; None: none.
        help: how it replaces a head's z, in a few words (``--kind``'s help: ``by 0``).
        definition: what ``r_h`` is, with its source.
    """

    name: str
    replace: Replace
    needs: str | None = None
    help: str = ""
    definition: str = ""

    def __post_init__(self):
        if self.needs is not None and self.needs not in NEEDS:
            raise ValueError(
                f"ablation kind {self.name!r}: needs must be None or one of {list(NEEDS)}, got {self.needs!r}"
            )


def _zero(z: Tensor, layer: int, heads: Any, inputs: AblationInputs) -> Tensor:
    return z.new_zeros(())


def _mean(z: Tensor, layer: int, heads: Any, inputs: AblationInputs) -> Tensor:
    assert inputs.mean_z is not None  # check() refused the kind without it
    return inputs.mean_z[layer, heads].to(z)  # [k, d_head], the same at every batch and position


def _resample(z: Tensor, layer: int, heads: Any, inputs: AblationInputs) -> Tensor:
    assert inputs.source_z is not None  # check() refused the kind without it
    return inputs.source_z[layer][:, :, heads].to(z)


KINDS: Registry[Kind] = Registry("ablation kind")
"""Every ablation kind by name (:class:`~headprobe.probe.core.registry.Registry`), in the order of
``--kind``'s choices."""


def register(kind: Kind) -> Kind:
    """Add ``kind`` to :data:`KINDS` under its name and return it (a test removes it again with
    ``KINDS.unregister(name)``).

    Raises:
        ValueError: a kind of that name exists.
    """
    KINDS.register(kind.name, kind)
    return kind


register(Kind("zero", _zero, None, "by 0", "r_h = 0"))
register(
    Kind(
        "mean",
        _mean,
        "mean_z",
        "by its mean z over reference tokens",
        "r_h = the head's mean z over the real tokens of a reference batch (Wang et al. 2022, sec. 2.1)",
    )
)
register(
    Kind(
        "resample",
        _resample,
        "source",
        "by its z on another input",
        "r_h = the head's z on another input of the same shape (Heimersheim & Nanda 2024; resample ablation)",
    )
)


def kinds() -> tuple[Kind, ...]:
    """Every registered kind, in registration order."""
    return tuple(KINDS.get(name) for name in KINDS)


def names(source: bool | None = None) -> tuple[str, ...]:
    """The registered kinds' names; ``source=False``: only those needing no source input (a task
    that has none can use them), ``True``: only those needing one."""
    return tuple(k.name for k in kinds() if source is None or (k.needs == "source") == source)


def check(name: str, mean_z: Any = None, source: Any = None, source_arg: str = "source_tokens") -> Kind:
    """The kind called ``name``, once the second input it needs is given.

    Args:
        mean_z: what the caller has for ``mean_z`` (None: nothing).
        source: what the caller has for the source input (None: nothing), called ``source_arg``
            in the message (``source_tokens`` in the engine, ``source_z`` in the hooks).

    Raises:
        HeadprobeError: unknown kind (the registry's one line, with the closest names), or its
            input missing: ``"<kind> ablation needs <arg> (<what>)"``.
    """
    kind = KINDS.get(name)
    given = {"mean_z": (mean_z, "mean_z"), "source": (source, source_arg)}
    if kind.needs is not None and given[kind.needs][0] is None:
        raise HeadprobeError(f"{kind.name} ablation needs {given[kind.needs][1]} ({NEEDS[kind.needs]})")
    return kind
