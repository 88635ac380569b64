"""The self-check every model gets at load: are its patterns and per-head results right?

headprobe reads two things out of a model and builds everything else on them: the attention
pattern of every head, and every head's output contribution ``result_h`` (the per-head W_O
decomposition, Elhage et al. 2021). Both are exact only if the backend understands the
architecture. A model whose blocks do something the decomposition does not know of (a norm on
the attention output, latent attention, a hook that rescales) would give silently wrong
per-head numbers. So one short forward pass (:data:`N_TOKENS` tokens) checks, per layer:

(a) **patterns**: every row of ``hook_pattern`` sums to 1 and puts no weight on a future key
    (``k_pos > q_pos``), within :data:`PATTERN_TOLERANCE` (an encoder's bidirectional heads read
    later keys by design: only the row sums are checked, ``max_future_weight`` is None). With
    learned attention sinks (GPT-OSS, :meth:`~headprobe.probe.backends.base.LoadedModel.sink_logits`)
    the pattern holds the real keys' weights and a row plus its sink mass sums to 1, the sink
    mass computed apart from the pattern, from the scores (``hook_attn_scores``) and the sink
    logit: ``sigmoid(sink - logsumexp_k scores)`` (:func:`sink_mass`); a model that dropped
    the sink from its softmax fails;
(b) **decomposition**: ``sum_h result_h + b_O`` equals what the attention block adds to the
    residual stream, to :data:`DECOMPOSITION_TOLERANCE` relative. Two errors are measured per
    layer, each at the scale of the quantities it subtracts, and the larger counts
    (:func:`decomposition_error`):

    - against the attention output itself (``hook_attn_out``, or the post-attention norm's
      output): ``|sum_h result_h + b_O - attn_out| / |attn_out|`` (Frobenius norms);
    - against the residual stream, ``resid_mid - resid_pre`` (or, for blocks whose attention and
      MLP read the same residual in parallel, ``resid_post - resid_pre - mlp_out``), which shows
      that the attention output is what the block adds (a norm the backend does not know of fails
      here). The residual is stored in the model's dtype, so each of its entries is only known to
      within its rounding, ``eps * |resid|``: a model with massive activations (a residual entry
      of ~1e3-1e4, Sun et al. 2024, "Massive activations in large language models") loses ``eps * 2.5e4 ~ 3e-3`` of every such entry when the attention output is
      added, far more than the attention output's own rounding. So the error against the residual
      is the part of ``|added - reference|`` that this rounding cannot explain,
      ``max(0, |added - reference| - eps * | |resid_mid| + |resid_pre| |) / |reference|`` (``|mlp_out|`` added inside for a parallel block)
      (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, sec. 2.2: ``fl(x + y) =
      (x + y)(1 + d)``, ``|d| <= eps / 2``; the bound ``eps`` covers the two roundings of a parallel
      block too). A healthy model with one 2.5e4 feature then passes with the same error as
      without it (1e-7), while a decomposition that is off by more than the residual's rounding
      still fails.

Precision: the tolerances above are float32's. :func:`~headprobe.options.load_model` and
:meth:`LoadedModel.to <headprobe.probe.backends.base.LoadedModel.to>` run the check on the float32 model
before casting it to bfloat16/float16, so a half-precision model is judged on its float32 weights
(``dtype`` in the record says which). A model already in half precision when checked gets
:func:`tolerance` of its dtype, ``8 * torch.finfo(dtype).eps`` (bfloat16: 0.0625, float16:
0.0078): on the tiny zoo the largest errors measured were 0.0055 (bfloat16) and 0.00037 (float16)
relative, 0.0022 and 0.00024 on a row sum (docs/results.md, "Half precision"), while a real
decomposition failure (a norm or head split the backend does not know of) is off by order 1.

The outcome is :class:`SelfCheck`, kept on the loaded model and written into every
summary.json (``self_check``). Per-head results are refused (:meth:`SelfCheck.require_decomposition`)
when (b) fails; pattern-only scores may still run when (a) holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_hook

N_TOKENS = 16
"""Tokens in the self-check's forward pass (one sequence, BOS first where the model has one)."""
DECOMPOSITION_TOLERANCE = 1e-4
"""Largest relative error of ``sum_h result_h + b_O`` against the attention output and against the
block's residual contribution beyond its rounding (:func:`decomposition_error`)."""
PATTERN_TOLERANCE = 1e-4
"""Largest error of a pattern row sum, and largest weight on a future key."""


