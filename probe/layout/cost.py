"""What an attention layout costs: parameters, KV cache, FLOPs and attention-matrix memory.

Pure, exact integer arithmetic over an :class:`~headprobe.probe.layout.attention.AttentionLayout` (the shape
of a model's attention, defined in :mod:`headprobe.probe.layout.attention` and re-exported here) and a workload (``batch`` sequences of ``seq_len`` tokens). No torch, no model, no I/O.

Units used throughout (every public function repeats the one it returns):

* parameters and "numbers" (cached elements) are counts of scalars;
* memory is in bytes; :func:`format_bytes` prints binary prefixes, 1 KiB = 2**10 bytes,
  1 MiB = 2**20, 1 GiB = 2**30, 1 TiB = 2**40 bytes (IEC 80000-13, as in the lesson);
* compute is in FLOPs, one multiply or one add each; a matrix product (m x k)(k x n) costs
  2*m*k*n FLOPs. 1 TFLOP = 10**12 FLOPs (decimal, as FLOPs are always quoted).

Definitions and worked numbers follow the lesson texts in ``shared/seeds/003_*`` ("Сколько это
стоит", "FLOPs", "Память", "Мост к MQA, GQA и MLA"):

* attention parameters per layer without biases: ``4 * d_model**2`` for MHA, independent of the
  number of heads; GQA (Ainslie et al. 2023, arXiv:2305.13245) and MQA (Shazeer 2019,
  arXiv:1911.02150) shrink W_K and W_V to ``d_model x n_kv_heads*d_head``;
* KV cache per token per layer: ``2 * n_kv_heads * d_head`` numbers; for MLA (DeepSeek-V2,
  arXiv:2405.04434, section 2.1) the cached latent ``kv_lora_rank`` plus the decoupled rotary key
  ``qk_rope_head_dim``;
* FLOPs of one attention layer: ``8*T*D**2`` (projections) + ``4*T**2*D`` (scores QK^T and the
  weighted sum AV); they are equal at ``T = 2*D``;
* QK-norm (Dehghani et al. 2023, arXiv:2302.05442; Qwen3, OLMo 2) adds its RMSNorm weights to
  the parameters; a sliding-window layer (Mistral 7B, arXiv:2310.06825; Gemma 2 every other
  layer) caches at most ``window`` positions, so a request of T tokens holds
  ``sum over layers of min(T, window_l)`` positions;
* a materialised attention weight matrix holds ``batch * n_heads * T * T`` elements; a fused kernel
  (FlashAttention, Dao et al. 2022, arXiv:2205.14135; PyTorch SDPA) never stores it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean

# Sizes as text are read and printed by headprobe.probe.core.sizes, one way for every floor; re-exported here.
from headprobe.probe.core.sizes import (  # noqa: F401
    GIB,
    KIB,
    MIB,
    TIB,
    exact,
    fixed,
    format_bytes,
    format_whole,
    parse_bytes,
    parse_count,
)

# The layout lives in headprobe.probe.layout.attention; re-exported so that cost.AttentionLayout keeps working.
from headprobe.probe.layout.attention import (  # noqa: F401
    BIAS_KINDS,
    QK_NORM_KINDS,
    AttentionLayout,
    KVPolicy,
    Streaming,
    _check_positive,
)

TFLOP = 10**12

#: Bytes per element of the number formats a user may name (``--dtype``).
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
BUDGET_DTYPE = "bf16"
"""The number format ``headprobe budget`` costs when no ``--dtype`` is given (kv's report names it)."""

#: The dtype attention computes in for each ``--dtype`` (the KV cache's storage format): its
#: activations, the materialised attention matrix and the fused kernel's Q, K, V and output. fp32,
#: bf16 and fp16 are compute formats and stay; fp8 and int8 are storage formats of a quantized cache,
#: which is dequantized for the attention, and the softmax probabilities are not fp8: bf16.
COMPUTE_DTYPE: dict[str, str] = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16", "int8": "bf16"}


def activation_bytes(layout: AttentionLayout) -> int:
    """Bytes of one number attention computes with (:data:`COMPUTE_DTYPE`): the layout's
    ``bytes_per_element`` (the cache's) where it is a compute format's (fp32 4, bf16/fp16 2), and
    bf16's 2 for a 1-byte storage format (fp8, int8)."""
    return max(layout.bytes_per_element, DTYPE_BYTES[COMPUTE_DTYPE["fp8"]])


MAX_WINDOWED_LAYERS = 100_000
"""The most layers :func:`sliding_windows` makes: a layout with windows is costed layer by layer
(one window per layer, :attr:`AttentionLayout.windows`), 0.5 s for ``budget`` at 1e5 layers and
2.8 to 5.3 s at 1e6 (linear). Real models have at most a few hundred; a layout without windows is counted,
not listed, at any number of layers (:func:`kv_positions_total`)."""


def sliding_windows(
    n_layers: int, window: int | None, global_every: int | None = None
) -> tuple[int | None, ...] | None:
    """Per-layer windows for :attr:`AttentionLayout.windows`: every layer windowed to ``window``
    positions, except that with ``global_every = N`` layer ``l`` (0-based) is global when
    ``(l + 1) % N == 0`` (Hugging Face's Gemma 2 pattern with N = 2, Gemma 3's with N = 6).
    ``window=None`` gives None (every layer global).

    Raises:
        HeadprobeError: ``global_every`` without ``window``, a size that is not a positive integer,
            or more than :data:`MAX_WINDOWED_LAYERS` layers.
    """
    if window is None:
        if global_every is not None:
            raise HeadprobeError("--global-every needs --sliding-window")
        return None
    _check_positive("n_layers", n_layers)
    if n_layers > MAX_WINDOWED_LAYERS:
        raise HeadprobeError(
            f"--n-layers {n_layers:,} with --sliding-window: a layout with windows is costed layer by layer, for "
            f"at most {MAX_WINDOWED_LAYERS:,} layers; give fewer, or leave out --sliding-window (layers without "
            "windows are counted at any number)"
        )
    _check_positive("sliding_window", window)
    if global_every is not None:
        _check_positive("global_every", global_every)
    return tuple(None if global_every and (i + 1) % global_every == 0 else window for i in range(n_layers))


def _check_workload(seq_len: int, batch: int) -> None:
    _check_positive("seq_len", seq_len)
    _check_positive("batch", batch)


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def attention_weight_shapes(layout: AttentionLayout) -> dict[str, tuple[int, int]]:
    """The (in_features, out_features) of every projection matrix of one attention layer.

    MHA/GQA/MQA: ``W_Q`` (d_model -> n_heads*d_qk), ``W_K`` (d_model -> n_kv_heads*d_qk) and
    ``W_V`` (d_model -> n_kv_heads*d_head), ``W_O`` (n_heads*d_head -> d_model); ``d_qk`` is
    ``d_head`` here unless the layout's ``qk_head_dim`` says otherwise.

    MLA, as in DeepSeek-V2/V3 (arXiv:2405.04434, eqs. 9-12 and 37-39; Hugging Face
    ``DeepseekV3Attention``): ``W_DQ`` (d_model -> q_lora_rank) and ``W_UQ`` (q_lora_rank ->
    n_heads*d_qk), or one ``W_Q`` (d_model -> n_heads*d_qk) without a query latent, where
    ``d_qk = qk_nope_head_dim + rope``; ``W_DKV_KR`` (d_model -> kv_lora_rank+rope, the latent
    and the shared rotary key); ``W_UKV`` (kv_lora_rank -> n_heads*(qk_nope_head_dim+d_head),
    the keys' non-rotary parts and the values of all heads); ``W_O`` (n_heads*d_head -> d_model).

    Returns:
        name -> (in_features, out_features), counts of numbers.
    """
    D, H, dh, dqk, KV = layout.d_model, layout.n_heads, layout.d_head, layout.d_qk, layout.n_kv_heads
    assert dh is not None and KV is not None  # filled by AttentionLayout.__post_init__
    if not layout.is_mla:
        gate = {"W_G": (D, H * dh)} if layout.output_gate else {}  # Qwen3-Next's output gate
        return {"W_Q": (D, H * dqk), **gate, "W_K": (D, KV * dqk), "W_V": (D, KV * dh), "W_O": (H * dh, D)}
    shapes: dict[str, tuple[int, int]] = {}
    if layout.q_lora_rank is None:
        shapes["W_Q"] = (D, H * dqk)
    else:
        shapes["W_DQ"] = (D, layout.q_lora_rank)
        shapes["W_UQ"] = (layout.q_lora_rank, H * dqk)
    assert (
        layout.kv_lora_rank is not None and layout.qk_rope_head_dim is not None and layout.qk_nope_head_dim is not None
    )
    shapes["W_DKV_KR"] = (D, layout.kv_lora_rank + layout.qk_rope_head_dim)
    shapes["W_UKV"] = (layout.kv_lora_rank, H * (layout.qk_nope_head_dim + dh))
    shapes["W_O"] = (H * dh, D)
    return shapes


def attention_params_per_layer(layout: AttentionLayout) -> int:
    """Parameters (number of scalars) of one attention layer.

    Without biases an MHA layer with ``n_heads * d_head == d_model`` has ``4 * d_model**2``,
    whatever ``n_heads`` is (lesson 003: the H matrices d_model x d_head of W_Q together are one
    d_model x d_model matrix). GQA/MQA reduce W_K and W_V to ``d_model * n_kv_heads * d_head``
    each. Biases add one number per output feature of the projections that have them
    (``"qkv"``: Q, K, V; ``"all"``: also O; ``"out"``: O only): GPT-2 small 4*768**2 + 4*768 = 2,362,368.

    MLA adds the two RMSNorm weight vectors of the latents (``q_lora_rank`` and ``kv_lora_rank``
    numbers), which live inside the attention block in DeepSeek-V3. QK-norm adds its weights
    (see :class:`AttentionLayout`): ``2 * d_qk`` per layer for ``"per_head"`` (Qwen3),
    ``(n_heads + n_kv_heads) * d_qk`` for ``"full"`` (OLMo 2). Learned sinks add ``n_heads`` (GPT-OSS).

    Returns:
        a count of parameters.
    """
    shapes = attention_weight_shapes(layout)
    total = sum(i * o for i, o in shapes.values())
    if layout.bias in ("qkv", "all"):
        total += sum(o for name, (_, o) in shapes.items() if name != "W_O")
    if layout.bias in ("all", "out"):
        total += shapes["W_O"][1]
    if layout.kv_lora_rank is not None:  # MLA
        total += layout.kv_lora_rank + (layout.q_lora_rank or 0)
    if layout.sinks:  # GPT-OSS: one learned sink logit per query head
        total += layout.n_heads
    if layout.qk_norm == "per_head":
        total += 2 * layout.d_qk
    elif layout.qk_norm == "full":
        assert layout.n_kv_heads is not None  # filled by AttentionLayout.__post_init__
        total += (layout.n_heads + layout.n_kv_heads) * layout.d_qk
    return total


def attention_params(layout: AttentionLayout) -> int:
    """Attention parameters of the whole model: ``attention_params_per_layer`` times the layers with
    heads (every layer, or a hybrid's ``head_layers``; its linear-attention layers are not counted). A count."""
    return layout.n_attention_layers * attention_params_per_layer(layout)


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------


def kv_numbers_per_token_per_layer(layout: AttentionLayout, decompressed: bool = False) -> int:
    """Numbers cached per token (per cached position) per layer during generation.

    MHA/GQA/MQA: ``n_kv_heads * (d_qk + d_head)``, i.e. ``2 * n_kv_heads * d_head`` (one key and
    one value per KV head; lesson 003:
    Llama 3 8B as MHA 2*32*128 = 8192). MLA: ``kv_lora_rank + qk_rope_head_dim``, the latent
    c^KV and the decoupled rotary key k^R shared by all heads (DeepSeek-V2 paper, section 2.1.3;
    DeepSeek-V3: 512 + 64 = 576). This is the cache of an inference engine that absorbs W_UK
    and W_UV. ``decompressed=True`` gives instead what the reference Hugging Face implementation
    (``DeepseekV3Attention``) caches: every head's key (``d_qk = qk_nope_head_dim +
    qk_rope_head_dim``) and value (``d_head``), ``n_heads * (d_qk + d_head)``; it changes nothing
    for MHA/GQA/MQA.

    Returns:
        a count of numbers.
    """
    assert layout.d_head is not None and layout.n_kv_heads is not None  # filled by AttentionLayout.__post_init__
    if layout.is_mla:
        assert layout.kv_lora_rank is not None and layout.qk_rope_head_dim is not None
        if decompressed:
            return layout.n_heads * (layout.d_qk + layout.d_head)
        return layout.kv_lora_rank + layout.qk_rope_head_dim
    return layout.n_kv_heads * (layout.d_qk + layout.d_head)


def kv_bytes_per_token(layout: AttentionLayout, decompressed: bool = False) -> int:
    """KV cache of one token over all layers, in bytes:
    ``kv_numbers_per_token_per_layer * n_layers * bytes_per_element``, over the layers with heads
    (a hybrid's linear-attention layers keep a fixed-size state, not counted).

    Llama 3 8B in bf16: 8192 * 32 * 2 = 524,288 bytes = 512 KiB as MHA, 128 KiB with 8 KV heads.
    Sliding windows are not applied: this is what each token costs while it is inside every
    layer's window (see :func:`kv_bytes_per_request` for a whole sequence).
    """
    return kv_numbers_per_token_per_layer(layout, decompressed) * layout.n_attention_layers * layout.bytes_per_element


@dataclass(frozen=True)
class KVTokenSpan:
    """The KV cache the tokens ``first_token..last_token`` (1-based, inclusive; ``last_token``
    None: every later token) of a sequence each add: ``bytes_per_token`` bytes, over the layers
    whose window still has room for them (a global layer always has).

    Attributes:
        first_token, last_token: token positions, 1-based; ``last_token`` None for no end.
        bytes_per_token: bytes each of these tokens adds to the cache of one sequence.
        n_layers: the attention layers that cache these tokens' keys and values (a count).
    """

    first_token: int
    last_token: int | None
    bytes_per_token: int
    n_layers: int

    def tokens_within(self, seq_len: int) -> int:
        """How many of the first ``seq_len`` tokens fall in this span (a count, 0 or more)."""
        last = seq_len if self.last_token is None else min(seq_len, self.last_token)
        return max(0, last - self.first_token + 1)


def kv_bytes_per_token_spans(layout: AttentionLayout, decompressed: bool = False) -> list[KVTokenSpan]:
    """What each token adds to one sequence's KV cache, span by span of positions: without windows
    one span, every token :func:`kv_bytes_per_token`; with sliding windows ``W_1 < W_2 < ...`` the
    tokens 1 to ``W_1`` add the cache of every layer, tokens ``W_1 + 1`` to ``W_2`` that of the
    layers with a longer window or none, and past the longest window only the global layers' (0
    bytes when every layer is windowed: Mistral 7B adds 128 KiB a token up to 4,096 tokens, then
    nothing, since each layer drops its oldest position).
    ``kv_bytes_per_request(layout, T) == sum(s.bytes_per_token * s.tokens_within(T))``.

    Returns:
        a list of :class:`KVTokenSpan`, in order of position, covering every token.
    """
    per_layer = kv_numbers_per_token_per_layer(layout, decompressed) * layout.bytes_per_element
    if layout.windows is None:
        return [KVTokenSpan(1, None, per_layer * layout.n_attention_layers, layout.n_attention_layers)]
    windows = [layout.windows[l] for l in layout.attention_layers]
    edges = sorted({w for w in windows if w is not None})
    spans, first = [], 1
    for last in [*edges, None]:
        n = sum(1 for w in windows if w is None or (last is not None and w >= last))
        spans.append(KVTokenSpan(first, last, per_layer * n, n))
        first = (last or 0) + 1
    return spans


def kv_positions(layout: AttentionLayout, seq_len: int) -> list[int]:
    """Positions each layer caches for one sequence of ``seq_len`` tokens: ``min(seq_len, window)``
    for a sliding-window layer, ``seq_len`` for a global one, 0 for a hybrid's linear-attention
    layer (its fixed-size state is not a KV cache; a list of ``n_layers`` counts).

    A sliding-window layer keeps a rolling buffer of ``window`` positions (Mistral 7B,
    arXiv:2310.06825; Hugging Face ``StaticSlidingWindowLayer`` allocates
    ``min(max_cache_len, sliding_window)``). Hugging Face's ``DynamicCache`` keeps one position
    fewer between steps and adds the new one during the step, so this is its peak.

    Raises:
        HeadprobeError: ``seq_len`` is not a positive integer.
    """
    _check_positive("seq_len", seq_len)
    windows = layout.windows or (None,) * layout.n_layers
    heads = set(layout.attention_layers)
    return [0 if l not in heads else seq_len if w is None else min(seq_len, w) for l, w in enumerate(windows)]


def kv_positions_total(layout: AttentionLayout, seq_len: int) -> int:
    """``sum(kv_positions(layout, seq_len))``, the positions all layers cache for one sequence,
    without a list per layer where no layer is windowed (``n_attention_layers * seq_len``): a
    layout from ``budget --recommend --params 1e30`` has 1.7e8 layers.

    Raises:
        HeadprobeError: ``seq_len`` is not a positive integer.
    """
    if layout.windows is None:
        _check_positive("seq_len", seq_len)
        return layout.n_attention_layers * seq_len
    return sum(kv_positions(layout, seq_len))


def kv_bytes_per_request(layout: AttentionLayout, seq_len: int, batch: int = 1, decompressed: bool = False) -> int:
    """KV cache of ``batch`` sequences of ``seq_len`` tokens, in bytes:
    ``sum over layers of kv_positions * kv_numbers_per_token_per_layer * bytes_per_element * batch``.

    Llama 3 8B as MHA at 32K tokens: 512 KiB * 32768 = 16 GiB. A sliding-window layer holds at
    most its window (:func:`kv_positions`).

    Raises:
        HeadprobeError: ``seq_len`` or ``batch`` is not a positive integer.
    """
    _check_workload(seq_len, batch)
    per_position = kv_numbers_per_token_per_layer(layout, decompressed) * layout.bytes_per_element
    return kv_positions_total(layout, seq_len) * per_position * batch


#: The answer of :func:`max_tokens_in_kv` when every layer is windowed and the windows fit.
UNBOUNDED_TOKENS = 2**62


def max_tokens_in_kv(layout: AttentionLayout, kv_limit_bytes: int, batch: int = 1) -> int:
    """The most tokens per sequence whose KV cache fits in ``kv_limit_bytes`` (a count of tokens).

    With sliding-window layers the cache stops growing in those layers past their window; when
    every layer is windowed and the full windows fit, any length fits and the answer is
    :data:`UNBOUNDED_TOKENS`.
    """
    _check_positive("batch", batch)
    if layout.windows is None:
        return kv_limit_bytes // (kv_bytes_per_token(layout) * batch)
    if kv_bytes_per_request(layout, UNBOUNDED_TOKENS, batch) <= kv_limit_bytes:
        return UNBOUNDED_TOKENS
    lo, hi = 0, UNBOUNDED_TOKENS  # cost(lo) fits (or lo = 0), cost(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv_bytes_per_request(layout, mid, batch) <= kv_limit_bytes:
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def projection_flops(layout: AttentionLayout, seq_len: int, batch: int = 1, as_mha: bool = False) -> int:
    """FLOPs of the projections of one attention layer on ``batch`` sequences of ``seq_len``.

    Every weight is used once per token in one multiply and one add: ``2 * tokens * weights``.
    For MHA with ``n_heads * d_head == d_model`` this is the lesson's ``8 * T * D**2``. With GQA
    or MQA the K and V projections are ``group_size`` times cheaper; ``as_mha=True`` counts the
    layer as MHA of the same heads, as the lesson's table does. Biases are not counted.

    Returns:
        FLOPs.
    """
    _check_workload(seq_len, batch)
    lay = layout.as_mha() if as_mha else layout
    weights = sum(i * o for i, o in attention_weight_shapes(lay).values())
    return 2 * batch * seq_len * weights


def visible_keys(seq_len: int, window: int | None = None) -> int:
    """(query, key) pairs one head scores over a sequence of ``seq_len`` tokens (a count).

    Without a window every score of the ``T x T`` matrix is counted, ``T**2`` (an eager
    implementation computes them all and masks; see :func:`score_flops`). With a window of ``W``
    keys each query at position ``pos`` reads ``min(W, pos + 1)`` keys (Mistral 7B's sliding
    window, arXiv:2310.06825; a kernel that skips masked blocks, FlashAttention-2's
    ``window_size`` or FlexAttention, computes only these):
    ``sum_{pos < T} min(W, pos + 1) = W(W+1)/2 + (T - W) W`` for ``T >= W``, ``T(T+1)/2`` below.
    A streaming group with ``S`` sink and ``W`` recent keys reads ``min(S + W, pos + 1)`` keys
    (the sink and the window are disjoint once ``pos + 1 > S + W``), i.e. the window ``S + W``.

    Raises:
        HeadprobeError: ``seq_len`` or ``window`` is not a positive integer.
    """
    _check_positive("seq_len", seq_len)
    if window is None:
        return seq_len * seq_len
    _check_positive("window", window)
    w = min(window, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


def score_flops(layout: AttentionLayout, seq_len: int, batch: int = 1, window: int | None = None) -> int:
    """FLOPs of the scores QK^T and the weighted sum AV of one attention layer.

    Per head: QK^T is (T x d_qk)(d_qk x T), ``2*T**2*d_qk`` FLOPs; AV is (T x T)(T x d_head),
    ``2*T**2*d_head``. With ``n_heads * d_head == D`` the total is the lesson's ``4 * T**2 * D``.
    For MLA ``d_qk = qk_nope_head_dim + qk_rope_head_dim`` (the naive,
    non-absorbed form). Without ``window`` every score is
    counted: a causal mask lets a kernel skip about half of them; the softmax is not counted.
    GQA does not change this term: every query head still scores every key. With ``window`` (a
    sliding-window layer) only the keys each query reads, ``T**2`` replaced by
    :func:`visible_keys` ``(T, window)``: Mistral 7B at T = 32768, W = 4096: 2.06 TFLOP per layer
    instead of 17.6.

    Returns:
        FLOPs.
    """
    _check_workload(seq_len, batch)
    assert layout.d_head is not None  # filled by AttentionLayout.__post_init__
    return 2 * batch * layout.n_heads * visible_keys(seq_len, window) * (layout.d_qk + layout.d_head)


def crossover_seq_len(layout: AttentionLayout, window: int | None = None, as_mha: bool = False) -> int | float | None:
    """The T at which projections and scores+AV cost the same FLOPs (a real number of tokens): an
    int where it is a whole number (``2*D`` for MHA, exact at any size), else the double nearest
    the exact fraction.

    Projections cost ``p*T`` and scores ``s * visible_keys(T, window)``. Without a window
    ``T = p / s`` (``2*D`` for MHA, lesson 003). With a window ``W``: below ``W`` the scores are
    ``s*T(T+1)/2``, equal at ``T = 2p/s - 1``; past ``W`` they grow as ``s*W`` per token, so
    when ``s*W > p`` they catch up at ``T = s*W(W-1) / (2(s*W - p))``, and when ``s*W <= p`` never
    (None: the projections dominate at every length; Mistral 7B with W = 4096). Computed in
    fractions (a float's ``p / s`` printed 2e23 as 199999999999999983222784 in ``--json``).
    """
    p = projection_flops(layout, 1, 1, as_mha=as_mha)
    s = score_flops(layout, 1, 1)
    if window is None:
        t = Fraction(p, s)
    else:
        t = Fraction(2 * p - s, s)  # 2p/s - 1
        if t > window:
            if s * window <= p:
                return None
            t = Fraction(s * window * (window - 1), 2 * (s * window - p))
    return t.numerator if t.denominator == 1 else float(t)


@dataclass(frozen=True)
class AttentionFlops:
    """FLOPs of one attention layer at one sequence length.

    Attributes:
        seq_len: T, tokens per sequence.
        projections: FLOPs of W_Q, W_K, W_V, W_O (linear in T).
        scores: FLOPs of QK^T and AV (quadratic in T on a global layer, linear past ``window``).
        quadratic_share: ``scores / (projections + scores)``, between 0 and 1.
        crossover_seq_len: the T at which the two terms are equal (2*D for MHA); a real number
            (an int where whole, exact; else the nearest double), or None when a window keeps the
            scores below the projections at every length.
        window: the layer's sliding window (positions), or None for a global layer.
        n_layers: layers of this kind in the layout (1 when costed alone).
    """

    seq_len: int
    projections: int
    scores: int
    quadratic_share: float
    crossover_seq_len: int | float | None
    window: int | None = None
    n_layers: int = 1

    @property
    def total(self) -> int:
        return self.projections + self.scores


def attention_flops(
    layout: AttentionLayout, seq_len: int, batch: int = 1, as_mha: bool = False, window: int | None = None
) -> AttentionFlops:
    """FLOPs of one attention layer (see :func:`projection_flops`, :func:`score_flops`), global or
    with a sliding ``window``.

    The crossover length solves ``projections(T) == scores(T)`` (:func:`crossover_seq_len`): on a
    global layer projections are ``p*T`` and scores ``s*T**2``, so ``T = p / s``; for MHA
    ``T = 8*D**2 / (4*D) = 2*D`` (lesson 003).

    Raises:
        HeadprobeError: ``seq_len``, ``batch`` or ``window`` is not a positive integer.
    """
    proj = projection_flops(layout, seq_len, batch, as_mha=as_mha)
    scores = score_flops(layout, seq_len, batch, window=window)
    return AttentionFlops(
        seq_len=seq_len,
        projections=proj,
        scores=scores,
        quadratic_share=scores / (proj + scores),
        crossover_seq_len=crossover_seq_len(layout, window=window, as_mha=as_mha),
        window=window,
    )


def layer_windows(layout: AttentionLayout) -> list[tuple[int | None, int]]:
    """The kinds of layer of ``layout`` as ``(window, n_layers)``: the global layers first
    (window None) if there are any, then each sliding window (positions) in increasing order,
    with how many of the ``n_layers`` layers have it. ``[(None, n_layers)]`` without windows."""
    if layout.windows is None:  # no list of n_layers entries (1.7e8 at --recommend --params 1e30)
        return [(None, layout.n_layers)]
    windows = layout.windows
    sizes = sorted({w for w in windows if w is not None})
    return [(w, windows.count(w)) for w in ([None] if None in windows else []) + sizes]


def attention_flops_by_window(
    layout: AttentionLayout, seq_len: int, batch: int = 1, as_mha: bool = False
) -> list[AttentionFlops]:
    """FLOPs of one layer of each kind of ``layout`` (:func:`layer_windows`: global, then each
    window), the one count every FLOPs figure of ``headprobe budget`` is read from: a global
    layer's scores count every score of the ``T x T`` matrix, a windowed layer's the
    :func:`visible_keys` ``(T, W)`` each head reads (Mistral 7B at T = 32768: 2.06 TFLOP of scores
    per layer, not 17.6). ``n_layers`` of each entry says how many layers it stands for.

    Raises:
        HeadprobeError: ``seq_len`` or ``batch`` is not a positive integer.
    """
    return [
        replace(attention_flops(layout, seq_len, batch, as_mha=as_mha, window=w), n_layers=n)
        for w, n in layer_windows(layout)
    ]


# ---------------------------------------------------------------------------------------------
# Attention-matrix memory
# ---------------------------------------------------------------------------------------------


def attention_matrix_bytes(layout: AttentionLayout, seq_len: int, batch: int = 1, window: int | None = None) -> int:
    """Bytes of one layer's materialised attention weights ``[batch, head, q_pos, k_pos]``.

    ``batch * n_heads * T * T * activation_bytes`` (lesson 003, ``score_matrix_bytes``): Llama 3
    8B in bf16, 32 heads: 4 GiB at T = 8192, 1 TiB at T = 131072. The matrix is in the compute
    dtype (:func:`activation_bytes`), not the KV cache's storage format: an fp8 cache leaves it bf16. A naive implementation holds
    several such matrices at once (scores, masked scores, weights). With ``window`` (a
    sliding-window layer) only the weights each query reads are stored (a banded matrix,
    ``min(W, pos + 1)`` per query, :func:`visible_keys`): Mistral 7B at 32768 tokens, 7.5 GiB
    instead of 64 GiB per layer.

    Raises:
        HeadprobeError: ``seq_len`` or ``batch`` is not a positive integer.
    """
    _check_workload(seq_len, batch)
    return batch * layout.n_heads * visible_keys(seq_len, window) * activation_bytes(layout)


def fused_attention_bytes(layout: AttentionLayout, seq_len: int, batch: int = 1) -> int:
    """Bytes one layer of a fused attention kernel (FlashAttention-2, SDPA) keeps in GPU memory.

    The kernel reads Q ``[batch, pos, head, d_qk]``, K ``[batch, pos, kv_head, d_qk]`` and V
    ``[batch, pos, kv_head, d_head]``, writes the output ``[batch, pos, head, d_head]`` and keeps,
    for the backward pass, one float32 log-sum-exp per (batch, head, q_pos) (Dao 2023,
    arXiv:2307.08691, algorithm 1). Score tiles live in on-chip SRAM and are never stored, so the
    memory is O(T), not O(T**2). For MLA the keys and values are the decompressed per-head ones.
    Q, K, V and the output are in the compute dtype (:func:`activation_bytes`: bf16 for an fp8 cache).

    Returns:
        bytes.
    """
    _check_workload(seq_len, batch)
    H, n, d_qk, d_v = layout.n_heads, batch * seq_len, layout.d_qk, layout.d_head
    kv_heads = H if layout.is_mla else layout.n_kv_heads  # MLA: decompressed keys and values, one per head
    assert kv_heads is not None and d_v is not None  # filled by AttentionLayout.__post_init__
    numbers = n * (H * d_qk + kv_heads * d_qk + kv_heads * d_v + H * d_v)
    return numbers * activation_bytes(layout) + n * H * 4


MLP_WIDTH_RATIO = 4
"""The MLP width ``d_mlp / d_model`` :func:`forward_sequence_bytes` assumes where none is given
(GPT-2 4; Llama 3 8B 3.5; SmolLM2-135M 2.67)."""


def forward_sequence_bytes(
    layout: AttentionLayout,
    seq_len: int,
    d_vocab: int,
    element_bytes: int,
    logit_positions: int | None = None,
    d_mlp: int | None = None,
    streams: int = 0,
    logit_bytes: int = 8,
) -> int:
    """Peak bytes one sequence adds to a batched forward pass without autograd (inference mode),
    the per-item estimate that batch sizes are planned from (:mod:`headprobe.probe.core.memory`)::

        T * element_bytes * ((4 + streams) * D + (H + 2 * KV) * d_head + 3 * d_mlp)
        + 4 * H * T * T + logit_bytes * P * d_vocab

    one layer's live activations at a time (the residual stream, its normed input, the attention
    and MLP outputs; queries, keys and values; the MLP's gate, up and their product), plus
    ``streams`` more ``d_model``-wide copies the caller holds per sequence (an exact sweep's
    resumed residual, attention output and its change: 3), one layer's attention weights in
    float32 (the eager softmax; a fused kernel stores none, so this bounds it from above), and
    the logits at the ``P = logit_positions`` (default ``T``) scored positions, ``logit_bytes`` per
    entry (default 8: float32 logits and their log-softmax; a forward that takes no loss passes
    :meth:`~headprobe.probe.backends.base.LoadedModel.logit_entry_bytes`). ``d_mlp`` defaults to
    :data:`MLP_WIDTH_RATIO` ``* d_model``.

    Returns:
        bytes.

    Raises:
        HeadprobeError: ``seq_len`` is not a positive integer.
    """
    T, (D, H, kv, d_head, mlp) = seq_len, _activation_widths(layout, seq_len, d_mlp)
    P = T if logit_positions is None else logit_positions
    per_token = (4 + streams) * D + (H + 2 * kv) * d_head + 3 * mlp
    return T * element_bytes * per_token + 4 * H * T * T + logit_bytes * P * d_vocab


def _activation_widths(layout: AttentionLayout, seq_len: int, d_mlp: int | None) -> tuple[int, int, int, int, int]:
    """``(d_model, n_heads, key/value heads (an MLA layer's: n_heads), d_head, d_mlp)`` of the
    per-sequence estimates (``d_mlp`` None: :data:`MLP_WIDTH_RATIO` ``* d_model``).

    Raises:
        HeadprobeError: ``seq_len`` is not a positive integer.
    """
    _check_workload(seq_len, 1)
    kv = layout.n_heads if layout.is_mla else layout.n_kv_heads
    assert kv is not None and layout.d_head is not None  # filled by AttentionLayout.__post_init__
    return layout.d_model, layout.n_heads, kv, layout.d_head, mlp_width(layout.d_model, d_mlp)


def mlp_width(d_model: int, d_mlp: int | None) -> int:
    """The MLP width the per-sequence estimates take: ``d_mlp``, or where not known (None)
    :data:`MLP_WIDTH_RATIO` ``* d_model``."""
    return MLP_WIDTH_RATIO * d_model if d_mlp is None else d_mlp


def backward_sequence_bytes(
    layout: AttentionLayout, seq_len: int, d_vocab: int, element_bytes: int, d_mlp: int | None = None
) -> int:
    """Peak bytes one sequence adds to a forward and backward pass through every layer (autograd;
    gradients for activations and head masks, none for the weights), the per-item estimate of
    gradient importance and L0 gates::

        L * (T * element_bytes * (8 * D + 3 * (H + 2 * KV) * d_head + 3 * H * d_head + 4 * d_mlp)
             + 2 * 4 * H * T * T)
        + 6 * 4 * T * d_vocab + forward_sequence_bytes(layout, T, d_vocab, element_bytes, 0, d_mlp)

    what autograd keeps of each of the ``L`` layers until the backward reaches it (the residual
    stream and norms; queries, keys and values with their rotated copies; ``z``, the masked
    ``z`` and its probe; the MLP's gate, up, activation and product; the float32 attention
    weights of the eager softmax, twice, which bounds a fused kernel's from above), six float32
    ``[T, d_vocab]`` tensors at the loss (the logits, their log-softmax, its gradient, the
    gradient through the log-softmax and the shifted slice, and one spare), and one layer's live tensors
    (:func:`forward_sequence_bytes` without logits) while that layer runs or is differentiated.
    ``d_mlp`` defaults to :data:`MLP_WIDTH_RATIO` ``* d_model``.

    Returns:
        bytes.

    Raises:
        HeadprobeError: ``seq_len`` is not a positive integer.
    """
    T, (D, H, kv, d_head, mlp) = seq_len, _activation_widths(layout, seq_len, d_mlp)
    per_token = 8 * D + 3 * (H + 2 * kv) * d_head + 3 * H * d_head + 4 * mlp
    saved = layout.n_layers * (T * element_bytes * per_token + 2 * 4 * H * T * T)
    return saved + 6 * 4 * T * d_vocab + forward_sequence_bytes(layout, T, d_vocab, element_bytes, 0, mlp)


# ---------------------------------------------------------------------------------------------
# Pruned layers: fewer heads in some layers
# ---------------------------------------------------------------------------------------------


def kept_kv_heads(layout: AttentionLayout, kept_heads: Sequence[int]) -> int:
    """Key/value heads a layer of ``layout`` keeps when it keeps the query heads ``kept_heads``
    (original numbering): each kept query head ``h`` reads ``h // group_size``, and a key/value head
    goes only when every query head of its group goes (headprobe.probe.model.pruned). A count."""
    return len({h // layout.group_size for h in kept_heads})


def layer_cost(formula: Callable[..., int], layout: AttentionLayout, n_heads: int, n_kv_heads: int, *args: Any) -> int:
    """``formula(layer, *args)`` for one layer of ``layout`` that keeps ``n_heads`` query heads
    reading ``n_kv_heads`` key/value heads, as a pruned model's layer does (``headprobe prune
    --save-pruned``): the counts need not divide each other and may be 0 (a layer with no head
    left keeps only the output bias).

    ``formula`` is one of the per-layer formulas here (:func:`attention_params_per_layer`,
    :func:`kv_numbers_per_token_per_layer`, :func:`projection_flops`, :func:`score_flops`,
    :func:`attention_matrix_bytes`, :func:`fused_attention_bytes`). Each is affine in the two
    counts, ``c + a * n_heads + b * n_kv_heads`` (every query head adds its slice of W_Q and W_O,
    its scores and its output; every key/value head its slices of W_K and W_V and its cache), so it
    is evaluated on three layouts of the same widths that :class:`AttentionLayout` accepts,
    ``(n_heads, n_kv_heads) = (1, 1), (2, 1), (2, 2)``, and extended exactly: ``a = f(2, 1) -
    f(1, 1)``, ``b = f(2, 2) - f(2, 1)``, ``c = f(1, 1) - a - b``. The unit is the formula's
    (a count, FLOPs or bytes).

    Raises:
        HeadprobeError: an MLA layout (its heads share one latent: MLA heads are not removed),
            a negative count, more key/value heads than query heads, or query heads without a
            key/value head (or the reverse).
    """
    if layout.is_mla:
        raise HeadprobeError("per-layer head counts describe MHA/GQA/MQA layers; MLA heads are not removed")
    if not (0 <= n_kv_heads <= n_heads and (n_kv_heads > 0) == (n_heads > 0)):
        raise HeadprobeError(f"a layer cannot keep {n_heads} query heads on {n_kv_heads} key/value heads")
    at = {
        hk: formula(replace(layout, n_layers=1, windows=None, head_layers=None, n_heads=hk[0], n_kv_heads=hk[1]), *args)
        for hk in ((1, 1), (2, 1), (2, 2))
    }
    a = at[2, 1] - at[1, 1]
    b = at[2, 2] - at[2, 1]
    return at[1, 1] - a - b + a * n_heads + b * n_kv_heads


# ---------------------------------------------------------------------------------------------
# Head-level KV-cache policies (per layer and KV group: full, or streaming with S sinks + W recent)
# ---------------------------------------------------------------------------------------------


def n_kv_groups(layout: AttentionLayout) -> int:
    """KV groups per layer, the units that own cache: ``n_kv_heads`` for MHA/GQA/MQA, 1 for MLA
    (its latent ``c^KV`` and rotary key are shared by every head)."""
    assert layout.n_kv_heads is not None  # filled by AttentionLayout.__post_init__
    return 1 if layout.is_mla else layout.n_kv_heads


def kv_numbers_per_token_per_group(layout: AttentionLayout) -> int:
    """Numbers one KV group caches per position: ``d_qk + d_head`` (its key and value) for
    MHA/GQA/MQA, ``kv_lora_rank + qk_rope_head_dim`` for MLA (the layer's latent). Times
    :func:`n_kv_groups` this is :func:`kv_numbers_per_token_per_layer`."""
    return kv_numbers_per_token_per_layer(layout) // n_kv_groups(layout)


@dataclass(frozen=True)
class PolicyCost:
    """What a :class:`~headprobe.probe.layout.attention.KVPolicy` costs on ``batch`` sequences of ``seq_len``.

    Attributes:
        seq_len, batch: the workload.
        kv_bytes_per_layer: KV cache of each layer, bytes.
        kv_bytes: the whole cache, bytes (the sum of ``kv_bytes_per_layer``).
        kv_bytes_full: the same layout with every group full (layer windows kept), bytes.
        kv_fraction: ``kv_bytes / kv_bytes_full``.
        n_full_groups, n_streaming_groups: counts.
        flops_scores_per_layer: scores + AV FLOPs of each layer (full groups as
            :func:`score_flops`, every score counted; streaming ones only the keys they read).
        flops_scores, flops_scores_full: their sum over layers, and with every group full; FLOPs.
        attention_matrix_bytes_largest_layer: the largest layer's materialised weights, bytes.
    """

    seq_len: int
    batch: int
    kv_bytes_per_layer: list[int]
    kv_bytes: int
    kv_bytes_full: int
    kv_fraction: float
    n_full_groups: int
    n_streaming_groups: int
    flops_scores_per_layer: list[int]
    flops_scores: int
    flops_scores_full: int
    attention_matrix_bytes_largest_layer: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def streaming_positions(seq_len: int, group: Streaming, layer_window: int | None = None) -> int:
    """Positions a streaming group caches after ``seq_len`` tokens (a count), on a layer whose own
    sliding window is ``layer_window`` (None: a global layer).

    The group's queries read the intersection of the layer's mask and StreamingLLM's (Xiao et al.
    2023, arXiv:2309.17453): query ``i`` reads key ``j <= i`` iff ``j > i - layer_window`` and
    (``j < sink`` or ``j > i - window``); the cache keeps what the last query reads. With ``m =
    min(window, layer_window)`` that is the last ``min(T, m)`` positions plus the sink positions
    still inside the layer's window, ``max(0, min(S, T - m) - max(0, T - layer_window))``. On a
    global layer this is ``min(T, sink + window)``; with ``layer_window <= window`` it is
    ``min(T, layer_window)``, the full group's (streaming changes nothing there).
    """
    m = group.window if layer_window is None else min(group.window, layer_window)
    past_layer = 0 if layer_window is None else max(0, seq_len - layer_window)
    return min(seq_len, m) + max(0, min(group.sink, seq_len - m) - past_layer)


def streaming_visible_keys(seq_len: int, group: Streaming, layer_window: int | None = None) -> int:
    """(query, key) pairs one head of a streaming group scores over ``seq_len`` tokens (a count):
    the sum over queries of what each reads (:func:`streaming_positions` after ``pos + 1`` tokens),
    in closed form: :func:`visible_keys` ``(T, m)`` for the recent keys plus, for each sink
    position ``j < sink``, the queries ``j + m < n <= min(T, j + layer_window)`` (``n = pos + 1``)
    that read it outside their recent window. On a global layer it equals
    :func:`visible_keys` ``(T, sink + window)``."""
    S, W = group.sink, layer_window
    m = group.window if W is None else min(group.window, W)
    total = visible_keys(seq_len, m)
    a = 0 if W is None else max(0, min(S, seq_len - W + 1))  # sinks read by W - m queries each
    if W is not None:
        total += a * (W - m)
    b = min(S, seq_len - m)  # sinks j in [a, b): read by T - m - j queries
    if b > a:
        total += (b - a) * (seq_len - m) - (a + b - 1) * (b - a) // 2
    return total


def _group_keys(layout: AttentionLayout, group: Streaming | None, layer: int, seq_len: int) -> tuple[int, int, int]:
    """(cached positions, materialised weights per head, causal keys per head) of one group of
    ``layer``: a global layer's full group materialises ``T**2`` weights (eager) but a kernel that
    skips masked blocks scores ``T(T+1)/2`` keys, the count every windowed and streaming group's
    FLOPs use too (:func:`visible_keys` with the window ``T``)."""
    window = layout.windows[layer] if layout.windows else None
    if group is None:
        causal = visible_keys(seq_len, seq_len if window is None else window)
        return (seq_len if window is None else min(seq_len, window)), visible_keys(seq_len, window), causal
    keys = streaming_visible_keys(seq_len, group, window)
    return streaming_positions(seq_len, group, window), keys, keys


def group_positions(layout: AttentionLayout, layer: int, group: Streaming | None, seq_len: int) -> int:
    """Positions one KV group of ``layer`` caches after ``seq_len`` tokens (a count): ``min(T,
    window_l)`` full (``T`` on a global layer), :func:`streaming_positions` streaming."""
    return _group_keys(layout, group, layer, seq_len)[0]


def policy_cost(layout: AttentionLayout, policy: KVPolicy, seq_len: int, batch: int = 1) -> PolicyCost:
    """The exact cost of a head-level policy (:class:`~headprobe.probe.layout.attention.KVPolicy`).

    A full group of layer ``l`` caches ``min(T, window_l)`` positions (``T`` on a global layer), a
    streaming one ``min(T, S + W)`` on a global layer and :func:`streaming_positions` on a
    sliding-window one (the layer's window and the streaming mask both apply), each ``kv_numbers_per_token_per_group * bytes_per_element``
    bytes per sequence; its ``group_size`` query heads (all heads for MLA) score the keys each
    query sees under the causal mask (``min(W, pos + 1)``, ``pos + 1`` on a global layer: one
    count for full and streaming groups, as a kernel that skips masked blocks computes them),
    ``2 * (d_qk + d_head)`` FLOPs per key (DuoAttention, Xiao et
    al. 2024, arXiv:2410.10819, counts memory the same way: full heads grow with T, streaming
    heads stay at S + W).

    Raises:
        HeadprobeError: the policy's layer or group count differs from the layout's, a bad workload.
    """
    _check_workload(seq_len, batch)
    policy.check_layout(layout.n_layers, n_kv_groups(layout), "the layout")
    per_pos = kv_numbers_per_token_per_group(layout) * layout.bytes_per_element * batch
    heads = layout.n_heads // n_kv_groups(layout)
    assert layout.d_head is not None  # filled by AttentionLayout.__post_init__
    per_key = 2 * batch * heads * (layout.d_qk + layout.d_head)
    kv, flops, matrix = [], [], []
    for layer, row in enumerate(policy.groups):
        costs = [_group_keys(layout, g, layer, seq_len) for g in row]
        kv.append(sum(c[0] for c in costs) * per_pos)
        flops.append(sum(c[2] for c in costs) * per_key)
        matrix.append(sum(c[1] for c in costs) * batch * heads * activation_bytes(layout))
    full = [_group_keys(layout, None, layer, seq_len) for layer in range(policy.n_layers)]
    kv_full = sum(c[0] for c in full) * policy.n_kv_groups * per_pos
    flops_full = sum(c[2] for c in full) * policy.n_kv_groups * per_key
    n_full = len(policy.full_groups)
    return PolicyCost(
        seq_len,
        batch,
        kv,
        sum(kv),
        kv_full,
        sum(kv) / kv_full,
        n_full,
        policy.n_layers * policy.n_kv_groups - n_full,
        flops,
        sum(flops),
        flops_full,
        max(matrix),
    )


# ---------------------------------------------------------------------------------------------
# Formatting FLOPs (sizes: headprobe.probe.core.sizes)
# ---------------------------------------------------------------------------------------------


def format_tflop(flops: int | float | Fraction) -> str:
    """FLOPs as a number of TFLOP (10**12 FLOPs), as in the lesson's table: two decimals below 10
    (``0.14``, ``1.10``, ``4.40``), one below 100 (``17.6``), none above (``281``); exact
    (:func:`~headprobe.probe.core.sizes.fixed`) at any size."""
    t = exact(flops) / TFLOP
    return fixed(t, 2 if t < 10 else 1 if t < 100 else 0)


def format_flops(flops: int | float, like: float | None = None) -> str:
    """FLOPs with a decimal prefix: ``4.40 TFLOP`` from 10**11 up, else ``GFLOP``, ``MFLOP``...

    ``like``: format in the unit this other count would get (a row that compares two counts reads
    in one unit, ``0.09 TFLOP`` beside ``1.10 TFLOP``); default ``flops`` itself."""
    ref = flops if like is None else like
    if ref >= 10**11:
        return f"{format_tflop(flops)} TFLOP"
    for unit, size in (("GFLOP", 10**9), ("MFLOP", 10**6), ("kFLOP", 10**3)):
        if ref >= size:
            return f"{format_tflop(exact(flops) * Fraction(TFLOP, size))} {unit}"
    return f"{fixed(flops, 0)} FLOP"


# ---------------------------------------------------------------------------------------------
# Presets (attention layouts from published configs)
# ---------------------------------------------------------------------------------------------

PRESETS: dict[str, AttentionLayout] = {
    # Vaswani et al. 2017 (arXiv:1706.03762), table 3 "base": d_model 512, h 8, d_k = d_v = 64,
    # N = 6 decoder layers. tensor2tensor's attention projections have no biases.
    "transformer-base": AttentionLayout(d_model=512, n_layers=6, n_heads=8, bias="none", name="Transformer base"),
    # openai-community/gpt2 config.json: n_embd 768, n_layer 12, n_head 12; c_attn and c_proj
    # carry biases (3*768 + 768 = 3072 numbers per layer).
    "gpt2-small": AttentionLayout(d_model=768, n_layers=12, n_heads=12, bias="all", name="GPT-2 small"),
    # Brown et al. 2020 (arXiv:2005.14165), table 2.1: d_model 12288, 96 layers, 96 heads of 128;
    # GPT-2 style projections with biases.
    "gpt3-175b": AttentionLayout(d_model=12288, n_layers=96, n_heads=96, bias="all", name="GPT-3 175B"),
    # meta-llama/Meta-Llama-3-8B config.json: hidden_size 4096, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8, attention_bias false; bf16.
    "llama3-8b": AttentionLayout(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, name="Llama 3 8B"),
    # mistralai/Mistral-7B-v0.1 config.json: hidden_size 4096, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8 (d_head 128), sliding_window 4096 on every
    # layer (Jiang et al. 2023, arXiv:2310.06825, table 1), no attention bias.
    "mistral-7b": AttentionLayout(
        d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, windows=(4096,) * 32, name="Mistral 7B v0.1"
    ),
    # mistralai/Mistral-7B-v0.3 config.json (v0.2's attention): the same heads, sliding_window null
    # (no window on any layer: a 32,768-token cache is 8x v0.1's), vocab 32768.
    "mistral-7b-v0.3": AttentionLayout(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, name="Mistral 7B v0.3"),
    # Qwen/Qwen2.5-7B config.json: hidden_size 3584, num_hidden_layers 28,
    # num_attention_heads 28, num_key_value_heads 4 (d_head 128); biases on q, k, v only.
    "qwen2.5-7b": AttentionLayout(d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, bias="qkv", name="Qwen2.5-7B"),
    # deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, num_hidden_layers 61,
    # num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
    # qk_rope_head_dim 64, v_head_dim 128, attention_bias false.
    "deepseek-v3": AttentionLayout(
        d_model=7168,
        n_layers=61,
        n_heads=128,
        d_head=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        name="DeepSeek-V3",
    ),
    # moonshotai/Kimi-K2-Instruct config.json (DeepSeek-V3 architecture): hidden_size 7168,
    # num_hidden_layers 61, num_attention_heads 64, q_lora_rank 1536, kv_lora_rank 512,
    # qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128 (arXiv:2507.20534: 64 heads).
    "kimi-k2": AttentionLayout(
        d_model=7168,
        n_layers=61,
        n_heads=64,
        d_head=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        name="Kimi K2",
    ),
    # HuggingFaceTB/SmolLM2-135M config.json: hidden_size 576, num_hidden_layers 30,
    # num_attention_heads 9, num_key_value_heads 3 (d_head 64), no attention bias.
    "smollm2-135m": AttentionLayout(d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, name="SmolLM2-135M"),
}


@dataclass(frozen=True)
class ModelShape:
    """What a preset's model has besides attention, for its whole-model parameters and FLOPs
    (:func:`model_params`, :func:`forward_flops_per_token`).

    Attributes:
        vocab_size: tokens of the vocabulary (rows of the embedding).
        d_mlp: the MLP's hidden width.
        gated_mlp: three MLP matrices (SwiGLU: gate, up, down) rather than two.
        tied_embeddings: the output layer reuses the input embedding (counted once).
        mlp_bias: the MLP's matrices carry biases (GPT-2).
        layer_norm: LayerNorm (a weight and a bias per feature) rather than RMSNorm (a weight).
        n_positions: learned absolute position embeddings (GPT-2: 1,024), 0 for rotary.
        norms_per_layer: norms of one layer (2: before the attention and before the MLP; Gemma 2
            and 3 add a norm after each, 4).
        other_norms: norms outside the layers (1: the final norm; an embedding norm adds one).
    """

    vocab_size: int
    d_mlp: int
    gated_mlp: bool = True
    tied_embeddings: bool = False
    mlp_bias: bool = False
    layer_norm: bool = False
    n_positions: int = 0
    norms_per_layer: int = 2
    other_norms: int = 1


#: The dense presets' MLP, vocabulary and embeddings, from the same config.json files as
#: :data:`PRESETS` (vocab_size, intermediate_size / n_inner, tie_word_embeddings); the MoE presets
#: (DeepSeek-V3, Kimi K2) and the encoder-decoder transformer-base have none, and get no whole-model rows.
MODEL_SHAPES: dict[str, ModelShape] = {
    # openai-community/gpt2: vocab 50257, n_positions 1024, n_inner 4*768, biases, LayerNorm, tied.
    "gpt2-small": ModelShape(
        vocab_size=50257,
        d_mlp=3072,
        gated_mlp=False,
        tied_embeddings=True,
        mlp_bias=True,
        layer_norm=True,
        n_positions=1024,
    ),
    # Brown et al. 2020 (arXiv:2005.14165), sec. 2.1 and Table 2.1: GPT-2's architecture (biases,
    # LayerNorm, tied embeddings, learned positions) at n_ctx 2048 and d_ff = 4 d_model.
    "gpt3-175b": ModelShape(
        vocab_size=50257,
        d_mlp=4 * 12288,
        gated_mlp=False,
        tied_embeddings=True,
        mlp_bias=True,
        layer_norm=True,
        n_positions=2048,
    ),
    # meta-llama/Meta-Llama-3-8B: vocab_size 128256, intermediate_size 14336, tie_word_embeddings false.
    "llama3-8b": ModelShape(vocab_size=128256, d_mlp=14336),
    # mistralai/Mistral-7B-v0.1: vocab_size 32000, intermediate_size 14336, tie_word_embeddings false.
    "mistral-7b": ModelShape(vocab_size=32000, d_mlp=14336),
    # mistralai/Mistral-7B-v0.3: vocab_size 32768, intermediate_size 14336, tie_word_embeddings false.
    "mistral-7b-v0.3": ModelShape(vocab_size=32768, d_mlp=14336),
    # Qwen/Qwen2.5-7B: vocab_size 152064, intermediate_size 18944, tie_word_embeddings false.
    "qwen2.5-7b": ModelShape(vocab_size=152064, d_mlp=18944),
    # HuggingFaceTB/SmolLM2-135M: vocab_size 49152, intermediate_size 1536, tie_word_embeddings true.
    "smollm2-135m": ModelShape(vocab_size=49152, d_mlp=1536, tied_embeddings=True),
}


@dataclass(frozen=True)
class ModelParams:
    """A dense decoder's parameters by part (counts): ``attention`` (:func:`attention_params`),
    ``mlp``, ``norms`` (two per layer and a final one), ``embeddings`` (the input embedding, the
    output layer unless tied, learned positions); ``total`` their sum, ``non_embedding`` Kaplan et
    al.'s N (arXiv:2001.08361, section 2.1: without embeddings and positions)."""

    attention: int
    mlp: int
    norms: int
    embeddings: int

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms + self.embeddings

    @property
    def non_embedding(self) -> int:
        return self.total - self.embeddings


def model_params(layout: AttentionLayout, shape: ModelShape, attention: int | None = None) -> ModelParams:
    """The whole model's parameters: Llama 3 8B 1,342,177,280 (attention) + 32 x 3 x 4096 x 14336
    (MLP) + (2 x 32 + 1) x 4096 (RMSNorms) + 2 x 128256 x 4096 (untied embeddings) = 8,030,261,248.
    ``attention``: the attention parameters where they are not the uniform layout's (a pruned model's,
    summed layer by layer; None: :func:`attention_params`). Counts."""
    D, L = layout.d_model, layout.n_layers
    n_mlp = 3 if shape.gated_mlp else 2
    mlp = n_mlp * D * shape.d_mlp + (((n_mlp - 1) * shape.d_mlp + D) if shape.mlp_bias else 0)
    per_norm = 2 * D if shape.layer_norm else D
    embeddings = shape.vocab_size * D * (1 if shape.tied_embeddings else 2) + shape.n_positions * D
    norms = (shape.norms_per_layer * L + shape.other_norms) * per_norm
    return ModelParams(attention_params(layout) if attention is None else attention, L * mlp, norms, embeddings)


def forward_flops_per_token(layout: AttentionLayout, shape: ModelShape, seq_len: int) -> int:
    """Forward FLOPs of one token that attends to ``seq_len`` keys (the last token of a sequence
    of ``seq_len``; a sliding-window layer reads at most its window): ``2 N`` (N the non-embedding
    parameters, one multiply-add each) plus the scores and AV of every attention layer,
    ``2 n_heads (d_qk + d_head) min(seq_len, window)`` (Kaplan et al. 2020, arXiv:2001.08361,
    table 1: ``C_forward = 2N + 2 n_layer n_ctx d_attn``, whose context term counts QK^T only; here
    AV too, as :func:`score_flops`). The embedding lookups and the output layer
    (``2 d_model vocab``) are not counted, as in Kaplan et al. FLOPs.

    Raises:
        HeadprobeError: ``seq_len`` is not a positive integer.
    """
    return 2 * model_params(layout, shape).non_embedding + score_flops(layout, 1, 1) * kv_positions_total(
        layout, seq_len
    )


def preset(name: str, bytes_per_element: int | None = None) -> AttentionLayout:
    """The layout of a published model by preset name (see :data:`PRESETS`).

    Raises:
        HeadprobeError: unknown name (the message lists the known ones).
    """
    key = name.lower()
    if key not in PRESETS:
        raise HeadprobeError(
            f"unknown preset {name!r}{did_you_mean(str(name), PRESETS)}; choose one of {', '.join(PRESETS)}"
        )
    lay = PRESETS[key]
    return lay if bytes_per_element is None else replace(lay, bytes_per_element=bytes_per_element)


# ---------------------------------------------------------------------------------------------
# Comparing KV-head counts and recommending a layout
# ---------------------------------------------------------------------------------------------


MAX_DIVIDED_HEADS = 10**13
"""The most query heads :func:`divisors` takes (the KV-head counts ``budget --compare`` lists, and
``--recommend``'s GQA bracket of an MLA layout): ``sqrt(n)`` = 3.2e6 steps, 0.3 s for ``budget
--compare`` at 1e13 heads (196 rows); 1e18 heads took 1e9 steps (39 s)."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, largest first: each pair ``(d, n // d)`` with ``d`` up to
    ``sqrt(n)``, ``O(sqrt n)`` steps (``budget --recommend --params 1e30`` proposes 1.7e8 heads;
    the loop to ``n`` took minutes).

    Raises:
        HeadprobeError: ``n`` above :data:`MAX_DIVIDED_HEADS` (one line)."""
    if n > MAX_DIVIDED_HEADS:
        raise HeadprobeError(
            f"{n:,} query heads: the KV-head counts that divide them (MHA, each GQA, MQA) are compared for at most "
            f"{MAX_DIVIDED_HEADS:,} heads; give fewer (--n-heads, or a narrower --d-model)"
        )
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def compare_kv_heads(
    layout: AttentionLayout, seq_len: int, batch: int = 1, kv_heads: list[int] | None = None
) -> list[dict[str, Any]]:
    """MHA, GQA with several group counts and MQA of the same heads, side by side.

    One row per ``n_kv_heads`` (every divisor of ``n_heads`` unless ``kv_heads`` is given), plus
    the MLA layout itself when ``layout`` is MLA. Every row's heads are ``layout``'s
    (:meth:`~AttentionLayout.with_kv_heads`): queries and keys ``d_qk`` wide, values ``d_head``, so
    the MHA baseline of an MLA model caches its own heads' keys (DeepSeek-V3: 192 = 128 + 64) and
    values (128). Columns: ``layout``, ``n_kv_heads``, ``group_size``, ``d_qk`` and ``d_head``
    (widths), ``attn_params_per_layer`` (count), ``kv_numbers_per_token_per_layer``
    (count), ``kv_bytes_per_token`` and ``kv_bytes_per_request`` (bytes),
    ``kv_vs_mha`` (fraction of the MHA cache), ``flops_per_layer_by_window`` (one entry per kind
    of layer, :func:`attention_flops_by_window`: ``window``, positions or None for a global layer,
    ``n_layers`` and ``flops_per_layer``, projections plus scores+AV at ``seq_len``) and
    ``flops_per_layer`` (FLOPs, when every layer is of one kind; None when global and windowed
    layers differ), ``attention_matrix_bytes_per_layer`` (bytes of a global layer's materialised
    weights, :func:`attention_matrix_bytes`; of the smallest window's where no layer is global: the
    same for every row, since it counts query heads) and ``fused_attention_bytes_per_layer``
    (:func:`fused_attention_bytes`, which counts the key/value heads).

    Raises:
        HeadprobeError: a requested ``n_kv_heads`` does not divide ``n_heads``.
    """
    rows = []
    mha_bytes = kv_bytes_per_token(layout.as_mha())
    candidates = [layout.with_kv_heads(k) for k in (kv_heads or divisors(layout.n_heads))]
    if layout.is_mla:
        candidates.append(layout)
    for lay in candidates:
        kinds = [
            {"window": f.window, "n_layers": f.n_layers, "flops_per_layer": f.total}
            for f in attention_flops_by_window(lay, seq_len, batch)
        ]
        rows.append(
            {
                "layout": lay.kind,
                "n_kv_heads": None if lay.is_mla else lay.n_kv_heads,
                "group_size": None if lay.is_mla else lay.group_size,
                "d_qk": lay.d_qk,
                "d_head": lay.d_head,
                "attn_params_per_layer": attention_params_per_layer(lay),
                "kv_numbers_per_token_per_layer": kv_numbers_per_token_per_layer(lay),
                "kv_bytes_per_token": kv_bytes_per_token(lay),
                "kv_bytes_per_request": kv_bytes_per_request(lay, seq_len, batch),
                "kv_vs_mha": kv_bytes_per_token(lay) / mha_bytes,
                "flops_per_layer": kinds[0]["flops_per_layer"] if len(kinds) == 1 else None,
                "flops_per_layer_by_window": kinds,
                # the first kind of layer (layer_windows): a global one where there is any, else the smallest window
                "attention_matrix_bytes_per_layer": attention_matrix_bytes(lay, seq_len, batch, kinds[0]["window"]),
                "fused_attention_bytes_per_layer": fused_attention_bytes(lay, seq_len, batch),
            }
        )
    return rows


TARGETS = ("gpu-server", "edge", "long-context")

#: Most key/value heads a target starts from before the KV limit is applied. Llama 3 8B/70B and
#: Qwen2.5-72B use 8 KV heads on servers; small on-device models use 3-4 (SmolLM2-135M: 3,
#: Qwen2.5-0.5B: 2); long-context serving starts from 8 and lets the limit decide.
_KV_HEAD_CAP = {"gpu-server": 8, "edge": 4, "long-context": 8}

#: Below this many KV heads GQA approaches MQA, whose quality loss Ainslie et al. 2023 report;
#: there MLA (cache ~4.5 d_head numbers, quality at or above MHA per DeepSeek-V2) is the better buy.
_MIN_GQA_KV_HEADS = 4


@dataclass(frozen=True)
class Recommendation:
    """A proposed attention layout and why.

    Attributes:
        layout: the proposed :class:`AttentionLayout` (MLA when ``use_mla``).
        use_mla: whether multi-head latent attention is worth it here.
        fits: whether the KV cache of one request at ``seq_len`` fits ``kv_limit_bytes``.
        seq_len, batch, kv_limit_bytes, target: the inputs (bytes, tokens).
        kv_bytes_per_request: the proposed layout's KV cache at ``seq_len`` (bytes).
        explanation: two or three lines on the trade-off.
    """

    layout: AttentionLayout
    use_mla: bool
    fits: bool
    seq_len: int
    batch: int
    kv_limit_bytes: int | None
    target: str
    kv_bytes_per_request: int
    explanation: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["explanation"] = list(self.explanation)
        return d


def _kv_heads_txt(n: int) -> str:
    return "1 KV head" if n == 1 else f"{n} KV heads"


def shape_for_params(n_params: int, d_head: int | None = None) -> tuple[int, int]:
    """A (d_model, n_layers) for a dense decoder of about ``n_params`` non-embedding parameters.

    Uses ``n_params ~ 12 * n_layers * d_model**2`` (Kaplan et al. 2020, arXiv:2001.08361, eq. 2.1,
    with d_ff = 4 d_model) and the aspect ratio ``d_model / n_layers`` of published models:
    128 from 1B parameters up (Llama 3 8B: 4096/32, GPT-3: 12288/96), 64 below (GPT-2 small).
    ``d_model`` is rounded to a multiple of 8 heads of 128 from 1B (4 heads of 64 below), then
    ``n_layers`` is recomputed from the budget.

    Raises:
        HeadprobeError: ``n_params`` is not a positive integer.
    """
    _check_positive("n_params", n_params)
    big = n_params >= 10**9
    aspect = 128 if big else 64
    d_head = d_head or (128 if big else 64)
    step = d_head * (8 if big else 4)  # n_heads a multiple of 8 (of 4 below 1B): many GQA choices
    n_layers = max(1, nearest_root(Fraction(n_params, 12 * aspect**2), 3))
    d_model = max(step, nearest_root(Fraction(n_params, 12 * n_layers * step**2), 2) * step)
    return d_model, layers_for_params(n_params, d_model)


def layers_for_params(n_params: int, d_model: int) -> int:
    """``n_params / (12 d_model**2)`` rounded to the nearest whole number of layers (half to even), at
    least 1, in integers (a float's quotient rounded 79822.5 + 1e-15 to 79822 at ``--params``
    99998499664381870081)."""
    return max(1, round(Fraction(n_params, 12 * d_model**2)))


def nearest_root(q: Fraction, k: int) -> int:
    """The whole number nearest ``q ** (1/k)`` for ``q >= 0`` and ``k`` 2 or 3 (an exact half rounds
    up), in integers: ``floor(q**(1/k) + 1/2) = (floor((2**k q) ** (1/k)) + 1) // 2``."""
    n = math.floor(q * 2**k)
    if k == 2:
        return (math.isqrt(n) + 1) // 2
    assert k == 3, k
    r = (1 << -(-n.bit_length() // 3)) if n else 0  # >= the cube root; Newton's integer steps fall to its floor
    while r and (y := (2 * r + n // (r * r)) // 3) < r:
        r = y
    return (r + 1) // 2


def recommend(
    *,
    seq_len: int,
    target: str = "gpu-server",
    n_params: int | None = None,
    d_model: int | None = None,
    n_layers: int | None = None,
    kv_limit_bytes: int | None = None,
    bytes_per_element: int = 2,
    batch: int = 1,
) -> Recommendation:
    """Propose n_heads, d_head, n_kv_heads and whether MLA is worth it.

    Rules (each from practice the lesson cites):

    1. Shape: ``d_model`` and ``n_layers`` as given, or from ``n_params`` by
       :func:`shape_for_params`.
    2. ``d_head`` is 128 from ``d_model >= 2048`` (Llama 3, Qwen2.5, DeepSeek-V3, GPT-3) and 64
       below (GPT-2, SmolLM2); ``edge`` always takes 64. ``n_heads = d_model // d_head``.
    3. ``n_kv_heads``: the largest divisor of ``n_heads`` not above the target's cap (8 for
       ``gpu-server`` and ``long-context``, 4 for ``edge``) whose KV cache at ``seq_len`` fits
       ``kv_limit_bytes`` (no limit: the cap).
    4. MLA (latent ``4 * d_head``, rotary key ``d_head / 2``, DeepSeek-V3's 512 + 64 for d_head 128)
       is proposed when the limit would push GQA below 4 KV heads (toward MQA's quality loss) or
       not fit at all, MLA fits, the target is not ``edge`` (MLA needs absorbed-matrix kernels few
       on-device runtimes have) and ``d_model >= 1024``.

    Returns:
        a :class:`Recommendation`; ``fits`` is False when nothing fits, and the explanation
        then gives the longest context that does.

    Raises:
        HeadprobeError: unknown ``target``; neither ``n_params`` nor ``d_model`` given;
            ``n_layers`` missing with ``d_model``; a size not positive.
    """
    _check_recommend_arguments(target, seq_len, batch, bytes_per_element, kv_limit_bytes)
    d_model, n_layers = _recommended_shape(target, n_params, d_model, n_layers)
    d_head = _recommended_d_head(target, d_model)
    base = AttentionLayout(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=d_model // d_head,
        d_head=d_head,
        bytes_per_element=bytes_per_element,
    )

    def fits(lay: AttentionLayout) -> bool:
        return kv_limit_bytes is None or kv_bytes_per_request(lay, seq_len, batch) <= kv_limit_bytes

    cap = min(_KV_HEAD_CAP[target], base.n_heads)
    # the divisors of n_heads up to the cap, largest first: cap steps, whatever the head count
    fitting = [k for k in range(cap, 0, -1) if base.n_heads % k == 0 and fits(base.with_kv_heads(k))]
    gqa = base.with_kv_heads(fitting[0] if fitting else 1)
    mla = replace(base, kv_lora_rank=4 * d_head, qk_rope_head_dim=d_head // 2)
    assert gqa.n_kv_heads is not None  # filled by AttentionLayout.__post_init__
    squeezed = not fitting or gqa.n_kv_heads < min(_MIN_GQA_KV_HEADS, cap)
    use_mla = squeezed and fits(mla) and target != "edge" and d_model >= 1024
    chosen = mla if use_mla else gqa
    ok = fits(chosen)
    req = kv_bytes_per_request(chosen, seq_len, batch)
    lines = _recommendation_summary(base, gqa, mla, use_mla, bool(fitting), req, seq_len, batch, kv_limit_bytes, target)
    lines.append(
        _recommendation_verdict(
            chosen, gqa, mla, use_mla, ok, squeezed, fits(mla), seq_len, batch, kv_limit_bytes, target
        )
    )
    return Recommendation(
        layout=chosen,
        use_mla=use_mla,
        fits=ok,
        seq_len=seq_len,
        batch=batch,
        kv_limit_bytes=kv_limit_bytes,
        target=target,
        kv_bytes_per_request=req,
        explanation=tuple(lines),
    )


def _check_recommend_arguments(
    target: str, seq_len: int, batch: int, bytes_per_element: int, kv_limit_bytes: int | None
) -> None:
    """:func:`recommend`'s refusals before any rule: an unknown ``target``, a workload or size not
    positive (the model's sizes are checked by :func:`_recommended_shape`)."""
    if target not in TARGETS:
        raise HeadprobeError(
            f"unknown deployment target {target!r}{did_you_mean(str(target), TARGETS)}; choose one of {', '.join(TARGETS)}"
        )
    _check_workload(seq_len, batch)
    _check_positive("bytes_per_element", bytes_per_element)
    if kv_limit_bytes is not None:
        _check_positive("kv_limit_bytes", kv_limit_bytes)


def _recommended_shape(target: str, n_params: int | None, d_model: int | None, n_layers: int | None) -> tuple[int, int]:
    """:func:`recommend`'s rule 1: ``(d_model, n_layers)`` as given, or what is missing from
    ``n_params`` (:func:`shape_for_params`; ``n_layers`` alone from ``n_params ~ 12 n_layers
    d_model**2``, Kaplan et al. 2020 eq. 2.1).

    Raises:
        HeadprobeError: neither ``n_params`` nor ``d_model``; ``d_model`` without ``n_layers`` or
            ``n_params``; a size not positive.
    """
    if d_model is None:
        if n_params is None:
            raise HeadprobeError("recommend needs a parameter budget (--params) or a width (--d-model)")
        d_model, auto_layers = shape_for_params(n_params, 64 if target == "edge" else None)
        n_layers = n_layers or auto_layers
    elif n_layers is None:
        if n_params is None:
            raise HeadprobeError("recommend with --d-model needs --n-layers or a parameter budget (--params)")
        _check_positive("d_model", d_model)  # before it divides
        n_layers = layers_for_params(n_params, d_model)
    _check_positive("d_model", d_model)
    _check_positive("n_layers", n_layers)
    return d_model, n_layers


def _recommended_d_head(target: str, d_model: int) -> int:
    """:func:`recommend`'s rule 2: 128 from ``d_model >= 2048`` (64 on the edge or below), 64
    where 128 does not divide ``d_model``.

    Raises:
        HeadprobeError: ``d_model`` is not a multiple of 64.
    """
    d_head = 64 if (target == "edge" or d_model < 2048) else 128
    if d_model % d_head:
        d_head = 64
    if d_model % d_head:
        raise HeadprobeError(f"d_model {d_model} is not a multiple of 64; no d_head of 64 or 128 divides it")
    return d_head


def _recommendation_summary(
    base: AttentionLayout,
    gqa: AttentionLayout,
    mla: AttentionLayout,
    use_mla: bool,
    any_fit: bool,
    req: int,
    seq_len: int,
    batch: int,
    kv_limit_bytes: int | None,
    target: str,
) -> list[str]:
    """The first two lines of :func:`recommend`'s explanation: the proposed layout and its cache
    (``req`` bytes), then what MHA, the GQA choice (``any_fit``: some KV-head count fits) and
    MLA would cache."""
    d_model, n_layers, n_heads, d_head = base.d_model, base.n_layers, base.n_heads, base.d_head
    assert gqa.n_kv_heads is not None  # filled by AttentionLayout.__post_init__
    limit_txt = format_bytes(kv_limit_bytes) if kv_limit_bytes is not None else "no limit"
    req_txt = f"{batch} x {seq_len} tokens" if batch > 1 else f"{seq_len} tokens"
    return [
        f"{n_layers} layers x d_model {d_model}: {n_heads} query heads of d_head {d_head}"
        + (
            f", MLA latent {mla.kv_lora_rank} + rotary key {mla.qk_rope_head_dim}"
            if use_mla
            else f", {_kv_heads_txt(gqa.n_kv_heads)} (group size {gqa.group_size}, {gqa.kind})"
        )
        + f"; KV cache {format_bytes(req)} per request at {req_txt}"
        + (f" against {limit_txt}." if kv_limit_bytes is not None else " (no KV-cache limit given)."),
        f"MHA would cache {format_bytes(kv_bytes_per_request(base, seq_len, batch))} ({n_heads} KV heads); "
        + (
            (
                "the most KV heads that fit: "
                if kv_limit_bytes is not None
                else f"no limit given, so the {target} target's cap: "
            )
            + f"{_kv_heads_txt(gqa.n_kv_heads)} ({gqa.kind}, {format_bytes(kv_bytes_per_request(gqa, seq_len, batch))})"
            if any_fit
            else "even MQA (1 KV head) does not fit"
        )
        + f", MLA would cache {format_bytes(kv_bytes_per_request(mla, seq_len, batch))}.",
    ]


def _recommendation_verdict(
    chosen: AttentionLayout,
    gqa: AttentionLayout,
    mla: AttentionLayout,
    use_mla: bool,
    ok: bool,
    squeezed: bool,
    mla_fits: bool,
    seq_len: int,
    batch: int,
    kv_limit_bytes: int | None,
    target: str,
) -> str:
    """The last line of :func:`recommend`'s explanation: why MLA is or is not worth it (rule 4),
    or, when nothing fits (``ok`` False), the longest context that does."""
    mla_bytes = format_bytes(kv_bytes_per_request(mla, seq_len, batch))
    if use_mla:
        return (
            "MLA is worth it: it keeps per-head keys and values (MHA-like quality, DeepSeek-V2) "
            f"for a cache {_gqa_bracket(gqa, mla, seq_len, batch)}, "
            "at the price of latent projections and absorbed kernels."
        )
    if not ok:
        assert kv_limit_bytes is not None  # without a limit everything fits
        most = max_tokens_in_kv(chosen, kv_limit_bytes, batch)
        if most == 0:  # not even one token: the limit, not the context, is what to change
            one = format_bytes(kv_bytes_per_request(chosen, 1, batch))
            return (
                f"Nothing fits: one token's KV cache ({one}) is more than the {format_bytes(kv_limit_bytes)} "
                f"limit; --kv-limit is bytes without a unit: give one (e.g. {kv_limit_bytes}MiB or 2GiB); "
                f"{seq_len} tokens need {format_bytes(kv_bytes_per_request(chosen, seq_len, batch))}."
            )
        return (
            f"Nothing fits: at this size at most {most} tokens fit; shorten the context, "
            f"quantise the cache (fp8 halves bf16), or use fewer layers."
        )
    if squeezed and target != "edge":
        why = (
            f"MLA's cache ({mla_bytes}) does not fit the limit"
            if not mla_fits
            else f"d_model {gqa.d_model} is too narrow for MLA's latent projections to pay off"
        )
        return (
            f"MLA would be the better buy at so few KV heads, but {why}; "
            f"expect some quality loss from sharing each K/V across {gqa.group_size} query heads."
        )
    if target == "edge":
        return (
            f"MLA is not worth it on the edge: {gqa.kind} already fits, and MLA needs absorbed-matrix "
            f"kernels few on-device runtimes have (its cache, {mla_bytes}, "
            f"{'would fit' if mla_fits else 'would not even fit'}); 64-wide heads keep kernels simple."
        )
    return (
        "MLA is not needed: GQA with this many KV heads fits the limit and keeps quality "
        "close to MHA (Ainslie et al. 2023) with plain, widely supported kernels."
    )


def _gqa_name(lay: AttentionLayout) -> str:
    """``MQA``, ``MHA`` or ``GQA-k`` (k key/value heads)."""
    return lay.kind if lay.kind != "GQA" else f"GQA-{lay.n_kv_heads}"


def _gqa_bracket(gqa: AttentionLayout, mla: AttentionLayout, seq_len: int, batch: int) -> str:
    """Where MLA's cache at ``seq_len`` falls among the caches of the same heads with every
    KV-head count that divides ``n_heads`` (MQA to MHA), from the computed bytes: ``"between
    GQA-2 (7.62 GiB) and GQA-4 (15.25 GiB)"``, ``"the size of GQA-k (...)"``, ``"smaller than
    MQA (...)"`` or ``"larger than MHA (...)"``."""
    mla_bytes = kv_bytes_per_request(mla, seq_len, batch)
    sizes = [(kv_bytes_per_request(lay, seq_len, batch), lay) for lay in map(gqa.with_kv_heads, divisors(gqa.n_heads))]
    sizes.sort(key=lambda x: x[0])

    def named(size: int, lay: AttentionLayout) -> str:
        return f"{_gqa_name(lay)} ({format_bytes(size)})"

    below = [x for x in sizes if x[0] < mla_bytes]
    above = [x for x in sizes if x[0] > mla_bytes]
    same = [x for x in sizes if x[0] == mla_bytes]
    if same:
        return f"the size of {named(*same[0])}"
    if not below:
        return f"smaller than {named(*above[0])}"
    if not above:
        return f"larger than {named(*below[-1])}"
    return f"between {named(*below[-1])} and {named(*above[0])}"
