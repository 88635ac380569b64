"""``headprobe budget``: what an attention layout costs (parameters, KV cache, FLOPs, memory).

Four ways to use it:

* a layout: ``--preset llama3-8b``, explicit flags (``--d-model 4096 --n-layers 32 --n-heads 32
  --n-kv-heads 8``) or both (flags override the preset), at ``--seq-len`` and ``--batch``;
* ``--compare``: MHA, GQA with every group count, and MQA of the same width side by side;
* ``--recommend``: propose n_heads, d_head, n_kv_heads and MLA or not for a parameter budget
  (``--params``) or width, a context length, a KV-cache limit (``--kv-limit``) and a target;
* ``--model NAME``: read the layout from a loaded model and check the computed KV cache against
  the bytes the model's own Hugging Face cache holds after a forward pass.

All formulas live in :mod:`headprobe.probe.cost`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import replace
from typing import Any

from headprobe.probe import cost
from headprobe.probe.cost import AttentionLayout, format_bytes, format_flops, format_tflop
from headprobe.probe.errors import HeadprobeError

HELP = "attention cost calculator: parameters, KV cache, FLOPs and attention-matrix memory for MHA, GQA, MQA and MLA"

DEFAULT_SEQ_LEN = 8192
FLOPS_TABLE_SEQ_LENS = (1024, 8192, 32768, 131072)  # the lesson's table (seeds/003, "FLOPs")
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog. Attention heads share keys and values."


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("layout (a preset, a model, explicit flags; flags override the first two)")
    src.add_argument("--preset", help=f"a published layout: {', '.join(cost.PRESETS)}")
    src.add_argument("--model", help="load this model (e.g. smollm2-135m, gpt2), read its layout and check its KV cache")
    src.add_argument("--d-model", type=int, help="residual width D")
    src.add_argument("--n-layers", type=int, help="number of attention layers")
    src.add_argument("--n-heads", type=int, help="query heads H")
    src.add_argument("--n-kv-heads", type=int, help="key/value heads (default: --n-heads, i.e. MHA; 1 is MQA)")
    src.add_argument("--d-head", type=int, help="head width (default: d_model / n_heads)")
    src.add_argument("--bias", choices=cost.BIAS_KINDS, help="projections with biases (default: the preset's, else none)")
    src.add_argument("--kv-lora-rank", type=int, help="MLA: width of the cached KV latent (DeepSeek-V3: 512)")
    src.add_argument("--q-lora-rank", type=int, help="MLA: width of the query latent (DeepSeek-V3: 1536)")
    src.add_argument("--qk-rope-head-dim", type=int, help="MLA: width of the decoupled rotary key (DeepSeek-V3: 64)")
    work = p.add_argument_group("workload")
    work.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"tokens per sequence T (default {DEFAULT_SEQ_LEN})")
    work.add_argument("--batch", type=int, default=1, help="sequences per request (default 1)")
    work.add_argument("--dtype", choices=list(cost.DTYPE_BYTES), default="bf16",
                      help="number format of cache and activations, sets the bytes per element (default bf16)")
    mode = p.add_argument_group("modes")
    mode.add_argument("--compare", action="store_true", help="MHA, GQA (every group count) and MQA of the same width side by side")
    mode.add_argument("--flops-table", nargs="*", type=int, metavar="T",
                      help=f"FLOPs of one layer at several lengths (default {' '.join(map(str, FLOPS_TABLE_SEQ_LENS))})")
    mode.add_argument("--as-mha", action="store_true", help="--flops-table: count K/V projections as MHA, as the lesson's table does")
    mode.add_argument("--recommend", action="store_true", help="propose a head layout for --params/--d-model, --seq-len, --kv-limit, --target")
    mode.add_argument("--params", help="recommend: parameter budget without embeddings, e.g. 135M, 8B")
    mode.add_argument("--kv-limit", help="recommend: KV-cache memory limit per request, e.g. 2GiB, 512MiB")
    mode.add_argument("--target", choices=cost.TARGETS, default="gpu-server", help="recommend: deployment target (default gpu-server)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


# ---------------------------------------------------------------------------------------------
# Building the layout
# ---------------------------------------------------------------------------------------------


def layout_from_args(args: argparse.Namespace, base: AttentionLayout | None = None) -> AttentionLayout:
    """The layout the flags describe, starting from ``base`` (a preset or a model) if given.

    Raises:
        HeadprobeError: unknown preset; no layout given; a bad size (see AttentionLayout).
    """
    bpe = cost.DTYPE_BYTES[args.dtype]
    if base is None and args.preset:
        base = cost.preset(args.preset)
    if base is None:
        missing = [f for f in ("d_model", "n_layers", "n_heads") if getattr(args, f) is None]
        if missing:
            flags = ", ".join("--" + f.replace("_", "-") for f in missing)
            raise HeadprobeError(f"give --preset, --model or the layout flags; missing {flags}")
        fields: dict[str, Any] = {}
    else:
        fields = base.to_dict()
        # A new width or head count invalidates the derived d_head and n_kv_heads unless given.
        if args.d_model is not None or args.n_heads is not None:
            fields["d_head"] = None
            if args.n_heads is not None:
                fields["n_kv_heads"] = None
    for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "bias",
              "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim"):
        if getattr(args, f) is not None:
            fields[f] = getattr(args, f)
    fields["bytes_per_element"] = bpe
    return AttentionLayout(**fields)


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def describe(lay: AttentionLayout, dtype: str | None = None) -> str:
    """One line: name, kind, width, layers, heads, bias, bytes per element."""
    heads = f"{lay.n_heads} query heads x d_head {lay.d_head}"
    if lay.is_mla:
        heads += f", MLA latent {lay.kv_lora_rank} + rotary key {lay.qk_rope_head_dim}"
        if lay.q_lora_rank:
            heads += f", query latent {lay.q_lora_rank}"
    else:
        kv = "1 KV head" if lay.n_kv_heads == 1 else f"{lay.n_kv_heads} KV heads"
        heads += f", {kv} (group size {lay.group_size})"
    fmt = f"{dtype} ({lay.bytes_per_element} bytes)" if dtype else f"{lay.bytes_per_element} bytes per element"
    name = f"{lay.name}: " if lay.name else ""
    return f"{name}{lay.kind}, d_model {lay.d_model}, {lay.n_layers} layers, {heads}, bias {lay.bias}, {fmt}"


def report(lay: AttentionLayout, seq_len: int, batch: int) -> dict[str, Any]:
    """Every number of one layout at one workload, as plain integers and floats (bytes, FLOPs, counts)."""
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
    }


def _table(rows: list[list[str]], header: list[str], right: set[int] = frozenset()) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_report(r: dict[str, Any], lay: AttentionLayout, dtype: str) -> str:
    T, B = r["workload"]["seq_len"], r["workload"]["batch"]
    other = lay.kind != "MHA"
    two_d = " = 2D" if lay.n_heads * lay.d_head == lay.d_model else ""
    mha = (lambda s: f"MHA: {s}") if other else (lambda s: "")
    rows = [
        ["attention params per layer", f"{r['attn_params_per_layer']:,}", f"bias {lay.bias}"],
        ["attention params, all layers", f"{r['attn_params']:,}", f"{lay.n_layers} layers"],
        ["KV numbers per token per layer", f"{r['kv_numbers_per_token_per_layer']:,}",
         mha(f"{r['kv_numbers_per_token_per_layer_mha']:,}")],
        ["KV cache per token", format_bytes(r["kv_bytes_per_token"]), mha(format_bytes(r["kv_bytes_per_token_mha"]))],
        [f"KV cache per request ({B} x {T} tokens)", format_bytes(r["kv_bytes_per_request"]),
         mha(format_bytes(r["kv_bytes_per_request_mha"]))],
        ["projection FLOPs per layer", format_flops(r['flops_projections_per_layer']),
         mha(format_flops(r['flops_projections_per_layer_as_mha']))],
        ["scores + AV FLOPs per layer", format_flops(r['flops_scores_per_layer']), "all heads, causal mask not used"],
        ["quadratic share", f"{100 * r['quadratic_share']:.0f}%", mha(f"{100 * r['quadratic_share_as_mha']:.0f}%")],
        ["crossover T (projections = scores)", f"{r['crossover_seq_len']:,.0f}",
         mha(f"{r['crossover_seq_len_as_mha']:,.0f}" + two_d) if other else two_d.strip(" =")],
        ["attention matrix per layer [batch, head, T, T]", format_bytes(r["attention_matrix_bytes_per_layer"]), "naive, materialised"],
        ["fused kernel per layer (Q, K, V, out, LSE)", format_bytes(r["fused_attention_bytes_per_layer"]), "FlashAttention / SDPA"],
    ]
    head = f"{describe(lay, dtype)}\nworkload: batch {B} x seq_len {T}; 1 KiB = 2^10 bytes, 1 TFLOP = 10^12 FLOPs\n"
    return head + "\n" + _table(rows, ["quantity", "value", "note"], right={1})


def format_compare(rows: list[dict[str, Any]], lay: AttentionLayout, dtype: str, seq_len: int, batch: int) -> str:
    table = [[
        r["layout"], "-" if r["n_kv_heads"] is None else str(r["n_kv_heads"]),
        "-" if r["group_size"] is None else str(r["group_size"]),
        f"{r['attn_params_per_layer']:,}", f"{r['kv_numbers_per_token_per_layer']:,}",
        format_bytes(r["kv_bytes_per_token"]), format_bytes(r["kv_bytes_per_request"]),
        f"{r['kv_vs_mha']:.3g}x", format_flops(r["flops_per_layer"]),
    ] for r in rows]
    header = ["layout", "n_kv_heads", "group_size", "attn params/layer", "KV numbers/token/layer",
              "KV/token", f"KV/request ({batch} x {seq_len})", "KV vs MHA", "FLOPs/layer"]
    return f"{describe(lay, dtype)}\n\n" + _table(table, header, right=set(range(1, 9)))


def flops_table(lay: AttentionLayout, seq_lens: list[int], batch: int, as_mha: bool) -> list[dict[str, Any]]:
    """One row per T: ``seq_len``, ``projections`` and ``scores`` (FLOPs), ``quadratic_share``."""
    rows = []
    for T in seq_lens:
        fl = cost.attention_flops(lay, T, batch, as_mha=as_mha)
        rows.append({"seq_len": T, "projections": fl.projections, "scores": fl.scores,
                     "quadratic_share": fl.quadratic_share, "crossover_seq_len": fl.crossover_seq_len})
    return rows


def format_flops_table(rows: list[dict[str, Any]], lay: AttentionLayout, dtype: str, as_mha: bool) -> str:
    table = [[f"{r['seq_len']:,}", format_tflop(r["projections"]), format_tflop(r["scores"]),
              f"{100 * r['quadratic_share']:.0f}%"] for r in rows]
    note = " (K/V projections counted as MHA)" if as_mha and lay.kind != "MHA" else ""
    cross = rows[0]["crossover_seq_len"] if rows else 0
    return (f"{describe(lay, dtype)}\nFLOPs of one attention layer{note}; 1 TFLOP = 10^12 FLOPs\n\n"
            + _table(table, ["T", "projections, TFLOP", "scores and AV, TFLOP", "quadratic share"], right={0, 1, 2, 3})
            + f"\n\nthe two are equal at T = {cross:,.0f}")


def format_recommendation(rec: cost.Recommendation, dtype: str) -> str:
    return "\n".join([f"target {rec.target}: {describe(rec.layout, dtype)}", "", *rec.explanation])


# ---------------------------------------------------------------------------------------------
# Live check against a model's own KV cache
# ---------------------------------------------------------------------------------------------


def _cache_tensors(cache: Any) -> list[tuple[Any, Any]]:
    """(keys, values) per layer from a Hugging Face cache (``DynamicCache`` or the legacy tuples)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]


