"""``headprobe budget``: what an attention layout costs (parameters, KV cache, FLOPs, memory).

Four ways to use it:

* a layout: ``--preset llama3-8b``, explicit flags (``--d-model 4096 --n-layers 32 --n-heads 32
  --n-kv-heads 8``) or both (flags override the preset), at ``--seq-len`` and ``--batch``;
* ``--compare``: MHA, GQA with every group count, and MQA of the same heads (their key and value widths) side by side;
* ``--recommend``: propose n_heads, d_head, n_kv_heads and MLA or not for a parameter budget
  (``--params``) or width, a context length, a KV-cache limit (``--kv-limit``) and a target;
* ``--model NAME``: read the layout from a loaded model (its spec and its Hugging Face config:
  QK-norm, sliding windows, MLA sizes) and check the formulas against the model's own KV cache
  and the parameters of its layer-0 attention module (on the TransformerLens backend,
  :data:`CHECK_BACKEND`, whatever the other commands pick). A headprobe checkpoint directory
  (``headprobe train``'s, or ``prune --save-pruned``'s ``pruned_model/``) is read directly, with
  its own layout: a pruned model's layers keep different numbers of heads, and it is costed layer
  by layer next to the unpruned layout (:func:`check_headprobe_dir`, :func:`layers_report`). A
  model with one dense MLP per layer gets the whole-model rows as a preset does, its MLP,
  vocabulary and embeddings read from its config (:func:`shape_of_native_config`); a mixture of
  experts or a hybrid with linear layers gets one line saying why not.

From Python: ``headprobe.budget(preset="llama3-8b", seq_len=32768)`` returns a
:class:`BudgetResult` (``.summary()`` is the ``--json`` output, ``.format()`` the text,
``.table`` a pandas DataFrame). Nothing here imports torch, transformers or pandas at module
level: ``headprobe budget`` without ``--model`` needs none of them.

All formulas live in :mod:`headprobe.probe.layout.cost`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from headprobe.commands import Command
from headprobe.options import dtype_name, notes_flags, positive_int
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import finite_json
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.reprs import CompactRepr
from headprobe.probe.core.sizes import exact, fixed
from headprobe.probe.core.vocabulary import unsupported_dtype
from headprobe.probe.layout import cost
from headprobe.probe.layout.attention import KVPolicy, attention_module, windows_from_hf_config
from headprobe.probe.layout.cost import AttentionLayout, format_bytes, format_flops, format_tflop, format_whole
from headprobe.settings import Flags, setting

if TYPE_CHECKING:  # pragma: no cover
    import pandas

    from headprobe.probe.backends.base import LoadedModel

HELP = "attention cost calculator: parameters, KV cache, FLOPs and attention-matrix memory for MHA, GQA, MQA and MLA"

DEFAULT_SEQ_LEN = 8192
FLOPS_TABLE_SEQ_LENS = (1024, 8192, 32768, 131072)  # the lesson's table (seeds/003, "FLOPs")
LAYOUT, WORKLOAD, MODES = (
    "layout (a preset, a model, explicit flags; flags override the first two)",
    "workload",
    "modes",
)
"""The sections of ``headprobe budget --help`` (:data:`FLAGS`)."""
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog. Attention heads share keys and values."
CHECK_PAST_WINDOW = 8  # the live check runs this many tokens past the smallest sliding window
CHECK_MIN_TOKENS = 16  # and at least this many (a tokenizer may read the prompt as a single unknown token)

#: torch's dtype names -> budget's short names (the keys of :data:`cost.DTYPE_BYTES`).
TORCH_DTYPE_NAMES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "int8": "int8",
}


def budget_dtype(text: str) -> str:
    """``--dtype``: a short name (``bf16``, ``fp32``, ``fp16``, ``fp8``, ``int8``) or torch's
    (``bfloat16``, ``float32``, ``float16``, ``float8_e4m3fn``, ``float8_e5m2``, ``int8``, with or
    without ``torch.``; also ``float``, ``half``), returned as the short name.

    Raises:
        argparse.ArgumentTypeError: an unknown name (argparse turns it into a one-line usage error).
    """
    name = str(text).strip().lower().removeprefix("torch.")
    if name in cost.DTYPE_BYTES:
        return name
    if name in TORCH_DTYPE_NAMES:
        return TORCH_DTYPE_NAMES[name]
    try:
        return TORCH_DTYPE_NAMES[dtype_name(name)]
    except argparse.ArgumentTypeError:
        choices = f"{', '.join(cost.DTYPE_BYTES)} or torch's {', '.join(n for n in TORCH_DTYPE_NAMES if n not in cost.DTYPE_BYTES)}"
        if unsupported_dtype(name):  # a real dtype, not a misspelling: no spelling suggestion
            raise argparse.ArgumentTypeError(f"dtype {text!r} is not supported: budget counts {choices}") from None
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}{did_you_mean(str(text).lower(), (*cost.DTYPE_BYTES, *TORCH_DTYPE_NAMES))}; "
            f"choose one of {choices}"
        ) from None


# ---------------------------------------------------------------------------------------------
# The configuration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetConfig:
    """Everything ``headprobe budget`` computes from; each field is the flag of the same name
    (:func:`~headprobe.settings.setting`; ``--json`` is :class:`BudgetPrint`'s).

    Attributes:
        preset: a published layout by name (:data:`headprobe.probe.layout.cost.PRESETS`), or None.
        model: a model to load (a name :func:`~headprobe.probe.backends.loading.load_model` takes), read and check, or None.
        d_model: residual width D; overrides the preset's or model's.
        n_layers: number of attention layers; overrides the preset's or model's.
        n_heads: query heads H; overrides the preset's or model's (and resets n_kv_heads, d_head).
        n_kv_heads: key/value heads (None: the base's, else n_heads, i.e. MHA).
        d_head: width of each head's value and z, and of its query and key except for MLA (None: the base's,
            else d_model // n_heads).
        bias: which projections carry biases: "none", "qkv", "all" or "out" (None: the base's, else none).
        qk_norm: QK-norm weights: "none", "per_head" or "full" (None: the base's, else none).
        sliding_window: every layer (but see global_every) attends to at most this many positions.
        global_every: with sliding_window, every global_every-th layer (1-based) is global instead.
        kv_lora_rank: MLA: width of the cached KV latent; setting it makes the layout MLA.
        q_lora_rank: MLA: width of the query latent (None: full-rank queries).
        qk_rope_head_dim: MLA: width of the decoupled rotary key.
        qk_nope_head_dim: MLA: width of each head's non-rotary query/key part (None: d_head).
        seq_len: tokens per sequence T (None: :data:`DEFAULT_SEQ_LEN`, 8192; :attr:`workload_seq_len`
            is the one in use). Refused with flops_table, which takes its lengths itself.
        batch: sequences per request (the KV and attention-matrix bytes are the whole batch's).
        dtype: number format of the KV cache: fp32, bf16, fp16, fp8, int8 or torch's names; the attention
            (its matrix, the fused kernel's tensors) computes in it, or in bf16 for fp8 and int8
            (:data:`~headprobe.probe.layout.cost.COMPUTE_DTYPE`).
        compare: MHA, every GQA group count and MQA of the same heads (their key and value widths) side by side.
        flops_table: FLOPs of one layer at these lengths (an empty tuple: the lesson's lengths); None: off.
        as_mha: with flops_table, count the K/V projections as MHA (one K/V head per query head; GQA's
            are group-size times cheaper): ``8 * T * D**2`` per layer with ``n_heads * d_head == D``.
        recommend: propose a layout for params or d_model, seq_len, kv_limit and target.
        params: recommend: parameter budget without embeddings, a count or text such as "135M".
        kv_limit: recommend: KV-cache limit per request, bytes or text such as "2GiB".
        target: recommend: deployment target, one of :data:`headprobe.probe.layout.cost.TARGETS` (None: gpu-server).
        policy: a KV policy file (docs/kv.md) to cost exactly on the layout (:func:`cost.policy_cost`), or None.

    Raises:
        HeadprobeError: an unknown dtype.
    """

    preset: str | None = setting(None, f"a published layout: {', '.join(cost.PRESETS)} (default: none)")
    model: str | None = setting(
        None,
        "load this model (e.g. smollm2-135m, gpt2, a local directory, a headprobe "
        "train or prune --save-pruned directory), read its layout and check the formulas "
        "against its own KV cache and attention parameters (a Hugging Face model runs on the "
        "TransformerLens backend here, for transformers' own cache) (default: none)",
    )
    d_model: int | None = setting(None, "residual width D (default: the preset's or model's)", type=positive_int)
    n_layers: int | None = setting(
        None, "number of attention layers (default: the preset's or model's)", type=positive_int
    )
    n_heads: int | None = setting(None, "query heads H (default: the preset's or model's)", type=positive_int)
    n_kv_heads: int | None = setting(
        None, "key/value heads (default: --n-heads, i.e. MHA; 1 is MQA)", type=positive_int
    )
    d_head: int | None = setting(
        None,
        "width of each head's value (z); of its query and key too except for MLA (default: d_model / n_heads)",
        type=positive_int,
    )
    bias: str | None = setting(
        None, "projections with biases (default: the preset's, else none)", choices=cost.BIAS_KINDS
    )
    qk_norm: str | None = setting(
        None,
        "QK-norm weights: per_head (Qwen3, Gemma 3) or full (OLMo 2) (default: the model's, else none)",
        choices=cost.QK_NORM_KINDS,
    )
    sliding_window: int | None = setting(
        None,
        "layers attend to (and cache) at most W positions (Mistral: 4096; default: the preset's or model's, else "
        "none); see --global-every",
        type=positive_int,
        metavar="W",
    )
    global_every: int | None = setting(
        None,
        "with --sliding-window: every N-th layer is global (Gemma 2: 2, Gemma 3: 6; default: none, all windowed)",
        type=positive_int,
        metavar="N",
    )
    kv_lora_rank: int | None = setting(
        None, "MLA: width of the cached KV latent (DeepSeek-V3: 512; default: none, not MLA)", type=positive_int
    )
    q_lora_rank: int | None = setting(
        None, "MLA: width of the query latent (DeepSeek-V3: 1536; default: full-rank queries)", type=positive_int
    )
    qk_rope_head_dim: int | None = setting(
        None,
        "MLA: width of the decoupled rotary key (DeepSeek-V3: 64; default: the preset's or model's, else 0)",
        type=positive_int,
    )
    qk_nope_head_dim: int | None = setting(
        None,
        "MLA: width of each head's non-rotary query/key part (DeepSeek-V3: 128; default: --d-head)",
        type=positive_int,
    )
    seq_len: int | None = setting(
        None, f"tokens per sequence T (default {DEFAULT_SEQ_LEN}; --flops-table takes its own)", type=positive_int
    )
    batch: int = setting(
        1,
        "sequences per request; KV cache and attention matrices are the whole batch's (default %(default)s)",
        type=positive_int,
    )
    dtype: str = setting(
        cost.BUDGET_DTYPE,
        "number format of the KV cache, sets its bytes per number; the attention matrix and the fused kernel "
        "are in it too, or in bf16 for fp8 and int8 (storage formats) (default "
        "%(default)s; torch's names bfloat16, float32, float16 accepted)",
        type=budget_dtype,
        metavar="{" + ",".join(cost.DTYPE_BYTES) + "}",
    )
    compare: bool = setting(
        False,
        "MHA, GQA (every group count) and MQA of the same heads (key and value widths) side by side",
        action="store_true",
    )
    flops_table: Sequence[int] | None = setting(
        None,
        f"FLOPs of one layer at several lengths (default {' '.join(map(str, FLOPS_TABLE_SEQ_LENS))})",
        nargs="*",
        type=positive_int,
        metavar="T",
    )
    as_mha: bool = setting(
        False,
        "--flops-table: count the K and V projections as in multi-head attention (MHA: one K and V head "
        "per query head), the textbook 8*T*D^2 projection FLOPs of a layer when n_heads*d_head = D; "
        "without it a GQA or MQA model's K and V projections cost group-size times less",
        action="store_true",
    )
    recommend: bool = setting(
        False, "propose a head layout for --params/--d-model, --seq-len, --kv-limit, --target", action="store_true"
    )
    params: str | int | None = setting(
        None, "recommend: parameter budget without embeddings, e.g. 135M, 8B (default: none)"
    )
    kv_limit: str | int | None = setting(
        None, "recommend: KV-cache memory limit per request, e.g. 2GiB, 512MiB (default: none)"
    )
    target: str | None = setting(None, "recommend: deployment target (default gpu-server)", choices=cost.TARGETS)
    policy: str | None = setting(
        None,
        "cost a head-level KV policy (headprobe kv's policy.json: per layer and KV group, "
        "full or streaming with S sink + W recent positions; format in docs/kv.md) at "
        "--seq-len (default: none)",
        metavar="FILE",
    )

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "dtype", budget_dtype(self.dtype))
        except argparse.ArgumentTypeError as e:
            raise HeadprobeError(str(e)) from None
        if self.flops_table is not None:
            object.__setattr__(self, "flops_table", tuple(self.flops_table))

    @property
    def workload_seq_len(self) -> int:
        """T of the workload: :attr:`seq_len`, or :data:`DEFAULT_SEQ_LEN` where it is not given."""
        return DEFAULT_SEQ_LEN if self.seq_len is None else self.seq_len

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one number in :attr:`dtype`."""
        return cost.DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class BudgetPrint:
    """How ``headprobe budget`` prints its result: a flag of the command line, not part of the
    :class:`BudgetConfig` (the Python API returns the :class:`BudgetResult` itself)."""

    json: bool = setting(False, "print JSON instead of a table", action="store_true", exclusive="print")
    """Print :meth:`BudgetResult.to_dict` as JSON instead of the table."""
    latex: bool = setting(
        False,
        "print the --compare table as a LaTeX booktabs table (a paper's; the terminal's cells and units)",
        action="store_true",
        exclusive="print",
    )
    """Print :meth:`BudgetResult.latex` (``--compare`` only) instead of the table."""


LATEX_NEEDS_COMPARE = "--latex prints the --compare table: add --compare"
"""The refusal of ``--latex`` in another mode (the command line's, before the run, and :meth:`BudgetResult.latex`'s)."""

WINDOW_FLAGS = ("sliding_window", "global_every")
"""The layout flags that make a layout's per-layer ``windows`` (:func:`~headprobe.probe.layout.cost.sliding_windows`)."""

MLA_FLAGS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
"""The layout flags only multi-head latent attention has (DeepSeek-V2's latent and decoupled rotary key)."""

#: Flags that change a uniform layout; a pruned model's layers keep different heads.
UNIFORM_LAYOUT_FLAGS = (
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_head",
    "bias",
    "qk_norm",
    *WINDOW_FLAGS,
    *MLA_FLAGS,
)

FLAGS = (
    Flags(
        only=("preset", "model", *UNIFORM_LAYOUT_FLAGS),
        title=LAYOUT,
    ),
    Flags(only=("seq_len", "batch", "dtype"), title=WORKLOAD),
    Flags(
        only=("compare", "flops_table", "as_mha", "recommend", "params", "kv_limit", "target", "policy"), title=MODES
    ),
    Flags(BudgetPrint),
)
"""``--help``'s blocks: the layout, the workload and the modes under their headings, then ``--json``."""

REPORT, COMPARE, FLOPS_TABLE, RECOMMEND = "the one-layout report", "--compare", "--flops-table", "--recommend"
"""budget's modes, as a refusal names them (:data:`FLAG_MODES`)."""
LAYOUT_MODES = (REPORT, COMPARE, FLOPS_TABLE)

#: The modes each flag does something in; given in another mode it would be ignored, so
#: :func:`refuse_other_modes` refuses it. Flags not listed (``--d-model``, ``--n-layers`` and the
#: workload) apply in every mode.
FLAG_MODES: dict[str, tuple[str, ...]] = {
    "params": (RECOMMEND,),
    "kv_limit": (RECOMMEND,),
    "target": (RECOMMEND,),
    "as_mha": (FLOPS_TABLE,),
    "seq_len": (REPORT, COMPARE, RECOMMEND),
    "policy": (REPORT,),
    "preset": LAYOUT_MODES,
    "model": LAYOUT_MODES,
    **{f: LAYOUT_MODES for f in UNIFORM_LAYOUT_FLAGS if f not in ("d_model", "n_layers")},
}


def config_mode(config: BudgetConfig) -> str:
    """The mode ``config`` runs in: :data:`RECOMMEND`, :data:`COMPARE`, :data:`FLOPS_TABLE` or :data:`REPORT`."""
    if config.recommend:
        return RECOMMEND
    if config.compare:
        return COMPARE
    return FLOPS_TABLE if config.flops_table is not None else REPORT


def refuse_other_modes(config: BudgetConfig) -> None:
    """Refuse a flag given in a mode it does nothing in (:data:`FLAG_MODES`): one line naming the
    flag and the mode it belongs to.

    Raises:
        HeadprobeError: such a flag is set (not None, not False).
    """
    mode = config_mode(config)
    for f, modes in FLAG_MODES.items():
        if mode not in modes and getattr(config, f) not in (None, False):
            flag = "--" + f.replace("_", "-")
            where = modes[0] if len(modes) == 1 else ", ".join(modes[:-1]) + " or " + modes[-1]
            hint = "; --recommend proposes a layout from --params or --d-model" if modes == LAYOUT_MODES else ""
            fix = f"add {where} or leave {flag} out" if mode == REPORT and len(modes) == 1 else f"leave {flag} out"
            if f == "seq_len":  # the table's lengths follow its flag
                fix = f"give the lengths after {FLOPS_TABLE} ({FLOPS_TABLE} {config.seq_len}) and leave {flag} out"
            raise HeadprobeError(f"{flag} belongs to {where}, not {mode}{hint}: {fix}")


# ---------------------------------------------------------------------------------------------
# Building the layout
# ---------------------------------------------------------------------------------------------


def layout_from_config(config: BudgetConfig, base: AttentionLayout | None = None) -> AttentionLayout:
    """The layout the config describes, starting from ``base`` (a preset or a model) if given.

    Raises:
        HeadprobeError: unknown preset; no layout given; a bad size (see AttentionLayout);
            a new ``n_layers`` for a base with sliding windows and no new ``sliding_window``;
            a flag of another kind of layout (:func:`refuse_flags`): ``n_kv_heads`` on an MLA
            layout (it would be ignored), an MLA flag (:data:`MLA_FLAGS`) on a base without a latent
            (it would turn the base into MLA with widths it never had).
    """
    if base is None and config.preset:
        base = cost.preset(config.preset)
    if base is None:
        missing = [f for f in ("d_model", "n_layers", "n_heads") if getattr(config, f) is None]
        if missing:
            flags = ", ".join("--" + f.replace("_", "-") for f in missing)
            raise HeadprobeError(f"give --preset, --model or the layout flags; missing {flags}")
        fields_: dict[str, Any] = {}
    else:
        fields_ = base.to_dict()
        # A new width or head count invalidates the derived d_head and n_kv_heads unless given.
        if config.d_model is not None or config.n_heads is not None:
            fields_["d_head"] = None
            if config.n_heads is not None:
                fields_["n_kv_heads"] = None
        if config.d_head is not None or fields_["d_head"] is None:
            if base.qk_nope_head_dim == base.d_head:
                fields_["qk_nope_head_dim"] = None  # derived from d_head, follows it
        if config.n_layers is not None and base.windows is not None and config.sliding_window is None:
            raise HeadprobeError(
                "the base layout has sliding-window layers; with --n-layers give --sliding-window "
                "(and --global-every) for the new layers too"
            )
        if not base.is_mla:
            refuse_flags(
                config,
                MLA_FLAGS,
                f"a {base.kind} layout ({base.name or 'the base layout'}: {base.n_kv_heads} KV heads cache "
                "keys and values, no MLA latent; an MLA layout is described with --d-model, --n-layers, "
                "--n-heads and --kv-lora-rank, or an MLA preset)",
            )
    for f in UNIFORM_LAYOUT_FLAGS:  # AttentionLayout's fields; the window flags make its ``windows`` below
        if f not in WINDOW_FLAGS and getattr(config, f) is not None:
            fields_[f] = getattr(config, f)
    if fields_.get("kv_lora_rank") is not None:
        refuse_flags(
            config,
            ("n_kv_heads",),
            f"an MLA layout (--kv-lora-rank {fields_['kv_lora_rank']}: every query head reads one cached latent)",
        )
    if config.sliding_window is not None or config.global_every is not None:
        n_layers = fields_.get("n_layers")
        assert n_layers is not None  # given (the missing-flags check) or the base's
        fields_["windows"] = cost.sliding_windows(n_layers, config.sliding_window, config.global_every)
    fields_["bytes_per_element"] = config.bytes_per_element
    return AttentionLayout(**fields_)


def refuse_flags(config: BudgetConfig, flags: Sequence[str], layout: str) -> None:
    """Refuse those of ``flags`` that ``config`` sets, as not applying to ``layout`` (a phrase:
    ``"an MLA layout (...)"``): one line naming each flag and its value.

    Raises:
        HeadprobeError: one of ``flags`` is set."""
    given = [f for f in flags if getattr(config, f) is not None]
    if given:
        named = ", ".join(f"--{f.replace('_', '-')} {getattr(config, f)}" for f in given)
        one = len(given) == 1
        raise HeadprobeError(
            f"{named} {'does' if one else 'do'} not apply to {layout}; leave {'it' if one else 'them'} out"
        )


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def describe_windows(lay: AttentionLayout) -> str:
    """``1 of 2 layers sliding-window (8 positions)``, or ``""`` when every layer is global."""
    if lay.windows is None:
        return ""
    sizes = sorted({w for w in lay.windows if w is not None})
    size_txt = ", ".join(f"{w:,}" for w in sizes) + (" position" if sizes == [1] else " positions")
    return f"{lay.n_windowed_layers} of {lay.n_layers} layers sliding-window ({size_txt})"


def describe(lay: AttentionLayout, dtype: str | None = None) -> str:
    """One line: name, kind, width, layers, heads, bias, QK-norm, windows, bytes per element."""
    heads = f"{lay.n_heads} query heads x d_head {lay.d_head}"
    if lay.is_mla:
        heads += f", MLA latent {lay.kv_lora_rank} + rotary key {lay.qk_rope_head_dim}"
        if lay.q_lora_rank:
            heads += f", query latent {lay.q_lora_rank}"
        if lay.qk_nope_head_dim != lay.d_head:
            heads += f", non-rotary query/key part {lay.qk_nope_head_dim}"
    else:
        kv = "1 KV head" if lay.n_kv_heads == 1 else f"{lay.n_kv_heads} KV heads"
        heads += f", {kv} (group size {lay.group_size})"
        if lay.d_qk != lay.d_head:
            heads += f", query/key width {lay.d_qk}"
    size = f"{lay.bytes_per_element} byte{'' if lay.bytes_per_element == 1 else 's'}"
    fmt = f"{dtype} ({size})" if dtype else f"{size} per element"
    if dtype and cost.COMPUTE_DTYPE[dtype] != dtype:  # a storage format: the KV cache's, not the attention's
        fmt = f"{dtype} KV cache ({size}), attention computed in {cost.COMPUTE_DTYPE[dtype]}"
    name = f"{lay.name}: " if lay.name else ""
    extra = "".join(
        f", {x}" for x in (f"QK-norm {lay.qk_norm}" if lay.qk_norm != "none" else "", describe_windows(lay)) if x
    )
    return f"{name}{lay.kind}, d_model {lay.d_model}, {lay.n_layers} layers, {heads}, bias {lay.bias}{extra}, {fmt}"


def report(
    lay: AttentionLayout,
    seq_len: int,
    batch: int,
    shape: cost.ModelShape | None = None,
    no_shape: str | None = None,
) -> dict[str, Any]:
    """Every number of one layout at one workload, as plain integers and floats (bytes, FLOPs, counts);
    with a preset's or model's ``shape`` (:data:`~headprobe.probe.layout.cost.MODEL_SHAPES`,
    :func:`shape_of_native_config`) the whole model's parameters and forward FLOPs per token too
    (:func:`whole_model_report`); ``no_shape``: why a model has none (``whole_model_missing``)."""
    mha = lay.as_mha()
    fl = cost.attention_flops(lay, seq_len, batch)
    fl_mha = cost.attention_flops(lay, seq_len, batch, as_mha=True)
    return {
        "layout": lay.to_dict() | {"kind": lay.kind},
        "workload": {"seq_len": seq_len, "batch": batch},
        "attn_params_per_layer": cost.attention_params_per_layer(lay),
        "attn_params": cost.attention_params(lay),
        "kv_numbers_per_token_per_layer": cost.kv_numbers_per_token_per_layer(lay),
        "kv_numbers_per_token_per_layer_mha": cost.kv_numbers_per_token_per_layer(mha),
        "kv_bytes_per_token": cost.kv_bytes_per_token(lay),
        "kv_bytes_per_token_mha": cost.kv_bytes_per_token(mha),
        "kv_bytes_per_token_spans": [asdict(x) for x in cost.kv_bytes_per_token_spans(lay)],
        "kv_bytes_per_token_spans_mha": [asdict(x) for x in cost.kv_bytes_per_token_spans(mha)],
        "kv_bytes_per_request": cost.kv_bytes_per_request(lay, seq_len, batch),
        "kv_bytes_per_request_mha": cost.kv_bytes_per_request(mha, seq_len, batch),
        "flops_projections_per_layer": fl.projections,
        "flops_projections_per_layer_as_mha": fl_mha.projections,
        "flops_scores_per_layer": fl.scores,
        "quadratic_share": fl.quadratic_share,
        "quadratic_share_as_mha": fl_mha.quadratic_share,
        "crossover_seq_len": fl.crossover_seq_len,
        "crossover_seq_len_as_mha": fl_mha.crossover_seq_len,
        "attention_matrix_bytes_per_layer": cost.attention_matrix_bytes(lay, seq_len, batch),
        "fused_attention_bytes_per_layer": cost.fused_attention_bytes(lay, seq_len, batch),
        "activation_bytes_per_element": cost.activation_bytes(lay),
        **(whole_model_report(lay, shape, seq_len) if shape is not None else {}),
        **({"whole_model_missing": no_shape} if no_shape else {}),
        **windowed_report(lay, seq_len, batch),
    }


def whole_model_report(lay: AttentionLayout, shape: cost.ModelShape, seq_len: int) -> dict[str, Any]:
    """The whole model's parameters by part (:func:`~headprobe.probe.layout.cost.model_params`) and
    the forward FLOPs of a token that attends to ``seq_len`` keys
    (:func:`~headprobe.probe.layout.cost.forward_flops_per_token`, Kaplan et al. 2020's 2N plus
    the scores and AV), with the attention part of the latter (FLOPs, counts)."""
    params = cost.model_params(lay, shape)
    context = cost.score_flops(lay, 1, 1) * cost.kv_positions_total(lay, seq_len)
    return _whole_model_dict(params, shape, context)


def _whole_model_dict(params: cost.ModelParams, shape: cost.ModelShape, context: int) -> dict[str, Any]:
    """The whole-model keys of a report: ``params`` by part, and ``2 N + context`` FLOPs per token."""
    return {
        "model_params": params.total,
        "model_params_by_part": {
            "attention": params.attention,
            "mlp": params.mlp,
            "norms": params.norms,
            "embeddings": params.embeddings,
        },
        "model_params_non_embedding": params.non_embedding,
        "tied_embeddings": shape.tied_embeddings,
        "forward_flops_per_token": 2 * params.non_embedding + context,
        "forward_flops_per_token_attention_context": context,
    }


def whole_model_rows(r: dict[str, Any], seq_len: int) -> list[list[str]]:
    """The report's whole-model rows (:func:`whole_model_report`), empty without a preset's or model's shape."""
    if "model_params" not in r:
        return []
    part = r["model_params_by_part"]
    tied = "tied" if r["tied_embeddings"] else "untied"
    context = r["forward_flops_per_token_attention_context"]
    return [
        [
            "parameters, whole model",
            f"{r['model_params']:,}",
            f"attention {part['attention']:,} + MLP {part['mlp']:,} + norms {part['norms']:,} "
            f"+ embeddings {part['embeddings']:,} ({tied})",
        ],
        [
            "forward FLOPs per token, whole model",
            format_flops(r["forward_flops_per_token"]),
            f"2 x {r['model_params_non_embedding']:,} non-embedding params + {format_flops(context)} scores + AV "
            f"against {seq_len:,} keys (Kaplan et al. 2020, AV added; output layer not counted)",
        ],
    ]


def windowed_report(lay: AttentionLayout, seq_len: int, batch: int) -> dict[str, Any]:
    """The sliding-window layers' costs, one entry per window size: each query at ``pos`` reads
    ``min(W, pos + 1)`` keys (:func:`~headprobe.probe.layout.cost.visible_keys`), so the scores+AV FLOPs
    (:func:`~headprobe.probe.layout.cost.attention_flops_by_window`), the attention-matrix bytes and
    the crossover are the window's; plus the sum over all layers. Empty when every layer is global."""
    if lay.windows is None:
        return {}
    rows = []
    for fl in cost.attention_flops_by_window(lay, seq_len, batch):
        w = fl.window
        if w is None:
            continue
        rows.append(
            {
                "window": w,
                "n_layers": fl.n_layers,
                "flops_scores_per_layer": fl.scores,
                "quadratic_share": fl.quadratic_share,
                "crossover_seq_len": fl.crossover_seq_len,
                **({} if fl.crossover_seq_len is not None else {"crossover_seq_len_null_reason": _never(lay, w)}),
                "attention_matrix_bytes_per_layer": cost.attention_matrix_bytes(lay, seq_len, batch, window=w),
            }
        )
    # one count on every layer: the causal keys (a global layer is a window of T), as the windowed rows
    kinds = []
    for w, n in cost.layer_windows(lay):
        per_layer = cost.score_flops(lay, seq_len, batch, window=seq_len if w is None else w)
        kinds.append({"window": w, "n_layers": n, "flops_scores_per_layer": per_layer, "flops_scores": n * per_layer})
    return {
        "windowed_layers": rows,
        "flops_scores_by_kind": kinds,
        "flops_scores_all_layers": sum(k["flops_scores"] for k in kinds),
        "n_global_layers": lay.n_layers - lay.n_windowed_layers,
    }


def _never(lay: AttentionLayout, window: int, as_mha: bool = False) -> str:
    """Why a window's crossover is None: past the window a token's scores cost ``s*W``, no more than its projections."""
    return (
        f"never: past the window a token's scores+AV cost s*W = {cost.score_flops(lay, 1, 1) * window:,} "
        f"FLOPs, no more than its projections' {cost.projection_flops(lay, 1, 1, as_mha=as_mha):,}; the projections "
        "dominate at every length"
    )


def _kind_txt(window: int | None, windowed: bool) -> str:
    """A layer kind's label: ``window 4,096``, ``global layer`` (in a layout with windows) or ``""``."""
    if window is not None:
        return f"window {window:,}"
    return "global layer" if windowed else ""


def _table(rows: list[list[str]], header: list[str], right: set[int] | frozenset[int] = frozenset()) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_report(r: dict[str, Any], lay: AttentionLayout, dtype: str) -> str:
    T, B = r["workload"]["seq_len"], r["workload"]["batch"]
    other = lay.kind != "MHA"
    assert lay.d_head is not None  # filled by AttentionLayout.__post_init__
    two_d = " = 2D" if lay.n_heads * lay.d_head == lay.d_model else ""
    mha = (lambda s: f"MHA: {s}") if other else (lambda s: "")
    compute = cost.COMPUTE_DTYPE[dtype]  # the attention matrix's dtype, not the cache's storage format
    rows = [
        ["attention params per layer", f"{r['attn_params_per_layer']:,}", f"bias {lay.bias}"],
        ["attention params, all layers", f"{r['attn_params']:,}", f"{lay.n_layers} layers"],
        *whole_model_rows(r, T),
        [
            "KV numbers per token per layer",
            f"{r['kv_numbers_per_token_per_layer']:,}",
            mha(f"{r['kv_numbers_per_token_per_layer_mha']:,}")
            + (f" (keys {lay.d_qk} + values {lay.d_head} wide)" if other and lay.d_qk != lay.d_head else ""),
        ],
        *kv_token_rows(r, mha),
        [
            "attention projection FLOPs per layer",
            format_flops(r["flops_projections_per_layer"]),
            mha(format_flops(r["flops_projections_per_layer_as_mha"])),
        ],
        ["scores + AV FLOPs per layer", format_flops(r["flops_scores_per_layer"]), "all heads, causal mask not used"],
        ["quadratic share", f"{100 * r['quadratic_share']:.0f}%", mha(f"{100 * r['quadratic_share_as_mha']:.0f}%")],
        [
            "crossover T (projections = scores)",
            format_whole(r["crossover_seq_len"]),
            mha(format_whole(r["crossover_seq_len_as_mha"]) + two_d) if other else two_d.strip(" ="),
        ],
        [
            f"attention matrix per layer [batch, head, T, T] in {compute}",
            format_bytes(r["attention_matrix_bytes_per_layer"]),
            "naive, materialised: all T^2, the masked half too",
        ],
        [
            "fused kernel per layer (Q, K, V, out, LSE)",
            format_bytes(r["fused_attention_bytes_per_layer"]),
            f"FlashAttention / SDPA; {compute}, LSE fp32",
        ],
    ]
    full = len(rows) - 5  # the full-attention rows: scores, quadratic share, crossover, attention matrix
    if lay.windows is not None and lay.n_windowed_layers == lay.n_layers:
        del rows[full : full + 4]  # no layer of this layout is global
    elif lay.windows is not None:
        for i in range(full, full + 4):  # what a global layer costs
            rows[i][0] += ", global layer"
        n_global = r["n_global_layers"]
        causal = format_flops(r["flops_scores_by_kind"][0]["flops_scores_per_layer"])
        rows[full][2] = (
            f"each of {n_global} of {lay.n_layers} layers; all T^2 scores, causal mask not used (causal: {causal})"
        )
    head = (
        f"{describe(lay, dtype)}\nworkload: batch {B} x seq_len {T}; 1 KiB = 2^10 bytes, 1 TFLOP = 10^12 FLOPs\n"
        f"{scope_line('model_params' in r, r.get('whole_model_missing'))}\n"
    )
    return head + "\n" + _table([*rows, *windowed_rows(r, lay, compute)], ["quantity", "value", "note"], right={1})


def scope_line(whole_model: bool, missing: str | None) -> str:
    """A report's third header line: its rows count attention only, except the whole-model rows
    where it has them (``whole_model``), and why a model has none (``missing``)."""
    only = ", except the rows marked whole model" if whole_model else ""
    return f"rows count attention only (no MLP, embeddings or norms){only}" + (f"; {missing}" if missing else "")


def windowed_rows(r: dict[str, Any], lay: AttentionLayout, compute: str) -> list[list[str]]:
    """The report's rows of a layout with windows: each window's per-layer rows (the note says how
    many of the model's layers have it), then the scores + AV FLOPs over the layers of each kind
    (``x n``, causal keys) and their sum, all layers, which is what the rows above it add up to."""
    rows = []
    for w in r.get("windowed_layers", []):
        cross = (
            "never (projections dominate)" if w["crossover_seq_len"] is None else format_whole(w["crossover_seq_len"])
        )
        note = f"each of {w['n_layers']} of {lay.n_layers} layers; min(W, pos+1) keys per query"
        rows += [
            [f"scores + AV FLOPs per layer, window {w['window']:,}", format_flops(w["flops_scores_per_layer"]), note],
            [f"quadratic share, window {w['window']:,}", f"{100 * w['quadratic_share']:.0f}%", ""],
            [f"crossover T, window {w['window']:,}", cross, ""],
            [
                f"attention matrix per layer in {compute}, window {w['window']:,}",
                format_bytes(w["attention_matrix_bytes_per_layer"]),
                f"banded: the min(W, pos+1) keys each query reads; an eager kernel, masked, holds all T^2: "
                f"{format_bytes(r['attention_matrix_bytes_per_layer'])}",
            ],
        ]
    kinds = r.get("flops_scores_by_kind", [])
    if len(kinds) > 1:  # one row per kind of layer, which the total adds up
        for k in kinds:
            what = "global layers" if k["window"] is None else f"window {k['window']:,} layers"
            keys = "pos+1" if k["window"] is None else "min(W, pos+1)"
            rows.append(
                [
                    f"scores + AV FLOPs, {what} (x{k['n_layers']})",
                    format_flops(k["flops_scores"]),
                    f"{k['n_layers']} x {format_flops(k['flops_scores_per_layer'])}, causal: {keys} keys per query",
                ]
            )
    if kinds:
        terms = (
            " + ".join(format_flops(k["flops_scores"]) for k in kinds)
            if len(kinds) > 1
            else f"{kinds[0]['n_layers']} x {format_flops(kinds[0]['flops_scores_per_layer'])}"
        )
        rows.append(
            [
                f"scores + AV FLOPs, all {lay.n_layers} layers",
                format_flops(r["flops_scores_all_layers"]),
                f"= {terms}; windows applied, causal keys on every layer",
            ]
        )
    return rows


def _span_label(span: dict[str, Any]) -> str:
    """``KV cache per token, tokens 1 to 4,096``, ``..., past token 4,096`` or ``KV cache per token``."""
    first, last = span["first_token"], span["last_token"]
    if last is not None:
        return f"KV cache per token, tokens {first:,} to {last:,}"
    return "KV cache per token" if first == 1 else f"KV cache per token, past token {first - 1:,}"


def kv_token_rows(r: dict[str, Any], mha: Callable[[str], str]) -> list[list[str]]:
    """The report's KV-cache rows: what a token adds to the cache, one row per span of positions
    (:func:`~headprobe.probe.layout.cost.kv_bytes_per_token_spans`: with sliding windows a token
    past a window adds nothing to that layer, so the per-token cost is not one number), then the
    cache of the batch, whose note says it is the sum of the spans' tokens when windows apply."""
    T, B = r["workload"]["seq_len"], r["workload"]["batch"]
    spans, spans_mha = r["kv_bytes_per_token_spans"], r["kv_bytes_per_token_spans_mha"]
    windowed = len(spans) > 1
    rows = []
    for span, other in zip(spans, spans_mha):
        where = ""
        if windowed and span["last_token"] is None:
            where = (
                "every layer windowed: the oldest position is dropped"
                if span["n_layers"] == 0
                else f"only the {span['n_layers']:,} layer{'s' if span['n_layers'] != 1 else ''} without a window"
            )
        elif windowed:
            where = f"{span['n_layers']:,} layers cache it"
        note = "; ".join(x for x in (mha(format_bytes(other["bytes_per_token"])), where) if x)
        rows.append([_span_label(span), format_bytes(span["bytes_per_token"]), note])
    total = mha(format_bytes(r["kv_bytes_per_request_mha"]))
    if windowed:
        used = [(s["bytes_per_token"], cost.KVTokenSpan(**s).tokens_within(T)) for s in spans]
        terms = " + ".join(f"{format_bytes(b)} x {n:,}" for b, n in used if n)
        total = "; ".join(x for x in (total, f"= {terms}" + (f", x {B} sequences" if B > 1 else "")) if x)
    rows.append([kv_batch_label(B, T), format_bytes(r["kv_bytes_per_request"]), total])
    return rows


def causal_keys_txt(lay: AttentionLayout) -> str:
    """The keys a full KV group's query reads, as the policy's FLOPs count them on ``lay``:
    ``pos+1`` (every layer global), ``min(4,096, pos+1)`` (every layer windowed to 4,096), or per
    kind of layer (:func:`~headprobe.probe.layout.cost.layer_windows`)."""
    kinds = cost.layer_windows(lay)
    if len(kinds) == 1:
        w = kinds[0][0]
        return "pos+1" if w is None else f"min({w:,}, pos+1)"
    return ", ".join(
        f"{'pos+1' if w is None else f'min({w:,}, pos+1)'} on {n} {'global' if w is None else 'windowed'} layers"
        for w, n in kinds
    )


def measured_length_note(policy: KVPolicy, measured: int | None, seq_len: int) -> str | None:
    """The NOTE under ``--policy``'s header where the policy is costed at ``seq_len`` tokens and its
    quality was measured at another length (``measured``; None: not recorded): the window's share of
    the sequence there and here. None at the measured length or without a streaming group.
    (A window of 128 is 1/8 of 1,024 tokens and 1/256 of 32,768: the cost is exact at any length,
    the quality was measured at one.)"""
    spans = {(s.sink, s.window) for row in policy.groups for s in row if s is not None}
    if not spans or measured == seq_len:
        return None
    sink, window = max(spans, key=sum)
    kept = f"sink {sink} + window {window}" if len(spans) == 1 else f"sink + window up to {sink} + {window}"
    share = lambda n: f"{100 * (sink + window) / n:.3g}%"
    said = (
        f"this policy's quality was measured at {measured:,} tokens ({kept} = {share(measured)} of it)"
        if measured is not None
        else f"the length this policy's quality was measured at is not recorded (headprobe kv's policy.json records it; {kept})"
    )
    return f"{said}; at {seq_len:,} tokens the window is {share(seq_len)}: the cost is exact, the quality is not measured at this length"


def format_policy(
    pc: dict[str, Any], path: str, lay: AttentionLayout, dtype: str = cost.BUDGET_DTYPE, note: str | None = None
) -> str:
    """The ``--policy`` rows: the policy's cache, FLOPs and attention matrix next to all-full; the
    notes name the keys the FLOPs count on ``lay`` (its layers' windows apply); ``note``
    (:func:`measured_length_note`) under the header."""
    full = causal_keys_txt(lay)
    streaming = "min(S+W, pos+1)" if lay.windows is None else "min(S+W, pos+1) within the layer's window"
    rows = [
        ["KV groups full / streaming", f"{pc['n_full_groups']:,} / {pc['n_streaming_groups']:,}", ""],
        ["KV cache of the batch, policy", format_bytes(pc["kv_bytes"]), f"{pc['kv_bytes']:,} bytes"],
        ["KV cache of the batch, all groups full", format_bytes(pc["kv_bytes_full"]), f"{pc['kv_bytes_full']:,} bytes"],
        ["KV cache fraction", f"{pc['kv_fraction']:.4f}", "policy / full"],
        [
            "scores + AV FLOPs, all layers, policy",
            format_flops(pc["flops_scores"], like=pc["flops_scores_full"]),
            f"causal keys, streaming: {streaming}; full: {full}",
        ],
        ["scores + AV FLOPs, all layers, full", format_flops(pc["flops_scores_full"]), f"causal keys: {full}"],
        [
            f"attention matrix, largest layer, policy, in {cost.COMPUTE_DTYPE[dtype]}",
            format_bytes(pc["attention_matrix_bytes_largest_layer"]),
            "",
        ],
    ]
    return (
        f"KV policy {path}\n"
        + (f"NOTE: {note}\n" if note else "")
        + "\n"
        + _table(rows, ["quantity", "value", "note"], right={1})
    )


def kv_batch_label(batch: int, seq_len: int) -> str:
    """The report's KV-cache row: the cache of the whole batch (``--batch`` sequences of ``seq_len``
    tokens), which ``kv_bytes_per_request`` counts; "per request (4 x 2048 tokens)" read as one
    sequence's."""
    return f"KV cache, {batch} sequence{'s' if batch != 1 else ''} x {seq_len} tokens"


def distinct_flops(values: list[int]) -> list[str]:
    """``values`` (FLOPs) as :func:`~headprobe.probe.layout.cost.format_flops` prints them, all in
    the largest one's unit, each with as many more decimals as it takes for different counts to print differently (the
    ``--compare`` column: MHA 176.3, GQA 169.1 and MQA 166.7 GFLOP printed 0.18, 0.17, 0.17 TFLOP),
    at most 13 more."""
    texts = [format_flops(v, like=max(values)) for v in values]  # one unit in a column
    shown = [text.split(" ") for text in texts]  # (number, unit) as format_flops prints each
    powers = dict(_FLOP_UNITS)
    for extra in range(1, 14):
        if len(set(texts)) == len(set(values)):
            return texts
        texts = [
            f"{fixed(exact(v) / 10 ** powers.get(unit, 0), len(number.partition('.')[2]) + extra)} {unit}"
            for v, (number, unit) in zip(values, shown)
        ]
    return texts


def layout_names(rows: list[dict[str, Any]]) -> list[str]:
    """One name per ``--compare`` row, each distinct (a LaTeX column per layout): the layout's name,
    with its KV heads where several rows share it (``GQA-8``, ``GQA-4``: Ainslie et al. 2023's
    GQA-G), and its position where that is not yet enough."""
    names = [r["layout"] for r in rows]
    names = [
        f"{n}-{r['n_kv_heads']}" if names.count(n) > 1 and r["n_kv_heads"] is not None else n
        for n, r in zip(names, rows)
    ]
    return [f"{n} ({i + 1})" if names.count(n) > 1 else n for i, n in enumerate(names)]


def kv_token_header(lay: AttentionLayout) -> str:
    """``--compare``'s per-token KV column: ``KV/token``, or with windows ``KV/token, tokens 1 to
    4,096``: a token past the smallest window adds less (nothing when every layer is windowed;
    the one-layout report gives every span, :func:`kv_token_rows`)."""
    if lay.windows is None or lay.n_windowed_layers == 0:
        return "KV/token"
    return f"KV/token, tokens 1 to {min(w for w in lay.windows if w is not None):,}"


def format_compare(rows: list[dict[str, Any]], lay: AttentionLayout, dtype: str, seq_len: int, batch: int) -> str:
    """The ``--compare`` table: one row per layout, one FLOPs column per kind of layer (global,
    each window; :func:`~headprobe.probe.layout.cost.attention_flops_by_window`)."""
    header, table = compare_cells(rows, lay, seq_len, batch)
    return f"{describe(lay, dtype)}\n\n" + _table(table, header, right=set(range(1, len(header))))


def compare_cells(
    rows: list[dict[str, Any]], lay: AttentionLayout, seq_len: int, batch: int
) -> tuple[list[str], list[list[str]]]:
    """``(header, cells)`` of the ``--compare`` table as the terminal and ``--latex`` print it."""
    table = [
        [
            r["layout"],
            "-" if r["n_kv_heads"] is None else str(r["n_kv_heads"]),
            "-" if r["group_size"] is None else str(r["group_size"]),
            f"{r['d_qk']}/{r['d_head']}",
            f"{r['attn_params_per_layer']:,}",
            f"{r['kv_numbers_per_token_per_layer']:,}",
            format_bytes(r["kv_bytes_per_token"]),
            format_bytes(r["kv_bytes_per_request"]),
            f"{r['kv_vs_mha']:.3g}x",
        ]
        for r in rows
    ]
    for i in range(len(rows[0]["flops_per_layer_by_window"])):  # each kind of layer's FLOPs, told apart
        for line, text in zip(
            table, distinct_flops([r["flops_per_layer_by_window"][i]["flops_per_layer"] for r in rows])
        ):
            line.append(text)
    for line, r in zip(table, rows):
        line += [
            format_bytes(r["attention_matrix_bytes_per_layer"]),
            format_bytes(r["fused_attention_bytes_per_layer"]),
        ]
    kinds = [_kind_txt(k["window"], lay.windows is not None) for k in rows[0]["flops_per_layer_by_window"]]
    first = rows[0]["flops_per_layer_by_window"][0]["window"]  # the kind of layer the matrix column counts
    matrix = "" if lay.windows is None else ", global" if first is None else f", window {first:,}"
    header = [
        "layout",
        "n_kv_heads",
        "group_size",
        "key/value width",
        "attn params/layer",
        "KV numbers/token/layer",
        kv_token_header(lay),
        f"KV/batch ({batch} x {seq_len})",
        "KV vs MHA",
        *(f"FLOPs/layer, {k}" if k else "FLOPs/layer" for k in kinds),
        f"attn matrix/layer{matrix}",
        "fused kernel/layer",
    ]
    return header, table


def flops_table(lay: AttentionLayout, seq_lens: list[int], batch: int, as_mha: bool) -> list[dict[str, Any]]:
    """One row per T and kind of layer (:func:`~headprobe.probe.layout.cost.attention_flops_by_window`:
    global, then each window): ``seq_len``, ``window`` (positions, None for a global layer),
    ``n_layers``, ``projections`` and ``scores`` (FLOPs of one such layer), ``quadratic_share``,
    ``crossover_seq_len`` (None when a window keeps the scores below the projections)."""
    return [
        {
            "seq_len": T,
            "window": fl.window,
            "n_layers": fl.n_layers,
            "projections": fl.projections,
            "scores": fl.scores,
            "quadratic_share": fl.quadratic_share,
            "crossover_seq_len": fl.crossover_seq_len,
        }
        for T in seq_lens
        for fl in cost.attention_flops_by_window(lay, T, batch, as_mha=as_mha)
    ]


_FLOP_UNITS = (("TFLOP", 12), ("GFLOP", 9), ("MFLOP", 6), ("kFLOP", 3))


def format_flops_table(rows: list[dict[str, Any]], lay: AttentionLayout, dtype: str, as_mha: bool) -> str:
    """The table in TFLOP as in the lesson, or in the largest decimal unit in which the table's
    largest entry is at least 1 (a small model's rows would otherwise all read ``0.00``); with
    sliding windows a ``layers`` column names each row's kind of layer and each kind gets its crossover."""
    top = max((max(r["projections"], r["scores"]) for r in rows), default=cost.TFLOP)
    unit, power = next(((u, p) for u, p in _FLOP_UNITS if top >= 10**p), _FLOP_UNITS[-1])
    scale = Fraction(cost.TFLOP, 10**power)  # format_tflop counts TFLOP; exact at any size
    windowed = lay.windows is not None
    table = [
        [
            f"{r['seq_len']:,}",
            *([_kind_txt(r["window"], True)] if windowed else []),
            format_tflop(r["projections"] * scale),
            format_tflop(r["scores"] * scale),
            f"{100 * r['quadratic_share']:.0f}%",
        ]
        for r in rows
    ]
    note = " (K/V projections counted as MHA)" if as_mha and lay.kind != "MHA" else ""
    keys = "; a window W: min(W, pos+1) keys per query, a global layer: T^2" if windowed else ""
    header = ["T", *(["layers"] if windowed else []), f"projections, {unit}", f"scores and AV, {unit}"]
    first = [r for r in rows if r["seq_len"] == rows[0]["seq_len"]] if rows else []
    cross = [_crossover_txt(r, lay, as_mha, windowed) for r in first]
    return (
        f"{describe(lay, dtype)}\nFLOPs of one attention layer{note}{keys}; 1 {unit} = 10^{power} FLOPs\n\n"
        + _table(table, [*header, "quadratic share"], right={0, *range(len(header) - 2, len(header) + 1)})
        + "\n\n"
        + "\n".join(cross)
    )


def _crossover_txt(row: dict[str, Any], lay: AttentionLayout, as_mha: bool, windowed: bool) -> str:
    """``the two are equal at T = 8,192``, prefixed by the layer kind in a layout with windows."""
    kind = _kind_txt(row["window"], windowed)
    prefix = f"{kind}: " if kind else ""
    if row["crossover_seq_len"] is None:
        return f"{prefix}the two are never equal ({_never(lay, row['window'], as_mha).removeprefix('never: ')})"
    return f"{prefix}the two are equal at T = {format_whole(row['crossover_seq_len'])}"


def format_recommendation(rec: cost.Recommendation, dtype: str) -> str:
    return "\n".join([f"target {rec.target}: {describe(rec.layout, dtype)}", "", *rec.explanation])


# ---------------------------------------------------------------------------------------------
# Live check against a model's own KV cache and attention module
# ---------------------------------------------------------------------------------------------


def _cache_tensors(cache: Any) -> list[tuple[Any, Any]]:
    """(keys, values) per layer from a Hugging Face cache (``DynamicCache``, ``StaticCache`` or the legacy tuples)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]


def attention_params_of_hf_config(config: Any) -> int | None:
    """Parameters of layer 0's attention module as Hugging Face builds it from ``config`` (a count).

    The model class is instantiated on the meta device (no memory, no weights), so the count is
    what the architecture's own attention module holds
    (:func:`~headprobe.probe.layout.attention.attention_module`: projections, biases, QK-norm and MLA
    latent norms), independent of any wrapper that rearranges the loaded weights.

    Returns:
        None when the module cannot be built or found.
    """
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception:  # an architecture transformers cannot build from its config alone
        return None
    module = attention_module(skeleton)
    return None if module is None else sum(p.numel() for p in module.parameters())


def attention_params_of_model(loaded: LoadedModel) -> int | None:
    """Parameters of layer 0's attention of a loaded model, from its Hugging Face config
    (:func:`attention_params_of_hf_config`), or None without one."""
    cfg = loaded.hf_config
    return None if cfg is None else attention_params_of_hf_config(cfg)


def check_length(lay: AttentionLayout, prompt_tokens: int, n_ctx: int) -> int:
    """Tokens the live check runs: the prompt's, at least ``CHECK_MIN_TOKENS``, and
    ``CHECK_PAST_WINDOW`` past the smallest sliding window so that every window is full, each
    where it fits the model's context ``n_ctx``."""
    n = max(prompt_tokens, min(CHECK_MIN_TOKENS, n_ctx))
    if lay.windows is None:
        return n
    wanted = min(w for w in lay.windows if w is not None) + CHECK_PAST_WINDOW
    return max(n, wanted) if wanted <= n_ctx else n


def measure_kv_cache(loaded: LoadedModel, n_tokens: int | None = None, text: str = CHECK_PROMPT) -> dict[str, Any]:
    """Run ``loaded`` once on ``n_tokens`` tokens (``text``, repeated as needed; default: ``text``
    once) with the model's own Hugging Face cache and measure what it holds.

    The cache is transformers' ``StaticCache`` built from the model's config for ``n_tokens``
    positions: a ``StaticSlidingWindowLayer`` of ``min(n_tokens, sliding_window)`` positions for
    each sliding-window layer, a full layer for each global one, with the key/value shapes the
    model's attention writes (``DynamicCache`` keeps one position fewer in sliding layers between
    steps). The bridge's ``return_type="logits_and_cache"`` hands it back filled.

    Returns:
        ``tokens`` (batch * positions), ``n_layers`` (cached layers), ``key_shape`` and
        ``value_shape`` of layer 0 ``[batch, kv_head, pos, d]``, ``positions_per_layer``,
        ``element_bytes``, ``numbers_per_token_per_layer`` (numbers per cached position per
        layer, a count), ``bytes`` (all layers) and ``bytes_per_token`` (``bytes / tokens``),
        from the tensors' numel and element size; ``cache_class``, the cache the model returned.

    Raises:
        HeadprobeError: the model returned no cache, or an empty one.
    """
    prompt = loaded.to_tokens(text)[0]  # [pos]
    n = max(n_tokens or 0, prompt.shape[0])
    tokens = prompt.repeat(-(-n // prompt.shape[0]))[:n][None].to(loaded.device)
    cfg = loaded.hf_config
    kwargs: dict[str, Any] = {}
    if cfg is not None:
        from transformers import StaticCache

        kwargs["cache"] = StaticCache(config=cfg, max_cache_len=n)
    cache = loaded.forward_with_cache(tokens, **kwargs)  # the TransformerLens backend's
    pairs = _cache_tensors(cache) if cache is not None else []
    if not pairs or any(k is None or v is None for k, v in pairs):
        raise HeadprobeError(f"model {loaded.spec.name} returned no key/value cache; the live check needs one")
    n_tokens = tokens.shape[0] * tokens.shape[1]
    positions = [k.shape[-2] for k, _ in pairs]
    numbers = sum(k.numel() + v.numel() for k, v in pairs)
    nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pairs)
    return {
        "tokens": n_tokens,
        "n_layers": len(pairs),
        "key_shape": list(pairs[0][0].shape),
        "value_shape": list(pairs[0][1].shape),
        "positions_per_layer": positions,
        "element_bytes": pairs[0][0].element_size(),
        "numbers_per_token_per_layer": numbers / (tokens.shape[0] * sum(positions)),
        "bytes": nbytes,
        "bytes_per_token": nbytes / n_tokens,
        "cache_class": type(cache).__name__,
    }


CHECK_BACKEND = "transformer-lens"
"""The backend ``--model`` loads a model on: its Hugging Face model fills transformers' own KV cache,
the reference the formulas are checked against (the native backend keeps headprobe's own cache)."""


def backends_of(loaded: LoadedModel) -> dict[str, str]:
    """``weights``, ``backend`` (the one ``loaded`` runs on, as :attr:`ModelSpec.precision` names it) and
    ``default_backend`` (the one ``--backend auto``, the other commands' default, picks for its config)."""
    from headprobe.probe.core.vocabulary import backend_class
    from headprobe.probe.layout.spec import BACKEND_LABELS

    default = backend_class("auto", lambda: loaded.hf_config).name
    return {
        "weights": loaded.spec.weights,
        "backend": BACKEND_LABELS.get(loaded.spec.backend, loaded.spec.backend),
        "default_backend": BACKEND_LABELS.get(default, default),
    }


def _backend_line(rec: dict[str, Any]) -> str:
    """The check's second header line: the backend it ran on, and why where the other commands differ."""
    line = f"backend: {rec['backend']}"
    if rec["backend"] == rec["default_backend"]:
        return line + " (as the other commands)"
    return (
        line + f" (budget --model loads it to measure the Hugging Face model's own KV cache; the other "
        f"commands run this model on the {rec['default_backend']} backend by default)"
    )


def check_loaded(loaded: LoadedModel) -> tuple[AttentionLayout, dict[str, Any]]:
    """Compare the formulas on a loaded model's own layout (``loaded.spec.layout``, the
    :class:`~headprobe.probe.layout.attention.AttentionLayout` its loader built) with the model.

    Two checks: the KV cache (cached layers, layer-0 key and value shapes, positions per layer,
    numbers per position per layer, bytes) against :func:`measure_kv_cache` over a sequence
    longer than the smallest sliding window (:func:`check_length`), and the attention parameters
    of layer 0 against :func:`attention_params_of_model`, counted on a module Hugging Face builds
    from the config. For MLA the cache compared is the decompressed one Hugging Face keeps
    (``cost.kv_numbers_per_token_per_layer(..., decompressed=True)``).

    Returns:
        (the layout in the model's element size, a check record with ``measured``, ``expected``
        and ``ok``).

    Raises:
        HeadprobeError: the Hugging Face config has a layer type that is not attention (see
            :func:`~headprobe.probe.layout.attention.windows_from_hf_config`); the model returns no cache.
    """
    s = loaded.spec
    config = loaded.hf_config
    if config is not None:  # the spec reads a non-attention layer as global; the formulas do not cover it
        windows_from_hf_config(config, s.n_layers)
    counted = attention_params_of_model(loaded)
    lay = replace(s.layout, name=s.name)
    tokens = loaded.to_tokens(CHECK_PROMPT)
    assert not isinstance(tokens, tuple)  # one text: one tensor, no mask
    n = check_length(lay, tokens.shape[-1], s.n_ctx)
    measured = measure_kv_cache(loaded, n)
    lay = replace(lay, bytes_per_element=measured["element_bytes"])
    T = measured["tokens"]
    positions = cost.kv_positions(lay, T)
    heads = lay.n_heads if lay.is_mla else lay.n_kv_heads  # MLA: Hugging Face caches every head's key and value
    kv_bytes = cost.kv_bytes_per_request(lay, T, decompressed=True)
    expected = {
        "n_layers": lay.n_layers,
        "key_shape": [1, heads, positions[0], lay.d_qk],
        "value_shape": [1, heads, positions[0], lay.d_head],
        "positions_per_layer": positions,
        "numbers_per_token_per_layer": cost.kv_numbers_per_token_per_layer(lay, decompressed=True),
        "bytes": kv_bytes,
        "bytes_per_token": kv_bytes / T,
    }
    ok = all(measured[k] == expected[k] for k in expected)
    record: dict[str, Any] = {
        "model": s.name,
        "precision": s.precision,
        **backends_of(loaded),
        "measured": measured,
        "expected": expected,
        "ok": ok,
        "self_check": loaded.self_check.to_dict(),
        "n_ctx": s.n_ctx,
    }
    if counted is not None:
        formula = cost.attention_params_per_layer(lay)
        record["attn_params_per_layer"] = {"counted": counted, "formula": formula, "ok": counted == formula}
        record["ok"] = ok and record["attn_params_per_layer"]["ok"]
    if lay.is_mla:
        record["mla_latent_numbers_per_token_per_layer"] = cost.kv_numbers_per_token_per_layer(lay)
    return lay, record


def format_check(rec: dict[str, Any]) -> str:
    m, e = rec["measured"], rec["expected"]
    rows = [
        ["cached layers", str(m["n_layers"]), str(e["n_layers"])],
        ["layer-0 key shape [batch, kv_head, pos, d_head]", str(m["key_shape"]), str(e["key_shape"])],
        ["layer-0 value shape", str(m["value_shape"]), str(e["value_shape"])],
        [
            "cached positions per layer",
            _counts_txt(m["positions_per_layer"]),
            _counts_txt(e["positions_per_layer"]),
        ],
        [
            "KV numbers per token per layer",
            f"{m['numbers_per_token_per_layer']:g}",
            str(e["numbers_per_token_per_layer"]),
        ],
        [
            f"KV bytes of the {m['tokens']} tokens ({m['element_bytes']}-byte elements)",
            f"{m['bytes']:,}",
            f"{e['bytes']:,}",
        ],
    ]
    if "attn_params_per_layer" in rec:
        a = rec["attn_params_per_layer"]
        rows.append(["attention params of layer 0", f"{a['counted']:,}", f"{a['formula']:,}"])
    notes = []
    if "mla_latent_numbers_per_token_per_layer" in rec:
        notes.append(
            f"MLA: Hugging Face caches decompressed keys and values ({e['numbers_per_token_per_layer']} numbers "
            f"per token per layer); an engine that absorbs W_UK and W_UV caches the latent and rotary key "
            f"({rec['mla_latent_numbers_per_token_per_layer']}), the figure below."
        )
    verdict = "OK: the formulas match the model" if rec["ok"] else "MISMATCH: the formulas disagree with the model"
    return (
        f"live check on {rec['model']} ({rec['weights']}), {m['tokens']} tokens through its own cache\n"
        + _backend_line(rec)
        + "\n\n"
        + _table(rows, ["quantity", "measured", "formula"], right={1, 2})
        + "\n\n"
        + "".join(n + "\n" for n in notes)
        + verdict
    )


# ---------------------------------------------------------------------------------------------
# A headprobe checkpoint directory (headprobe train, headprobe prune --save-pruned), read directly
# ---------------------------------------------------------------------------------------------


def is_headprobe_dir(name: str) -> bool:
    """Whether ``name`` is a headprobe checkpoint directory (written by ``headprobe train`` or
    ``headprobe prune --save-pruned``), which budget reads itself instead of loading it as a
    Hugging Face model."""
    from pathlib import Path

    from headprobe.probe.model.checkpoint import is_native_dir

    return is_native_dir(Path(name).expanduser())


def heads_per_layer(lay: AttentionLayout, kept: Sequence[Sequence[int]] | None) -> tuple[list[int], list[int]]:
    """Query heads and key/value heads of each layer: ``n_heads`` and ``n_kv_heads`` everywhere
    when ``kept`` is None, else each layer's kept query heads (original numbering) and the
    key/value heads they read (:func:`headprobe.probe.layout.cost.kept_kv_heads`). Counts."""
    if kept is None:
        assert lay.n_kv_heads is not None  # filled by AttentionLayout.__post_init__
        return [lay.n_heads] * lay.n_layers, [lay.n_kv_heads] * lay.n_layers
    return [len(k) for k in kept], [cost.kept_kv_heads(lay, k) for k in kept]


def layers_report(
    lay: AttentionLayout, heads: Sequence[int], kv_heads: Sequence[int], seq_len: int, batch: int
) -> dict[str, Any]:
    """The costs of a model whose layer ``l`` has ``heads[l]`` query heads on ``kv_heads[l]``
    key/value heads (a pruned model), each layer costed by
    :func:`headprobe.probe.layout.cost.layer_cost`: totals over layers (parameters, cached numbers per
    token, KV bytes per token and per request of ``batch`` x ``seq_len`` tokens with the layout's
    sliding windows, projection and score FLOPs of one forward pass) and the largest layer's
    attention matrix and fused-kernel memory (bytes; what one layer at a time needs).

    Raises:
        HeadprobeError: a bad workload or head counts (see :func:`~headprobe.probe.layout.cost.layer_cost`).
    """

    def each(formula: Any, *args: Any) -> list[int]:
        return [cost.layer_cost(formula, lay, h, kv, *args) for h, kv in zip(heads, kv_heads)]

    kv_numbers = each(cost.kv_numbers_per_token_per_layer)
    positions = cost.kv_positions(lay, seq_len)
    cost.kv_bytes_per_request(lay, seq_len, batch)  # validates the workload
    return {
        "heads_per_layer": list(heads),
        "kv_heads_per_layer": list(kv_heads),
        "attn_params_per_layer": each(cost.attention_params_per_layer),
        "attn_params": sum(each(cost.attention_params_per_layer)),
        "kv_numbers_per_token": sum(kv_numbers),
        "kv_bytes_per_token": sum(kv_numbers) * lay.bytes_per_element,
        "kv_bytes_per_request": sum(p * n for p, n in zip(positions, kv_numbers)) * lay.bytes_per_element * batch,
        "flops_projections": sum(each(cost.projection_flops, seq_len, batch)),
        "flops_scores": sum(each(cost.score_flops, seq_len, batch)),
        "attention_matrix_bytes_largest_layer": max(each(cost.attention_matrix_bytes, seq_len, batch)),
        "fused_attention_bytes_largest_layer": max(each(cost.fused_attention_bytes, seq_len, batch)),
    }


def check_headprobe_dir(path: str) -> tuple[AttentionLayout, list[list[int]] | None, dict[str, Any]]:
    """Read a headprobe checkpoint directory and check the formulas against the model in it.

    The layout is the directory's own: its config.json's model config
    (:attr:`headprobe.probe.model.config.TransformerConfig.layout`) and, for a pruned model, the query
    heads each layer keeps (``pruned.kept_heads``). The model is the one the directory holds: the
    small pruned model itself (:func:`headprobe.probe.model.pruned.load_pruned_dir`, removed heads'
    weights absent) or the trained one. One forward pass over :func:`check_length` tokens measures,
    per layer, the query heads (``o_proj``'s input width over ``d_head``), the key/value heads and
    the numbers per token of the keys and values the layer computes (``hook_k`` and ``hook_v``:
    what a key/value cache without weight absorption holds; pruned models run without a cache), and
    counts each layer's attention parameters on its module. The formulas: :func:`heads_per_layer`
    and :func:`headprobe.probe.layout.cost.layer_cost` of ``kv_numbers_per_token_per_layer``
    (decompressed, for MLA) and ``attention_params_per_layer``.

    Returns:
        (the layout in the weights' element size, the kept heads per layer or None when nothing
        was removed, a check record with ``measured``, ``expected`` and ``ok``).

    Raises:
        HeadprobeError: the directory cannot be read (see :func:`headprobe.probe.backends.native_loading.load_native`
            and :func:`headprobe.probe.model.pruned.load_pruned_dir`).
    """
    from headprobe.probe.backends.native_loading import load_native
    from headprobe.probe.model.pruned import attention_sizes, is_pruned_dir, load_pruned_dir

    if is_pruned_dir(path):
        model: Any = load_pruned_dir(path)  # the small model: a native Transformer
        kept: list[list[int]] | None = [list(k) for k in model.kept_heads]
        base, n_ctx, element = model.cfg.layout, model.cfg.n_ctx, next(model.parameters()).element_size()
        n_removed = base.n_layers * base.n_heads - sum(map(len, model.kept_heads))
        precision = (
            f"pruned headprobe checkpoint, {n_removed} of {base.n_layers * base.n_heads} heads removed, "
            f"{str(next(model.parameters()).dtype).removeprefix('torch.')} weights"
        )
        self_check = None
    else:
        model = load_native(path)  # a LoadedModel on the native backend
        kept, precision, self_check = None, model.spec.precision, model.self_check.to_dict()
        base, n_ctx, element = model.spec.layout, model.spec.n_ctx, model.dtype.itemsize
    lay = replace(base, name=str(path), bytes_per_element=element)
    n = check_length(lay, 0, n_ctx)
    measured = {"tokens": n, **attention_sizes(model, n), "element_bytes": element}
    heads, kv_heads = heads_per_layer(lay, kept)
    if kept is None:
        per_layer = [cost.kv_numbers_per_token_per_layer(lay, decompressed=True)] * lay.n_layers
        params = [cost.attention_params_per_layer(lay)] * lay.n_layers
    else:
        per_layer = [cost.layer_cost(cost.kv_numbers_per_token_per_layer, lay, h, kv) for h, kv in zip(heads, kv_heads)]
        params = [cost.layer_cost(cost.attention_params_per_layer, lay, h, kv) for h, kv in zip(heads, kv_heads)]
    expected = {
        "heads_per_layer": heads,
        "kv_heads_per_layer": [h if lay.is_mla else kv for h, kv in zip(heads, kv_heads)],
        "kv_numbers_per_token_per_layer": per_layer,
        "attn_params_per_layer": params,
    }
    record: dict[str, Any] = {
        "model": str(path),
        "precision": precision,
        "measured": measured,
        "expected": expected,
        "ok": all(measured[k] == expected[k] for k in expected),
        "pruned": kept is not None,
        "n_ctx": n_ctx,
    }
    if kept is not None:
        record["kept_heads"] = kept
    if self_check is not None:
        record["self_check"] = self_check
    if lay.is_mla:
        record["mla_latent_numbers_per_token_per_layer"] = cost.kv_numbers_per_token_per_layer(lay)
    return lay, kept, record


def _counts_txt(values: Sequence[int]) -> str:
    """``[4, 7]`` -> ``4, 7``; a constant list ``[8, 8, 8]`` -> ``8 x 3``; long lists by value."""
    values = list(values)
    if len(set(values)) == 1:
        return f"{values[0]:,} x {len(values)}"
    if len(values) <= 6:
        return ", ".join(f"{v:,}" for v in values)
    return ", ".join(f"{v:,} x {values.count(v)}" for v in sorted(set(values)))


def format_dir_check(rec: dict[str, Any]) -> str:
    """The live check of :func:`check_headprobe_dir` as a table (per-layer lists)."""
    m, e = rec["measured"], rec["expected"]
    rows = [
        ["query heads per layer", _counts_txt(m["heads_per_layer"]), _counts_txt(e["heads_per_layer"])],
        ["key/value heads per layer", _counts_txt(m["kv_heads_per_layer"]), _counts_txt(e["kv_heads_per_layer"])],
        [
            "K and V numbers per token per layer",
            _counts_txt(m["kv_numbers_per_token_per_layer"]),
            _counts_txt(e["kv_numbers_per_token_per_layer"]),
        ],
        [
            "attention params per layer",
            _counts_txt(m["attn_params_per_layer"]),
            _counts_txt(e["attn_params_per_layer"]),
        ],
    ]
    for row in rows:  # a per-layer list the formula gives exactly is not printed twice
        row[2] = "= measured" if row[2] == row[1] else row[2]
    notes = []
    if "mla_latent_numbers_per_token_per_layer" in rec:
        notes.append(
            f"MLA: the layers compute every head's key and value; an engine that absorbs W_UK and W_UV "
            f"caches the latent and rotary key ({rec['mla_latent_numbers_per_token_per_layer']}), the figure below."
        )
    what = "the small pruned model" if rec["pruned"] else "the model"
    verdict = "OK: the formulas match the model" if rec["ok"] else "MISMATCH: the formulas disagree with the model"
    return (
        f"live check on {rec['model']} ({rec['precision']}), {m['tokens']} tokens through {what}\n\n"
        + _table(rows, ["quantity", "measured", "formula"], right={1, 2})
        + "\n\n"
        + "".join(n + "\n" for n in notes)
        + verdict
    )


def _flops_pair(a: float, b: float) -> tuple[str, str]:
    """Two FLOP counts in one unit, the larger's: a row compares them."""
    return format_flops(a, like=max(a, b)), format_flops(b, like=max(a, b))


def format_layers_report(d: dict[str, Any], lay: AttentionLayout, dtype: str) -> str:
    """The report of a pruned model: each quantity for the pruned model and for the unpruned layout."""
    p, u = d["pruned"], d["unpruned"]
    T, B = d["workload"]["seq_len"], d["workload"]["batch"]
    rows = [
        ["query heads per layer", _counts_txt(p["heads_per_layer"]), _counts_txt(u["heads_per_layer"])],
        ["key/value heads per layer", _counts_txt(p["kv_heads_per_layer"]), _counts_txt(u["kv_heads_per_layer"])],
        ["attention params, all layers", f"{p['attn_params']:,}", f"{u['attn_params']:,}"],
        ["KV numbers per token, all layers", f"{p['kv_numbers_per_token']:,}", f"{u['kv_numbers_per_token']:,}"],
        ["KV cache per token", format_bytes(p["kv_bytes_per_token"]), format_bytes(u["kv_bytes_per_token"])],
        [
            kv_batch_label(B, T),
            format_bytes(p["kv_bytes_per_request"]),
            format_bytes(u["kv_bytes_per_request"]),
        ],
        ["attention projection FLOPs, all layers", *_flops_pair(p["flops_projections"], u["flops_projections"])],
        ["scores + AV FLOPs, all layers", *_flops_pair(p["flops_scores"], u["flops_scores"])],
        [
            f"attention matrix, largest layer, in {cost.COMPUTE_DTYPE[dtype]}",
            format_bytes(p["attention_matrix_bytes_largest_layer"]),
            format_bytes(u["attention_matrix_bytes_largest_layer"]),
        ],
        [
            "fused kernel, largest layer",
            format_bytes(p["fused_attention_bytes_largest_layer"]),
            format_bytes(u["fused_attention_bytes_largest_layer"]),
        ],
    ]
    if "model_params" in p:
        rows[3:3] = [
            ["parameters, whole model", f"{p['model_params']:,}", f"{u['model_params']:,}"],
            [
                "forward FLOPs per token, whole model",
                *_flops_pair(p["forward_flops_per_token"], u["forward_flops_per_token"]),
            ],
        ]
    head = (
        f"{describe(lay, dtype)}; pruned: {sum(u['heads_per_layer']) - sum(p['heads_per_layer'])} of "
        f"{sum(u['heads_per_layer'])} query heads removed\n"
        f"workload: batch {B} x seq_len {T}; 1 KiB = 2^10 bytes, 1 TFLOP = 10^12 FLOPs\n"
        f"{scope_line('model_params' in p, d.get('whole_model_missing'))}\n"
    )
    return head + "\n" + _table(rows, ["quantity", "pruned", "unpruned"], right={1, 2})


# ---------------------------------------------------------------------------------------------
# Config -> run -> Result
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class BudgetResult(CompactRepr):
    """What ``headprobe budget`` computed.

    Attributes:
        config: the :class:`BudgetConfig` it ran.
        mode: ``"report"`` (one layout), ``"compare"``, ``"flops_table"``, ``"recommend"`` or
            ``"pruned"`` (a pruned model directory: :func:`layers_report` of the pruned and the
            unpruned heads, under ``data["pruned"]`` and ``data["unpruned"]``) or ``"policy"``
            (the report plus ``data["policy"]``, :func:`~headprobe.probe.layout.cost.policy_cost` of ``--policy``).
        layout: the layout reported on (the proposed one for ``recommend``).
        data: every number, as ``--json`` prints it (see :meth:`to_dict`).
        check: the live check record of ``--model`` (``measured``, ``expected``, ``ok``), or None.
        recommendation: the :class:`~headprobe.probe.layout.cost.Recommendation` of ``recommend``, or None.
    """

    config: BudgetConfig
    mode: str
    layout: AttentionLayout
    data: dict[str, Any]
    check: dict[str, Any] | None = None
    recommendation: cost.Recommendation | None = None

    @property
    def ok(self) -> bool:
        """False when the live check disagrees with the model or no recommended layout fits."""
        if self.recommendation is not None:
            return self.recommendation.fits
        return self.check is None or bool(self.check["ok"])

    @property
    def exit_code(self) -> int:
        """The CLI's exit status: 0, or 1 (like grep's "no match") when not :attr:`ok`."""
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        """Every number as plain JSON types (bytes, FLOPs, counts): :meth:`summary` before a NaN or
        infinity becomes None."""
        return json.loads(json.dumps(self.data))

    def summary(self) -> dict[str, Any]:
        """What ``--json`` prints (budget writes no summary.json): :meth:`to_dict` with every NaN or
        infinity None (JSON ``null``, :func:`~headprobe.probe.core.io.finite_json`)."""
        return finite_json(self.to_dict())

    def format(self) -> str:
        """The text ``headprobe budget`` prints."""
        c, d = self.config, self.data
        if self.mode == "recommend":
            assert self.recommendation is not None  # recommend's result carries it
            return format_recommendation(self.recommendation, c.dtype)
        if self.mode == "flops_table":
            text = format_flops_table(d["flops"], self.layout, c.dtype, c.as_mha)
        elif self.mode == "compare":
            text = format_compare(d["compare"], self.layout, c.dtype, c.workload_seq_len, c.batch)
        elif self.mode == "pruned":
            text = format_layers_report(d, self.layout, c.dtype)
        else:
            text = format_report(d, self.layout, c.dtype)
        if self.mode == "policy":
            note = d.get("policy_measured", {}).get("note")
            text += "\n\n" + format_policy(d["policy"], d["policy_file"], self.layout, c.dtype, note)
        if "beyond_context" in d:
            b = d["beyond_context"]
            text += (
                f"\nNOTE: {b['seq_len']:,} tokens is beyond the model's context of {b['n_ctx']:,} (n_ctx): these are "
                "the formulas' costs at that length, not a length the model was trained to read"
            )
        if self.check is None:
            return text
        checked = format_dir_check if "heads_per_layer" in self.check["measured"] else format_check
        return checked(self.check) + "\n\n" + text

    def latex(self) -> str:
        """The ``--compare`` table as a LaTeX booktabs table (:func:`~headprobe.analyses.latex_tables.table_tex`),
        one column per layout and one row per quantity, with the terminal's cells and units
        (:func:`compare_cells`), the caption naming the layout, its element size and the workload.

        Raises:
            HeadprobeError: not a ``--compare`` result.
        """
        import pandas as pd

        from headprobe.analyses.latex_tables import table_tex

        if self.mode != "compare":
            raise HeadprobeError(LATEX_NEEDS_COMPARE)
        c = self.config
        header, cells = compare_cells(self.data["compare"], self.layout, c.workload_seq_len, c.batch)
        caption = (
            f"Attention cost of head layouts: {describe(self.layout, c.dtype)}. Per layer and token where "
            f"named; KV/batch at {c.batch} × {c.workload_seq_len:,} tokens; formulas of headprobe budget."
        )
        # one column per layout, one row per quantity: ten columns of long headers overrun a page's width
        table = pd.DataFrame({"": header[1:], **dict(zip(layout_names(self.data["compare"]), (r[1:] for r in cells)))})
        return table_tex(table, caption, "tab:budget-compare", "l" + "r" * len(cells))

    @property
    def table(self) -> pandas.DataFrame:
        """The result as a pandas DataFrame: one row per layout (compare), per length (flops
        table), per quantity (report: columns ``quantity``, ``value``), or the proposed layout
        (recommend)."""
        import pandas as pd

        if self.mode == "compare":
            return pd.DataFrame(self.data["compare"])
        if self.mode == "flops_table":
            return pd.DataFrame(self.data["flops"])
        if self.mode == "pruned":
            p, u = self.data["pruned"], self.data["unpruned"]
            return pd.DataFrame({"quantity": list(p), "pruned": list(p.values()), "unpruned": [u[k] for k in p]})
        if self.mode == "recommend":
            r = self.recommendation
            assert r is not None  # recommend's result carries it
            return pd.DataFrame(
                [
                    {
                        **self.layout.to_dict(),
                        "kind": self.layout.kind,
                        "use_mla": r.use_mla,
                        "fits": r.fits,
                        "kv_bytes_per_request": r.kv_bytes_per_request,
                    }
                ]
            )
        skip = {
            "layout",
            "workload",
            "check",
            "windowed_layers",
            "policy",
            "policy_file",
            "policy_measured",
            "beyond_context",
            "kv_bytes_per_token_spans",
            "kv_bytes_per_token_spans_mha",
        }
        return pd.DataFrame(
            {
                "quantity": [k for k in self.data if k not in skip],
                "value": [v for k, v in self.data.items() if k not in skip],
            }
        )

    @property
    def check_table(self) -> pandas.DataFrame | None:
        """The live check as a DataFrame (``quantity``, ``measured``, ``expected``), or None."""
        if self.check is None:
            return None
        import pandas as pd

        m, e = self.check["measured"], self.check["expected"]
        return pd.DataFrame({"quantity": list(e), "measured": [m[k] for k in e], "expected": list(e.values())})


def check_modes(config: BudgetConfig) -> None:
    """Refuse two modes at once, a flag of another mode (:func:`refuse_other_modes`: ``--kv-limit``
    without ``--recommend``, ``--preset`` with it...) and both a preset and a model.

    Raises:
        HeadprobeError: one line naming the flags.
    """
    modes = [
        flag
        for flag, on in (
            ("--compare", config.compare),
            ("--flops-table", config.flops_table is not None),
            ("--recommend", config.recommend),
        )
        if on
    ]
    if len(modes) > 1:
        raise HeadprobeError(f"{' and '.join(modes)} are separate modes; give one of them")
    refuse_other_modes(config)
    if not config.recommend and config.preset and config.model:
        raise HeadprobeError("give --preset or --model, not both")


def _recommend_sizes(config: BudgetConfig) -> tuple[int | None, int | None]:
    """``(n_params, kv_limit_bytes)`` of ``--recommend``'s ``--params`` and ``--kv-limit`` (None where not given).

    Raises:
        HeadprobeError: an unreadable count or size, or a bare number under 1 KiB (a forgotten unit).
    """
    params, limit = config.params, config.kv_limit
    if isinstance(limit, str):  # a bare number under 1 KiB is a forgotten unit (sizes.parse_bytes)
        limit = cost.parse_bytes(limit, "--kv-limit", bare_at_least=cost.KIB)
    return (cost.parse_count(params) if isinstance(params, str) else params), limit


def check(args: argparse.Namespace, config: BudgetConfig) -> None:
    """What ``headprobe budget`` refuses before it reads a model or a policy file and computes
    (:attr:`Command.check`): :func:`check_modes`; ``--recommend``'s sizes; without ``--model``, the
    layout of the preset or the flags and the workload (:func:`layout_from_config`).

    Raises:
        HeadprobeError: as :func:`run` for these.
    """
    check_modes(config)
    if config.recommend:
        _recommend_sizes(config)
    elif not config.model:
        cost.kv_bytes_per_request(layout_from_config(config), config.workload_seq_len, config.batch)


def run(config: BudgetConfig) -> BudgetResult:
    """Compute what ``config`` asks for.

    Raises:
        HeadprobeError: as :func:`check_modes`; a bad layout or workload (see
            :class:`~headprobe.probe.layout.cost.AttentionLayout`); a model that cannot be loaded.
    """
    check_modes(config)
    if config.recommend:
        n_params, limit = _recommend_sizes(config)
        rec = cost.recommend(
            seq_len=config.workload_seq_len,
            target=config.target or "gpu-server",
            n_params=n_params,
            d_model=config.d_model,
            n_layers=config.n_layers,
            kv_limit_bytes=limit,
            bytes_per_element=config.bytes_per_element,
            batch=config.batch,
        )
        return BudgetResult(config, "recommend", rec.layout, rec.to_dict(), recommendation=rec)

    check = None
    base = None
    if config.model and is_headprobe_dir(config.model):
        return _run_headprobe_dir(config)
    if config.model:
        from headprobe.probe.backends.loading import load_model

        # TransformerLens prints progress on stdout; keep stdout for the report (and --json).
        with redirect_stdout(sys.stderr):
            loaded = load_model(config.model, backend=CHECK_BACKEND)
            model_layout, check = check_loaded(loaded)
        base = replace(model_layout, bytes_per_element=config.bytes_per_element)
        return _report(config, base, check, shape_of_hf_config(loaded.hf_config))
    return _report(config, base, check)


def _report(
    config: BudgetConfig,
    base: AttentionLayout | None,
    check: dict[str, Any] | None,
    shape: cost.ModelShape | str | None = None,
) -> BudgetResult:
    """The report, compare or FLOPs-table mode of :func:`run` on ``base`` (a model's layout, or
    None: the preset's or the flags') with the flags applied, and the live ``check`` record;
    ``shape``: a model's MLP, vocabulary and embeddings (:func:`shape_of_native_config`), or why it
    has none (a line), or None for a preset's (:func:`model_shape`)."""
    lay = layout_from_config(config, base)
    # Validate the workload before computing anything.
    cost.kv_bytes_per_request(lay, config.workload_seq_len, config.batch)

    lengths = list(config.flops_table or FLOPS_TABLE_SEQ_LENS) if config.flops_table is not None else None
    if lengths is not None:
        rows = flops_table(lay, lengths, config.batch, config.as_mha)
        mode, out = "flops_table", {"layout": lay.to_dict(), "as_mha": config.as_mha, "flops": rows}
    elif config.compare:
        rows = cost.compare_kv_heads(lay, config.workload_seq_len, config.batch)
        mode = "compare"
        out = {
            "layout": lay.to_dict(),
            "workload": {"seq_len": config.workload_seq_len, "batch": config.batch},
            "compare": rows,
        }
    else:
        mode, out = "report", report(lay, config.workload_seq_len, config.batch, *model_shape(config, shape))
    if config.policy is not None:
        from headprobe.analyses.exchange import kv_policy_measured_length, read_kv_policy

        policy = read_kv_policy(config.policy)
        measured, read_from = kv_policy_measured_length(config.policy)
        mode, out = (
            "policy",
            {
                **out,
                "policy_file": str(config.policy),
                "policy": cost.policy_cost(lay, policy, config.workload_seq_len, config.batch).to_dict(),
                "policy_measured": {
                    "seq_len": measured,
                    "read_from": read_from,
                    "note": measured_length_note(policy, measured, config.workload_seq_len),
                },
            },
        )
    longest = max(lengths) if lengths is not None else config.workload_seq_len
    if check is not None and check.get("n_ctx") and longest > check["n_ctx"]:
        out["beyond_context"] = {"seq_len": longest, "n_ctx": check["n_ctx"]}
    if check is not None:
        out = {"check": check, **out}
    return BudgetResult(config, mode, lay, out, check=check)


def model_shape(
    config: BudgetConfig, loaded: cost.ModelShape | str | None = None
) -> tuple[cost.ModelShape | None, str | None]:
    """The MLP, vocabulary and embeddings for the whole-model rows: a ``--model``'s (``loaded``,
    :func:`shape_of_native_config`) or the preset's (:data:`~headprobe.probe.layout.cost.MODEL_SHAPES`),
    and None or why there is none. None without a reason: no model nor preset, a preset without
    one (MoE, encoder-decoder); with one: a model whose MLP is not one dense MLP (``loaded`` is
    the reason), or ``--d-model`` / ``--n-layers`` given with ``--model`` (its MLP width and
    depth would no longer be its own; a preset's rows are then left out silently)."""
    resized = config.d_model is not None or config.n_layers is not None
    if config.model:
        if isinstance(loaded, str):
            return None, f"no whole-model rows: {loaded}"
        if resized:
            return None, "no whole-model rows: --d-model or --n-layers makes the model's MLP and depth someone else's"
        return loaded, None
    if config.preset is None or resized:
        return None, None
    return cost.MODEL_SHAPES.get(config.preset.lower()), None


def shape_of_native_config(cfg: Any) -> cost.ModelShape | str:
    """A model's MLP, vocabulary, embeddings and norms as a :class:`~headprobe.probe.layout.cost.ModelShape`,
    read from its native :class:`~headprobe.probe.model.config.TransformerConfig` (a Hugging Face
    model's through :func:`~headprobe.probe.model.convert.config_from_hf`): ``d_vocab``, ``d_mlp``,
    ``mlp`` (gated: SwiGLU, GeGLU), ``tied_unembed``, ``bias`` (the MLP's), ``norm``, learned
    positions (``n_ctx`` of them), pre and post norms, the final and embedding norms; or, where one
    dense MLP per layer does not describe the model, one line saying why (MoE, hybrid with linear
    layers, no MLP)."""
    if cfg.n_experts is not None or cfg.moe_layers is not None:
        return "mixture-of-experts MLPs (experts, router): no single dense MLP to count"
    if cfg.linear_layers is not None:
        return "a hybrid with linear-attention (Gated DeltaNet) layers, whose parameters the formulas do not count"
    if cfg.mlp is None or cfg.d_mlp is None:
        return "an attention-only model (no MLP)"
    post = (2 if cfg.post_norm else 0) + (2 if cfg.post_ln and not cfg.pre_norm else 0)
    return cost.ModelShape(
        vocab_size=cfg.d_vocab,
        d_mlp=cfg.d_mlp,
        gated_mlp=cfg.mlp in ("swiglu", "geglu"),
        tied_embeddings=cfg.tied_unembed,
        mlp_bias=cfg.bias,
        layer_norm=cfg.norm == "layernorm",
        n_positions=cfg.n_ctx if cfg.positional == "learned" else 0,
        norms_per_layer=(2 if cfg.pre_norm else 0) + post,
        other_norms=int(cfg.final_norm) + int(cfg.embed_norm),
    )


def shape_of_hf_config(cfg: Any) -> cost.ModelShape | str:
    """:func:`shape_of_native_config` of a Hugging Face model's config (``budget --model``'s), or why none."""
    from headprobe.probe.model.convert import config_from_hf, supports

    if cfg is None or not supports(cfg):
        kind = getattr(cfg, "model_type", None)
        return f"model type {kind!r} is not one headprobe's own transformer reads (its MLP and norms are unknown)"
    shape = shape_of_native_config(config_from_hf(cfg))
    if isinstance(shape, cost.ModelShape) and cfg.model_type in COHERE_TYPES:
        # one bias-free LayerNorm per parallel layer (the native block loads it twice, with zero biases)
        shape = replace(shape, norms_per_layer=1, layer_norm=False)
    return shape


COHERE_TYPES = ("cohere", "cohere2")
"""Hugging Face model types whose parallel layer has one LayerNorm without a bias (counted as one weight)."""


def _run_headprobe_dir(config: BudgetConfig) -> BudgetResult:
    """:func:`run` for ``--model DIR``, a headprobe checkpoint directory (:func:`check_headprobe_dir`).
    An unpruned one is reported like any layout (and takes every mode and flag); a pruned one
    has per-layer head counts: it gets :func:`layers_report` (pruned and unpruned side by side)
    and refuses what describes one uniform layout (``--compare``, ``--flops-table``, layout flags)."""
    assert config.model is not None  # called for --model DIR
    pruned = _is_pruned(config.model)
    if pruned:
        given = [f"--{f.replace('_', '-')}" for f in UNIFORM_LAYOUT_FLAGS if getattr(config, f) is not None]
        given += [
            flag
            for flag, on in (
                ("--compare", config.compare),
                ("--flops-table", config.flops_table is not None),
                ("--policy", config.policy is not None),
            )
            if on
        ]
        if given:
            raise HeadprobeError(
                f"{config.model} is a pruned model whose layers keep different numbers of heads; "
                f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} one uniform layout: "
                f"drop {'it' if len(given) == 1 else 'them'}"
            )
    with redirect_stdout(sys.stderr):
        lay, kept, check = check_headprobe_dir(config.model)
    base = replace(lay, bytes_per_element=config.bytes_per_element)
    shape = shape_of_native_config(_dir_config(config.model))
    if kept is None:
        return _report(config, base, check, shape)
    heads, kv_heads = heads_per_layer(base, kept)
    T, B = config.workload_seq_len, config.batch
    out: dict[str, Any] = {
        "check": check,
        "layout": base.to_dict(),
        "workload": {"seq_len": T, "batch": B},
        "pruned": layers_report(base, heads, kv_heads, T, B),
        "unpruned": layers_report(base, *heads_per_layer(base, None), T, B),
    }
    if isinstance(shape, str):
        out["whole_model_missing"] = f"no whole-model rows: {shape}"
    else:
        for key, (h, kv) in (("pruned", (heads, kv_heads)), ("unpruned", heads_per_layer(base, None))):
            out[key] |= layers_whole_model(base, shape, h, kv, T)
    return BudgetResult(config, "pruned", base, out, check=check)


def _dir_config(path: str) -> Any:
    """The native :class:`~headprobe.probe.model.config.TransformerConfig` of a headprobe checkpoint
    directory (its config.json's ``model``), already read once by :func:`check_headprobe_dir`."""
    from pathlib import Path

    from headprobe.probe.model.config import TransformerConfig

    meta = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    return TransformerConfig.from_json(meta["model"])


def layers_whole_model(
    lay: AttentionLayout, shape: cost.ModelShape, heads: Sequence[int], kv_heads: Sequence[int], seq_len: int
) -> dict[str, Any]:
    """The whole-model parameters and forward FLOPs per token (:func:`whole_model_report`'s keys) of
    a model whose layer ``l`` keeps ``heads[l]`` query heads on ``kv_heads[l]`` key/value heads: the
    attention part summed layer by layer (:func:`~headprobe.probe.layout.cost.layer_cost`), the
    MLP, norms and embeddings ``shape``'s; the scores + AV of a token against ``seq_len`` keys
    (``min(seq_len, window)`` on a windowed layer). Counts and FLOPs."""
    attention = sum(cost.layer_cost(cost.attention_params_per_layer, lay, h, kv) for h, kv in zip(heads, kv_heads))
    params = cost.model_params(lay, shape, attention=attention)
    context = sum(
        cost.layer_cost(cost.score_flops, lay, h, kv, 1, 1) * positions
        for h, kv, positions in zip(heads, kv_heads, cost.kv_positions(lay, seq_len))
    )
    return _whole_model_dict(params, shape, context)


def _is_pruned(name: str) -> bool:
    from pathlib import Path

    from headprobe.probe.model.pruned import is_pruned_dir

    return is_pruned_dir(Path(name).expanduser())


@notes_flags("budget")
def budget(**fields_: Any) -> BudgetResult:
    """``headprobe budget`` as a function: ``budget(preset="llama3-8b", seq_len=32768)``.

    Takes the fields of :class:`BudgetConfig` as keyword arguments.

    Returns:
        BudgetResult: ``data``, every number ``--json`` prints (bytes, FLOPs, counts); ``layout``;
            ``check`` (a ``model``'s live KV-cache check) and ``recommendation`` where asked; nothing written.

    Raises:
        TypeError: an unknown keyword (naming the nearest one).
        HeadprobeError: as :func:`run`; a message naming flags has a note giving their Python spelling (``e.__notes__``).
    """
    from headprobe.options import check_fields

    check_fields(BudgetConfig, fields_, "budget", positional=(), accepts=budget)
    return run(BudgetConfig(**fields_))


def main(args: argparse.Namespace, config: BudgetConfig) -> int:
    """The CLI's run target: :class:`BudgetConfig` -> :func:`run` -> printed text, JSON (``args.json``)
    or the ``--compare`` table in LaTeX (``args.latex``); returns the exit status (:attr:`BudgetResult.exit_code`)."""
    if getattr(args, "latex", False) and not config.compare:  # before run: --model loads a model
        raise HeadprobeError(LATEX_NEEDS_COMPARE)
    result = run(config)
    if getattr(args, "latex", False):
        print(result.latex())
        return result.exit_code
    # --json as strictly as every file headprobe writes (headprobe.probe.core.io.write_json): no bare NaN or Infinity
    print(json.dumps(result.summary(), indent=2, allow_nan=False) if args.json else result.format())
    return result.exit_code


COMMAND = Command(
    HELP,
    config=BudgetConfig,
    run="headprobe.commands.budget:main",
    flags=FLAGS,
    api=budget,
    check="headprobe.commands.budget:check",
)
"""``headprobe budget``, registered in :data:`headprobe.commands.COMMANDS`."""
