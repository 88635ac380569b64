"""What a model family module defines (:class:`Family`, its :class:`TinySpec` and
:class:`Variant`), and the helpers several families' config mappings share (rotary parameters,
sliding windows, GELU names).

A family module ``probe/model/families/<model_type>.py`` defines ``FAMILY = Family(...)`` and is
registered in :data:`headprobe.probe.model.families.FAMILIES`; nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.model.config import TransformerConfig

# ---------------------------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A change of a family's tiny config that the native backend still loads exactly (tested
    against Hugging Face's model like the tiny model itself)."""

    change: Mapping[str, Any]
    """Config fields changed from :attr:`TinySpec.fields`."""
    why: str
    """What the change exercises (one line; the test's id)."""
    layout: Mapping[str, Any] = field(default_factory=dict)
    """Fields of :class:`~headprobe.probe.layout.attention.AttentionLayout` the changed model must have,
    read by hand from the Hugging Face config."""


@dataclass(frozen=True)
class TinySpec:
    """The family's tiny seeded random-init checkpoint in the test zoo (``tests/zoo.py`` builds
    it with transformers, no download: 2 layers, ``d_model`` 64) and what is known of that model
    by hand from the Hugging Face modules: the facts ``tests/test_native_families.py`` and
    ``tests/test_selfcheck.py`` check the native model against. Defaults are Llama's."""

    fields: Mapping[str, Any]
    """Config fields that make the model tiny (``AutoConfig.for_model(model_type, **fields)``)."""
    layout: tuple[str, str, str, tuple[int | None, ...] | None]
    """``(kind, bias, qk_norm, windows)`` of its :class:`~headprobe.probe.layout.attention.AttentionLayout`."""
    attention_output: str = "model.layers.{l}.self_attn"
    """The Hugging Face module whose output is what layer ``{l}``'s attention adds to the residual
    stream (the attention module, or the norm after it where the block has one)."""
    post_attention_norm: bool = False
    """The block normalises the attention output before adding it (OLMo-2, Gemma-2)."""
    norm_offset: float = 0.0
    """Hugging Face's RMSNorm multiplies by ``norm_offset + w`` (Gemma: 1)."""
    self_check_reference: str = "resid_mid - resid_pre"
    """What the load-time self-check compares the heads' sum with (:mod:`headprobe.probe.hooks.selfcheck`)."""
    unprunable: str | None = None
    """What the refusal to remove its heads names (:func:`headprobe.probe.model.pruned.remove_heads`),
    or None where heads can be removed."""
    bridge: bool = True
    """TransformerLens' bridge wraps the family (the tests compare the two backends)."""
    perturb: tuple[str, ...] = ("norm",)
    """Parameter names containing one of these (and every bias) are randomised away from their
    initial value, so that every term is tested."""
    variants: tuple[Variant, ...] = ()
    """Config changes that still load natively."""
    unsupported: tuple[Mapping[str, Any], ...] = ()
    """Config changes the native backend refuses (``--backend auto`` then takes the bridge)."""
    hybrid: Mapping[str, Any] | None = None
    """Config changes that make it a hybrid model, loaded natively: linear-attention layers (no
    heads) among its attention layers; None: the family has none."""


@dataclass(frozen=True)
class Family:
    """One model family of the native backend (a Hugging Face ``model_type``)."""

    config: Callable[[Any], TransformerConfig]
    """Hugging Face config -> the :class:`TransformerConfig` that reproduces it. Raises
    :class:`HeadprobeError` (one line) for an option the native model does not implement."""
    weights: Callable[[dict[str, Tensor], TransformerConfig, bool], dict[str, Tensor]]
    """``(hf_state, cfg, rope_interleave) -> native_state``: the Hugging Face state dict (names
    as saved) in the native model's names and layouts, the tensors themselves wherever the
    conversion is a rename. ``rope_interleave`` is the checkpoint's own flag (adjacent rotary
    pairs, DeepSeek-V3; False where the config has none); a family whose checkpoints never
    interleave ignores it."""
    tiny: TinySpec
    """Its tiny test checkpoint and the facts the tests check."""
    encoder: bool = False
    """Loaded with ``AutoModel`` (no causal LM head) and run with bidirectional attention."""
    embedding_names: tuple[str, str] = ("model.embed_tokens.weight", "lm_head.weight")
    """Hugging Face names of the input embedding and the unembedding: safetensors keeps one name
    of a tied pair, and the conversion is handed the other too."""


