"""headprobe's own transformer: one readable decoder-only model with TransformerLens hook points.

The model is written by concern, one module each beside this one, in forward order: ``config``
(:class:`~headprobe.probe.model.config.TransformerConfig`, its options and their checks),
``positions`` (the embedding, rotary positions), ``norms``, ``masks`` (which keys a query reads),
``cache`` (the KV caches), ``attention`` (the shared base with the eager and the fused path; MHA,
GQA, MQA), ``latent_attention`` (MLA), ``linear_attention`` (a hybrid's Gated-DeltaNet layers) and
``feedforward`` (the MLP, the mixture of experts). This module puts them together: :func:`make_attention`, :class:`Block`,
:class:`Transformer`, :func:`init_weights` and :func:`generate`.

The architecture options load these families exactly (see :mod:`headprobe.probe.model.convert`):
GPT-2 (learned positions, LayerNorm, GELU with the tanh approximation, biases, tied
unembedding; Radford et al. 2019), Llama / SmolLM2 (rotary positions with Hugging Face's
``rotate_half`` convention, RMSNorm, SwiGLU, no biases, GQA; Touvron et al. 2023), Mistral,
Qwen2, Qwen3, OLMo-2, Gemma-2, GPT-NeoX / Pythia and dense DeepSeek-V3 (MLA), through the
options of :class:`~headprobe.probe.model.config.TransformerConfig` (sliding windows, soft-capping, QK-norm, post norms,
parallel blocks, partial rotary, ...). ``mlp=None`` gives attention-only models. The same
model read as an encoder (``causal=False``, ``post_ln``, ``embed_norm``) loads BERT (Devlin et
al. 2019; e.g. sentence-transformers' all-MiniLM-L6-v2).

Every hook point is named as TransformerLens names it and declared with its shape where it is
created. The parts' names are imported from their own modules.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Literal, cast

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor, nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout.attention import KVPolicy
from headprobe.probe.model.attention import (
    Attention,
    SelfAttention,
)
from headprobe.probe.model.cache import KVCache, StreamingKVCache
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.feedforward import make_mlp
from headprobe.probe.model.latent_attention import LatentAttention
from headprobe.probe.model.linear_attention import LinearAttention
from headprobe.probe.model.norms import Norm, PostNorm
from headprobe.probe.model.positions import Embedding, Rotary, padding_and_positions


def make_attention(cfg: TransformerConfig, layer: int = 0) -> SelfAttention:
    """Layer ``layer``'s attention: :class:`LatentAttention` for an MLA config, else :class:`Attention`."""
    return LatentAttention(cfg, layer) if cfg.is_mla else Attention(cfg, layer)


