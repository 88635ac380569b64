"""Capturing every head's attention pattern and output contribution.

Two ways:

* :func:`patterns_by_layer` hands each layer's pattern ``[batch, head, q_pos, k_pos]`` to a
  callback as the forward pass produces it and keeps nothing, so memory does not grow with the
  number of layers (the scan reduces each layer's patterns to scores this way).
* :func:`capture_heads` returns patterns and per-head results for chosen layers, for small
  analyses and tests.

The per-head output contribution (Elhage et al. 2021, "A Mathematical Framework for Transformer
Circuits", the W_O decomposition) is ``result_h = z_h @ W_O[h]``, with ``W_O`` split by head as
``[head, d_head, d_model]``; ``attn_out = sum_h result_h + b_O``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import einops
import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError, InputValueError, one_line_repr
from headprobe.probe.core.heads import indices
from headprobe.probe.core.padding import padding_mask
from headprobe.probe.hooks.ablation import HookCounter
from headprobe.probe.hooks.names import attn_hook, block_hook

PatternCallback = Callable[[int, Float[Tensor, "batch head q_pos k_pos"]], None]


def head_results(
    z: Float[Tensor, "batch pos head d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "batch pos head d_model"]:
    """Each head's output contribution through its slice of W_O: ``z[..., h, :] @ W_O[h]``."""
    return einops.einsum(z, W_O, "batch pos head d_head, head d_head d_model -> batch pos head d_model")


def kv_head_of(
    head: Int[Tensor, " head"] | Int[np.ndarray, " head"] | int, n_heads: int, n_kv_heads: int
) -> Int[Tensor, " head"] | Int[np.ndarray, " head"] | int:
    """GQA: the key/value head that query head ``head`` reads, ``head // (n_heads // n_kv_heads)``."""
    return head // (n_heads // n_kv_heads)


