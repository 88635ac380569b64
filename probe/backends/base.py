"""The one model interface analyses and commands program against, and what every backend shares.

:class:`LoadedModel` is that interface. It is a base class, not a ``typing.Protocol``: about half
of its members (tokenizing, the norms read off the modules, hook bookkeeping, casting, the
self-check) are the same code on every backend, so a Protocol would have to be re-declared by a
base class anyway, and the two drifted apart (a 25-member Protocol beside a base re-declaring
24 of them, with members used that neither declared). Here every member an analysis or a
command uses is declared once, on :class:`LoadedModel` or a mixin it inherits: implemented where
the backends share it, and with a documented body that raises where each backend implements it
(``forward``, ``W_O``, ``scored_losses``, ...). ``tests/test_architecture.py`` checks that no function in ``analyses/``
or ``headprobe/`` takes an unannotated or ``Any`` model, and that analyses never reach into a
backend's modules.

The backends are :class:`headprobe.probe.backends.native.NativeModel` (headprobe's own
:class:`~headprobe.probe.model.transformer.Transformer`) and :class:`headprobe.probe.backends.bridge.BridgeModel`
(TransformerLens' ``TransformerBridge``), registered once, by name, in
:data:`headprobe.probe.core.vocabulary.BACKEND_REGISTRY` (lazy targets): ``--backend`` lists it,
:func:`headprobe.probe.backends.wrapping.wrap` builds from it, and ``LoadedModel(module, tokenizer, spec)``
picks the registered class whose :meth:`LoadedModel.wraps` accepts ``module``.

This module holds the interface itself: the construction, the capability flags, the per-layer
templates that check a layer once (:meth:`LoadedModel.layer_index`) before calling a backend's ``_`` hook,
and the members each backend implements. What every backend shares is in the modules beside it, which
:class:`LoadedModel` inherits or this module re-exports: :mod:`~headprobe.probe.backends.wrapped`
(:class:`~headprobe.probe.backends.wrapped.WrappedModule`: devices, dtype, fingerprint, the norms and
biases read off the blocks; :class:`NormWeights`), :mod:`~headprobe.probe.backends.tokens`
(:class:`~headprobe.probe.backends.tokens.Tokenizing`) and :mod:`~headprobe.probe.backends.losses` (the
losses, :func:`token_losses`, :func:`scored_loss`, :func:`cross_entropy_inplace`: cross-entropies in
nats, the unit of every loss headprobe reports; :func:`chunked_token_losses`, which unembeds through
the model, is here).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

# re-exported: the losses were defined here, and `from headprobe.probe.backends.base import scored_loss` stays
from headprobe.probe.backends.losses import LOSS_ROWS as LOSS_ROWS
from headprobe.probe.backends.losses import cross_entropy_inplace as cross_entropy_inplace
from headprobe.probe.backends.losses import scored_loss as scored_loss
from headprobe.probe.backends.losses import token_losses as token_losses
from headprobe.probe.backends.tokens import Tokenizing
from headprobe.probe.backends.wrapped import NormWeights as NormWeights  # re-exported: norm_weights' result
from headprobe.probe.backends.wrapped import WrappedModule
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.vocabulary import CAPABILITIES as CAPABILITIES  # re-exported: the flags of LoadedModel
from headprobe.probe.core.vocabulary import lacks_line
from headprobe.probe.hooks.selfcheck import SelfCheck
from headprobe.probe.layout.spec import Checkpoint, ModelSpec

if TYPE_CHECKING:
    from headprobe.probe.layout.attention import KVPolicy
    from headprobe.probe.model.transformer import Transformer

HookFn = Callable[..., Any]
"""A TransformerLens hook: ``fn(activation, hook) -> replacement or None``."""


HYBRID_LACKS: tuple[str, ...] = ("streams_statistics", "kv_policies", "path_patching", "removes_heads")
"""The capabilities a hybrid model (linear-attention layers without heads, ``AttentionLayout.head_layers``)
lacks on every backend: they address every layer's heads (set False on the instance)."""