def tolerance(dtype: torch.dtype) -> float:
    """The self-check's tolerance (relative, and on pattern row sums) for a model computing in
    ``dtype``: 1e-4 (:data:`DECOMPOSITION_TOLERANCE`) for float32 and wider, else
    ``8 * torch.finfo(dtype).eps`` (bfloat16 0.0625, float16 0.0078; see the module docstring)."""
    return max(DECOMPOSITION_TOLERANCE, 8 * torch.finfo(dtype).eps)


@dataclass(frozen=True)
class SelfCheck:
    """Outcome of :func:`run_self_check` (recorded as ``self_check`` in every summary.json).

    Attributes:
        architecture: the Hugging Face architecture (``LlamaForCausalLM``) or ``headprobe Transformer``.
        backend: ``native`` or ``transformer-lens``.
        n_tokens: tokens in the checked forward pass.
        patterns_ok: (a) held in every layer.
        max_row_sum_error: largest ``|sum_k pattern[q, k] + sink mass - 1|`` over layers, heads and
            queries (the sink mass is 0 without learned sinks; :func:`sink_mass`).
        max_future_weight: largest weight on a key after its query.
        decomposition_ok: (b) held in every layer.
        max_relative_error: largest relative error of (b) over layers (None if not computed).
        worst_layer: the layer where it was largest.
        reference: the residual reference of (b) (``resid_mid - resid_pre`` or ``resid_post -
            resid_pre - mlp_out``); (b) also compares with the attention output itself.
        post_attention_norm: the blocks normalise the attention output before adding it; results
            are then taken after that norm (see :func:`headprobe.probe.hooks.capture.capture_heads`).
        error: why a check could not be computed at all (one line), else None.
        tolerance: the tolerance of (a) and (b) (:func:`tolerance` of ``dtype``).
        dtype: the precision the check ran in (torch's name, ``float32`` for every model
            loaded by name, whatever ``--dtype`` asked: the check runs before the cast).
    """

    architecture: str
    backend: str
    n_tokens: int
    patterns_ok: bool
    max_row_sum_error: float | None
    max_future_weight: float | None
    decomposition_ok: bool
    max_relative_error: float | None
    worst_layer: int | None
    reference: str
    post_attention_norm: bool
    error: str | None = None
    tolerance: float = DECOMPOSITION_TOLERANCE
    dtype: str = "float32"
    max_sink_mass: float | None = None
    """Largest sink mass of a row (learned sinks only; None without them, and left out of the record)."""

    @property
    def ok(self) -> bool:
        """Both checks held."""
        return self.patterns_ok and self.decomposition_ok

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record, floats rounded to 3 significant digits."""
        d = asdict(self)
        for key in ("max_row_sum_error", "max_future_weight", "max_relative_error", "max_sink_mass"):
            if d[key] is not None:
                d[key] = float(f"{d[key]:.3g}")
        if d["max_sink_mass"] is None:  # no learned sinks: no sink-mass key in the record
            del d["max_sink_mass"]
        d["ok"] = self.ok
        return d

    def _identity(self) -> str:
        if self.error is not None:
            return f"it could not be computed ({self.error})"
        return (
            f"sum_h result_h + b_O differs from the attention output or {self.reference} by {self.max_relative_error:.2g} relative in layer "
            f"{self.worst_layer} (tolerance {self.tolerance:g})"
        )

    def require_decomposition(self, what: str = "per-head results") -> None:
        """Raise unless (b) held: ``what`` would otherwise be silently wrong.

        Raises:
            HeadprobeError: one line naming the architecture and the identity that failed.
        """
        if not self.decomposition_ok:
            raise HeadprobeError(
                f"{what} refused for {self.architecture} ({self.backend} backend): the load-time self-check of the "
                f"per-head W_O decomposition failed: {self._identity()}"
            )

    def require_patterns(self, what: str = "attention patterns") -> None:
        """Raise unless (a) held.

        Raises:
            HeadprobeError: one line naming the architecture and the pattern property that failed.
        """
        if not self.patterns_ok:
            rows = "rows plus their sink mass sum" if self.max_sink_mass is not None else "rows sum"
            why = (
                self.error
                if self.max_row_sum_error is None
                else (
                    f"{rows} to 1 within {self.max_row_sum_error:.2g}"
                    + (
                        ""
                        if self.max_future_weight is None
                        else f" and future keys get up to {self.max_future_weight:.2g}"
                    )
                )
            )
            raise HeadprobeError(
                f"{what} refused for {self.architecture} ({self.backend} backend): the load-time "
                f"self-check of attention patterns failed: {why} (tolerance {self.tolerance:g})"
            )


def check_tokens(model: Any, n_tokens: int = N_TOKENS) -> torch.Tensor:
    """``[1, n_tokens]`` token ids for the self-check: BOS (where the model has one) then seeded
    random ids below ``min(d_vocab, len(tokenizer))``; capped at the model's context."""
    n = min(n_tokens, model.spec.n_ctx)
    vocab = model.spec.d_vocab
    if model.tokenizer is not None:
        vocab = min(vocab, len(model.tokenizer))
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    if model.prepend_bos:
        ids[0, 0] = model.bos_token_id
    return ids


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def decomposition_error(
    added: Float[Tensor, "batch pos d_model"],
    attn_out: Float[Tensor, "batch pos d_model"],
    resid_plus: Float[Tensor, "batch pos d_model"],
    *resid_minus: Float[Tensor, "batch pos d_model"],
) -> float:
    """Relative error of check (b) in one layer (module docstring): the larger of
    ``|added - attn_out| / |attn_out|`` and the error against the residual stream beyond its
    rounding, ``max(0, |added - ref| - eps * | |resid_plus| + sum |resid_minus| |) / |ref|`` with
    ``ref = resid_plus - sum(resid_minus)`` (``resid_mid, resid_pre`` or ``resid_post, resid_pre,
    mlp_out``). Norms are Frobenius norms computed in float64; ``eps`` is
    ``torch.finfo(resid_plus.dtype).eps`` (float32: 1.2e-7). Dimensionless."""
    added = added.double()
    ref = resid_plus.double() - sum(r.double() for r in resid_minus)
    rounding = torch.finfo(resid_plus.dtype).eps * sum(
        (r.double().abs() for r in resid_minus), resid_plus.double().abs()
    )
    beyond = max(float((added - ref).norm() - rounding.norm()), 0.0)
    return max(_relative_error(added, attn_out), beyond / float(ref.norm().clamp_min(1e-30)))