# ---------------------------------------------------------------------------------------------
# The zoo's sizes
# ---------------------------------------------------------------------------------------------

TINY_VOCAB = 101
"""Vocabulary of the zoo's causal models: word-level ``t0 .. t99`` plus ``<|endoftext|>`` (100)."""
TINY_ENCODER_VOCAB = 104
"""Vocabulary of the zoo's encoders: ``t0 .. t99``, ``[CLS]`` 100, ``[SEP]`` 101, ``[UNK]`` 102, ``[PAD]`` 103."""
TINY_FIELDS: Mapping[str, Any] = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=64,
    intermediate_size=128,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=128,
    bos_token_id=100,
    eos_token_id=100,
    pad_token_id=100,
)
"""The zoo's tiny sizes in Llama's config names (4 query heads on 2 KV heads)."""

# ---------------------------------------------------------------------------------------------
# Helpers of the config mappings and weight conversions
# ---------------------------------------------------------------------------------------------


def hf_sizes(hf_config: Any, d_mlp: int | None = None) -> dict[str, Any]:
    """The :class:`TransformerConfig` sizes under transformers' standard config names
    (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``vocab_size``,
    ``max_position_embeddings``, ``intermediate_size``; GPT-2's ``n_layer`` ... answer to them
    through its ``attribute_map``); ``d_mlp`` given where the config has no ``intermediate_size``."""
    return dict(
        n_layers=hf_config.num_hidden_layers,
        d_model=hf_config.hidden_size,
        n_heads=hf_config.num_attention_heads,
        d_vocab=hf_config.vocab_size,
        n_ctx=hf_config.max_position_embeddings,
        d_mlp=hf_config.intermediate_size if d_mlp is None else d_mlp,
    )


def renamed(
    sd: Mapping[str, Tensor],
    pairs: tuple[tuple[str, str], ...],
    ours: str = "",
    theirs: str = "",
    params: tuple[str, ...] = ("weight", "bias"),
    transposed: bool = False,
) -> dict[str, Tensor]:
    """``{ours + a + "." + p: sd[theirs + b + "." + p]}`` for every ``(a, b)`` in ``pairs`` and ``p``
    in ``params``: the tensors themselves, or the weights transposed (``transposed``: GPT-2's
    ``Conv1D`` stores ``[in, out]``, ``nn.Linear`` wants ``[out, in]``).

    Raises:
        KeyError: a tensor missing from ``sd``.
    """
    out = {}
    for a, b in pairs:
        for p in params:
            w = sd[f"{theirs}{b}.{p}"]
            out[f"{ours}{a}.{p}"] = w.T if transposed and p == "weight" else w
    return out


GATED_MLP = (("mlp.fc_gate", "mlp.gate_proj"), ("mlp.fc_in", "mlp.up_proj"), ("mlp.fc_out", "mlp.down_proj"))
"""Native name -> Hugging Face name of a gated MLP's projections (Llama's, DeepSeek's)."""


