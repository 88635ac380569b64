"""The attention layout of a decoder-only transformer (:class:`AttentionLayout`): one type shared
by the native model's config (:attr:`headprobe.probe.model.config.TransformerConfig.layout`), a loaded
model's spec (:attr:`headprobe.probe.layout.spec.ModelSpec.layout`) and the cost formulas
(:mod:`headprobe.probe.layout.cost`).

Also here: the layout of a Hugging Face model as read from its config and attention module
(:func:`layout_from_hf_config`, :func:`attention_module`, :func:`attention_bias`, and whether its
attention and MLP run in parallel, :func:`parallel_attn_mlp_from_hf_config`), which the
TransformerLens bridge's spec and ``headprobe budget --model`` use; and head-level KV-cache
policies (:class:`KVPolicy`: per layer and KV group, a full or a streaming cache; the file format
in docs/kv.md, read by :func:`headprobe.analyses.exchange.read_kv_policy`). No torch, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean

#: Bias conventions: which projections carry a bias vector (``"out"``: W_O only).
BIAS_KINDS = ("none", "qkv", "all", "out")

#: QK-norm conventions: normalisation weights on queries and keys before the scores.
QK_NORM_KINDS = ("none", "per_head", "full")


# ---------------------------------------------------------------------------------------------
# The layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionLayout:
    """The attention shape of a decoder-only transformer.

    Attributes:
        d_model: residual stream width D.
        n_layers: number of attention layers.
        n_heads: number of query heads H.
        n_kv_heads: number of key/value heads (H for MHA, 1 for MQA, a divisor of H for GQA).
            ``None`` means ``n_heads``. Ignored by the KV-cache formula of an MLA layout, whose
            cache is one latent shared by all heads.
        d_head: width of each head's value, of ``z`` (``hook_z``'s last axis) and of each head's
            block of W_O rows, whatever the kind (what a loaded model's ``spec.d_head`` is).
            ``None`` means ``d_model // n_heads``. ``n_heads * d_head`` need not equal ``d_model``
            (DeepSeek-V3: 128 * 128 = 16384 > 7168). Queries and keys are :attr:`d_qk` wide:
            ``d_head`` too, except for MLA.
        bias: which projections have biases: ``"none"`` (Llama, the original Transformer),
            ``"qkv"`` (Qwen2.5), ``"all"`` (GPT-2, GPT-3) or ``"out"`` (W_O only: a native
            ``TransformerConfig(bias=True, qkv_bias=False)``).
        qk_norm: RMSNorm weights on queries and keys (Dehghani et al. 2023, arXiv:2302.05442):
            ``"none"``; ``"per_head"``, one ``d_qk`` weight for all query heads and one for all
            key heads (Qwen3, Gemma 3: Hugging Face ``q_norm``/``k_norm`` of size ``head_dim``);
            ``"full"``, over the whole projections, ``n_heads*d_qk`` + ``n_kv_heads*d_qk``
            numbers (OLMo 2: ``q_norm``/``k_norm`` of ``Olmo2Attention``). Not for MLA.
        bytes_per_element: bytes of one cached or stored number (2 for bf16/fp16).
        kv_lora_rank: MLA only: width of the compressed KV latent c^KV (DeepSeek-V3: 512).
            ``None`` means the layout is not MLA.
        q_lora_rank: MLA only: width of the compressed query latent c^Q (DeepSeek-V3: 1536);
            ``None`` means a full-rank query projection.
        qk_rope_head_dim: MLA only: width of the decoupled rotary key shared by all heads and of
            each head's rotary query part (DeepSeek-V3: 64); ``None`` or 0: none (learned positions).
        qk_nope_head_dim: MLA only: width of each head's non-rotary query and key part (Hugging
            Face ``qk_nope_head_dim``); ``None`` means ``d_head`` (DeepSeek-V3: 128, its
            ``v_head_dim``).
        windows: the key window of each layer, ``n_layers`` entries, each a number of positions
            (sliding-window attention: the layer attends to, and caches, at most that many
            positions, Mistral 7B, arXiv:2310.06825, "rolling buffer cache") or ``None``
            (global attention). ``None`` for the whole field means every layer is global.
            Gemma 2 alternates sliding (4096) and global layers.
        name: a label for tables.
        sinks: every query head has a learned sink logit in the attention module (GPT-OSS's
            ``sinks``: ``n_heads`` parameters per layer; nothing cached).

    Raises:
        HeadprobeError: a size is not a positive integer, ``d_model`` is not divisible by
            ``n_heads`` when ``d_head`` is not given, ``n_heads`` is not divisible by
            ``n_kv_heads``, an MLA size is given without ``kv_lora_rank``, ``bias`` or
            ``qk_norm`` is unknown, ``qk_norm`` or ``qk_head_dim`` is set on MLA, or ``windows`` does not hold
            ``n_layers`` entries of None or a positive integer.
    """

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    d_head: int | None = None
    bias: str = "none"
    bytes_per_element: int = 2
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_norm: str = "none"
    qk_nope_head_dim: int | None = None
    windows: tuple[int | None, ...] | None = None
    name: str = ""
    sinks: bool = False
    output_gate: bool = False
    """A per-head output gate computed by the query projection (Qwen3-Next's gated attention:
    ``W_G`` d_model -> n_heads*d_head beside ``W_Q``; ``z_h`` is multiplied by ``sigmoid(x W_G^h)``)."""
    head_layers: tuple[int, ...] | None = None
    """The layers that have heads, by the model's own layer numbers (a hybrid model's attention
    layers; Qwen3-Next's Gated-DeltaNet layers have none); None: every layer."""
    qk_head_dim: int | None = None
    """Not MLA: width of each head's query and key where it differs from ``d_head`` (the values'),
    as in MHA of an MLA model's own heads (:meth:`with_kv_heads`; Hugging Face DeepSeek's
    ``qk_head_dim``, DeepSeek-V3: 128 + 64 = 192, values 128). None: ``d_head``. MLA's is
    ``qk_nope_head_dim + qk_rope_head_dim``."""

    def __post_init__(self) -> None:
        if self.head_layers is not None:  # JSON gives a list
            object.__setattr__(self, "head_layers", tuple(int(l) for l in self.head_layers))
            if any(not 0 <= l < self.n_layers for l in self.head_layers):
                raise HeadprobeError(f"head_layers {self.head_layers} out of range for {self.n_layers} layers")
        for field in ("d_model", "n_layers", "n_heads", "bytes_per_element"):
            _check_positive(field, getattr(self, field))
        for field in (
            "n_kv_heads",
            "d_head",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "qk_head_dim",
        ):
            value = getattr(self, field)
            # MLA without a rotary key has qk_rope_head_dim 0 (filled below), kept by replace()
            if value is not None and not (field == "qk_rope_head_dim" and value == 0 and self.kv_lora_rank is not None):
                _check_positive(field, value)
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise HeadprobeError(
                    f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}; "
                    f"choose n_heads dividing d_model or give d_head explicitly"
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        assert self.n_kv_heads is not None  # filled above
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise HeadprobeError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}; "
                f"each key/value head must serve a whole group of query heads"
            )
        if self.bias not in BIAS_KINDS:
            raise HeadprobeError(
                f"unknown bias kind {self.bias!r}{did_you_mean(str(self.bias), BIAS_KINDS)}; choose one of {', '.join(BIAS_KINDS)}"
            )
        if self.kv_lora_rank is None and (
            self.q_lora_rank is not None or self.qk_rope_head_dim is not None or self.qk_nope_head_dim is not None
        ):
            raise HeadprobeError(
                "q_lora_rank, qk_rope_head_dim and qk_nope_head_dim describe MLA; give kv_lora_rank too"
            )
        if self.kv_lora_rank is not None and self.qk_head_dim is not None:
            raise HeadprobeError(
                "qk_head_dim is for a layout without a latent; MLA's query and key are "
                "qk_nope_head_dim + qk_rope_head_dim wide"
            )
        if self.kv_lora_rank is not None and self.qk_rope_head_dim is None:
            object.__setattr__(self, "qk_rope_head_dim", 0)
        if self.kv_lora_rank is not None and self.qk_nope_head_dim is None:
            object.__setattr__(self, "qk_nope_head_dim", self.d_head)
        if self.qk_norm not in QK_NORM_KINDS:
            raise HeadprobeError(
                f"unknown qk_norm kind {self.qk_norm!r}{did_you_mean(str(self.qk_norm), QK_NORM_KINDS)}; choose one of {', '.join(QK_NORM_KINDS)}"
            )
        if self.qk_norm != "none" and self.kv_lora_rank is not None:
            raise HeadprobeError("qk_norm describes MHA/GQA/MQA projections; MLA's latent norms are counted already")
        if self.windows is not None:
            windows = tuple(self.windows)
            if len(windows) != self.n_layers:
                raise HeadprobeError(f"windows holds {len(windows)} entries; give one per layer ({self.n_layers})")
            for w in windows:
                if w is not None:
                    _check_positive("a layer's window", w)
            object.__setattr__(self, "windows", windows if any(w is not None for w in windows) else None)

    # -- derived names ---------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        """Whether this is multi-head latent attention (a ``kv_lora_rank`` is set)."""
        return self.kv_lora_rank is not None

    @property
    def d_qk(self) -> int:
        """Width of each head's query and key: ``qk_nope_head_dim + qk_rope_head_dim`` for MLA (the
        non-rotary part and the decoupled rotary part, DeepSeek-V2 eq. 16), else :attr:`qk_head_dim`
        where given, else ``d_head``."""
        assert self.d_head is not None  # filled by __post_init__, as the MLA sizes for MLA
        if self.is_mla:
            assert self.qk_nope_head_dim is not None and self.qk_rope_head_dim is not None
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.d_head if self.qk_head_dim is None else self.qk_head_dim

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: ``n_heads // n_kv_heads``."""
        assert self.n_kv_heads is not None  # filled by __post_init__
        return self.n_heads // self.n_kv_heads

    @property
    def kind(self) -> str:
        """``MLA``, ``MHA`` (n_kv_heads == n_heads), ``MQA`` (n_kv_heads == 1) or ``GQA``."""
        if self.is_mla:
            return "MLA"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    @property
    def n_windowed_layers(self) -> int:
        """How many layers attend within a sliding window (0 when every layer is global)."""
        return sum(w is not None for w in self.windows or ())

    def with_kv_heads(self, n_kv_heads: int) -> AttentionLayout:
        """The same heads (not MLA) with ``n_kv_heads`` key/value heads: queries and keys keep their
        width :attr:`d_qk` and values theirs, ``d_head`` (MLA's become :attr:`qk_head_dim`)."""
        return replace(
            self,
            n_kv_heads=n_kv_heads,
            kv_lora_rank=None,
            q_lora_rank=None,
            qk_rope_head_dim=None,
            qk_nope_head_dim=None,
            qk_head_dim=None if self.d_qk == self.d_head else self.d_qk,
        )

    def as_mha(self) -> AttentionLayout:
        """The MHA layout of the same heads: one K and one V per query head, as wide as this
        layout's (:meth:`with_kv_heads`), no latent."""
        return self.with_kv_heads(self.n_heads)

    @property
    def n_attention_layers(self) -> int:
        """How many layers have heads: ``len(attention_layers)``, without its tuple of every layer."""
        return self.n_layers if self.head_layers is None else len(self.head_layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with heads, in order (``head_layers``, or every layer)."""
        return tuple(range(self.n_layers)) if self.head_layers is None else self.head_layers

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``windows`` a tuple or None; ``sinks`` and ``output_gate``
        only where True, ``head_layers`` and ``qk_head_dim`` only where not None)."""
        d = asdict(self)
        for optional in ("head_layers", "qk_head_dim"):
            if d[optional] is None:
                del d[optional]
        for flag in ("sinks", "output_gate"):
            if not d[flag]:
                del d[flag]
        return d


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HeadprobeError(f"{name} must be a positive integer, got {value!r}")


# ---------------------------------------------------------------------------------------------
# The layout of a Hugging Face model
# ---------------------------------------------------------------------------------------------

#: Hugging Face ``model_type`` -> QK-norm kind of its attention module (see :class:`AttentionLayout`):
#: ``q_norm``/``k_norm`` of size ``head_dim`` (Qwen3Attention, Gemma3Attention) or over the whole
#: projections (Olmo2Attention, Olmo3Attention, OlmoeAttention).
QK_NORM_OF_MODEL_TYPE = {
    "qwen3": "per_head",
    "qwen3_moe": "per_head",
    "gemma3": "per_head",
    "gemma3_text": "per_head",
    "olmo2": "full",
    "olmo3": "full",
    "olmoe": "full",
    "qwen3_next": "per_head",
    "qwen3_5_text": "per_head",
}

#: Model types whose query projection also gives each head an output gate (:attr:`AttentionLayout.output_gate`).
OUTPUT_GATE_MODEL_TYPES = ("qwen3_next", "qwen3_5_text")

#: Hugging Face ``model_type``s whose attention has a learned sink logit per head (``sinks``).
SINKS_OF_MODEL_TYPE = frozenset({"gpt_oss"})

#: Layer 0's attention module in a Hugging Face model: ``self_attn``/``attn``/``attention`` of
#: ``layers.0``/``h.0``.
_ATTENTION_MODULE = re.compile(r"(^|\.)(layers|h)\.0\.(self_attn|attn|attention)$")

#: Output projections' names, whose bias makes the kind ``"all"`` or ``"out"``.
_OUTPUT_PROJECTION = re.compile(r"(o_proj|c_proj|out_proj|dense)")


def windows_from_hf_config(config: Any, n_layers: int, strict: bool = True) -> tuple[int | None, ...] | None:
    """Per-layer windows (:attr:`AttentionLayout.windows`) of a Hugging Face config, read as
    transformers' caches read them (``transformers.cache_utils.get_layer_types_and_kwargs``):
    ``layer_types`` when present (``sliding_attention`` -> ``sliding_window``,
    ``chunked_attention`` -> ``attention_chunk_size``, ``full_attention`` -> None), else every
    layer windowed when ``sliding_window`` is set (Mistral), else None (all global).

    Args:
        strict: raise on a layer type that is not attention; False reads it as a global layer
            (a loaded hybrid model's spec, whose attention layers are what headprobe probes).

    Raises:
        HeadprobeError: with ``strict``, a layer type that is not attention (a recurrent or
            linear layer), whose cost the formulas do not cover.
    """
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = (
            "sliding_attention"
            if window is not None
            else "chunked_attention"
            if chunk is not None
            else "full_attention"
        )
        types = [kind] * n_layers
    out: list[int | None] = []
    for t in list(types)[:n_layers]:
        if t == "sliding_attention":
            out.append(window)
        elif t == "chunked_attention":
            out.append(chunk)
        elif t == "full_attention" or not strict:
            out.append(None)
        else:
            raise HeadprobeError(f"layer type {t!r}: headprobe budget's formulas cover attention layers only")
    return tuple(out) if any(w is not None for w in out) else None


def layout_from_hf_config(
    config: Any,
    *,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    d_head: int,
    d_model: int,
    bias: str = "none",
    strict: bool = True,
) -> AttentionLayout:
    """The layout of a Hugging Face model: the sizes given (as a wrapper such as TransformerLens
    normalises them from ``config``), with what only ``config`` says: the MLA sizes
    (``kv_lora_rank``, ``q_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim``, and
    ``v_head_dim`` as ``d_head``; ``n_kv_heads`` is then ``n_heads``), QK-norm by ``model_type``
    (:data:`QK_NORM_OF_MODEL_TYPE`), learned sinks (:data:`SINKS_OF_MODEL_TYPE`) and sliding windows
    (:func:`windows_from_hf_config`).

    Args:
        bias: the bias kind, read from the model's attention module (:func:`attention_bias`).
        strict: see :func:`windows_from_hf_config`.

    Raises:
        HeadprobeError: with ``strict``, a layer type that is not attention; a size that
            :class:`AttentionLayout` refuses.
    """
    common: dict[str, Any] = dict(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        bias=bias,
        windows=windows_from_hf_config(config, n_layers, strict),
        sinks=getattr(config, "model_type", "") in SINKS_OF_MODEL_TYPE,
    )
    if getattr(config, "kv_lora_rank", None):
        return AttentionLayout(
            d_head=config.v_head_dim,
            kv_lora_rank=config.kv_lora_rank,
            q_lora_rank=getattr(config, "q_lora_rank", None) or None,
            qk_rope_head_dim=config.qk_rope_head_dim,
            qk_nope_head_dim=config.qk_nope_head_dim,
            **common,
        )
    model_type = getattr(config, "model_type", "")
    return AttentionLayout(
        n_kv_heads=n_kv_heads,
        d_head=d_head,
        qk_norm=QK_NORM_OF_MODEL_TYPE.get(model_type, "none"),
        output_gate=model_type in OUTPUT_GATE_MODEL_TYPES,
        **common,
    )


#: Hugging Face ``model_type`` -> (the config key that says whether attention and MLP run in
#: parallel, its default in transformers' config class); a key of None: always parallel (the
#: block is ``resid + attn(ln(resid)) + mlp(ln(resid))`` in the modeling code). Falcon's
#: ``new_decoder_architecture`` is parallel too (:func:`parallel_attn_mlp_from_hf_config`).
PARALLEL_ATTN_MLP_OF_MODEL_TYPE: dict[str, tuple[str | None, bool]] = {
    "gpt_neox": ("use_parallel_residual", True),
    "stablelm": ("use_parallel_residual", False),
    "falcon": ("parallel_attn", True),
    "gptj": (None, True),
    "codegen": (None, True),
    "phi": (None, True),
    "cohere": (None, True),
    "cohere2": (None, True),
}


def parallel_attn_mlp_from_hf_config(config: Any) -> bool | None:
    """Whether a Hugging Face model's MLP reads the block's input residual rather than the residual
    after its own attention (``resid_post = resid_pre + attn_out + mlp_out``; TransformerLens'
    ``parallel_attn_mlp``, EAP-IG's graph config), read off ``config`` (attributes: a transformers
    config, or a ``config.json`` as a namespace) by ``model_type``
    (:data:`PARALLEL_ATTN_MLP_OF_MODEL_TYPE`; every other model type is sequential). None where
    ``config`` has no ``model_type``."""
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or not model_type:
        return None
    key, default = PARALLEL_ATTN_MLP_OF_MODEL_TYPE.get(model_type, (None, False))
    if model_type == "falcon" and getattr(config, "new_decoder_architecture", False):
        return True
    value = default if key is None else getattr(config, key, default)
    return default if value is None else bool(value)


def attention_module(model: Any) -> Any | None:
    """Layer 0's attention module of a Hugging Face model (``self_attn``/``attn``/``attention`` of
    ``layers.0``/``h.0``, as transformers names them), or None where there is none by those names
    (or the model has been rewired, as TransformerLens' bridge rewires the model it wraps)."""
    return next((m for n, m in model.named_modules() if _ATTENTION_MODULE.search(n)), None)


def attention_bias(model: Any) -> str:
    """The bias kind (:data:`BIAS_KINDS`) of a Hugging Face model's attention, read from the
    parameter names of :func:`attention_module`: ``"all"`` when the output projection
    (``o_proj``, ``c_proj``, ``out_proj``, ``dense``) and another projection have biases,
    ``"out"`` when only the output projection does, ``"qkv"`` when only others do, ``"none"``
    without biases or without a module found."""
    module = attention_module(model)
    if module is None:
        return "none"
    biases = [n for n, _ in module.named_parameters() if n.endswith("bias")]
    out = [n for n in biases if _OUTPUT_PROJECTION.search(n)]
    if not biases:
        return "none"
    if not out:
        return "qkv"
    return "all" if len(out) < len(biases) else "out"


# ---------------------------------------------------------------------------------------------
# Head-level KV-cache policies: per layer and KV group, a full cache or a streaming one
# ---------------------------------------------------------------------------------------------

#: The ``format`` field of a policy file (documented in docs/kv.md).
KV_POLICY_FORMAT = "headprobe-kv-policy"
KV_POLICY_VERSION = 1


@dataclass(frozen=True)
class Streaming:
    """A streaming KV group: its query heads read only the first ``sink`` keys (attention sinks)
    and the ``window`` most recent ones, the query itself included; the cache keeps those
    ``sink + window`` positions (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453; DuoAttention,
    Xiao et al. 2024, arXiv:2410.10819, sections 2.1 and 2.3).

    Attributes:
        sink: positions kept from the start, >= 0.
        window: recent positions kept, >= 1.

    Raises:
        HeadprobeError: a negative ``sink`` or a ``window`` below 1.
    """

    sink: int
    window: int

    def __post_init__(self) -> None:
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise HeadprobeError(f"a streaming group's sink must be an integer >= 0, got {self.sink!r}")
        _check_positive("a streaming group's window", self.window)

    @property
    def span(self) -> int:
        """``sink + window``: the most keys one query reads and the positions cached."""
        return self.sink + self.window


def _json_int(d: dict, key: str, source: str) -> int:
    """``d[key]``, a JSON integer (not 0.9, 1e999, Infinity or true).

    Raises:
        KeyError: missing. HeadprobeError: any other value, in one line.
    """
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise HeadprobeError(f"{source}: {key!r} must be an integer, got {value!r}")
    return value


def _streaming(e: dict, layer: int, g: int, source: str) -> Streaming:
    """The :class:`Streaming` group of policy entry ``e``, its refusal naming the file and the group.

    Raises:
        KeyError: no sink or window. HeadprobeError: a bad one, as the policy's other errors do."""
    where, sink, window = f"{source}: group (layer {layer}, kv_group {g})", e["sink"], e["window"]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (sink, window)):  # 1.5, "4": before Streaming's types
        raise HeadprobeError(
            f"{where}: a streaming group's sink must be an integer >= 0 and its window a positive integer, "
            f"got sink {sink!r}, window {window!r}"
        )
    try:
        return Streaming(sink, window)
    except HeadprobeError as err:
        raise HeadprobeError(f"{where}: {err}") from None