def sink_mass(
    scores: Float[Tensor, "batch head q_pos k_pos"], sinks: Float[Tensor, " head"]
) -> Float[Tensor, "batch head q_pos"]:
    """The weight a learned sink takes from each row: ``exp(sink_h) / (exp(sink_h) + sum_k
    exp(scores_k))`` ``= sigmoid(sink_h - logsumexp_k scores_k)`` (masked keys ``-inf``), in float64."""
    lse = scores.double().logsumexp(dim=-1)
    return torch.sigmoid(sinks.double().to(lse.device)[None, :, None] - lse)


def _row_sum_error(cap: dict, sinks: dict[int, Tensor | None]) -> tuple[float, float | None]:
    """Check (a)'s row error ``max |sum_k pattern + sink mass - 1|`` over layers, and the largest
    sink mass (None without sinks); ``sinks``: layer -> its sink logits or None.

    Raises:
        KeyError: a layer with sinks whose scores were not captured.
    """
    err, most = 0.0, None
    for l, s in sinks.items():
        rows = cap["pattern"][l].double().sum(-1)
        if s is not None:
            mass = sink_mass(cap["attn_scores"][l], s).to(rows.device)
            rows = rows + mass
            most = max(most or 0.0, float(mass.max()))
        err = max(err, float((rows - 1).abs().max()))
    return err, most