def moe_weights(
    sd: Mapping[str, Tensor],
    ours: str,
    theirs: str,
    *,
    router: str = "gate",
    layout: str = "chunked",
    shared: str | None = None,
    shared_gate: str | None = None,
) -> dict[str, Tensor]:
    """A mixture-of-experts MLP's weights (Hugging Face names under ``theirs``) in the names and
    layouts of :class:`~headprobe.probe.model.feedforward.MoE` (under ``ours``): ``gate_up`` ``[expert, gate
    rows | up rows, d_model]`` and ``down`` ``[expert, d_model, d_expert]``.

    Args:
        router: the router's module (``gate``: Mixtral, Qwen3; ``router``: GPT-OSS, Llama-4); its
            bias is loaded where the state dict has one.
        layout: ``chunked`` (``experts.gate_up_proj`` ``[E, 2I, D]``, ``down_proj`` ``[E, D, I]``:
            ``MixtralExperts``, ``Qwen3MoeExperts``; passed through), ``transposed`` (``[E, D, 2I]``,
            ``[E, I, D]``: ``Llama4TextExperts``) or ``interleaved`` (as ``transposed`` with gate and up
            columns alternating, and biases: ``GptOssExperts``).
        shared, shared_gate: the shared expert's module (``gate_proj``/``up_proj``/``down_proj``)
            and its sigmoid gate's (Qwen3-Next), where the family has them.

    Raises:
        KeyError: a tensor missing from ``sd``.
    """
    gate_up, down = sd[f"{theirs}experts.gate_up_proj"], sd[f"{theirs}experts.down_proj"]
    out = {f"{ours}router.weight": sd[f"{theirs}{router}.weight"]}
    if f"{theirs}{router}.bias" in sd:
        out[f"{ours}router.bias"] = sd[f"{theirs}{router}.bias"]
    if layout != "chunked":
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if layout == "interleaved":  # GptOssExperts._apply_gate: gate = [..., ::2], up = [..., 1::2]
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        b = sd[f"{theirs}experts.gate_up_proj_bias"]
        out[f"{ours}gate_up_bias"] = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
        out[f"{ours}down_bias"] = sd[f"{theirs}experts.down_proj_bias"]
    out[f"{ours}gate_up"], out[f"{ours}down"] = gate_up, down
    if shared is not None:
        out.update(
            renamed(
                sd,
                (("shared.fc_gate", "gate_proj"), ("shared.fc_in", "up_proj"), ("shared.fc_out", "down_proj")),
                ours,
                f"{theirs}{shared}.",
                params=("weight",),
            )
        )
    if shared_gate is not None:
        out[f"{ours}shared_gate.weight"] = sd[f"{theirs}{shared_gate}.weight"]
    return out


GELU_MLPS: dict[str, Literal["gelu", "gelu_erf"]] = {
    "gelu": "gelu_erf",
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
}
"""Hugging Face activation name -> the native GELU MLP (``gelu_erf`` exact, ``gelu`` tanh)."""


def gelu_mlp(act: str, kind: str) -> Literal["gelu", "gelu_erf"]:
    """The native MLP of a Hugging Face GELU activation (:data:`GELU_MLPS`).

    Raises:
        HeadprobeError: another activation.
    """
    if act not in GELU_MLPS:
        raise HeadprobeError(f"native {kind} implements GELU MLPs, not {act}")
    return GELU_MLPS[act]


