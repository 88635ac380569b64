"""The TransformerLens backend: a ``TransformerBridge`` (TransformerLens 4.x) behind
:class:`~headprobe.probe.backends.base.LoadedModel`.

The bridge runs the Hugging Face modules themselves, so there is no block to resume from
outside. :meth:`BridgeModel.resume_scored_losses` is therefore an honest forward from the tokens
with layer ``layer``'s residual stream and raw attention output replaced through their hooks
(``blocks.{l}.hook_resid_pre`` and :meth:`~headprobe.probe.backends.base.LoadedModel.attn_out_hook`):
one full forward per ``batch`` sequences, the numbers of the shortcut the native backend takes.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.probe.backends.base import HookFn, LoadedModel, _module_type, scored_loss
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.padding import padding_mask
from headprobe.probe.hooks.names import UNEMBED_IN, attn_hook, block_hook
from headprobe.probe.layout.attention import layout_from_hf_config, parallel_attn_mlp_from_hf_config
from headprobe.probe.layout.spec import Checkpoint, ModelSpec

if TYPE_CHECKING:  # pragma: no cover
    from transformer_lens.model_bridge import TransformerBridge


class BridgeModel(LoadedModel):
    """A :class:`~headprobe.probe.backends.base.LoadedModel` on TransformerLens' ``TransformerBridge``
    (``model``); padded batches only right-padded (:meth:`BridgeModel.forward`)."""

    name = "transformer-lens"
    residual_with_logits = True  # final_residual keeps unembed's input from a whole forward
    # No capability flag (streams_statistics, kv_policies, path_patching, half_precision, native_weights,
    # splits_after_load, removes_heads): LoadedModel's False stands.

    @property
    def supports_padding(self) -> bool:  # type: ignore[override]
        """Right padding of a causal model only (:meth:`forward`)."""
        return self.spec.causal

    @property
    def padding_sides(self) -> tuple[str, ...]:  # type: ignore[override]
        """``("right",)`` for a causal model (:meth:`forward`), else none."""
        return ("right",) if self.spec.causal else ()

    @classmethod
    def wraps(cls, module: object) -> bool:
        return _module_type(module, "transformer_lens.model_bridge", "TransformerBridge")

    @classmethod
    def supports(cls, hf_config: Any) -> bool:
        """Every causal LM TransformerLens has an adapter for (whether it has one shows at wrapping);
        not an encoder (its BERT adapter wants ``BertForMaskedLM``)."""
        from headprobe.probe.model import convert

        return not convert.is_encoder(getattr(hf_config, "model_type", None))

    @classmethod
    def from_checkpoint(
        cls, ckpt: Checkpoint, device: str | torch.device = "cpu", prepend_bos: bool = True, copy: bool = True
    ) -> BridgeModel:
        """The checkpoint's Hugging Face model (a deep copy unless ``copy`` is False) wrapped in a
        ``TransformerBridge`` (:func:`boot_bridge`); a model transformers
        split over devices at load stays where it is.

        Raises:
            HeadprobeError: an encoder (BERT), or an architecture TransformerLens cannot wrap.
        """
        import copy as copy_module
        import io

        from headprobe.probe.layout.attention import attention_bias

        if not cls.supports(ckpt.hf_model.config):
            # TransformerLens' BERT adapter wants BertForMaskedLM (it reads `.bert`); a bare encoder fails inside it
            raise HeadprobeError(
                f"{ckpt.name} is an encoder ({type(ckpt.hf_model).__name__}): it runs on --backend native "
                f"(or auto), not on TransformerLens' bridge"
            )
        hf_model = copy_module.deepcopy(ckpt.hf_model) if copy else ckpt.hf_model
        bias = attention_bias(hf_model)  # before the bridge rewires the modules it wraps
        model = boot_bridge(ckpt.hf_name, hf_model, ckpt.tokenizer)
        split = getattr(hf_model, "hf_device_map", None) is not None
        if not split:  # a model split at load stays where transformers put it
            with contextlib.redirect_stdout(io.StringIO()):  # TransformerLens prints "Moving model to device" on stdout
                model.to(device)
        loaded = cls(
            model,
            ckpt.tokenizer,
            spec_from_bridge(ckpt.name, ckpt.hf_name, ckpt.precision, model, bias),
            prepend_bos=prepend_bos,
        )
        if split:
            loaded._main_device = _execution_device(hf_model.get_input_embeddings())
        return loaded

    @property
    def architecture(self) -> str:
        """See :attr:`headprobe.probe.backends.base.LoadedModel.architecture`: the wrapped Hugging Face model's."""
        hf = self.model.original_model
        return (getattr(hf.config, "architectures", None) or [type(hf).__name__])[0]

    @property
    def hf_config(self) -> Any:
        """The wrapped Hugging Face model's config."""
        return self.model.original_model.config

    @property
    def parallel_attn_mlp(self) -> bool:
        """See :attr:`headprobe.probe.backends.base.LoadedModel.parallel_attn_mlp`: the bridge
        config's ``parallel_attn_mlp`` (its adapters set it) or what the wrapped model's config says
        (:func:`~headprobe.probe.layout.attention.parallel_attn_mlp_from_hf_config`; the Hugging Face
        modules compute the block)."""
        return bool(getattr(self.model.cfg, "parallel_attn_mlp", False)) or bool(
            parallel_attn_mlp_from_hf_config(self.hf_config)
        )

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        head_mask: Float[Tensor, "layer head"] | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.forward`; ``head_mask`` multiplies
        ``hook_z`` through hooks, and hooks on ``hook_attn_scores`` see masked keys as ``-inf``
        (:func:`_scores_with_neg_inf`).

        ``attention_mask``: right padding of a causal model only. Real tokens come first there and a
        causal query never reads a later key, so the forward without the mask is exact at every
        real token (tested against each text alone); what padded positions hold means nothing.
        Left padding would need positions counted over real tokens, which this backend does not
        promise, so it is refused.

        Raises:
            HeadprobeError: an ``attention_mask`` with left (or inner) padding, or on an encoder.
        """
        if attention_mask is not None:
            real = padding_mask(attention_mask)
            right = bool((real[:, 1:] <= real[:, :-1]).all()) and bool(real[:, 0].all())  # 1...1 0...0 per row
            if not (self.spec.causal and right):
                raise HeadprobeError(self._padding_refusal())
            attention_mask = None  # exact at the real tokens, see above
        tokens = tokens.to(self.device)
        fwd_hooks = _scores_with_neg_inf(fwd_hooks)
        if head_mask is not None:
            fwd_hooks = _head_mask_hooks(head_mask) + fwd_hooks
        if fwd_hooks:
            return self.model.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
        return self.model(tokens)

    def _padding_refusal(self) -> str:
        """:meth:`forward`'s one line for a mask it refuses: right padding first (what works here), the
        native backend only where it can load this model (left padding works there)."""
        from headprobe.probe.model import convert

        line = (
            "padded batches on the TransformerLens bridge need right padding of a causal model: pad on the right "
            "instead (to_tokens(texts), whose default is padding_side='right'), exact at every real token"
        )
        if self.spec.causal and convert.supports(self.hf_config):
            line += "; left padding needs the native backend (--backend native), which loads this model"
        return line

    def hooks(
        self, fwd_hooks: Sequence[tuple[str, HookFn]] = (), bwd_hooks: Sequence[tuple[str, HookFn]] = ()
    ) -> contextlib.AbstractContextManager[None]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.hooks`; ``hook_attn_scores`` hooks see
        masked keys as ``-inf``, as in :meth:`forward`."""
        return self.model.hooks(fwd_hooks=_scores_with_neg_inf(fwd_hooks), bwd_hooks=list(bwd_hooks))

    def _W_O(self, layer: int) -> Float[Tensor, "head d_head d_model"]:
        """Layer ``layer``'s output projection split by head: ``result_h = z_h @ W_O[h]``."""
        attn = self.model.blocks[layer].attn
        with self._aligned(self.model.blocks[layer]):  # weights offloaded by a device map: real inside
            try:
                return attn.W_O
            except ValueError:  # latent attention (MLA): z is v_head_dim wide, not d_head
                weight = attn.o.original_component.weight  # nn.Linear [d_model, head * d_v]
                return weight.T.unflatten(0, (self.spec.n_heads, weight.shape[1] // self.spec.n_heads))

    def _sink_logits(self, layer: int) -> Float[Tensor, " head"] | None:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.sink_logits`: the Hugging Face attention
        module's ``sinks`` (GPT-OSS), read off the wrapped model (the bridge nests each module it
        wraps as ``_original_component``)."""
        want = f"layers.{layer}.self_attn.sinks"
        for name, p in self.model.original_model.named_parameters():
            if name.replace("_original_component.", "").endswith(want):
                return p.detach().float()
        return None

    def _projection(self, layer: int, which: str) -> Tensor:
        """The bridge's per-head ``W_Q`` / ``W_K`` / ``W_V`` (``which``: ``q``, ``k``, ``v``) of layer ``layer``."""
        name = f"W_{which.upper()}"
        try:
            with self._aligned(self.model.blocks[layer]):
                return getattr(self.model.blocks[layer].attn, name)
        except (ValueError, AttributeError, NotImplementedError):  # latent attention (MLA) has no per-head W_Q/W_K/W_V
            raise HeadprobeError(
                f"this architecture has no per-head {name}: weight-based head metrics do not apply"
            ) from None

    def _qkv_bias(self, layer: int, which: str) -> Tensor | None:
        """The bridge's per-head ``b_Q`` / ``b_K`` / ``b_V`` of layer ``layer``, or None where it has none."""
        try:
            with self._aligned(self.model.blocks[layer]):
                return getattr(self.model.blocks[layer].attn, f"b_{which.upper()}", None)
        except (ValueError, AttributeError, NotImplementedError):
            return None

    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.W_E`."""
        with self._aligned(self.model.embed):
            return self.model.W_E

    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.W_U`."""
        with self._aligned(self.model.unembed):
            return self.model.W_U

    def b_U(self) -> Float[Tensor, " d_vocab"] | None:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.b_U`."""
        with self._aligned(self.model.unembed):
            return getattr(self.model, "b_U", None)

    def final_residual(
        self,
        tokens: Int[Tensor, "batch pos"],
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        attention_mask: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.final_residual`: what the unembedding
        reads (``unembed.hook_in``, after the final norm), from one forward with ``fwd_hooks``.

        Raises:
            HeadprobeError: an encoder (its last hidden state is not what the bridge unembeds),
                ``attention_mask`` given (as :meth:`forward`).
        """
        if not self.spec.causal or UNEMBED_IN not in self.model.hook_dict:
            raise HeadprobeError(f"the final residual stream of this model needs the native backend, not {self.name}")
        kept: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any) -> None:
            kept["x"] = x

        self.forward(tokens, [*fwd_hooks, (UNEMBED_IN, keep)], attention_mask)
        return kept["x"]

    def logits_from_residual(
        self,
        resid: Float[Tensor, "... d_model"],
        vocab: Int[Tensor, "... k"] | None = None,
        *,
        normed: bool = False,
        softcap: bool = True,
    ) -> Float[Tensor, "... d_vocab"] | Float[Tensor, "... k"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.logits_from_residual`: the bridge's ``ln_final`` and
        ``unembed`` modules (Hugging Face's final norm and LM head), then the architecture adapter's
        ``apply_output_logits_transform`` (TransformerLens: the family's soft-cap and logit
        scaling). ``softcap=False``: the transform's slope at 0 instead (:meth:`_logit_scale`)."""
        x = resid.to(self.device, self.dtype)
        norm = getattr(self.model, "ln_final", None)
        if not normed and norm is not None:
            x = norm(x)
        logits = self.model.unembed(x)
        if vocab is not None:
            logits = logits.gather(-1, vocab.to(logits.device))
        if softcap:
            return self.model.adapter.apply_output_logits_transform(logits)
        return logits * self._logit_scale()

    def _logit_scale(self) -> float:
        """The linear part of the adapter's output transform, read off it as ``T(e) / e`` for
        ``e = 1e-6`` in float64 (a logit scale ``a`` gives ``a``; a soft-cap ``c tanh(a x / c)``
        gives ``a`` to 1e-12 relative; no transform gives 1)."""
        e = torch.tensor([1e-6], dtype=torch.float64)
        return float(self.model.adapter.apply_output_logits_transform(e)[0] / e[0])

    @torch.inference_mode()
    def scored_losses(
        self, tokens: Int[Tensor, "batch pos"], first: int, fwd_hooks: Sequence[tuple[str, HookFn]] = ()
    ) -> Float[Tensor, " batch"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.scored_losses`."""
        tokens = tokens.to(self.device)
        return scored_loss(self.forward(tokens, fwd_hooks), tokens, first)

    @torch.inference_mode()
    def _resume_scored_losses(
        self,
        layer: int,
        tokens: Int[Tensor, "batch pos"],
        resid_pre: Float[Tensor, "n pos d_model"],
        attn_out: Float[Tensor, "n pos d_model"],
        first: int,
    ) -> Float[Tensor, " n"]:
        """See :meth:`headprobe.probe.backends.base.LoadedModel.resume_scored_losses`: one forward of
        ``tokens`` per ``batch`` of the ``n`` sequences, with ``blocks.{layer}.hook_resid_pre`` and
        the raw attention output replaced (the layers before ``layer`` are recomputed)."""
        tokens = tokens.to(self.device)
        B = tokens.shape[0]
        out = []
        for i in range(0, resid_pre.shape[0], B):
            hooks = [
                (block_hook(layer, "resid_pre"), _replace(resid_pre[i : i + B])),
                (self.attn_out_hook(layer), _replace(attn_out[i : i + B])),
            ]
            out.append(self.scored_losses(tokens, first, hooks))
        return torch.cat(out)

    @contextlib.contextmanager
    def _cache_kwarg_shim(self) -> Iterator[None]:
        """Hand each attention bridge the Hugging Face cache under the name it reads.

        transformers 5.x passes the cache to attention as ``cache=`` (``past_key_values`` is
        deprecated); TransformerLens' attention bridges read only ``past_key_values``/``layer_past``,
        so without this the model's cache comes back empty. The pre-hooks copy ``cache`` into
        ``past_key_values`` when only the former is given, and are removed on exit.
        """

        def pre_hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if kwargs.get("past_key_values") is None and kwargs.get("cache") is not None:
                return args, {**kwargs, "past_key_values": kwargs["cache"]}
            return None

        handles = [
            block.attn.register_forward_pre_hook(pre_hook, with_kwargs=True)
            for block in getattr(self.model, "blocks", ())
            if hasattr(block, "attn")
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def forward_with_cache(self, tokens: Int[Tensor, "batch pos"], cache: Any = None) -> Any:
        """Run ``tokens`` with the Hugging Face key/value cache on and return the cache object the
        model filled (``cache``, e.g. a ``transformers.StaticCache``, when given; else the one the
        model made), or None when it returned none."""
        kwargs = {} if cache is None else {"cache": cache}
        with self._cache_kwarg_shim():
            out = self.model(tokens.to(self.device), return_type="logits_and_cache", use_cache=True, **kwargs)
        return out[1] if isinstance(out, tuple) else None


def _scores_with_neg_inf(fwd_hooks: Sequence[tuple[str, HookFn]]) -> list[tuple[str, HookFn]]:
    """``fwd_hooks`` with each hook on ``blocks.{l}.attn.hook_attn_scores`` handed the scores with
    masked keys set to ``-inf``, the sentinel of headprobe's hook points (and of TransformerLens'
    ``HookedTransformer``). The bridge runs Hugging Face's attention, whose additive masks are
    ``torch.finfo(dtype).min`` (-3.4e38 in float32), so ``isneginf`` found none of them; a masked
    score is exactly that value (a score plus ``finfo.min`` rounds to it), and no real score
    comes near it. What the hook returns goes on to the softmax as usual (``-inf`` and
    ``finfo.min`` both give weight 0)."""

    def wrapped(fn: HookFn) -> HookFn:
        def hook(scores: Tensor, hook: Any) -> Any:
            return fn(scores.masked_fill(scores <= torch.finfo(scores.dtype).min, float("-inf")), hook)

        return hook

    return [
        (name, wrapped(fn)) if isinstance(name, str) and name.endswith("attn.hook_attn_scores") else (name, fn)
        for name, fn in fwd_hooks
    ]


def _replace(value: Tensor) -> HookFn:
    """A hook returning ``value`` in place of the activation."""

    def hook(x: Tensor, hook: Any) -> Tensor:
        return value.to(x.dtype)

    return hook


def _head_mask_hooks(head_mask: Float[Tensor, "layer head"]) -> list[tuple[str, HookFn]]:
    """Hooks multiplying each head's ``z`` by ``head_mask[layer, head]`` (Michel et al. 2019)."""

    def make(layer: int) -> HookFn:
        def hook(z: Tensor, hook: Any) -> Tensor:
            return z * head_mask[layer].to(z.device, z.dtype)[:, None]

        return hook

    return [(attn_hook(layer, "z"), make(layer)) for layer in range(head_mask.shape[0])]


def boot_bridge(hf_name: str, hf_model: Any, tokenizer: Any) -> TransformerBridge:
    """Wrap a loaded Hugging Face causal LM in a TransformerLens ``TransformerBridge``.

    Raises:
        HeadprobeError: TransformerLens has no adapter for the architecture.
    """
    import copy

    from transformer_lens.model_bridge import TransformerBridge

    # TransformerLens re-reads a tokenizer without `add_bos_token` from its `name_or_path` (a folder or a
    # Hub name): a tokenizer built in memory has none, and its model's class name sent it to the Hub
    # (HEAD https://huggingface.co/LlamaForCausalLM/..., 5 retries, then an OSError). headprobe tokenizes
    # itself and hands the bridge token ids, so the bridge's tokenizer is never used to tokenize: it
    # gets a copy marked add_bos_token, which it keeps as it is (and may change: padding side, pad token).
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.init_kwargs["add_bos_token"] = True
    tokenizer.init_kwargs.setdefault("name_or_path", getattr(tokenizer, "name_or_path", "") or hf_name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.getLogger("transformer_lens").setLevel(logging.ERROR)
            bridge = TransformerBridge.boot_transformers(hf_name, hf_model=hf_model, tokenizer=tokenizer)
    except (ValueError, NotImplementedError, KeyError) as e:
        arch = getattr(hf_model.config, "architectures", None) or [type(hf_model).__name__]
        raise HeadprobeError(f"TransformerLens cannot wrap architecture {arch[0]}: {str(e).splitlines()[0]}") from None
    bridge.eval()
    return bridge


def spec_from_bridge(name: str, hf_name: str, weights: str, bridge: Any, bias: str) -> ModelSpec:
    """The :class:`ModelSpec` of a TransformerLens bridge: sizes from the bridge's config
    (``n_layers``, ``n_heads``, ``n_key_value_heads``, ``d_head``, ``d_model``, ``d_vocab``,
    ``n_ctx``), the rest of the layout from the wrapped Hugging Face config
    (:func:`~headprobe.probe.layout.attention.layout_from_hf_config`: MLA sizes, QK-norm, windows; a layer
    type other than attention is read as global). ``bias`` is the bias kind of the Hugging Face
    model's attention, read before the bridge rewired it
    (:func:`~headprobe.probe.layout.attention.attention_bias`).

    Raises:
        HeadprobeError: the sizes make no valid :class:`~headprobe.probe.layout.attention.AttentionLayout`.
    """
    cfg = bridge.cfg
    layout = layout_from_hf_config(
        bridge.original_model.config,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=getattr(cfg, "n_key_value_heads", None) or cfg.n_heads,
        d_head=cfg.d_head,
        d_model=cfg.d_model,
        bias=bias,
        strict=False,
    )
    return ModelSpec(
        name=name,
        hf_name=hf_name,
        layout=layout,
        d_vocab=cfg.d_vocab,
        n_ctx=cfg.n_ctx,
        weights=weights,
        backend="transformer-lens",
        d_mlp=_mlp_activation_width(cfg),
    )


def _mlp_activation_width(cfg: Any) -> int | None:
    """:attr:`ModelSpec.d_mlp` from a bridge's config: ``d_mlp``, times ``experts_per_token`` for a
    mixture of experts, 0 for an attention-only model; None where the config gives no width."""
    if getattr(cfg, "attn_only", False):
        return 0
    d_mlp = getattr(cfg, "d_mlp", None)
    if not isinstance(d_mlp, int) or d_mlp <= 0:
        return None
    return d_mlp * (getattr(cfg, "experts_per_token", None) or 1) if getattr(cfg, "num_experts", None) else d_mlp


def _execution_device(module: torch.nn.Module) -> torch.device:
    """Where accelerate runs ``module`` (its hook's execution device), else where its weights are."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is None:
        return next(module.parameters()).device
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
