"""The native backend: headprobe's own :class:`~headprobe.probe.model.transformer.Transformer` behind
:class:`~headprobe.probe.backends.base.LoadedModel`.

Resuming a forward (:meth:`NativeModel.resume_scored_losses`) runs the rest of one block from
its raw attention output (:meth:`headprobe.probe.model.transformer.Block.resume`) and the later blocks, then
unembeds only the scored positions into one reused logits buffer with the loss taken in place
(:func:`~headprobe.probe.backends.base.cross_entropy_inplace`): with a 49,152-token vocabulary the
unembedding and the loss dominate each ablation's cost in the exact sweep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headprobe.probe.backends.base import LOSS_ROWS, HookFn, LoadedModel, _module_type, cross_entropy_inplace
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout.spec import Checkpoint
from headprobe.probe.model.positions import padding_and_positions

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from headprobe.probe.layout.attention import KVPolicy
    from headprobe.probe.model.transformer import Transformer


class NativeModel(LoadedModel):
    """A :class:`~headprobe.probe.backends.base.LoadedModel` on headprobe's own transformer
    (``model`` is the :class:`~headprobe.probe.model.transformer.Transformer`). Takes padded batches."""

    name = "native"
    supports_padding = True
    padding_sides = ("left", "right")
    streams_statistics = kv_policies = path_patching = half_precision = True
    native_weights = splits_after_load = removes_heads = True

    @classmethod
    def wraps(cls, module: object) -> bool:
        return _module_type(
            module, "headprobe.probe.model.transformer", "Transformer"
        )  # no Transformer exists before that import

    @classmethod
    def supports(cls, hf_config: Any) -> bool:
        """Whether a registered family converts ``hf_config`` exactly (:func:`headprobe.probe.model.convert.supports`)."""
        from headprobe.probe.model import convert

        return convert.supports(hf_config)

    @classmethod
    def from_checkpoint(
        cls, ckpt: Checkpoint, device: str | torch.device = "cpu", prepend_bos: bool = True, copy: bool = True
    ) -> NativeModel:
        """The checkpoint's weights in headprobe's own transformer (:func:`headprobe.probe.model.convert.from_hf`;
        ``copy`` False takes its tensors without copying them).

        Raises:
            HeadprobeError: an architecture or option the native model does not implement.
        """
        from headprobe.probe.model import convert

        model = convert.from_hf(ckpt.hf_model, copy=copy).to(device).eval()
        spec = convert.spec_from_native(ckpt.name, ckpt.hf_name, ckpt.precision, model.cfg)
        return cls(model, ckpt.tokenizer, spec, prepend_bos=prepend_bos)

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        head_mask: Float[Tensor, "layer head"] | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.forward`."""
        tokens = tokens.to(self.device)
        kwargs: dict[str, Tensor] = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if head_mask is not None:
            kwargs["head_mask"] = head_mask.to(self.device)
        if fwd_hooks:
            return self.model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks), **kwargs)
        return self.model(tokens, **kwargs)

    def final_residual(
        self,
        tokens: Int[Tensor, "batch pos"],
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        attention_mask: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.final_residual`."""
        kwargs: dict[str, Tensor] = {} if attention_mask is None else {"attention_mask": attention_mask.to(self.device)}
        with self.hooks(fwd_hooks):
            return self.model(tokens.to(self.device), return_type="resid", **kwargs)

    def _W_O(self, layer: int) -> Float[Tensor, "head d_head d_model"]:
        """Layer ``layer``'s output projection split by head (a view of ``o_proj.weight``, on the
        device its block computes on)."""
        with self._aligned(self.model.blocks[layer]):
            return self.model.blocks[layer].attn.W_O

    def _sink_logits(self, layer: int) -> Float[Tensor, " head"] | None:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.sink_logits` (``attn.sinks``)."""
        sinks = self.model.blocks[layer].attn.sinks
        return None if sinks is None else sinks.detach().float()

    def _projection(self, layer: int, which: str) -> Float[Tensor, "head d_model d_head"]:
        """A view of ``{which}_proj.weight`` (``which``: ``q``, ``k``, ``v``) split by head."""
        attn, proj = self.model.blocks[layer].attn, f"{which}_proj"
        if self.model.cfg.is_mla:
            raise HeadprobeError(
                "latent attention (MLA) has no per-head W_Q, W_K, W_V: weight-based head metrics do not apply"
            )
        with self._aligned(self.model.blocks[layer]):
            weight = getattr(attn, proj).weight  # nn.Linear [n * d_head, d_model]
        cfg = self.model.cfg
        if which == "q" and cfg.attn_gate:  # q_proj holds [q_h, g_h] per head: the query part only
            return weight.T.unflatten(1, (cfg.n_heads, -1))[..., : cfg.d_head].transpose(0, 1)
        return weight.T.unflatten(1, (-1, cfg.d_head)).transpose(0, 1)

    def _qkv_bias(self, layer: int, which: str) -> Tensor | None:
        """``{which}_proj.bias`` split by head (the query part only of a gated ``q_proj``), or None."""
        cfg, block = self.model.cfg, self.model.blocks[layer]
        if cfg.is_mla:
            return None
        with self._aligned(block):
            bias = getattr(block.attn, f"{which}_proj").bias  # [n * d_head] or None
        if bias is None:
            return None
        if which == "q" and cfg.attn_gate:
            return bias.unflatten(0, (cfg.n_heads, -1))[:, : cfg.d_head]
        return bias.unflatten(0, (-1, cfg.d_head))

    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.W_E`."""
        return self.model.embed.W_E.weight

    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.W_U`."""
        return self.model.unembed.weight.T

    def b_U(self) -> Float[Tensor, " d_vocab"] | None:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.b_U`."""
        return self.model.unembed.bias

    def logits_from_residual(
        self,
        resid: Float[Tensor, "... d_model"],
        vocab: Int[Tensor, "... k"] | None = None,
        *,
        normed: bool = False,
        softcap: bool = True,
    ) -> Float[Tensor, "... d_vocab"] | Float[Tensor, "... k"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.logits_from_residual`: the model's own
        :meth:`~headprobe.probe.model.transformer.Transformer.logits`, the function its forward pass ends with."""
        resid = resid.to(self.device, self.dtype)
        return self.model.logits(
            resid, normed=normed, vocab=None if vocab is None else vocab.to(self.device), softcap=softcap
        )

    @torch.inference_mode()
    def scored_losses(
        self, tokens: Int[Tensor, "batch pos"], first: int, fwd_hooks: Sequence[tuple[str, HookFn]] = ()
    ) -> Float[Tensor, " batch"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.scored_losses`; logits only at the scored positions."""
        tokens = tokens.to(self.device)
        with self.hooks(fwd_hooks):
            resid = self.model(tokens, return_type="resid")  # after ln_final
        return self._losses(resid, tokens, first, normed=True)

    @torch.inference_mode()
    def _resume_scored_losses(
        self,
        layer: int,
        tokens: Int[Tensor, "batch pos"],
        resid_pre: Float[Tensor, "n pos d_model"],
        attn_out: Float[Tensor, "n pos d_model"],
        first: int,
    ) -> Float[Tensor, " n"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.resume_scored_losses`: layer ``layer``'s
        :meth:`~headprobe.probe.model.transformer.Block.resume` (post-attention norm and parallel MLP as in the
        forward pass), the later blocks, and logits only at the scored positions."""
        net = self.model
        tokens = tokens.to(self.device)
        block_device = self._block_device(layer)
        with self._aligned(net.blocks[layer]):  # resume is not a forward: accelerate's hook does not load the weights
            x = net.blocks[layer].resume(resid_pre.to(block_device), attn_out.to(block_device))
        _, positions = padding_and_positions(x.shape[0], x.shape[1], x.device)
        for later in net.blocks[layer + 1 :]:
            x = later(x, positions)
        return self._losses(x.to(self.device), tokens, first)

    @torch.inference_mode()
    def _scored_losses_from(
        self,
        layer: int,
        tokens: Int[Tensor, "n pos"],
        resid_pre: Float[Tensor, "n pos d_model"],
        first: int,
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
    ) -> Float[Tensor, " n"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.scored_losses_from`: blocks ``layer`` on
        from ``resid_pre``, then logits only at the scored positions."""
        with self.hooks(fwd_hooks):
            resid = self._resid_from(layer, resid_pre)
        return self._losses(resid.to(self.device), tokens.to(self.device), first)

    def _resid_from(
        self, layer: int, resid_pre: Float[Tensor, "n pos d_model"], attention_mask: Int[Tensor, "n pos"] | None = None
    ) -> Float[Tensor, "n pos d_model"]:
        """Blocks ``layer ..`` from ``resid_pre``: the final residual before the final norm
        (:meth:`forward_from`, :meth:`scored_losses_from`; their callers hold the hooks).
        Positions ``0 .. pos-1`` without ``attention_mask``; with it (1 real, 0 padding) the
        positions and padding keys of :meth:`forward` on a padded batch, from the same code
        (:func:`~headprobe.probe.model.positions.padding_and_positions`).

        Raises:
            InputValueError: a mask value other than 0 and 1, as :meth:`forward` refuses it."""
        x = resid_pre.to(self._block_device(layer), self.dtype)
        mask = None if attention_mask is None else attention_mask.to(x.device)
        padding, positions = padding_and_positions(x.shape[0], x.shape[1], x.device, mask)  # as Transformer.forward
        for block in self.model.blocks[layer:]:
            x = block(x, positions, padding)
        return x

    def _losses(
        self, resid: Float[Tensor, "n pos d_model"], tokens: Int[Tensor, "batch pos"], first: int, normed: bool = False
    ) -> Float[Tensor, " n"]:
        return _scored_losses_from_resid(self.model, resid, tokens, first, normed)

    def _forward_from(
        self,
        layer: int,
        resid_pre: Float[Tensor, "batch pos d_model"],
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        attention_mask: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.forward_from`."""
        with self.hooks(fwd_hooks):  # hooks on ln_final fire too
            return self.model.logits(self._resid_from(layer, resid_pre, attention_mask).to(self.device))

    def _attention_input(
        self, layer: int, resid: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos d_model"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.attention_input`."""
        block = self.model.blocks[layer]
        if block.post_ln:
            raise HeadprobeError(
                "a post-LN block (BERT) normalises the residual after the attention: "
                "paths into its heads' inputs are not defined here"
            )
        return resid if block.ln1 is None else block.ln1(resid)

    def _attention_scale(self, layer: int) -> tuple[float, float | None]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.attention_scale`."""
        attn = self.model.blocks[layer].attn
        return float(attn.scale), attn.softcap

    def _n_heads(self, layer: int) -> int:
        """Query heads in layer ``layer``: its attention module's (fewer in a pruned layer)."""
        return self.model.blocks[layer].attn.n_heads

    def _qk_terms(
        self,
        layer: int,
        head: int,
        side: Literal["q", "k"],
        terms: Float[Tensor, "n d_model"],
        ref: Float[Tensor, " d_model"],
        pos: int,
    ) -> Float[Tensor, "n_plus_1 d_qk"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.qk_terms`."""
        from headprobe.probe.hooks.qk import head_qk_terms

        with self._aligned(self.model.blocks[layer]):
            return head_qk_terms(self.model, layer, head, side, terms, ref, pos)

    def _online_stats_geometry(self, layer: int) -> tuple[Any, bool]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.online_stats_geometry`: read off the layer's attention module."""
        from headprobe.probe.hooks.online_stats import AttentionGeometry

        attn = self.model.blocks[layer].attn
        if hasattr(attn, "kept_heads"):
            raise HeadprobeError(
                "streaming head statistics do not cover pruned models (their layers keep fewer heads); "
                "use --streaming off"
            )
        if getattr(attn, "chunk", None) or getattr(attn, "qk_l2", False) or getattr(attn, "temperature", None):
            raise HeadprobeError(
                f"streaming head statistics do not cover layer {layer}'s chunked attention, QK L2 norm or "
                "query temperature (Llama-4); use --streaming off"
            )
        rotary = getattr(attn, "rotary", None) is not None and hasattr(attn, "hook_rot_q")
        if not rotary and getattr(attn, "q_norm", None) is not None:
            raise HeadprobeError(
                f"layer {layer} normalises queries after hook_q and has no rotary hook: "
                f"streaming statistics cannot read its queries"
            )
        geom = AttentionGeometry(
            float(attn.scale),
            attn.softcap,
            attn.window,
            bool(attn.cfg.causal),
            attn.n_heads,
            attn.n_kv_heads,
            None if attn.sinks is None else attn.sinks.detach().float(),
        )
        return geom, rotary

    def check_prunable(self) -> None:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.check_prunable`."""
        from headprobe.probe.model.pruned import check_prunable

        self.require("removes_heads", "real head removal (--save-pruned) needs the native backend (--backend native)")
        if self._main_device is not None:
            raise HeadprobeError(
                "real head removal (--save-pruned) needs the whole model on one device, not split by --device-map"
            )
        check_prunable(self.model.cfg)

    def remove_heads(self, keep: Bool[Tensor, "layer head"]) -> Transformer:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.remove_heads`."""
        from headprobe.probe.model.pruned import remove_heads

        self.check_prunable()
        return remove_heads(self.model, keep)

    def attention_parameters(self) -> int:
        """Parameters in all attention projections (q, k, v, o; biases included)."""
        from headprobe.probe.model.pruned import count_attention_parameters

        return count_attention_parameters(self.model)

    def save(self, out: Any, extra: dict[str, Any] | None = None) -> None:
        """Write the weights and config as a headprobe checkpoint (:func:`headprobe.probe.model.checkpoint.save_native`)."""
        from headprobe.probe.model.checkpoint import save_native

        if self._main_device is not None:
            raise HeadprobeError(
                "a model split over devices (--device-map) cannot be saved: load it without --device-map to save it"
            )
        save_native(self.model, out, extra)

    def dispatch(
        self,
        device_map: str | dict[str, int | str],
        max_memory: dict[int | str, int | str] | None = None,
        offload_dir: str | None = None,
    ) -> NativeModel:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.dispatch`."""
        from headprobe.probe.backends.devicemap import dispatch

        if self._main_device is not None:
            raise HeadprobeError("the model is split over devices already")
        if self.device.type != "cpu":
            self.model.to("cpu")
        self.model, self._main_device, self._offload_dir = dispatch(self.model, device_map, max_memory, offload_dir)
        return self

    @property
    def parallel_attn_mlp(self) -> bool:
        """See :attr:`headprobe.probe.backends.base.LoadedModel.parallel_attn_mlp`: the native
        model's ``parallel_residual``."""
        return bool(self.model.cfg.parallel_residual)

    # ---- head-level KV-cache policies (headprobe kv; the native backend only) ------------------

    @property
    def logit_entry_bytes(self) -> int:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.logit_entry_bytes`: the compute dtype's
        bytes times the ``[pos, d_vocab]`` tensors :meth:`~headprobe.probe.model.transformer.Transformer.logits`
        holds at once: 1, 2 with ``logit_scale`` (``logits * scale``), 3 with ``final_softcap``
        (``tanh(logits / c) * c`` beside the logits)."""
        cfg = self.model.cfg
        copies = 3 if cfg.final_softcap is not None else 2 if cfg.logit_scale is not None else 1
        return torch.empty((), dtype=self.dtype).element_size() * copies

    @property
    def n_kv_groups(self) -> int:
        """KV groups per layer, the units a KV policy addresses (``n_kv_heads``; 1 for MLA)."""
        return self.model.n_kv_groups

    @property
    def kv_layout(self):
        """The attention layout (:class:`~headprobe.probe.layout.attention.AttentionLayout`) with the bytes
        per element of the compute dtype: what the KV cache holds."""
        return dataclasses.replace(
            self.model.cfg.layout, bytes_per_element=torch.empty((), dtype=self.dtype).element_size()
        )

    def check_kv_policy(self, policy: KVPolicy) -> None:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.check_kv_policy`
        (:meth:`headprobe.probe.model.transformer.Transformer.check_kv_policy`)."""
        self.model.check_kv_policy(policy)

    def kv_policy(self, policy: KVPolicy | None) -> AbstractContextManager[Any]:
        """Context manager: every forward inside runs with ``policy``'s per-KV-group streaming
        attention (:meth:`headprobe.probe.model.transformer.Transformer.kv_policy`; None: full attention).

        Raises:
            HeadprobeError: a policy that does not fit the model.
        """
        return self.model.kv_policy(policy)

    def streaming_cache_bytes(self, tokens: Int[Tensor, "batch pos"], policy: KVPolicy) -> int:
        """Bytes of the :class:`~headprobe.probe.model.cache.StreamingKVCache` the model allocates for
        ``policy`` after prefilling ``tokens`` (one forward pass)."""
        cache = self.model.streaming_cache(policy)
        with torch.inference_mode():
            self.model(tokens.to(self.device), return_type="resid", cache=cache)
        return cache.nbytes


@torch.inference_mode()
def _scored_losses_from_resid(
    net: Transformer,
    resid: Float[Tensor, "n pos d_model"],
    tokens: Int[Tensor, "batch pos"],
    first: int,
    normed: bool = False,
) -> Float[Tensor, " n"]:
    """Per-sequence mean loss (nats/token) from the final residual of ``n = k * batch`` sequences
    (k copies of ``tokens``), unembedding only the scored positions ``first .. pos-2`` (the
    logits at position i predict token i+1), ``batch`` sequences and at most
    :data:`~headprobe.probe.backends.base.LOSS_ROWS` rows at a time (positions in chunks, so a long
    sequence never has its ``[pos, d_vocab]`` logits at once) into one reused logits buffer (a fresh 150 MB tensor per chunk costs page faults), with the loss taken in
    place (:func:`~headprobe.probe.backends.base.cross_entropy_inplace`). The logits come from
    :meth:`headprobe.probe.model.transformer.Transformer.logits`, as in the forward pass (Gemma-2's soft-cap
    included)."""
    B, T = tokens.shape
    step = max(1, LOSS_ROWS // B)  # positions per chunk: at most LOSS_ROWS rows of logits, whatever T
    W_U = net.unembed.weight  # [d_vocab, d_model]
    width = min(step, T - 1 - first)
    buffer = torch.empty(B * width, W_U.shape[0], device=resid.device) if W_U.dtype == torch.float32 else None
    out = []
    for i in range(0, resid.shape[0], B):
        total = torch.zeros(B, dtype=torch.float64, device=resid.device)
        for c0 in range(first, T - 1, step):
            c1 = min(c0 + step, T - 1)
            sel = resid[i : i + B, c0:c1]
            if not normed and net.ln_final is not None:
                sel = net.ln_final(sel)
            sel = sel.flatten(0, 1)
            target = tokens[:, c0 + 1 : c1 + 1].flatten()
            if buffer is not None:
                logits = net.logits(sel, normed=True, out=buffer[: len(target)])
            else:  # half precision: logits in float32, as cross_entropy would compute them
                logits = net.logits(sel, normed=True).float()
            total += cross_entropy_inplace(logits, target).view(B, -1).double().sum(dim=1)
        out.append((total / (T - 1 - first)).float())
    return torch.cat(out)