@torch.inference_mode()
def chunked_token_losses(
    model: LoadedModel,
    resid: Float[Tensor, "batch pos d_model"],
    tokens: Int[Tensor, "batch pos"],
    first: int = 0,
    rows: int = LOSS_ROWS,
) -> Float[Tensor, "batch n"]:
    """:func:`token_losses` from the final residual stream (after the final norm, as
    :meth:`LoadedModel.final_residual` returns it) for the predictions from index ``first`` on
    (``n = pos - 1 - first``), unembedding at most ``rows`` positions at a time through
    :meth:`LoadedModel.logits_from_residual` (the one unembedding), so no ``[pos, d_vocab]``
    tensor of a whole sequence exists. Cross-entropy in nats (float32), the same numbers as
    ``token_losses(logits, tokens)[:, first:]`` to float32 rounding (tested).

    Raises:
        ValueError: ``first`` outside ``[0, pos - 1)`` or ``rows`` < 1.
    """
    B, T = tokens.shape
    if not 0 <= first < T - 1 or rows < 1:
        raise ValueError(f"first must be in [0, {T - 1}) and rows >= 1, got first={first}, rows={rows}")
    step = max(1, rows // B)
    out = []
    for c0 in range(first, T - 1, step):
        c1 = min(c0 + step, T - 1)
        logits = model.logits_from_residual(resid[:, c0:c1], normed=True).float().flatten(0, 1)
        target = tokens[:, c0 + 1 : c1 + 1].flatten().to(logits.device)
        out.append(cross_entropy_inplace(logits, target).view(B, c1 - c0))
        del logits
    return torch.cat(out, dim=1)


class LoadedModel(Tokenizing, WrappedModule):
    """A pretrained model behind TransformerLens hook points, with its tokenizer and layout: the
    whole surface a head analysis or a command may use (with what it inherits: tokenizing from
    :class:`~headprobe.probe.backends.tokens.Tokenizing`, devices, dtype and what is read off the
    module's blocks from :class:`~headprobe.probe.backends.wrapped.WrappedModule`).

    Hook names are TransformerLens': ``blocks.{l}.hook_resid_pre`` ``[batch, pos, d_model]``,
    ``blocks.{l}.attn.hook_attn_scores`` ``[batch, head, q_pos, k_pos]`` (scaled and, where the
    family caps them, soft-capped scores before the softmax; every masked key, future, outside a
    sliding window or padding, is ``-inf`` on every backend, TransformerLens' ``HookedTransformer``
    convention), ``blocks.{l}.attn.hook_pattern`` ``[batch, head, q_pos, k_pos]``,
    ``blocks.{l}.attn.hook_z`` ``[batch, pos, head, d_head]``, ``blocks.{l}.hook_attn_out``
    ``[batch, pos, d_model]``, ..., so the same analysis code serves every backend. Losses are in
    nats per token.

    ``LoadedModel(module, tokenizer, spec)`` returns the registered backend class that wraps
    ``module`` (:data:`~headprobe.probe.core.vocabulary.BACKEND_REGISTRY`, :meth:`wraps`). ``model``
    is the wrapped module: for the probe floor and tests, not for analyses.

    Attributes:
        spec: the layout and provenance (:class:`~headprobe.probe.layout.spec.ModelSpec`).
        tokenizer: the Hugging Face tokenizer.
        prepend_bos: inputs start with BOS (``[CLS]`` for an encoder); False where the tokenizer has none.
        trained_periods: ``(min_period, max_period, eval_period)`` of a model ``headprobe train``
            made (its repeated-block periods, tokens), else None.

    Raises:
        TypeError: no registered backend wraps ``module``.
    """

    name: ClassVar[str] = ""
    """The backend's name (``--backend``; its key in :data:`~headprobe.probe.core.vocabulary.BACKEND_REGISTRY`)."""
    supports_padding: ClassVar[bool] = False
    """Whether :meth:`forward` takes an ``attention_mask``."""
    # Capabilities (:data:`CAPABILITIES`): what a feature asks of a backend, never its name.
    streams_statistics: ClassVar[bool] = False
    """Scores and captures a layer at a time with online-softmax statistics, no pattern (:meth:`online_stats_geometry`)."""
    kv_policies: ClassVar[bool] = False
    """Runs head-level KV-cache policies (:meth:`kv_policy`, :attr:`kv_layout`, :meth:`streaming_cache_bytes`; ``headprobe kv``)."""
    path_patching: ClassVar[bool] = False
    """Resumes a forward at a layer and rebuilds a head's input (:meth:`forward_from`, :meth:`attention_input`; path patching)."""
    half_precision: ClassVar[bool] = False
    """Self-checks a half-precision model in float32 before casting it back, attention scores and softmax in float32 (float16 safe)."""
    native_weights: ClassVar[bool] = False
    """Loads headprobe's own weights: a headprobe checkpoint directory, the weights cache's native entries."""
    splits_after_load: ClassVar[bool] = False
    """Is split over devices after the load, the self-check and any cast (:meth:`dispatch`); else transformers splits it as it loads."""
    removes_heads: ClassVar[bool] = False
    """Removes heads from its weights (:meth:`check_prunable`, :meth:`remove_heads`; ``prune --save-pruned``)."""
    padding_sides: ClassVar[tuple[str, ...]] = ()
    """The padding sides :meth:`forward` computes exactly at the real tokens (``left``, ``right``)."""
    residual_with_logits: ClassVar[bool] = False
    """Whether :meth:`final_residual` computes the logits at every position too (a whole forward);
    memory plans count them."""
    spec: ModelSpec
    tokenizer: Any
    prepend_bos: bool
    trained_periods: tuple[int, int, int] | None

    @classmethod
    def wraps(cls, module: object) -> bool:
        """Whether this backend class wraps ``module`` (what ``LoadedModel(module, ...)`` dispatches on)."""
        return False

    @classmethod
    def supports(cls, hf_config: Any) -> bool:
        """Whether this backend runs the architecture of ``hf_config`` (a Hugging Face config):
        ``--backend auto`` takes the first registered backend that does."""
        return False

    @classmethod
    def from_checkpoint(
        cls, ckpt: Checkpoint, device: str | torch.device = "cpu", prepend_bos: bool = True, copy: bool = True
    ) -> LoadedModel:
        """Wrap a loaded Hugging Face checkpoint (:func:`headprobe.probe.backends.wrapping.wrap`, which has the
        arguments' meaning).

        Raises:
            HeadprobeError: this backend cannot run the checkpoint's architecture.
        """
        raise NotImplementedError

    def __new__(cls, *args: Any, **kwargs: Any) -> LoadedModel:
        if cls is LoadedModel:
            from headprobe.probe.core.vocabulary import BACKEND_REGISTRY

            module = args[0] if args else kwargs.get("model")
            for name in BACKEND_REGISTRY.names():
                if BACKEND_REGISTRY.get(name).wraps(module):
                    cls = BACKEND_REGISTRY.get(name)
                    break
            else:
                raise TypeError(f"no headprobe backend wraps a {type(module).__name__}")
        return super().__new__(cls)

    def __init__(self, model: Any, tokenizer: Any, spec: ModelSpec, prepend_bos: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        # spec.backend names the class that runs it, a registered backend built on another's converter too
        self.spec = dataclasses.replace(spec, backend=self.name) if self.name and spec.backend != self.name else spec
        self.prepend_bos = prepend_bos and self.bos_token_id is not None
        self._self_check: SelfCheck | None = None
        self._post_norm_weights: dict[int, Tensor] = {}
        self._main_device: torch.device | None = None  # set by dispatch: a model split over devices
        self._offload_dir: Any = None  # the temporary offload folder of a dispatched model, kept alive with it
        self.trained_periods = None
        if spec.layout.head_layers is not None:  # a hybrid: these flags are off for this model, whatever the backend
            for capability in HYBRID_LACKS:
                setattr(self, capability, False)

    def __repr__(self) -> str:
        """One line: ``NativeModel(name='smollm2-135m', backend='native', layers=30, heads=9,
        layout='GQA, 3 kv heads', device='cpu', dtype='float32')`` (``layers``: all of them, ``heads``:
        query heads per layer; ``layout``: MHA, MQA, MLA, or GQA with its key/value heads; ``(split)``
        after the device where :meth:`dispatch` split the model)."""
        spec = self.spec
        layout = spec.kind if spec.kind != "GQA" else f"{spec.kind}, {spec.layout.n_kv_heads} kv heads"
        device = f"{self.device}" + (" (split)" if self._main_device is not None else "")
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{type(self).__name__}(name={spec.name!r}, backend={self.backend!r}, layers={spec.n_layers}, "
            f"heads={spec.n_heads}, layout={layout!r}, device={device!r}, dtype={dtype!r})"
        )

    def lacks(self, capability: str, what: str) -> HeadprobeError:
        """The one-line refusal of ``what`` (a sentence naming the feature) on this model, which
        lacks ``capability`` (one of :data:`CAPABILITIES`): the flag and the backend named, or the
        hybrid's linear-attention layers where those are why (:data:`HYBRID_LACKS`)."""
        head_layers = self.spec.layout.head_layers
        if head_layers is not None and capability in HYBRID_LACKS:
            linear = [l for l in range(self.spec.n_layers) if l not in head_layers]
            return HeadprobeError(f"{what} (a hybrid model, linear-attention layers {linear}, lacks {capability})")
        return HeadprobeError(lacks_line(what, self.name, capability))

    def require(self, capability: str, what: str) -> None:
        """Raise :meth:`lacks` unless this model has ``capability``.

        Raises:
            HeadprobeError: the flag is off.
        """
        if not getattr(self, capability):
            raise self.lacks(capability, what)

    # ---- what every backend shares (with the devices, tokenizing and block readouts it inherits) --

    @property
    def backend(self) -> str:
        """``native`` (headprobe's own transformer) or ``transformer-lens`` (TransformerBridge)."""
        return self.name

    @property
    def architecture(self) -> str:
        """The Hugging Face architecture behind the model (``LlamaForCausalLM``, on the bridge), or
        ``headprobe Transformer`` (the native backend, whose module is headprobe's own)."""
        return "headprobe Transformer"

    @property
    def hf_config(self) -> Any | None:
        """The Hugging Face config of the wrapped model (the bridge's), or None (native)."""
        return None

    @property
    def parallel_attn_mlp(self) -> bool | None:
        """Whether each block's MLP reads the block's input residual, not the residual after its own
        attention (``resid_post = resid_pre + attn_out + mlp_out``: GPT-NeoX, GPT-J, Phi-1/2,
        Cohere; TransformerLens' ``parallel_attn_mlp``), so that no edge runs from a layer's heads
        to its MLP; None where the backend does not know."""
        return None

    @property
    def has_post_attention_norm(self) -> bool:
        """Whether the blocks normalise the attention output before adding it to the residual
        stream (OLMo-2, Gemma-2/3); see :func:`headprobe.probe.hooks.capture.capture_heads`."""
        return self.post_attention_norm_hooks(0) is not None

    def post_attention_norm_hooks(self, layer: int) -> tuple[str, str] | None:
        """(input, output) hook names of layer ``layer``'s post-attention norm, or None.

        Raises:
            HeadprobeError: ``layer`` out of range (:meth:`layer_index`), as every method taking a layer.
        """
        return self._post_attention_norm_hooks(self.layer_index(layer))

    def attn_out_hook(self, layer: int) -> str:
        """The hook holding layer ``layer``'s raw attention output ``sum_h z_h W_O^(h) + b_O``
        ``[batch, pos, d_model]``: the post-attention norm's input where there is one, else
        ``blocks.{layer}.hook_attn_out``. Replacing it changes what the rest of the block sees.

        Raises:
            HeadprobeError: ``layer`` out of range (:meth:`layer_index`).
        """
        return self._attn_out_hook(self.layer_index(layer))

    @torch.inference_mode()
    def post_attention_norm_weight(self, layer: int) -> Float[Tensor, " d_model"]:
        """The elementwise weight ``w`` of layer ``layer``'s post-attention RMS-type norm, read off
        the norm itself: ``norm(c * 1) = w * c / sqrt(c^2 + eps) = w`` to float rounding for
        ``c = 1e3`` (so Gemma's ``1 + w`` convention needs no special case).

        Raises:
            HeadprobeError: ``layer`` out of range (:meth:`layer_index`).
        """
        return self._post_attention_norm_weight(self.layer_index(layer))

    @property
    def self_check(self) -> SelfCheck:
        """The load-time :class:`~headprobe.probe.hooks.selfcheck.SelfCheck` (run on first access;
        :func:`~headprobe.probe.backends.loading.load_model` runs it at load)."""
        if self._self_check is None:
            from headprobe.probe.hooks.selfcheck import run_self_check

            self._self_check = run_self_check(self)
        return self._self_check

    @property
    def logit_entry_bytes(self) -> int:
        """Bytes per (position, vocabulary entry) a forward's returned logits hold at their peak, as
        memory plans of a forward without a loss count them: here float32 logits and one more copy
        (8; this backend's own code makes them). The native backend counts its own
        (:meth:`headprobe.probe.backends.native.NativeModel.logit_entry_bytes`)."""
        return 8

    def dispatch(
        self,
        device_map: str | dict[str, int | str],
        max_memory: dict[int | str, int | str] | None = None,
        offload_dir: str | None = None,
    ) -> LoadedModel:
        """Split the model over GPUs, CPU memory and disk with accelerate; returns ``self``
        (see :mod:`headprobe.probe.backends.devicemap`). Run it after the self-check and any cast
        (:meth:`to`): a split model's dtype is fixed.

        Raises:
            HeadprobeError: a backend that cannot be split, a model split already, or as
                :func:`headprobe.probe.backends.devicemap.dispatch`.
        """
        raise self.lacks(
            "splits_after_load",
            f"the {self.name} backend is split only as transformers loads it, in float32 "
            f"(load_model(device_map=...), no --dtype): --dtype with --device-map needs --backend native",
        )

    def to(self, dtype: torch.dtype) -> LoadedModel:
        """Cast the weights to ``dtype`` in place; returns ``self``.

        Rotary frequencies (buffers named ``inv_freq``, ``original_inv_freq``) stay float32: cast to bfloat16 they keep
        3 significant digits and angles at long positions are off by radians (Hugging Face keeps
        them float32 when it loads a model in half precision). The load-time self-check, if not
        run yet, runs first, in the dtype the model had (float32 for every loader), so that half
        precision rounding is never mistaken for a broken decomposition
        (:mod:`headprobe.probe.hooks.selfcheck`).

        Raises:
            HeadprobeError: the model is split over devices (``--device-map``) and ``dtype`` is not
                the dtype it was split in.
        """
        if self._main_device is not None and dtype != self.dtype:
            raise HeadprobeError(
                "a model split over devices (--device-map) keeps the dtype it was split in: cast it before dispatch"
            )
        if self._self_check is None and self.dtype == torch.float32 and dtype != torch.float32:
            self.self_check  # noqa: B018 - check the float32 model before rounding it
        freqs = {
            name: b
            for name, b in self.model.named_buffers()
            if name.rsplit(".", 1)[-1] in ("inv_freq", "original_inv_freq")
        }
        self.model.to(dtype)
        for name, b in freqs.items():
            owner, _, leaf = name.rpartition(".")
            module = self.model.get_submodule(owner)
            if module._buffers[leaf].dtype != b.dtype:
                module._buffers[leaf] = b.to(module._buffers[leaf].device)
        return self

    # ---- head-level KV-cache policies (headprobe kv): the native backend implements them --------

    @property
    def n_kv_groups(self) -> int:
        """KV groups per layer, the units a :class:`~headprobe.probe.layout.attention.KVPolicy` addresses
        (``n_kv_heads``; 1 for MLA, whose latent is shared by every head)."""
        return 1 if self.spec.layout.is_mla else self.spec.n_kv_heads

    @property
    def kv_layout(self) -> Any:
        """The attention layout with the bytes per element of the compute dtype (what a KV cache holds).

        Raises:
            HeadprobeError: the backend does not offer it.
        """
        raise self.lacks("kv_policies", f"KV-cache policies need the native backend, not {self.name}")

    def check_kv_policy(self, policy: KVPolicy) -> None:
        """Raise unless ``policy`` fits the model: its ``n_layers`` x ``n_kv_groups``, and attention the
        model can mask per KV group (no chunked attention).

        Raises:
            HeadprobeError: a policy that does not fit, or a backend without per-group masks.
        """
        raise self.lacks("kv_policies", f"KV-cache policies need the native backend, not {self.name}")

    def kv_policy(self, policy: KVPolicy | None) -> AbstractContextManager[Any]:
        """Context manager: forwards inside run with ``policy``'s per-KV-group streaming attention.

        Raises:
            HeadprobeError: the backend has no per-group masks (only the native one does).
        """
        raise self.lacks("kv_policies", f"KV-cache policies need the native backend, not {self.name}")

    def streaming_cache_bytes(self, tokens: Int[Tensor, "batch pos"], policy: KVPolicy) -> int:
        """Bytes of the KV cache the model allocates for ``policy`` after prefilling ``tokens``.

        Raises:
            HeadprobeError: the backend does not offer it.
        """
        raise self.lacks("kv_policies", f"KV-cache policies need the native backend, not {self.name}")

    def final_residual(
        self,
        tokens: Int[Tensor, "batch pos"],
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        attention_mask: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """The last hidden state ``[batch, pos, d_model]`` (after the final norm where the model
        has one; an encoder's ``last_hidden_state``) with ``fwd_hooks`` active for this forward.

        Raises:
            HeadprobeError: the backend does not offer it (an encoder on the TransformerLens bridge).
        """
        raise HeadprobeError(f"the final residual stream needs the native backend, not {self.name}")

    def forward_with_cache(self, tokens: Int[Tensor, "batch pos"], cache: Any = None) -> Any:
        """Run ``tokens`` with the Hugging Face key/value cache on and return the cache object the
        model filled (``cache``, e.g. a ``transformers.StaticCache``, when given; else the one the
        model made), or None when it returned none (``headprobe budget --check``'s live check).

        Raises:
            HeadprobeError: the backend runs no Hugging Face cache (the native backend).
        """
        raise HeadprobeError(
            f"the live key/value-cache check runs the Hugging Face model: it needs --backend "
            f"transformer-lens, not {self.name}"
        )

    def hooks(
        self, fwd_hooks: Sequence[tuple[str, HookFn]] = (), bwd_hooks: Sequence[tuple[str, HookFn]] = ()
    ) -> AbstractContextManager[None]:
        """``fwd_hooks`` / ``bwd_hooks`` (``[(hook_name, fn), ...]``) active for every forward in
        the ``with`` body; removed on exit, also when the body raises."""
        return self.model.hooks(fwd_hooks=list(fwd_hooks), bwd_hooks=list(bwd_hooks))

    def layer_index(self, layer: int) -> int:
        """``layer`` as an index into the model's ``spec.n_layers`` layers (``-1``: the last), checked as
        :func:`headprobe.capture_heads` checks its ``layers``. Every public method taking a layer (:meth:`W_O`,
        :meth:`b_O`, :meth:`forward_from`, :meth:`attention_input`, :meth:`qk_terms`, ...) is a template here that
        checks it with this, then calls its ``_`` hook (``W_O`` -> ``_W_O``), which a backend implements
        with ``layer`` checked already: no backend checks a layer itself.

        Raises:
            HeadprobeError: ``layer 30 is out of range: there are 30 (0 .. 29, or -30 .. -1 from the end)``,
                or not an integer (one line).
        """
        from headprobe.probe.core.heads import indices

        return indices([layer], self.spec.n_layers, "layer")[0]

    def b_O(self, layer: int) -> Float[Tensor, " d_model"] | None:
        """Layer ``layer``'s output bias ``[d_model]``, added once after ``sum_h z_h @ W_O[h]``;
        None for a model without one (e.g. Llama), where :func:`~headprobe.probe.hooks.capture.capture_heads`'s
        ``"b_O"`` holds zeros instead.

        Raises:
            HeadprobeError: ``layer`` out of range (:meth:`layer_index`).
        """
        return self._b_O(self.layer_index(layer))

    @torch.inference_mode()
    def norm_weights(self, layer: int | None = None) -> NormWeights | None:
        """The elementwise affine part of layer ``layer``'s pre-attention norm (``ln1``), or of the
        final norm (``layer`` None), read off the norm itself, or None where the model has none.

        The norm ``N`` is probed with ``c u`` and ``-c u`` (``u`` alternating +-1, mean 0, RMS 1,
        ``c = 1e3``): both LayerNorm and RMS-type norms give ``N(+-c u) = +-w u + b`` to float rounding,
        so ``w = (N(cu) - N(-cu)) / 2u`` and ``b = (N(cu) + N(-cu)) / 2`` (Gemma's ``1 + w`` needs no
        special case). ``centers``: ``N`` ignores a constant added to its input (LayerNorm subtracts the mean).

        Raises:
            HeadprobeError: an odd ``d_model`` (the probe needs a mean-zero +-1 vector), ``layer`` out of
                range (:meth:`layer_index`).
        """
        return self._norm_weights(None if layer is None else self.layer_index(layer))

    def logits_from_residual(
        self,
        resid: Float[Tensor, "... d_model"],
        vocab: Int[Tensor, "... k"] | None = None,
        *,
        normed: bool = False,
        softcap: bool = True,
    ) -> Float[Tensor, "... d_vocab"] | Float[Tensor, "... k"]:
        """Logits from the final residual stream, exactly as :meth:`forward` computes them: the
        final norm (:meth:`final_norm`; skipped when ``normed``, for a residual that has been
        through it, as :meth:`final_residual` returns it), ``@ W_U + b_U``, then whatever the
        family does to its logits: Gemma-2's final soft-cap ``c * tanh(logits / c)`` (``c = 30``;
        Gemma Team 2024, "Gemma 2", arXiv 2408.00118; Hugging Face's ``final_logit_softcapping``),
        and on the TransformerLens backend every output transform its architecture adapter
        declares (``apply_output_logits_transform``: Cohere's ``logit_scale``, Granite's
        ``logits_scaling``, ...). Analyses never unembed a residual themselves (patching's logit
        difference, the direct logit attribution and the exact sweep's losses all come through
        here), so no analysis can skip a step of it.

        Args:
            resid: ``[..., d_model]`` (any leading axes), in any float dtype (cast to the model's).
            vocab: token ids ``[..., k]`` with ``resid``'s leading axes: only those logits,
                ``[..., k]`` (on the native backend without forming the ``[..., d_vocab]`` product).
            normed: ``resid`` is after the final norm already.
            softcap: False leaves the soft-cap out (the logit before it, which is affine in the
                normed residual; a linear logit scale stays in). For families without a soft-cap
                the two are the same.

        Returns:
            ``[..., d_vocab]`` logits (``[..., k]`` with ``vocab``), in the model's dtype, on its device.
        """
        raise NotImplementedError

    # ---- what each backend implements ---------------------------------------------------------

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        head_mask: Float[Tensor, "layer head"] | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits for ``tokens`` with ``fwd_hooks`` (``[(hook_name, fn), ...]``) active only for
        this call. ``attention_mask``: 1 real, 0 padding (either side), where
        :attr:`supports_padding`. ``head_mask``: a factor ``xi[layer, head]`` on each head's ``z``
        (Michel et al. 2019; 0 removes the head's output contribution).

        Raises:
            HeadprobeError: ``attention_mask`` given to a backend without padding support.
        """
        raise NotImplementedError

    def W_O(self, layer: int) -> Float[Tensor, "head d_head d_model"]:
        """Layer ``layer``'s output projection split by head, ``[n_heads, d_head, d_model]``:
        ``result_h = z_h @ W_O[h]`` (``z_h`` ``[..., d_head]``, ``result_h`` ``[..., d_model]``).
        A plain tensor: a head index past ``n_heads - 1`` (``W_O(18)[9]`` with 9 heads) is torch's
        ``IndexError``.

        Raises:
            HeadprobeError: ``layer`` out of range (:meth:`layer_index`).
        """
        return self._W_O(self.layer_index(layer))

    def _W_O(self, layer: int) -> Float[Tensor, "head d_head d_model"]:
        """What each backend implements behind :meth:`W_O` (``layer`` checked, ``0 .. n_layers-1``)."""
        raise NotImplementedError

    def sink_logits(self, layer: int) -> Float[Tensor, " head"] | None:
        """Layer ``layer``'s learned attention-sink logits (GPT-OSS's ``self_attn.sinks``: the
        softmax runs over ``[scores, sink]`` and the sink's column is dropped, so a pattern row
        sums to ``1 - sink mass``), float32; None where the model has none.

        Raises:
            HeadprobeError: ``layer`` out of range (:meth:`layer_index`).
        """
        return self._sink_logits(self.layer_index(layer))

    def _sink_logits(self, layer: int) -> Float[Tensor, " head"] | None:
        """What a backend with sinks implements behind :meth:`sink_logits` (``layer`` checked)."""
        return None

    def scored_losses(
        self, tokens: Int[Tensor, "batch pos"], first: int, fwd_hooks: Sequence[tuple[str, HookFn]] = ()
    ) -> Float[Tensor, " batch"]:
        """Per-sequence mean loss (nats/token) of the predictions from index ``first`` on
        (:func:`scored_loss`), with ``fwd_hooks`` active for this forward."""
        raise NotImplementedError

    def _projection(self, layer: int, which: str) -> Tensor:
        """Layer ``layer``'s ``which`` (``q``, ``k``, ``v``) projection split by head: what each
        backend implements behind :meth:`W_Q`, :meth:`W_K` and :meth:`W_V`."""
        raise NotImplementedError

    def W_Q(self, layer: int) -> Float[Tensor, "head d_model d_head"]:
        """Layer ``layer``'s query projection split by head (``q_h = x @ W_Q[h]``, before rotary and
        QK-norm; the pre-attention norm not folded in).

        Raises:
            HeadprobeError: latent attention (MLA), which has no per-head W_Q/W_K/W_V; ``layer`` out of
                range (:meth:`layer_index`).
        """
        return self._projection(self.layer_index(layer), "q")

    def W_K(self, layer: int) -> Float[Tensor, "kv_head d_model d_head"]:
        """Layer ``layer``'s key projection split by key/value head (query head h reads ``h // group_size``).

        Raises:
            HeadprobeError: as :meth:`W_Q`.
        """
        return self._projection(self.layer_index(layer), "k")

    def W_V(self, layer: int) -> Float[Tensor, "kv_head d_model d_head"]:
        """Layer ``layer``'s value projection split by key/value head (``v = x @ W_V[kv_head]``).

        Raises:
            HeadprobeError: as :meth:`W_Q`.
        """
        return self._projection(self.layer_index(layer), "v")

    def qkv_bias(self, layer: int, which: str) -> Float[Tensor, "head d_head"] | None:
        """Layer ``layer``'s ``which`` (``q``, ``k``, ``v``) projection bias split by head, ``[n_heads, d_head]``
        for ``q``, ``[n_kv_heads, d_head]`` for ``k`` and ``v`` (as :meth:`W_Q`, :meth:`W_K`, :meth:`W_V`
        index them); None where the projection has no bias.

        Raises:
            HeadprobeError: ``layer`` out of range (:meth:`layer_index`).
        """
        return self._qkv_bias(self.layer_index(layer), which)

    def _qkv_bias(self, layer: int, which: str) -> Tensor | None:
        """What a backend with q/k/v biases implements behind :meth:`qkv_bias` (``layer`` checked)."""
        return None

    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        """The token embedding matrix (without Gemma's ``sqrt(d_model)`` factor)."""
        raise NotImplementedError

    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        """The unembedding matrix as the checkpoint holds it (``final_norm(resid) @ W_U + b_U`` are
        the logits before the family's output transform: use :meth:`logits_from_residual` for logits)."""
        raise NotImplementedError

    def b_U(self) -> Float[Tensor, " d_vocab"] | None:
        """The unembedding bias, or None."""
        raise NotImplementedError

    def resume_scored_losses(
        self,
        layer: int,
        tokens: Int[Tensor, "batch pos"],
        resid_pre: Float[Tensor, "n pos d_model"],
        attn_out: Float[Tensor, "n pos d_model"],
        first: int,
    ) -> Float[Tensor, " n"]:
        """Resume ``n = k * batch`` forward passes at layer ``layer`` and score them.

        Sequence ``i`` of the ``n`` is ``tokens[i % batch]``; its residual stream entering layer
        ``layer`` is ``resid_pre[i]`` and that layer's raw attention output (what
        :meth:`attn_out_hook` holds) is ``attn_out[i]``. The rest of the block (post-attention
        norm, MLP, parallel residual), the later blocks and the unembedding run as in
        :meth:`forward`; returns :meth:`scored_losses` of each of the ``n`` (nats/token).

        Raises:
            HeadprobeError: ``layer`` out of range (:meth:`layer_index`).
        """
        return self._resume_scored_losses(self.layer_index(layer), tokens, resid_pre, attn_out, first)

    def _resume_scored_losses(
        self,
        layer: int,
        tokens: Int[Tensor, "batch pos"],
        resid_pre: Float[Tensor, "n pos d_model"],
        attn_out: Float[Tensor, "n pos d_model"],
        first: int,
    ) -> Float[Tensor, " n"]:
        """What each backend implements behind :meth:`resume_scored_losses` (``layer`` checked)."""
        raise NotImplementedError

    def scored_losses_from(
        self,
        layer: int,
        tokens: Int[Tensor, "n pos"],
        resid_pre: Float[Tensor, "n pos d_model"],
        first: int,
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
    ) -> Float[Tensor, " n"]:
        """:meth:`scored_losses` of ``tokens`` (nats/token, ``[n]``) with ``fwd_hooks`` active, run
        from layer ``layer`` on: ``resid_pre[i]`` is the clean residual stream entering that layer
        for ``tokens[i]``, which is what the earlier layers compute when no hook acts on them (the
        caller's promise: every hook is on layer ``layer`` or later). Saves the first ``layer``
        blocks of every forward of a head-set ablation (:func:`headprobe.analyses.ablation.set_ablation_losses`).

        Raises:
            HeadprobeError: ``layer`` out of range (:meth:`layer_index`).
        """
        return self._scored_losses_from(self.layer_index(layer), tokens, resid_pre, first, fwd_hooks)

    def _scored_losses_from(
        self,
        layer: int,
        tokens: Int[Tensor, "n pos"],
        resid_pre: Float[Tensor, "n pos d_model"],
        first: int,
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
    ) -> Float[Tensor, " n"]:
        """What a backend implements behind :meth:`scored_losses_from` (``layer`` checked). This
        base version is the honest full forward (``resid_pre`` unused), which is what a backend
        that cannot start a forward mid-way does (the TransformerLens bridge)."""
        return self.scored_losses(tokens, first, fwd_hooks)

    def _offers(self, hook: str) -> bool:
        """Whether this backend implements ``hook``, one of the hooks below whose :class:`LoadedModel`
        version refuses the feature whatever its arguments: their templates check ``layer`` only
        then, so a backend without the feature names what it lacks, not the layer."""
        return getattr(type(self), hook) is not getattr(LoadedModel, hook)

    def forward_from(
        self,
        layer: int,
        resid_pre: Float[Tensor, "batch pos d_model"],
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        attention_mask: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """The logits of :meth:`forward` resumed at layer ``layer``: blocks ``layer ..`` run from
        ``resid_pre`` (what ``blocks.{layer}.hook_resid_pre`` held; positions ``0 .. pos-1``, or
        with ``attention_mask`` -- 1 real, 0 padding -- those of :meth:`forward` on that padded
        batch) with ``fwd_hooks`` active, then the final norm and unembedding. The layers before
        are not run, so path patching into a late receiver skips them.

        Raises:
            HeadprobeError: not the native backend; ``layer`` out of range (:meth:`layer_index`).
        """
        if self._offers("_forward_from"):
            layer = self.layer_index(layer)
        return self._forward_from(layer, resid_pre, fwd_hooks, attention_mask)

    def _forward_from(
        self,
        layer: int,
        resid_pre: Float[Tensor, "batch pos d_model"],
        fwd_hooks: Sequence[tuple[str, HookFn]] = (),
        attention_mask: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """What a backend with :attr:`path_patching` implements behind :meth:`forward_from` (``layer`` checked)."""
        raise self.lacks("path_patching", f"resuming a forward at a layer needs the native backend, not {self.name}")

    def attention_input(
        self, layer: int, resid: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos d_model"]:
        """Layer ``layer``'s pre-attention norm applied to ``resid`` ``[batch, pos, d_model]`` (recomputed,
        differentiable), or ``resid`` itself where the block reads the raw residual (OLMo-2). Path
        patching and edge attribution (:mod:`headprobe.analyses.circuit`) build a receiver's input with it.

        Raises:
            HeadprobeError: a backend or architecture without it (the bridge; post-LN encoders);
                ``layer`` out of range (:meth:`layer_index`).
        """
        if self._offers("_attention_input"):
            layer = self.layer_index(layer)
        return self._attention_input(layer, resid)

    def _attention_input(
        self, layer: int, resid: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos d_model"]:
        """What a backend with :attr:`path_patching` implements behind :meth:`attention_input` (``layer`` checked)."""
        raise self.lacks(
            "path_patching",
            f"a head's attention input (path patching, edge attribution) needs the native backend, not {self.name}",
        )

    def attention_scale(self, layer: int) -> tuple[float, float | None]:
        """Layer ``layer``'s factor of ``q . k`` in the scores (``1/sqrt(d_qk)`` or the family's) and
        its attention soft-cap ``c`` (scores ``c tanh(s / c)``, Gemma-2), or None.

        Raises:
            HeadprobeError: not the native backend; ``layer`` out of range (:meth:`layer_index`).
        """
        if self._offers("_attention_scale"):
            layer = self.layer_index(layer)
        return self._attention_scale(layer)

    def _attention_scale(self, layer: int) -> tuple[float, float | None]:
        """What a backend implements behind :meth:`attention_scale` (``layer`` checked)."""
        raise HeadprobeError(f"the attention scale of a layer is read on the native backend only, not {self.name}")

    def qk_terms(
        self,
        layer: int,
        head: int,
        side: Literal["q", "k"],
        terms: Float[Tensor, "n d_model"],
        ref: Float[Tensor, " d_model"],
        pos: int,
    ) -> Float[Tensor, "n_plus_1 d_qk"]:
        """Query head ``head``'s query (``side="q"``) or key (``"k"``, its key/value head's) at
        position ``pos`` as a sum of terms: row ``i`` is what ``terms[i]`` (a term of the attention
        input, after the pre-attention norm) contributes, the last row the projection bias; QK-norm
        (and MLA's latent norm) frozen at their scale for ``ref``, the whole input at ``pos``; rotary
        applied at ``pos`` (:func:`headprobe.probe.hooks.qk.head_qk_terms`). Used by the QK attribution.

        Raises:
            HeadprobeError: not the native backend, an attention it does not split (MLA with a query latent),
                or ``layer`` or ``head`` (of the layer's :meth:`_n_heads`) out of range (:meth:`layer_index`'s line).
        """
        if self._offers("_qk_terms"):
            from headprobe.probe.core.heads import indices

            layer = self.layer_index(layer)
            head = indices([head], self._n_heads(layer), "head")[0]
        return self._qk_terms(layer, head, side, terms, ref, pos)

    def _n_heads(self, layer: int) -> int:
        """Query heads in layer ``layer`` (checked), what :meth:`qk_terms` checks ``head`` against:
        ``spec.n_heads`` here; a backend whose layers keep fewer (a pruned model) says so."""
        return self.spec.n_heads

    def _qk_terms(
        self,
        layer: int,
        head: int,
        side: Literal["q", "k"],
        terms: Float[Tensor, "n d_model"],
        ref: Float[Tensor, " d_model"],
        pos: int,
    ) -> Float[Tensor, "n_plus_1 d_qk"]:
        """What a backend implements behind :meth:`qk_terms` (``layer`` and ``head`` checked)."""
        raise HeadprobeError(f"QK attribution needs the native backend (--backend native), not {self.name}")

    def online_stats_geometry(self, layer: int) -> tuple[Any, bool]:
        """Layer ``layer``'s :class:`~headprobe.probe.hooks.online_stats.AttentionGeometry` and whether its final
        queries and keys are the rotary hooks' (``hook_rot_q``/``hook_rot_k``, else ``hook_q``/``hook_k``):
        what :func:`headprobe.probe.hooks.online_stats.online_head_stats` recomputes the scores from
        (:attr:`streams_statistics`).

        Raises:
            HeadprobeError: a backend without :attr:`streams_statistics`, a pruned layer, or a layer
                whose hooked queries are not the ones attention reads; ``layer`` out of range (:meth:`layer_index`).
        """
        if self._offers("_online_stats_geometry"):
            layer = self.layer_index(layer)
        return self._online_stats_geometry(layer)

    def _online_stats_geometry(self, layer: int) -> tuple[Any, bool]:
        """What a backend with :attr:`streams_statistics` implements behind :meth:`online_stats_geometry`
        (``layer`` checked)."""
        from headprobe.probe.hooks.online_stats import STREAMING_REFUSAL

        raise self.lacks("streams_statistics", STREAMING_REFUSAL.format(backend=self.name))

    def check_prunable(self) -> None:
        """Raise unless :meth:`remove_heads` removes heads exactly from this model.

        Raises:
            HeadprobeError: not the native backend, or an architecture whose heads cannot be
                removed exactly (MLA, all-head QK-norm; :func:`headprobe.probe.model.pruned.check_prunable`).
        """
        raise self.lacks(
            "removes_heads", "real head removal (--save-pruned) needs the native backend (--backend native)"
        )

    def remove_heads(self, keep: Bool[Tensor, "layer head"]) -> Transformer:
        """A copy of the model with the heads ``keep`` marks False removed
        (:func:`headprobe.probe.model.pruned.remove_heads`).

        Raises:
            HeadprobeError: as :meth:`check_prunable`, or ``keep`` has the wrong shape.
        """
        self.check_prunable()
        raise NotImplementedError

    def attention_parameters(self) -> int:
        """Parameters in all attention projections (q, k, v, o; biases included).

        Raises:
            HeadprobeError: as :meth:`check_prunable` (counted on the native backend only).
        """
        self.check_prunable()
        raise NotImplementedError

    def same_weights(self, other: LoadedModel) -> bool | None:
        """Whether ``other``'s module holds the same tensors as this one's: the same names and shapes
        and equal values (each of ``other``'s moved to this one's tensor's device: a split model);
        None where some weight is not in memory (offloaded to the meta device) to compare."""
        mine, theirs = self.model.state_dict(), other.model.state_dict()
        if mine.keys() != theirs.keys() or any(mine[k].shape != theirs[k].shape for k in mine):
            return False
        try:  # tensor by tensor: the first that differs ends it
            return all(torch.equal(mine[k], theirs[k].to(mine[k].device)) for k in mine)
        except (RuntimeError, NotImplementedError):
            return None


def _module_type(module: Any, module_name: str, class_name: str) -> bool:
    """Whether ``module`` is an instance of ``module_name.class_name``, without importing it."""
    mod = sys.modules.get(module_name)
    return mod is not None and isinstance(module, getattr(mod, class_name))