@dataclass(frozen=True)
class KVPolicy:
    """A head-level KV-cache policy: ``groups[layer][kv_group]`` is None (a full cache) or a
    :class:`Streaming` group. The unit is the one that owns cache: a key/value head for
    MHA/GQA/MQA (``n_kv_groups = n_kv_heads``; its ``group_size`` query heads share it), the
    layer's latent ``c^KV`` and rotary key for MLA (``n_kv_groups = 1``: the latent is shared by
    every head, so a window applies to all of the layer's heads at once).

    Attributes:
        groups: ``n_layers`` tuples of ``n_kv_groups`` entries.
        model: a label (the model the policy was chosen for), or "".

    Raises:
        HeadprobeError: no layer, layers of different group counts, or an entry that is neither
            None nor :class:`Streaming`.
    """

    groups: tuple[tuple[Streaming | None, ...], ...]
    model: str = ""

    def __post_init__(self) -> None:
        groups = tuple(tuple(layer) for layer in self.groups)
        if not groups or not groups[0] or len({len(layer) for layer in groups}) != 1:
            raise HeadprobeError("a KV policy needs at least one layer and the same number of KV groups in every layer")
        if any(g is not None and not isinstance(g, Streaming) for layer in groups for g in layer):
            raise HeadprobeError("a KV policy's group is a full cache (None) or Streaming(sink, window)")
        object.__setattr__(self, "groups", groups)

    @classmethod
    def uniform(cls, n_layers: int, n_kv_groups: int, group: Streaming | None = None, model: str = "") -> KVPolicy:
        """Every group the same: all full (``group=None``) or all ``group``."""
        return cls(tuple((group,) * n_kv_groups for _ in range(n_layers)), model)

    @classmethod
    def with_full(cls, n_layers: int, n_kv_groups: int, full: Any, streaming: Streaming, model: str = "") -> KVPolicy:
        """``full`` (an iterable of ``(layer, kv_group)``) keep full caches; every other group is ``streaming``."""
        keep = {tuple(x) for x in full}
        return cls(
            tuple(
                tuple(None if (layer, g) in keep else streaming for g in range(n_kv_groups))
                for layer in range(n_layers)
            ),
            model,
        )

    @property
    def n_layers(self) -> int:
        return len(self.groups)

    @property
    def n_kv_groups(self) -> int:
        return len(self.groups[0])

    @property
    def full_groups(self) -> list[tuple[int, int]]:
        """``(layer, kv_group)`` of every group with a full cache."""
        return [(layer, g) for layer, row in enumerate(self.groups) for g, s in enumerate(row) if s is None]

    def cached_positions(self, seq_len: int) -> list[list[int]]:
        """Positions each group caches after ``seq_len`` tokens, ``[layer][kv_group]``:
        ``seq_len`` for a full group, ``min(seq_len, sink + window)`` for a streaming one."""
        return [[seq_len if s is None else min(seq_len, s.span) for s in row] for row in self.groups]

    def check_layout(self, n_layers: int, n_kv_groups: int, what: str = "the model") -> None:
        """Raise HeadprobeError unless the policy has ``n_layers`` layers of ``n_kv_groups`` groups."""
        if (self.n_layers, self.n_kv_groups) != (n_layers, n_kv_groups):
            raise HeadprobeError(
                f"the KV policy has {self.n_layers} layers x {self.n_kv_groups} KV groups; "
                f"{what} has {n_layers} x {n_kv_groups}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The policy file's JSON (docs/kv.md): format, version, model, sizes, one entry per group."""
        entries = [
            {"layer": layer, "kv_group": g, "cache": "full"}
            if s is None
            else {"layer": layer, "kv_group": g, "cache": "streaming", "sink": s.sink, "window": s.window}
            for layer, row in enumerate(self.groups)
            for g, s in enumerate(row)
        ]
        return {
            "format": KV_POLICY_FORMAT,
            "version": KV_POLICY_VERSION,
            "model": self.model,
            "n_layers": self.n_layers,
            "n_kv_groups": self.n_kv_groups,
            "groups": entries,
        }

    @classmethod
    def from_dict(cls, d: Any, source: str = "the KV policy") -> KVPolicy:
        """Read :meth:`to_dict`'s JSON.

        Raises:
            HeadprobeError: another format or version, missing or bad fields, a group listed twice
                or not at all.
        """
        if not isinstance(d, dict) or d.get("format") != KV_POLICY_FORMAT:
            raise HeadprobeError(f'{source} is not a KV policy file (its "format" must be {KV_POLICY_FORMAT!r})')
        if d.get("version") != KV_POLICY_VERSION:
            raise HeadprobeError(
                f"{source} has version {d.get('version')!r}; this headprobe reads version {KV_POLICY_VERSION}"
            )
        try:
            n_layers, n_groups = _json_int(d, "n_layers", source), _json_int(d, "n_kv_groups", source)
            grid: list[list[Any]] = [[...] * n_groups for _ in range(n_layers)]
            for e in d["groups"]:
                layer, g = _json_int(e, "layer", source), _json_int(e, "kv_group", source)
                if not (0 <= layer < n_layers and 0 <= g < n_groups) or grid[layer][g] is not ...:
                    raise HeadprobeError(
                        f"{source}: group (layer {layer}, kv_group {g}) is out of range or listed twice"
                    )
                if e["cache"] not in ("full", "streaming"):
                    raise HeadprobeError(f'{source}: a group\'s cache is "full" or "streaming", not {e["cache"]!r}')
                grid[layer][g] = None if e["cache"] == "full" else _streaming(e, layer, g, source)
        except HeadprobeError:  # a ValueError too: its own line, not wrapped as a malformed policy
            raise
        except (KeyError, TypeError, ValueError) as err:
            raise HeadprobeError(f"{source}: malformed policy ({type(err).__name__}: {err})") from None
        missing = [(layer, g) for layer in range(n_layers) for g in range(n_groups) if grid[layer][g] is ...]
        if missing:
            raise HeadprobeError(
                f"{source}: {len(missing)} groups are not listed, first (layer, kv_group) = {missing[0]}"
            )
        return cls(tuple(tuple(row) for row in grid), str(d.get("model", "")))