@torch.inference_mode()
def patterns_by_layer(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    on_pattern: PatternCallback,
    layers: int | Sequence[int] | None = None,
    extra_hooks: Sequence[tuple[str, Callable]] = (),
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch pos d_vocab"]:
    """Run ``model`` (a :class:`~headprobe.probe.backends.loading.LoadedModel`) on ``tokens``, calling
    ``on_pattern(layer, pattern)`` for each layer as soon as its pattern exists: ``pattern``
    ``[batch, head, q_pos, k_pos]``, each query's softmax attention weights (a row sums to 1),
    ``layer`` the non-negative index. ``tokens`` and ``attention_mask`` as :func:`capture_heads`'
    (``[batch, pos]`` token ids, at most ``spec.n_ctx``); ``layers``: an int or a list of indices,
    negative ones from the end (default: every attention layer).

    The callback must not keep or modify ``pattern``; it is dropped after the call.

    Returns:
        The logits ``[batch, pos, d_vocab]`` of the same forward pass.

    Raises:
        TypeError: ``model`` not a loaded model, ``tokens`` not an integer tensor, ``layers`` neither
            an int nor a sequence of ints (:func:`check_capture_inputs`, one line each).
        HeadprobeError: bad ``tokens`` or ``attention_mask`` (:func:`check_capture_inputs`); a layer
            out of range or one without an attention pattern (a hybrid's linear-attention layer);
            a pattern hook did not fire exactly once (fused attention kernel).
    """
    check_capture_inputs(model, tokens, attention_mask)
    chosen: Sequence[int] = model.spec.attention_layers  # a hybrid's linear layers have no pattern
    if layers is not None:
        chosen = indices(_as_list(layers, "layers") or [], model.spec.n_layers, "layer")
        without = [layer for layer in chosen if layer not in model.spec.attention_layers]
        if without:
            raise HeadprobeError(f"layer {without[0]} has no attention pattern (a linear-attention layer)")
    counter = HookCounter()
    names = [attn_hook(layer, "pattern") for layer in chosen]

    def make_hook(layer: int, name: str):
        def hook(pattern: Tensor, hook: Any) -> None:
            counter.tick(name)
            on_pattern(layer, pattern)

        return hook

    hooks = [(name, make_hook(layer, name)) for layer, name in zip(chosen, names)]
    logits = model.forward(tokens, fwd_hooks=[*hooks, *extra_hooks], attention_mask=attention_mask)
    counter.check_once(names)
    return logits


def pad_prompts(
    prompts: Sequence[Int[Tensor, " _pos"]], pad_id: int, side: str = "right"
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """Stack token sequences of different lengths into ``(tokens, attention_mask)``.

    ``side`` is ``"right"`` (padding after the prompt) or ``"left"`` (before it); the mask is 1
    on real tokens and 0 on padding.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    T = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        sl = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        tokens[i, sl], mask[i, sl] = p, 1
    return tokens, mask


@torch.inference_mode()
def prompt_patterns_by_layer(
    model: Any,
    prompts: Sequence[Int[Tensor, " _pos"]],
    on_pattern: Callable[[int, int, Float[Tensor, "head q_pos k_pos"]], None],
    side: str = "right",
    layers: Sequence[int] | None = None,
) -> None:
    """Run prompts of different lengths as one padded batch; hand each prompt's own pattern to
    ``on_pattern(layer, prompt_index, pattern)``, cut to its real tokens ``[head, L, L]``.

    The cut removes padded queries and padded keys, so whatever is computed from it equals what
    the prompt gives alone (padded keys get zero weight through the attention mask; scores never
    average over padding).

    Raises:
        HeadprobeError: the backend cannot take padded batches (see ``LoadedModel.forward``).
    """
    lengths = [len(p) for p in prompts]
    pad_id = model.bos_token_id if model.bos_token_id is not None else 0
    tokens, mask = pad_prompts(prompts, pad_id, side)
    T = tokens.shape[1]

    def per_prompt(layer: int, pattern: Tensor) -> None:
        for i, L in enumerate(lengths):
            sl = slice(T - L, T) if side == "left" else slice(0, L)
            on_pattern(layer, i, pattern[i, :, sl, sl])

    patterns_by_layer(model, tokens, per_prompt, layers=layers, attention_mask=mask)


@torch.no_grad()  # not inference_mode: what it returns is an ordinary tensor (usable with weights that need grad)
def capture_internal(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    layers: Sequence[int] | None = None,
    residual: bool = False,
    out: dict[str, dict[int, Tensor]] | None = None,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    patterns: bool = True,
    scores: bool = False,
) -> dict[str, dict[int, Tensor]]:
    """:func:`capture_heads` without the self-check guard (the self-check uses it), plus ``norm_in``
    ``[batch, pos, d_model]`` after a post-attention norm; ``residual``: ``resid_pre``, ``resid_mid``, ``resid_post``,
    ``mlp_out`` ``[batch, pos, d_model]`` (where hooked); ``scores``: ``attn_scores`` as ``pattern`` (pre-softmax,
    masked keys ``-inf``). ``out``: filled in place (kept on an error). ``patterns`` False: no pattern hook.

    Raises:
        HeadprobeError: a pattern hook did not fire (a fused kernel), or ``hook_z``'s heads do not match ``W_O``'s.
    """
    layers = list(model.spec.attention_layers if layers is None else layers)
    out = {} if out is None else out
    out.update({"pattern": {}, "z": {}, "attn_out": {}})
    names = set(model.hook_names())

    def saver(kind: str, layer: int):
        def hook(x: Tensor, hook: Any) -> None:
            out.setdefault(kind, {})[layer] = x.detach().clone()

        return hook

    hooks = []
    for layer in layers:
        if patterns:
            hooks.append((attn_hook(layer, "pattern"), saver("pattern", layer)))
        if scores:
            hooks.append((attn_hook(layer, "attn_scores"), saver("attn_scores", layer)))
        hooks.append((attn_hook(layer, "z"), saver("z", layer)))
        post = model.post_attention_norm_hooks(layer)
        if post is not None:  # the block adds norm(attention output): keep the norm's input and output
            hooks.append((post[0], saver("norm_in", layer)))
            hooks.append((post[1], saver("attn_out", layer)))
        else:
            hooks.append((block_hook(layer, "attn_out"), saver("attn_out", layer)))
        if residual:
            for kind in ("resid_pre", "resid_mid", "resid_post", "mlp_out"):
                if block_hook(layer, kind) in names:
                    hooks.append((block_hook(layer, kind), saver(kind, layer)))
    model.forward(tokens, fwd_hooks=hooks, attention_mask=attention_mask)
    missing = [attn_hook(layer, "pattern") for layer in layers if patterns and layer not in out["pattern"]]
    if missing:
        raise HeadprobeError(
            f"hook {missing[0]} did not fire; the model probably runs a fused attention kernel "
            f"that hides attention patterns: load it with attn_implementation='eager'"
        )
    out["result"], out["b_O"] = {}, {}
    for layer in layers:
        W_O = model.W_O(layer)
        z = out["z"][layer]
        if tuple(z.shape[2:]) != tuple(W_O.shape[:2]):
            raise HeadprobeError(
                f"hook_z of layer {layer} is split into heads as {tuple(z.shape[2:])} (head, d_head) but "
                f"W_O as {tuple(W_O.shape[:2])}: the backend reads this architecture's head geometry wrongly"
            )
        result = head_results(z, W_O.to(z))
        b_O = model.b_O(layer)
        bias = (
            torch.zeros(result.shape[-1], dtype=result.dtype, device=result.device)
            if b_O is None
            else b_O.detach().to(result)
        )
        if layer in out.get("norm_in", {}):
            # Frozen-norm linearisation: y = w * a * s(a), with the per-token scale s fixed from the
            # full attention output a, is linear in a, so each head's term is w * s * result_h.
            scale = post_norm_factor(
                out["norm_in"][layer], out["attn_out"][layer], model.post_attention_norm_weight(layer)
            )
            result = result * scale[:, :, None, :]
            bias = bias * scale
        out["result"][layer], out["b_O"][layer] = result, bias
    return out


def post_norm_factor(
    a: Float[Tensor, "batch pos d_model"], y: Float[Tensor, "batch pos d_model"], w: Float[Tensor, " d_model"]
) -> Float[Tensor, "batch pos d_model"]:
    """The per-token linear map ``w * s_t`` of an RMS-type norm ``y_t = w * a_t * s_t`` applied to
    the attention output ``a``: ``s_t`` is fitted per token by least squares,
    ``s_t = <y_t, w a_t> / |w a_t|^2``, exact for any norm of that form (RMSNorm, Gemma's
    ``1 + w`` RMSNorm). A norm of another form (LayerNorm subtracts the mean) does not satisfy
    ``w * s_t * a_t = y_t``, which the load-time self-check then reports."""
    wa = a * w
    s = (y * wa).sum(-1, keepdim=True) / (wa * wa).sum(-1, keepdim=True).clamp_min(1e-30)
    return w * s


def check_capture_inputs(model: Any, tokens: Any, attention_mask: Any = None) -> None:
    """Refuse what :func:`capture_heads` cannot run, in one line naming the argument, before a hook is set.

    Raises:
        TypeError: ``model`` not a loaded model, ``tokens`` not an integer tensor.
        HeadprobeError: ``tokens`` not ``[batch, pos]`` or ``[pos]``, empty, longer than the model's
            context ``spec.n_ctx``, an id outside the vocabulary, or an ``attention_mask`` of another
            shape or with a value other than 0 and 1 (:class:`~headprobe.probe.core.errors.InputValueError`).
    """
    if not hasattr(model, "self_check") or not hasattr(model, "spec"):
        raise TypeError(
            f"model must be a loaded model (headprobe.load_model(...)), got {one_line_repr(model)} ({type(model).__name__})"
        )
    if (
        not isinstance(tokens, Tensor)
        or tokens.dtype.is_floating_point
        or tokens.dtype.is_complex
        or (tokens.dtype == torch.bool)
    ):
        what = type(tokens).__name__ if not isinstance(tokens, Tensor) else f"a {tokens.dtype} tensor"
        raise TypeError(
            f"tokens must be an integer tensor of token ids [batch, pos] (model.to_tokens(text)), got {what}"
        )
    if tokens.dim() not in (1, 2) or tokens.numel() == 0:
        raise HeadprobeError(
            f"tokens must be [batch, pos] token ids with at least one token, got shape {tuple(tokens.shape)}"
        )
    if tokens.shape[-1] > model.spec.n_ctx:
        raise HeadprobeError(
            f"tokens has {tokens.shape[-1]} positions, more than the model's context of {model.spec.n_ctx} (n_ctx)"
        )
    model.check_token_ids(tokens, "tokens")
    if attention_mask is not None and (
        not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(tokens.shape)
    ):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise HeadprobeError(f"attention_mask {shape} must be a tensor of the tokens' shape {tuple(tokens.shape)}")
    if attention_mask is not None:
        padding_mask(attention_mask)  # 0 and 1 only, refused before a hook is set


def _as_list(values: Any, name: str) -> Sequence[int] | None:
    """One index as a list of one (``layers=18``, or a 0-d integer tensor, as ``[18]``); None and
    a sequence as given (their items are checked by :func:`~headprobe.probe.core.heads.indices`, which refuses a bool).

    Raises:
        TypeError: ``values`` neither an index nor a sequence (``layers=1.0``, a string), naming ``name``.
        InputValueError: an empty sequence (``heads=[]``: an empty head axis), naming ``name``.
    """
    import operator

    if values is None or isinstance(values, bool):
        return None if values is None else [values]
    try:
        return [operator.index(values)]
    except TypeError:
        pass
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(
            f"{name} must be an int or a sequence of ints, got {one_line_repr(values)} ({type(values).__name__})"
        )
    values = list(values)
    if not values:  # an empty axis in every tensor returned
        raise InputValueError(f"{name} is empty: give at least one index, or None for all")
    return values


def _stream_rows(model: Any, tokens: Tensor, out: dict[str, dict[int, Tensor]], rows: Sequence[int]) -> None:
    """Fill ``out["pattern"]`` with the ``rows`` of each captured layer's pattern, computed from its
    queries and keys (the native backend's online statistics), as ordinary tensors."""
    from headprobe.probe.hooks.online_stats import online_head_stats

    def keep(layer: int, st: Any) -> None:
        out["pattern"][layer] = st.rows(rows).to(out["z"][layer].dtype)

    online_head_stats(model, tokens, keep, layers=sorted(out["z"]), windows=(), final_residual=False, statistics=False)
    # online_head_stats runs in inference mode: clone its tensors outside it
    out["pattern"] = {layer: p.clone() if p.is_inference() else p for layer, p in out["pattern"].items()}


def capture_heads(
    model: Any,
    tokens: Int[Tensor, "batch pos"] | Int[Tensor, " pos"],
    layers: int | Sequence[int] | None = None,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    heads: int | Sequence[int] | None = None,
    rows: int | Sequence[int] | None = None,
) -> dict[str, dict[int, Tensor]]:
    """Patterns, z, per-head results and attention outputs of ``layers`` (default: all).

    Long sequences: ``heads`` keeps only those query heads in ``pattern``, ``z`` and ``result``
    (their head axis is then ``len(heads)``, in the order given); ``rows`` keeps only those
    query positions of ``pattern`` (``[batch, head, len(rows), k_pos]``), computed on the native
    backend from the layer's queries and keys (:meth:`headprobe.probe.hooks.online_stats.HeadStats.rows`,
    the fused kernel running), so no ``[head, q_pos, k_pos]`` pattern of a layer is made; on the
    bridge they are cut from the materialised pattern.

    ``tokens``: token ids ``[batch, pos]`` (or ``[pos]``, a batch of one), at most ``spec.n_ctx``
    positions. ``layers``, ``heads``, ``rows``: a list of indices or one int.

    ``attention_mask`` ``[batch, pos]`` (1 real, 0 padding; from ``model.to_tokens(list_of_texts)``)
    runs a padded batch: padded keys get zero weight and positions count real tokens only, so at
    the real positions every tensor equals the unpadded run's (tested to 1e-5 on every zoo family,
    either side; the TransformerLens bridge takes right padding only, docs/padding.md). Values at padded query positions are not meaningful (a padded query reads only
    itself); cut each sequence to its real tokens (``mask[b].bool()``) before using them.

    ``result_h`` is each head's output contribution to the residual stream, ``z_h @ W_O[h]``
    (Elhage et al. 2021). In blocks that normalise the attention output before adding it
    (OLMo-2, Gemma-2/3: ``resid_mid = resid_pre + norm(attn_out)``), the norm's per-token scale is
    fixed from the full attention output, which makes the norm linear, and ``result_h`` is taken
    after it: ``w * s_t * z_h W_O[h]`` (the frozen-norm linearisation used for direct logit
    attribution; Elhage et al. 2021, Nanda's TransformerLens ``apply_ln_to_stack``). Either way
    ``sum_h result_h + b_O`` equals what the block adds to the residual stream (a post-LN encoder's,
    BERT's: the sublayer's output before its norm; docs/self-check.md).

    Visualisers: CircuitsVis' ``attention_patterns(tokens, attention)`` takes one sequence,
    ``cap["pattern"][layer][b]`` ``[head, q_pos, k_pos]``; bertviz's ``head_view(attention,
    tokens)`` takes the per-layer patterns as they are, ``tuple(cap["pattern"][l] for l in
    sorted(cap["pattern"]))`` (Hugging Face's ``output_attentions`` format).

    The tensors are ordinary ones (no gradient; not inference tensors), so products with the
    model's weights (``z_h @ W_O[h]``) and in-place edits work on them.

    Returns:
        Hook point -> layer -> tensor: ``pattern`` ``[batch, head, q_pos, k_pos]``, ``z``
            ``[batch, pos, head, d_head]``, ``result`` ``[batch, pos, head, d_model]``, ``b_O``
            ``[d_model]`` or ``[batch, pos, d_model]`` and ``attn_out`` ``[batch, pos, d_model]``, what
            the attention block adds to the residual stream (after the post-attention norm, where there is one).

    Raises:
        TypeError: ``model`` not a loaded model, ``tokens`` not an integer tensor (:func:`check_capture_inputs`);
            ``layers``, ``heads`` or ``rows`` neither an int nor a sequence of ints (``1.0``, ``"1"``).
        HeadprobeError: the model's load-time self-check found that its per-head results do not
            sum to what its blocks add (see :mod:`headprobe.probe.hooks.selfcheck`); bad ``tokens``
            or ``attention_mask`` (:func:`check_capture_inputs`); a left-padded ``attention_mask`` on
            the TransformerLens bridge; or a layer, head or row out of range (negative ones count
            from the end, as Python's, the same on both backends; the dicts are keyed by the
            non-negative layer).
    """
    check_capture_inputs(model, tokens, attention_mask)
    model.self_check.require_decomposition("per-head results (capture_heads)")
    spec = model.spec
    layers, heads, rows = _as_list(layers, "layers"), _as_list(heads, "heads"), _as_list(rows, "rows")
    layers = None if layers is None else indices(layers, spec.n_layers, "layer")
    heads = None if heads is None else indices(heads, spec.n_heads, "head")
    rows = None if rows is None else indices(rows, tokens.shape[-1], "row (query position)")
    stream = rows is not None and model.streams_statistics and attention_mask is None
    out = capture_internal(model, tokens, layers, attention_mask=attention_mask, patterns=not stream)
    out.pop("norm_in", None)
    if stream:
        assert rows is not None  # stream implies rows
        _stream_rows(model, tokens, out, rows)
    elif rows is not None:
        out["pattern"] = {layer: p[:, :, list(rows)] for layer, p in out["pattern"].items()}
    if heads is not None:
        h = list(heads)
        out["pattern"] = {layer: p[:, h] for layer, p in out["pattern"].items()}
        out["z"] = {layer: z[:, :, h] for layer, z in out["z"].items()}
        out["result"] = {layer: r[:, :, h] for layer, r in out["result"].items()}
    return out