class Block(nn.Module):
    """Residual block. Sequential (default): ``resid_mid = resid_pre + attn_out``,
    ``resid_post = resid_mid + mlp_out``; parallel (``parallel_residual``): ``resid_post =
    resid_pre + attn_out + mlp_out`` with the MLP reading ``resid_pre`` (no ``resid_mid``).
    Here ``attn_out = ln1_post(attn(ln1(resid_pre)))`` and ``mlp_out = ln2_post(mlp(ln2(.)))``,
    each norm present only where the config has it (``pre_norm``: ``ln1``/``ln2``,
    ``post_norm``: ``ln1_post``/``ln2_post``); no MLP in attention-only models.

    ``hook_attn_out`` and ``hook_mlp_out`` hold what is added to the residual stream (after
    the post norms, as TransformerLens). :meth:`resume` is everything after the attention.
    """

    def __init__(self, cfg: TransformerConfig, layer: int = 0):
        super().__init__()
        has_mlp = cfg.mlp is not None
        self.post_ln = cfg.post_ln  # BERT: ln1/ln2 normalise the residual after each addition
        self.ln1 = Norm(cfg) if cfg.pre_norm or cfg.post_ln else None
        # a linear layer's mixer stands where the heads are; code over heads visits cfg.attention_layers only
        self.attn = (
            cast("SelfAttention", LinearAttention(cfg, layer)) if cfg.is_linear(layer) else make_attention(cfg, layer)
        )
        self.ln1_post = PostNorm(cfg) if cfg.post_norm else None
        self.ln2 = Norm(cfg) if (has_mlp and cfg.pre_norm) or cfg.post_ln else None
        self.mlp = make_mlp(cfg, layer)
        self.ln2_post = PostNorm(cfg) if has_mlp and cfg.post_norm else None
        self.parallel = cfg.parallel_residual
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_mid = None if self.parallel else HookPoint()  # [batch, pos, d_model]
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]
        # post_ln only: ln2(resid_post), what the block passes on
        self.hook_normalized_resid_post = HookPoint() if self.post_ln else None  # [batch, pos, d_model]

    def forward(
        self,
        resid: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "batch pos"],
        padding: Bool[Tensor, "batch pos"] | None = None,
        head_mask: Tensor | None = None,
        cache: KVCache | StreamingKVCache | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """``resid_post`` from ``resid_pre``; the other arguments as :meth:`~headprobe.probe.model.attention.SelfAttention.forward`'s."""
        resid = self.hook_resid_pre(resid)
        x = resid if self.ln1 is None or self.post_ln else self.ln1(resid)
        return self.resume(resid, self.attn(x, positions, padding, head_mask, cache))

    def resume(
        self, resid_pre: Float[Tensor, "batch pos d_model"], attn_out: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos d_model"]:
        """The rest of the block from its attention's raw output ``attn_out`` (``sum_h z_h W_O^(h)
        + b_O``, before any post norm): ``resid_post``. ``forward`` is ``resume(resid_pre,
        attn(ln1(resid_pre)))``; an ablation that changes one head adds ``(r_h - z_h) W_O^(h)``
        to ``attn_out`` and resumes here, so post norms and parallel MLPs are applied as in the
        forward pass (:func:`headprobe.analyses.ablation.exact_sweep`).

        Post-LN blocks (``post_ln``, BERT): ``resid_mid = resid_pre + attn_out``, ``x =
        ln1(resid_mid)``, ``resid_post = x + mlp(x)``, and the block returns ``ln2(resid_post)``."""
        if self.post_ln:
            # post_ln: not parallel, both norms (TransformerConfig.__post_init__)
            assert self.hook_resid_mid is not None and self.ln1 is not None and self.ln2 is not None
            assert self.hook_normalized_resid_post is not None
            resid = self.hook_resid_mid(resid_pre + self.hook_attn_out(attn_out))
            x = self.ln1(resid)
            resid_post = self.hook_resid_post(x + self.hook_mlp_out(self.mlp(x)) if self.mlp is not None else x)
            return self.hook_normalized_resid_post(self.ln2(resid_post))
        if self.ln1_post is not None:
            attn_out = self.ln1_post(attn_out)
        attn_out = self.hook_attn_out(attn_out)
        if self.parallel:
            mlp_out = self.hook_mlp_out(self._mlp(resid_pre)) if self.mlp is not None else 0
            return self.hook_resid_post(mlp_out + attn_out + resid_pre)  # Hugging Face's GPT-NeoX order
        assert self.hook_resid_mid is not None  # not parallel
        resid = self.hook_resid_mid(resid_pre + attn_out)
        if self.mlp is not None:
            resid = resid + self.hook_mlp_out(self._mlp(resid))
        return self.hook_resid_post(resid)

    def _mlp(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        assert self.mlp is not None  # called only with an MLP
        out = self.mlp(resid if self.ln2 is None else self.ln2(resid))
        return out if self.ln2_post is None else self.ln2_post(out)


class Transformer(HookedRootModule):
    """Decoder-only transformer with TransformerLens hook points (``run_with_hooks``,
    ``run_with_cache``, ``hooks(...)`` all work).

    Hook names: ``hook_embed``, ``hook_pos_embed``, ``blocks.{l}.hook_resid_pre``,
    ``blocks.{l}.ln1.hook_normalized``, ``blocks.{l}.attn.hook_{q,k,v,rot_q,rot_k,attn_scores,
    pattern,z,result}``, ``blocks.{l}.hook_attn_out``, ``blocks.{l}.hook_resid_mid``,
    ``blocks.{l}.mlp.hook_{pre,pre_linear,post}``, ``blocks.{l}.hook_mlp_out``,
    ``blocks.{l}.hook_resid_post``, ``ln_final.hook_normalized`` (an MLA layer has no
    ``hook_rot_q``/``hook_rot_k``: its ``hook_q``/``hook_k`` are after rotary; a layer without
    positions, a NoPE entry of ``rope_thetas``, never calls them); with ``post_norm`` also
    ``blocks.{l}.ln1_post.hook_{in,out}`` and ``blocks.{l}.ln2_post.hook_{in,out}``; parallel
    blocks have no ``hook_resid_mid``, blocks without ``pre_norm`` no ``ln1``/``ln2``. An
    encoder (BERT) adds ``ln_embed.hook_normalized`` and, per post-LN block,
    ``blocks.{l}.hook_normalized_resid_post``, where ``ln1``/``ln2`` follow the residual sums.
    """

    kept_heads: list[list[int]]  # a pruned copy's query heads per layer (set by headprobe.probe.model.pruned)

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.ln_embed = Norm(cfg) if cfg.embed_norm else None
        # nn.ModuleList is typed as holding nn.Module; these are Blocks
        self.blocks = cast("Sequence[Block]", nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers)))
        self.ln_final = Norm(cfg) if cfg.final_norm else None
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        if cfg.tied_unembed:
            self.unembed.weight = self.embed.W_E.weight
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.hook_pos_embed = HookPoint()  # [batch, pos, d_model] (learned positions only)
        self.setup()

    @classmethod
    def from_state_dict(cls, cfg: TransformerConfig, state: dict[str, Tensor]) -> Transformer:
        """A model of ``cfg`` holding ``state``'s tensors themselves (``load_state_dict(...,
        assign=True)``, no copy): built on the meta device, so no weight is initialised only to
        be overwritten (for SmolLM2-135M that saved ~2 s of a load); the only buffers, the rotary
        frequencies, are computed afterwards. The caller must not keep using ``state`` for
        something else (clone it first if so). In eval mode.

        Raises:
            RuntimeError: ``state`` misses a parameter of ``cfg``'s model or has one it lacks.
        """
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(state, strict=True, assign=True)
        if cfg.tied_unembed:  # assigning replaced the shared parameter by two: one again, as __init__ ties it
            model.unembed.weight = model.embed.W_E.weight
        for module in model.modules():
            if isinstance(module, Rotary):
                module.inv_freq = module.frequencies()
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:  # a module grew a tensor that neither the state dict nor the code above fills
            raise RuntimeError(f"from_state_dict left {left[0]} uninitialised")
        return model.eval()

    @property
    def force_eager(self) -> bool:
        """Whether every layer takes the eager attention path even without pattern hooks."""
        return all(b.attn.force_eager for b in self.blocks)

    @force_eager.setter
    def force_eager(self, value: bool) -> None:
        for b in self.blocks:
            b.attn.force_eager = bool(value)

    @property
    def n_kv_groups(self) -> int:
        """KV groups per layer, the units a :class:`~headprobe.probe.layout.attention.KVPolicy` addresses:
        ``n_kv_heads``, or 1 for MLA (the latent is shared by every head of the layer)."""
        assert self.cfg.n_kv_heads is not None  # filled by TransformerConfig.__post_init__
        return 1 if self.cfg.is_mla else self.cfg.n_kv_heads

    def check_kv_policy(self, policy: KVPolicy) -> None:
        """Raise HeadprobeError unless ``policy`` fits: ``n_layers`` x :attr:`n_kv_groups`, and no
        chunked attention. On a sliding-window layer a streaming group reads what both its layer's
        window and the policy allow (:func:`~headprobe.probe.model.masks.streaming_key_mask`)."""
        policy.check_layout(self.cfg.n_layers, self.n_kv_groups, "the model")
        if self.cfg.attention_chunk is not None:
            raise HeadprobeError("KV policies are not implemented for chunked attention (attention_chunk)")

    def streaming_cache(self, policy: KVPolicy) -> StreamingKVCache:
        """An empty :class:`~headprobe.probe.model.cache.StreamingKVCache` for ``policy`` on this model (its sliding windows included).

        Raises:
            HeadprobeError: see :meth:`check_kv_policy`.
        """
        self.check_kv_policy(policy)
        return StreamingKVCache(policy, windows=self.cfg.layout.windows)

    @contextlib.contextmanager
    def kv_policy(self, policy: KVPolicy | None) -> Iterator[Transformer]:
        """Within the block, each KV group's query heads read only the keys ``policy`` leaves them
        (:func:`~headprobe.probe.model.masks.streaming_key_mask`: a streaming group's first ``sink`` and last ``window``
        positions); exact attention, not an estimate. None: no change. Restored in ``finally``.

        Raises:
            HeadprobeError: see :meth:`check_kv_policy`.
        """
        if policy is not None:
            self.check_kv_policy(policy)
        before = [b.attn.streaming for b in self.blocks]
        try:
            for layer, b in enumerate(self.blocks):
                row = None if policy is None else policy.groups[layer]
                b.attn.streaming = None if row is None or all(g is None for g in row) else row
            yield self
        finally:
            for b, row in zip(self.blocks, before):
                b.attn.streaming = row

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        head_mask: Float[Tensor, ...] | None = None,
        attention_mask: Shaped[Tensor, "batch pos"] | None = None,
        return_type: Literal["logits", "resid"] = "logits",
        cache: KVCache | StreamingKVCache | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits ``[batch, pos, d_vocab]`` (or the final residual, ``return_type="resid"``).

        Args:
            tokens: token ids ``[batch, pos]`` (a 1-D tensor is treated as one sequence).
            head_mask: factors ``xi[layer, head]`` (or ``[batch, layer, head]``) multiplying each
                head's ``z``; 0 removes a head's output contribution (zero ablation), 1 keeps it.
                Differentiable, for gradient importance ``|dL/dxi|`` (Michel et al. 2019).
            attention_mask: 1 for real tokens, 0 for padding (any side). Positions count real
                tokens only, so a left-padded sequence gets the same positions as unpadded.
            cache: a :class:`~headprobe.probe.model.cache.KVCache` holding the keys and values of the tokens before
                ``tokens`` (empty for the first call); this call's are appended, and ``tokens``
                get positions after the cached ones. Not combined with ``attention_mask``.

        Raises:
            HeadprobeError: ``head_mask`` has the wrong shape, or the sequence is longer than
                ``n_ctx`` with learned positions.
        """
        cfg = self.cfg
        if tokens.dim() == 1:
            tokens = tokens[None]
        B, T = tokens.shape
        if cfg.positional == "learned" and T > cfg.n_ctx:
            raise HeadprobeError(f"sequence of {T} tokens is longer than the model's n_ctx={cfg.n_ctx}")
        if (
            head_mask is not None
            and tuple(head_mask.shape[-2:]) != (cfg.n_layers, cfg.n_heads)
            or (head_mask is not None and head_mask.dim() == 3 and head_mask.shape[0] != B)
        ):
            raise HeadprobeError(
                f"head_mask has shape {tuple(head_mask.shape)}; expected [{cfg.n_layers}, {cfg.n_heads}] "
                f"or [{B}, {cfg.n_layers}, {cfg.n_heads}]"
            )

        past = 0 if cache is None else cache.n_tokens
        if cache is not None and not cfg.causal:
            raise HeadprobeError("a KV cache needs causal attention; this model is bidirectional (an encoder)")
        if cache is not None and attention_mask is not None:
            raise HeadprobeError("a KV cache cannot be combined with attention_mask (padding)")
        if cfg.positional == "learned" and past + T > cfg.n_ctx:
            raise HeadprobeError(f"{past + T} tokens with the cache are longer than the model's n_ctx={cfg.n_ctx}")
        # each layer's attention masks the padding keys (key_mask)
        padding, positions = padding_and_positions(B, T, tokens.device, attention_mask, past)

        tok_embed, pos_embed = self.embed(tokens, positions)
        resid = self.hook_embed(tok_embed)
        if pos_embed is not None:
            resid = resid + self.hook_pos_embed(pos_embed)
        if self.ln_embed is not None:
            resid = self.ln_embed(resid)
        for layer, block in enumerate(self.blocks):
            mask_l = None if head_mask is None else head_mask[..., layer, :]
            resid = block(resid, positions, padding, mask_l, cache)
        if self.ln_final is not None:
            resid = self.ln_final(resid)
        if return_type == "resid":
            return resid
        return self.logits(resid, normed=True)

    def logits(
        self,
        resid: Float[Tensor, "... d_model"],
        normed: bool = False,
        vocab: Int[Tensor, "... k"] | None = None,
        out: Tensor | None = None,
        softcap: bool = True,
    ) -> Float[Tensor, "... d_vocab"] | Float[Tensor, "... k"]:
        """Logits from a final residual stream: ``ln_final`` (unless ``normed``), the unembedding
        (``@ W_U + b_U``), ``logit_scale`` (Cohere, Granite) and ``final_softcap`` (``c * tanh(logits / c)``,
        Gemma-2) where the config has them. The one place the native model turns a residual into logits: the forward
        pass, the losses of the exact sweep and patching's logit difference all end here.

        Args:
            resid: ``[..., d_model]``.
            normed: ``resid`` has been through ``ln_final`` already.
            vocab: token ids ``[..., k]`` (the leading axes as ``resid``'s): only those logits,
                ``[..., k]``, without the ``[..., d_vocab]`` product.
            out: a ``[n, d_vocab]`` buffer of ``resid``'s dtype for a 2-D ``resid`` ``[n, d_model]``
                (``vocab`` None): the logits are written into it and it is returned.
            softcap: False leaves ``final_softcap`` out (the logit before the cap).
        """
        if not normed and self.ln_final is not None:
            resid = self.ln_final(resid)
        W, b = self.unembed.weight, self.unembed.bias  # [d_vocab, d_model], [d_vocab] | None
        if vocab is not None:
            logits = torch.einsum("...d,...kd->...k", resid, W[vocab])
            if b is not None:
                logits = logits + b[vocab]
        elif out is not None:
            logits = torch.mm(resid, W.T, out=out)
            if b is not None:
                logits += b
        else:
            logits = self.unembed(resid)
        if self.cfg.logit_scale is not None:  # Cohere; Granite's 1 / logits_scaling
            logits = (
                logits.mul_(self.cfg.logit_scale)
                if out is not None and vocab is None
                else logits * self.cfg.logit_scale
            )
        cap = self.cfg.final_softcap
        if cap is None or not softcap:
            return logits
        if out is not None and vocab is None:
            return logits.div_(cap).tanh_().mul_(cap)
        return torch.tanh(logits / cap) * cap


def init_weights(model: Transformer, std: float = 0.02) -> Transformer:
    """GPT-2's initialisation for training from scratch (Radford et al. 2019): every linear and
    embedding weight ``N(0, std)``, output projections of the residual branches (``o_proj``,
    ``fc_out``) ``N(0, std / sqrt(2 n_layers))``, biases 0, norms 1. In place; returns ``model``.

    (PyTorch's default ``N(0, 1)`` embedding, tied to the unembedding, starts with logits of
    standard deviation ``sqrt(d_model)`` and a loss far above chance.)
    """
    resid_std = std / math.sqrt(2 * model.cfg.n_layers)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                last = name.rsplit(".", 1)[-1]
                module.weight.normal_(0.0, resid_std if last in ("o_proj", "fc_out") else std)
                bias = getattr(module, "bias", None)  # nn.Embedding has none
                if bias is not None:
                    bias.zero_()
    return model


@torch.inference_mode()
def generate(
    model: Transformer,
    tokens: Int[Tensor, "batch pos"],
    n_new: int,
    use_cache: bool = True,
    policy: KVPolicy | None = None,
) -> tuple[Int[Tensor, "batch pos_plus_new"], KVCache | StreamingKVCache | None]:
    """Greedy decoding of ``n_new`` tokens after ``tokens``.

    With ``use_cache`` the prompt runs once and each new token runs alone against a
    :class:`~headprobe.probe.model.cache.KVCache` (MHA, GQA and MQA cache ``n_kv_heads`` keys and values per layer), or with
    ``policy`` a :class:`~headprobe.probe.model.cache.StreamingKVCache` (each KV group keeps what the policy leaves it); without
    it the whole sequence is recomputed every step (the reference the cache must equal), under
    :meth:`Transformer.kv_policy` when ``policy`` is given.

    Returns:
        (tokens with the ``n_new`` generated ones appended, the cache or None).

    Raises:
        HeadprobeError: a policy that does not fit the model (:meth:`Transformer.check_kv_policy`).
    """
    if policy is not None:
        model.check_kv_policy(policy)
    cache = (KVCache() if policy is None else model.streaming_cache(policy)) if use_cache else None
    out = tokens
    step_in = tokens
    with model.kv_policy(None if use_cache else policy):
        for _ in range(n_new):
            logits = model(step_in, cache=cache) if use_cache else model(out)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            step_in = nxt
    return out, cache