@contextmanager
def _cache_kwarg_shim(bridge: Any) -> Iterator[None]:
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

    handles = [block.attn.register_forward_pre_hook(pre_hook, with_kwargs=True)
               for block in getattr(bridge, "blocks", ()) if hasattr(block, "attn")]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def measure_kv_cache(loaded: Any, text: str = CHECK_PROMPT) -> dict[str, Any]:
    """Run ``loaded`` once on ``text`` with the Hugging Face cache on and measure what it holds.

    The bridge's ``return_type="logits_and_cache"`` hands back the model's own ``past_key_values``
    (a ``DynamicCache``), filled by the model's attention layers during this forward pass.

    Returns:
        ``tokens`` (batch * positions), ``n_layers`` (cached layers), ``key_shape`` of layer 0
        ``[batch, kv_head, pos, d_head]``, ``element_bytes``, ``numbers_per_token_per_layer``
        (count) and ``bytes_per_token`` (all layers, bytes), from the tensors' numel and element size.

    Raises:
        HeadprobeError: the model returned no cache, or an empty one.
    """
    import torch

    tokens = loaded.to_tokens(text)[None].to(loaded.device)
    with torch.no_grad():
        with _cache_kwarg_shim(loaded.model):
            out = loaded.model(tokens, return_type="logits_and_cache", use_cache=True)
    cache = out[1] if isinstance(out, tuple) else None
    pairs = _cache_tensors(cache) if cache is not None else []
    if not pairs or any(k is None or v is None for k, v in pairs):
        raise HeadprobeError(f"model {loaded.spec.name} returned no key/value cache; the live check needs one")
    n_tokens = tokens.shape[0] * tokens.shape[1]
    numbers = sum(k.numel() + v.numel() for k, v in pairs)
    nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pairs)
    return {
        "tokens": n_tokens,
        "n_layers": len(pairs),
        "key_shape": list(pairs[0][0].shape),
        "value_shape": list(pairs[0][1].shape),
        "element_bytes": pairs[0][0].element_size(),
        "numbers_per_token_per_layer": numbers / (n_tokens * len(pairs)),
        "bytes_per_token": nbytes / n_tokens,
    }