def _max_future_weight(cap: dict, layers: Sequence[int], T: int) -> float:
    """The largest pattern weight a query puts on a later key, over the captured ``layers`` of a
    causal model (0 for a single token)."""
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return max(float(cap["pattern"][l].double().cpu()[..., future].abs().max()) if T > 1 else 0.0 for l in layers)


def _decomposition_errors(cap: dict, layers: Sequence[int], parallel: bool) -> list[float]:
    """Check (b)'s :func:`decomposition_error` of every layer in ``layers``: the heads' results plus
    ``b_O`` against ``attn_out`` and the residual difference (``parallel``: less ``mlp_out``)."""
    errors = []
    for l in layers:
        added = cap["result"][l].sum(dim=2) + cap["b_O"][l]
        resid: tuple[Tensor, ...]
        if parallel:
            resid = (cap["resid_post"][l], cap["resid_pre"][l], cap["mlp_out"][l])
        else:
            resid = (cap["resid_mid"][l], cap["resid_pre"][l])
        errors.append(decomposition_error(added, cap["attn_out"][l], *resid))
    return errors


@torch.inference_mode()
def run_self_check(model: Any, n_tokens: int = N_TOKENS) -> SelfCheck:
    """Run checks (a) and (b) of the module docstring on ``model`` (a
    :class:`~headprobe.probe.backends.loading.LoadedModel`). Never raises for a model that fails them:
    the failure is the result."""
    from headprobe.probe.hooks.capture import capture_internal

    spec = model.spec
    tokens = check_tokens(model, n_tokens)
    T = tokens.shape[1]
    names = set(model.hook_names())
    layers = spec.attention_layers  # a hybrid model's linear-attention layers have no heads to check
    parallel = any(block_hook(l, "resid_mid") not in names for l in layers)
    reference = "resid_post - resid_pre - mlp_out" if parallel else "resid_mid - resid_pre"
    tol = tolerance(model.dtype)
    common = dict(
        architecture=model.architecture,
        backend=model.backend,
        n_tokens=T,
        reference=reference,
        post_attention_norm=model.has_post_attention_norm,
        tolerance=tol,
        dtype=str(model.dtype).removeprefix("torch."),
    )

    def failed(why: str, **kw) -> SelfCheck:
        fields = dict(
            patterns_ok=False,
            max_row_sum_error=None,
            max_future_weight=None,
            decomposition_ok=False,
            max_relative_error=None,
            worst_layer=None,
        )
        return SelfCheck(**{**fields, **kw}, error=why, **common)

    sinks = {l: model.sink_logits(l) for l in layers}
    has_sinks = any(s is not None for s in sinks.values())
    cap: dict = {}
    try:
        capture_internal(model, tokens, layers=layers, residual=True, out=cap, scores=has_sinks)
    except Exception as e:  # a backend that cannot be captured fails the check, with the reason
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if len(cap.get("pattern", ())) < len(layers):
            return failed(why)
        cap["failure"] = why
    try:
        row_err, most = _row_sum_error(cap, sinks)
    except KeyError:
        return failed(
            "the model has learned attention sinks but hook_attn_scores did not fire: the sink mass cannot be checked"
        )
    common["max_sink_mass"] = most

    future_w = _max_future_weight(cap, layers, T) if spec.causal else None  # an encoder reads later keys by design
    patterns_ok = row_err <= max(PATTERN_TOLERANCE, tol) and (
        future_w is None or future_w <= max(PATTERN_TOLERANCE, tol)
    )
    if "failure" in cap:
        return failed(cap["failure"], patterns_ok=patterns_ok, max_row_sum_error=row_err, max_future_weight=future_w)

    errors = _decomposition_errors(cap, layers, parallel)
    worst = max(range(len(errors)), key=errors.__getitem__)  # an index into layers
    return SelfCheck(
        patterns_ok=patterns_ok,
        max_row_sum_error=row_err,
        max_future_weight=future_w,
        decomposition_ok=errors[worst] <= tol,
        max_relative_error=errors[worst],
        worst_layer=layers[worst],
        **common,
    )
