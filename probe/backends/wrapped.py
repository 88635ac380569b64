"""What every backend reads off the wrapped module the same way: what
:class:`~headprobe.probe.backends.base.LoadedModel` inherits from :class:`WrappedModule`.

Where the weights are and in what dtype (one device, or split over devices by
:meth:`~headprobe.probe.backends.base.LoadedModel.dispatch`, with offloaded weights made real for a
read), their count and fingerprint, the hook names, and the default hooks behind the per-layer
templates that read a block's norms and bias (``_b_O``, ``_norm_weights``, ``_post_attention_norm_*``,
``_attn_out_hook``: :class:`~headprobe.probe.backends.base.LoadedModel` checks the layer first).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headprobe.probe.backends.devicemap import aligned
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_hook, norm_hook
from headprobe.probe.layout.spec import ModelSpec


@dataclass(frozen=True)
class NormWeights:
    """The affine part of a norm ``N(x) = w * normalize(x) + b`` (:meth:`LoadedModel.norm_weights`).

    Attributes:
        weight: ``w`` ``[d_model]`` (float32).
        bias: ``b`` ``[d_model]`` (zeros for RMS-type norms).
        centers: the norm subtracts the mean of its input (LayerNorm), so it reads only the
            component orthogonal to the all-ones direction.
    """

    weight: Float[Tensor, " d_model"]
    bias: Float[Tensor, " d_model"]
    centers: bool


class WrappedModule:
    """The members of :class:`~headprobe.probe.backends.base.LoadedModel` read off the wrapped module
    ``model`` (a mixin; the attributes below are the model's, set by its ``__init__`` and
    :meth:`LoadedModel.dispatch`)."""

    model: Any
    spec: ModelSpec
    _main_device: torch.device | None
    _post_norm_weights: dict[int, Tensor]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """Where inputs go and logits come out: the device of the weights, or of the embedding
        when the model is split over devices (:meth:`LoadedModel.dispatch`)."""
        return self._main_device if self._main_device is not None else next(self.model.parameters()).device

    @property
    def device_map(self) -> dict[str, int | str] | None:
        """``{piece: device}`` of a model split by :meth:`LoadedModel.dispatch` (``disk``: offloaded), else None."""
        if self._main_device is None:
            return None
        hf = getattr(self.model, "original_model", self.model)  # the bridge: transformers split the Hugging Face model
        return getattr(hf, "hf_device_map", None)

    def _aligned(self, module: torch.nn.Module) -> AbstractContextManager[None]:
        """The weights of ``module`` real for the ``with`` body where the model is split and they are
        offloaded (:func:`headprobe.probe.backends.devicemap.aligned`); nothing for a model on one device."""
        return aligned(module) if self._main_device is not None else contextlib.nullcontext()

    def _block_device(self, layer: int) -> torch.device:
        """The device block ``layer`` computes on (the model's unless it is split)."""
        hook = getattr(self.model.blocks[layer], "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        return (
            self.device if device is None else torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        )

    @property
    def n_params(self) -> int:
        """Number of parameters of the wrapped model (a tied embedding counted once)."""
        return sum(p.numel() for p in self.model.parameters())

    def weights_fingerprint(self) -> str:
        """A SHA-256 over every parameter and persistent buffer (name, dtype, shape and an exact
        on-device digest of its bytes, :func:`~headprobe.probe.core.checksum.tensor_digest`, in the
        module's order), as loaded: what a resumed run must have been computed from
        (:class:`~headprobe.probe.core.io.RunCheckpoint`). Sound where a file's size and time are
        not (a model replaced in place, a GGUF dequantized alike, a cast) and the same on every
        device; only 1/2048 of the bytes leave the device (0.35 s for 134M float32 parameters on 2
        idle CPU cores). Offloaded weights are brought back one module at a time."""
        import hashlib

        from headprobe.probe.core.checksum import tensor_digest

        h = hashlib.sha256()
        for prefix, module in self.model.named_modules():
            with self._own_weights(module):
                own = [
                    *module.named_parameters(recurse=False),
                    *(
                        (n, b)
                        for n, b in module.named_buffers(recurse=False)
                        if n not in module._non_persistent_buffers_set
                    ),
                ]
                for name, t in own:
                    h.update(f"{prefix}.{name}:{t.dtype}:{tuple(t.shape)};".encode())
                    h.update(tensor_digest(t))
        return h.hexdigest()

    def _own_weights(self, module: torch.nn.Module) -> AbstractContextManager[None]:
        """``module``'s own weights real for the ``with`` body where the model is split and they are
        offloaded (not its submodules', as :meth:`_aligned` would)."""
        if self._main_device is None:
            return contextlib.nullcontext()
        from accelerate.utils import align_module_device, has_offloaded_params

        return align_module_device(module) if has_offloaded_params(module) else contextlib.nullcontext()

    def hook_names(self) -> list[str]:
        """Every hook point the backend offers (TransformerLens names)."""
        return list(self.model.hook_dict)

    def _post_attention_norm_hooks(self, layer: int) -> tuple[str, str] | None:
        """What :meth:`LoadedModel.post_attention_norm_hooks` returns (``layer`` checked): both hooks
        where the model has them."""
        names = (norm_hook(layer, "ln1_post", "in"), norm_hook(layer, "ln1_post", "out"))
        return names if names[0] in self.model.hook_dict and names[1] in self.model.hook_dict else None

    def _attn_out_hook(self, layer: int) -> str:
        """What :meth:`LoadedModel.attn_out_hook` returns (``layer`` checked)."""
        post = self._post_attention_norm_hooks(layer)
        return post[0] if post is not None else block_hook(layer, "attn_out")

    def _post_attention_norm_weight(self, layer: int) -> Float[Tensor, " d_model"]:
        """What :meth:`LoadedModel.post_attention_norm_weight` returns (``layer`` checked), read once per layer."""
        if layer not in self._post_norm_weights:
            block = self.model.blocks[layer]
            with self._aligned(block):
                ones = torch.full((1, 1, self.spec.d_model), 1e3, dtype=self.dtype, device=self._block_device(layer))
                self._post_norm_weights[layer] = block.ln1_post(ones)[0, 0].detach().to(self.device)
        return self._post_norm_weights[layer]

    def _b_O(self, layer: int) -> Float[Tensor, " d_model"] | None:
        """What :meth:`LoadedModel.b_O` returns (``layer`` checked): the block's ``attn.b_O``."""
        with self._aligned(self.model.blocks[layer]):
            return self.model.blocks[layer].attn.b_O

    def _norm_weights(self, layer: int | None) -> NormWeights | None:
        """What :meth:`LoadedModel.norm_weights` returns (``layer`` checked; None: the final norm)."""
        module = (
            getattr(self.model, "ln_final", None) if layer is None else getattr(self.model.blocks[layer], "ln1", None)
        )
        if module is None:
            return None
        D = self.spec.d_model
        if D % 2:
            raise HeadprobeError(f"cannot read the norm weights of a model with odd d_model ({D})")
        u = torch.ones(D, dtype=torch.float32, device=self.device)
        u[1::2] = -1
        c = 1e3
        probe = torch.stack([c * u, -c * u, c * u + 3 * c]).to(self.dtype)[None]  # [1, 3, d_model]
        with self._aligned(self.model.blocks[layer] if layer is not None else module):
            device = self.device if layer is None else self._block_device(layer)
            out = module(probe.to(device))[0].float().to(self.device)
        w, b = (out[0] - out[1]) / (2 * u), (out[0] + out[1]) / 2
        centers = bool(torch.allclose(out[2], out[0], rtol=1e-2, atol=1e-2 * float(out[0].abs().max())))
        return NormWeights(w, b, centers)

    def final_norm(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        """The model's final norm (``ln_final``) applied to the final residual stream ``resid``
        (``resid`` itself where the model has none)."""
        norm = getattr(self.model, "ln_final", None)
        return resid if norm is None else norm(resid)