def rope_parameters(hf_config: Any) -> dict:
    """``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x) of a config, or {}."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return params if isinstance(params, dict) else {}


def rope_theta(hf_config: Any) -> float:
    """The rotary base: ``rope_parameters["rope_theta"]``, else ``rope_theta``, else 10000."""
    theta = rope_parameters(hf_config).get("rope_theta")
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


def plain_rope(hf_config: Any, kind: str) -> None:
    """Refuse rotary scaling (any ``rope_type`` but ``default``).

    Raises:
        HeadprobeError: a scaled rotary embedding.
    """
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise HeadprobeError(f"native {kind} implements plain rotary positions, not rope_type={rope_type}")


ROPE_LAYER_TYPES = ("full_attention", "sliding_attention")
"""Layer types that key a per-layer-type ``rope_parameters`` (transformers 5: Gemma-3, OLMo-3)."""


def layer_ropes(
    hf_config: Any, kind: str, no_rope_layers: Collection[int] = (), flat_types: Collection[str] = ("default",)
) -> dict:
    """The rotary fields of :class:`TransformerConfig`: ``rope_theta``, and ``rope_thetas`` /
    ``rope_factors`` where layers differ. A flat ``rope_parameters`` gives every layer its base
    and, of ``flat_types`` (the family's: ``default``, ``linear``, ``llama3``), its scaling
    (``rope_factors``; ``llama3_rope``); one keyed by layer type (Gemma-3's sliding layers
    with ``rope_local_base_freq``, OLMo-3) gives each layer its type's base and, for
    ``rope_type="linear"``, its factor. ``no_rope_layers`` have no positions (None in
    ``rope_thetas``).

    Raises:
        HeadprobeError: a rotary scaling other than linear per layer type, or not of ``flat_types``
            per flat config.
    """
    params = rope_parameters(hf_config)
    types = getattr(hf_config, "layer_types", None)
    scaled: dict[str, Any] = {}  # a flat config's scaling beyond a factor (llama3_rope)
    if types is not None and set(params) & set(ROPE_LAYER_TYPES):
        thetas, factors = [], []
        for t in types:
            p = params.get(t) or {}
            rope_type = p.get("rope_type", "default")
            if rope_type not in ("default", "linear"):
                raise HeadprobeError(
                    f"native {kind} implements plain and linear rotary positions, not rope_type={rope_type} on {t} layers"
                )
            thetas.append(float(p.get("rope_theta", 10000.0)))
            factors.append(float(p.get("factor", 1.0)) if rope_type == "linear" else 1.0)
    else:
        factor, scaled = _flat_scaling(hf_config, kind, flat_types)
        n = hf_config.num_hidden_layers
        thetas, factors = [rope_theta(hf_config)] * n, [factor] * n
    per_layer: list[float | None] = [None if l in no_rope_layers else t for l, t in enumerate(thetas)]
    first = next((t for t in per_layer if t is not None), thetas[0])
    out: dict[str, Any] = dict(rope_theta=first)
    if any(t != first for t in per_layer):
        out["rope_thetas"] = tuple(per_layer)
    if any(f != 1.0 for f in factors):
        out["rope_factors"] = tuple(factors)
    return {**out, **scaled}


def _flat_scaling(hf_config: Any, kind: str, flat_types: Collection[str]) -> tuple[float, dict]:
    """A flat ``rope_parameters``' scaling: ``(linear factor, other fields)``: ``(f, {})`` for linear
    (position interpolation), ``(1, {"llama3_rope": (...)})`` for Llama-3.1's (read as
    ``_compute_llama3_parameters`` reads it), ``(1, {})`` for plain rotary.

    Raises:
        HeadprobeError: a ``rope_type`` not of ``flat_types``.
    """
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in flat_types:
        raise HeadprobeError(
            f"native {kind} implements {', '.join(t.replace('default', 'plain') for t in flat_types)} rotary "
            f"positions, not rope_type={rope_type}"
        )
    if rope_type == "linear":
        return float(params["factor"]), {}
    if rope_type == "llama3":  # types normalised by TransformerConfig (check_layer_rope)
        ctx = params.get("original_max_position_embeddings") or hf_config.max_position_embeddings
        return 1.0, {"llama3_rope": (params["factor"], params["low_freq_factor"], params["high_freq_factor"], ctx)}
    return 1.0, {}


def sliding(hf_config: Any, kind: str, every_layer: bool = False) -> dict:
    """``sliding_window`` and ``sliding_layers`` (:class:`TransformerConfig`) from ``layer_types``
    (Qwen2/3, Gemma-2); without ``layer_types``, a ``sliding_window`` on every layer where
    ``every_layer`` (Mistral), else none.

    Raises:
        HeadprobeError: a layer type other than full or sliding attention, or sliding layers
            without a window.
    """
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise HeadprobeError(f"native {kind} implements full and sliding-window attention layers, not {unknown[0]}")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if not layers:
            return {}
        if window is None:
            raise HeadprobeError(f"{kind} config has sliding-window layers but no sliding_window")
        return dict(sliding_window=int(window), sliding_layers=None if len(layers) == len(types) else layers)
    if every_layer and window is not None:
        return dict(sliding_window=int(window))
    return {}