def attention_params_of_model(loaded: Any) -> tuple[int, str] | None:
    """(parameters, bias kind) of layer 0's attention in the model's own modules, or None if not found.

    Counts the parameters whose name contains ``layers.0.`` or ``h.0.`` and ``attn``.
    """
    import re

    hf = getattr(loaded.model, "original_model", None)
    if hf is None:
        return None
    pat = re.compile(r"(^|\.)(layers|h)\.0\.")
    named = [(n, p) for n, p in hf.named_parameters() if pat.search(n) and "attn" in n]
    if not named:
        return None
    biases = [n for n, _ in named if n.endswith("bias")]
    has_o_bias = any(re.search(r"(o_proj|c_proj|out_proj|dense)", n) for n in biases)
    bias = "none" if not biases else ("all" if has_o_bias else "qkv")
    return sum(p.numel() for _, p in named), bias


def check_loaded(loaded: Any) -> tuple[AttentionLayout, dict[str, Any]]:
    """Build a loaded model's layout from its ``spec`` and compare the formulas with the model.

    Two checks: the KV cache per token (numbers and bytes, in the model's own element size)
    against :func:`measure_kv_cache`, and the attention parameters of layer 0 against
    :func:`attention_params_of_model` (the bias kind is read from the model's parameter names).

    Returns:
        (the layout in the model's element size, a check record with ``measured``, ``expected``
        and ``ok``).
    """
    s = loaded.spec
    measured = measure_kv_cache(loaded)
    counted = attention_params_of_model(loaded)
    lay = AttentionLayout(d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads,
                          d_head=s.d_head, bias=counted[1] if counted else "none",
                          bytes_per_element=measured["element_bytes"], name=s.name)
    expected = {
        "n_layers": lay.n_layers,
        "numbers_per_token_per_layer": cost.kv_numbers_per_token_per_layer(lay),
        "bytes_per_token": cost.kv_bytes_per_token(lay),
        "key_shape": [1, lay.n_kv_heads, measured["tokens"], lay.d_head],
    }
    ok = all(measured[k] == expected[k] for k in expected)
    record: dict[str, Any] = {"model": s.name, "precision": s.precision, "measured": measured, "expected": expected, "ok": ok,
                              "self_check": loaded.self_check.to_dict()}
    if counted is not None:
        record["attn_params_per_layer"] = {"counted": counted[0], "formula": cost.attention_params_per_layer(lay),
                                           "ok": counted[0] == cost.attention_params_per_layer(lay)}
        record["ok"] = ok and record["attn_params_per_layer"]["ok"]
    return lay, record


def format_check(rec: dict[str, Any]) -> str:
    m, e = rec["measured"], rec["expected"]
    rows = [
        ["cached layers", str(m["n_layers"]), str(e["n_layers"])],
        ["layer-0 key shape [batch, kv_head, pos, d_head]", str(m["key_shape"]), str(e["key_shape"])],
        ["KV numbers per token per layer", f"{m['numbers_per_token_per_layer']:g}", str(e["numbers_per_token_per_layer"])],
        [f"KV bytes per token ({m['element_bytes']}-byte elements)", f"{m['bytes_per_token']:g}", str(e["bytes_per_token"])],
    ]
    if "attn_params_per_layer" in rec:
        a = rec["attn_params_per_layer"]
        rows.append(["attention params of layer 0", f"{a['counted']:,}", f"{a['formula']:,}"])
    verdict = "OK: the formulas match the model" if rec["ok"] else "MISMATCH: the formulas disagree with the model"
    return (f"live check on {rec['model']} ({rec['precision']}), {m['tokens']} tokens through its own cache\n\n"
            + _table(rows, ["quantity", "measured", "formula"], right={1, 2}) + f"\n\n{verdict}")


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    modes = [flag for flag, on in (("--compare", args.compare), ("--flops-table", args.flops_table is not None),
                                   ("--recommend", args.recommend)) if on]
    if len(modes) > 1:
        raise HeadprobeError(f"{' and '.join(modes)} are separate modes; give one of them")
    if args.recommend:
        if args.preset or args.model:
            raise HeadprobeError("--recommend proposes a layout; it takes --params or --d-model, not --preset or --model")
        rec = cost.recommend(
            seq_len=args.seq_len, target=args.target,
            n_params=cost.parse_count(args.params) if args.params else None,
            d_model=args.d_model, n_layers=args.n_layers,
            kv_limit_bytes=cost.parse_bytes(args.kv_limit) if args.kv_limit else None,
            bytes_per_element=cost.DTYPE_BYTES[args.dtype], batch=args.batch,
        )
        print(json.dumps(rec.to_dict(), indent=2) if args.json else format_recommendation(rec, args.dtype))
        return 0 if rec.fits else 1  # like grep: 1 = a valid question with no layout that fits
    if args.preset and args.model:
        raise HeadprobeError("give --preset or --model, not both")

    check = None
    base = None
    if args.model:
        from headprobe.probe.loading import load_model

        # TransformerLens prints progress on stdout; keep stdout for the report (and --json).
        with redirect_stdout(sys.stderr):
            model_layout, check = check_loaded(load_model(args.model, backend="transformer-lens"))
        base = replace(model_layout, bytes_per_element=cost.DTYPE_BYTES[args.dtype])
    lay = layout_from_args(args, base)
    # Validate the workload before computing anything.
    cost.kv_bytes_per_request(lay, args.seq_len, args.batch)

    if args.flops_table is not None:
        seq_lens = args.flops_table or list(FLOPS_TABLE_SEQ_LENS)
        rows = flops_table(lay, seq_lens, args.batch, args.as_mha)
        out = {"layout": lay.to_dict(), "as_mha": args.as_mha, "flops": rows}
        text = format_flops_table(rows, lay, args.dtype, args.as_mha)
    elif args.compare:
        rows = cost.compare_kv_heads(lay, args.seq_len, args.batch)
        out: Any = {"layout": lay.to_dict(), "workload": {"seq_len": args.seq_len, "batch": args.batch}, "compare": rows}
        text = format_compare(rows, lay, args.dtype, args.seq_len, args.batch)
    else:
        out = report(lay, args.seq_len, args.batch)
        text = format_report(out, lay, args.dtype)
    if check is not None:
        out = {"check": check, **out} if isinstance(out, dict) else out
        text = format_check(check) + "\n\n" + text
    print(json.dumps(out, indent=2) if args.json else text)
    return 0 if check is None or check["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    from headprobe.cli import main

    sys.exit(main(["budget", *sys.argv[1:]]))
