"""``headprobe study heads|layouts``: train small models side by side (issue 7).

* ``heads``: the same width (d_model 64) split into 1, 2, 4, 8, 16 heads; same data, same steps,
  several seeds.
* ``layouts``: the same width and heads as MHA, GQA, MQA and MLA at several latent ranks; each
  with its attention parameter count and KV cache per token (``headprobe.probe.cost``, bf16, over all
  layers), the context-2048 cache, and the losses.

Every run is one :func:`headprobe.commands.train.train` call (same data stream per seed). Default data
(``--corpus text+copy``): CPython's documentation text at character level, split by topic into
training and held-out text, with 3/4 of every batch copy sequences over the same 96 characters
(:func:`headprobe.commands.train.mixed_batch`). The losses (nats/token, a token is a character) are the
held-out text loss (``eval_loss``), the in-context loss on held-out copy sequences (and on held-out
text) and the loss on the repeated half of ``[BOS] r r``.
Outputs: ``results.csv`` (one row per run), ``study.json`` (settings and the headline numbers)
and one figure (PNG + PDF).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import numpy as np
import pandas as pd

from headprobe.analyses import figures
from headprobe.commands.train import INDUCTION_FORMED, N_CHARS, TrainConfig, train
from headprobe.probe.cost import AttentionLayout, attention_params_per_layer, kv_bytes_per_request, kv_bytes_per_token
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.io import package_versions, prepare_output_dir, write_json, write_text

HELP = "train small models side by side: how many heads (study heads), MHA vs GQA vs MQA vs MLA (study layouts)"

CONTEXT = 2048  # tokens, for the per-request KV cache column


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise HeadprobeError(f"--{name} must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < (0 if name == "seeds" else 1):
        raise HeadprobeError(f"--{name} must list at least one {'non-negative' if name == 'seeds' else 'positive'} integer, got {text!r}")
    return values


def layout_of(cfg: TrainConfig) -> AttentionLayout:
    """The :class:`headprobe.probe.cost.AttentionLayout` of a training config (bf16 cache, no biases)."""
    return AttentionLayout(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                           kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim or None,
                           bias="none", bytes_per_element=2)


def variants(which: str, base: TrainConfig, n_heads_list: list[int], ranks: list[int], rope: int) -> list[tuple[str, TrainConfig]]:
    """(label, config) of every model the study trains (seeds apart)."""
    if which == "heads":
        return [(f"{h} heads", dataclasses.replace(base, n_heads=h, n_kv_heads=None)) for h in n_heads_list]
    H = base.n_heads
    out = [("MHA", dataclasses.replace(base, n_kv_heads=None))]
    out += [(f"GQA {g} groups", dataclasses.replace(base, n_kv_heads=g)) for g in (4, 2) if 1 < g < H and H % g == 0]
    out.append(("MQA", dataclasses.replace(base, n_kv_heads=1)))
    out += [(f"MLA r={r}", dataclasses.replace(base, n_kv_heads=None, kv_lora_rank=r, qk_rope_head_dim=rope)) for r in ranks]
    return out


def run_study(which: str, base: TrainConfig, seeds: list[int], n_heads_list: list[int], ranks: list[int], rope: int,
              progress: bool = True) -> pd.DataFrame:
    from headprobe.probe.loading import char_level_tokenizer, word_level_tokenizer

    runs = variants(which, base, n_heads_list, ranks, rope)
    for _, cfg in runs:  # every config error before any training
        cfg.validate()
        cfg.model_config()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = char_level_tokenizer(tmp) if base.corpus == "text+copy" else word_level_tokenizer(tmp, base.n_words)
        for label, cfg in runs:
            for seed in seeds:
                t0 = time.perf_counter()
                r = train(dataclasses.replace(cfg, seed=seed), tokenizer, progress=False)
                last = r.log.iloc[-1]
                lay = layout_of(cfg)
                rows.append({
                    "variant": label, "kind": lay.kind, "n_heads": cfg.n_heads, "n_kv_heads": lay.n_kv_heads,
                    "kv_lora_rank": cfg.kv_lora_rank, "seed": seed, "corpus": cfg.corpus, "steps": cfg.steps,
                    "attn_params_per_layer": attention_params_per_layer(lay),
                    "model_params": sum(p.numel() for p in r.loaded.model.parameters()),
                    "kv_bytes_per_token": kv_bytes_per_token(lay),
                    f"kv_bytes_at_{CONTEXT}": kv_bytes_per_request(lay, CONTEXT),
                    "eval_loss": float(last["eval_loss"]), "in_context_loss": float(last["in_context_loss"]),
                    "text_in_context_loss": float(last.get("text_in_context_loss", float("nan"))),
                    "repeated_loss": float(last["repeated_loss"]), "max_induction": float(last["max_induction"]),
                    "max_previous_token": float(last["max_previous_token"]), "seconds": time.perf_counter() - t0,
                    "self_check_ok": r.loaded.self_check.ok,
                    "self_check_max_relative_error": r.loaded.self_check.max_relative_error,
                })
                if progress:
                    x = rows[-1]
                    print(f"{label:<16} seed {seed}: loss {x['eval_loss']:.3f}  in-context {x['in_context_loss']:+.3f}  "
                          f"induction {x['max_induction']:.2f}  KV/token {x['kv_bytes_per_token']} B  ({x['seconds']:.0f} s)",
                          flush=True)
    return pd.DataFrame(rows)


def headline(which: str, table: pd.DataFrame) -> dict:
    """Per-variant means and, for layouts, the smallest MLA rank whose cache is below 1/8 of MHA's."""
    agg = table.groupby("variant", sort=False).agg(
        eval_loss=("eval_loss", "mean"), eval_loss_sd=("eval_loss", "std"), eval_loss_min=("eval_loss", "min"),
        eval_loss_max=("eval_loss", "max"), in_context_loss=("in_context_loss", "mean"),
        in_context_loss_sd=("in_context_loss", "std"), max_induction=("max_induction", "mean"),
        min_max_induction=("max_induction", "min"), kv_bytes_per_token=("kv_bytes_per_token", "first"),
        seconds=("seconds", "mean"))
    out = {"per_variant": {k: {c: (None if pd.isna(v) else round(float(v), 4)) for c, v in row.items()}
                           for k, row in agg.iterrows()}}
    if which == "layouts" and "MHA" in agg.index:
        mha = agg.loc["MHA"]
        mla = agg[[v.startswith("MLA") for v in agg.index]]
        small = mla[mla["kv_bytes_per_token"] < mha["kv_bytes_per_token"] / 8]
        if len(small):
            best = small["eval_loss"].idxmin()
            out["mla_below_one_eighth"] = {
                "variant": best, "kv_fraction_of_mha": round(float(small.loc[best, "kv_bytes_per_token"] / mha["kv_bytes_per_token"]), 4),
                "loss_gap_vs_mha": round(float(small.loc[best, "eval_loss"] - mha["eval_loss"]), 4),
                "mha_loss_seed_sd": None if pd.isna(mha["eval_loss_sd"]) else round(float(mha["eval_loss_sd"]), 4),
                # the held-out loss alone hides a missing induction circuit: report the in-context loss too
                "in_context_loss_gap_vs_mha": round(float(small.loc[best, "in_context_loss"] - mha["in_context_loss"]), 4),
                "induction_formed": bool(small.loc[best, "min_max_induction"] > INDUCTION_FORMED),
                "every_rank_below": {v: {"eval_loss": round(float(r["eval_loss"]), 4),
                                         "in_context_loss": round(float(r["in_context_loss"]), 4),
                                         "max_induction": round(float(r["max_induction"]), 4)} for v, r in small.iterrows()}}
        else:
            out["mla_below_one_eighth"] = None
    return out


def study_figure(which: str, table: pd.DataFrame, out, prefix: str, title: str) -> list:
    """Write the study's figure from its ``results.csv`` table: ``loss_vs_heads`` (held-out loss and
    in-context loss against heads, every seed shown) or ``quality_vs_kv`` (mean held-out loss with
    the seed range against KV cache per token). Returns the written paths (PNG, PDF)."""
    label = ("held-out text loss (nats/char)" if (table["corpus"] == "text+copy").all()
             else "held-out loss (nats/token)")
    if which == "heads":
        fig = figures.loss_vs_heads(table["n_heads"].to_numpy(), table["eval_loss"].to_numpy(), prefix + title,
                                    table["in_context_loss"].to_numpy(), label)
        return figures.save_figure(fig, out / "loss_vs_heads")
    agg = table.groupby("variant", sort=False).agg(kv=("kv_bytes_per_token", "first"), loss=("eval_loss", "mean"),
                                                  lo=("eval_loss", "min"), hi=("eval_loss", "max"),
                                                  induction=("max_induction", "mean"))
    fig = figures.quality_vs_kv(list(agg.index), agg["kv"].to_numpy(), agg["loss"].to_numpy(), agg["lo"].to_numpy(),
                                agg["hi"].to_numpy(), prefix + title, label, formed=agg["induction"].to_numpy() > INDUCTION_FORMED)
    return figures.save_figure(fig, out / "quality_vs_kv")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=["heads", "layouts"], help="heads: 1..16 heads at one width; layouts: MHA/GQA/MQA/MLA")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--steps", type=int, default=1200, help="training steps per run (default %(default)s)")
    p.add_argument("--corpus", choices=["text+copy", "copy"], default="text+copy",
                   help="text+copy: CPython documentation text (character level) mixed with copy sequences (default); "
                        "copy: random-token copy sequences only, as headprobe train")
    p.add_argument("--copy-fraction", type=float, default=0.75, help="text+copy: copy sequences per batch (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=48, help="tokens per sequence, BOS included (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (default %(default)s)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-heads", type=int, default=8, help="layouts: query heads (default %(default)s)")
    p.add_argument("--n-heads-list", default="1,2,4,8,16", help="heads: head counts (default %(default)s)")
    p.add_argument("--ranks", default="4,6,8,16", help="layouts: MLA latent ranks (default %(default)s)")
    p.add_argument("--rope", type=int, default=8, help="layouts: MLA decoupled rotary width (default %(default)s; 4 gives the shared rotary key only 2 frequencies and no previous-token head formed within the default steps)")
    p.add_argument("--eval-every", type=int, default=200, help="steps between evaluations (default %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


def run(args: argparse.Namespace) -> int:
    seeds = _ints(args.seeds, "seeds")
    n_heads_list = _ints(args.n_heads_list, "n-heads-list")
    ranks = _ints(args.ranks, "ranks")
    if args.rope < 0 or args.rope % 2:
        raise HeadprobeError(f"--rope must be an even non-negative integer, got {args.rope}")
    base = TrainConfig(d_model=args.d_model, n_heads=args.n_heads, steps=args.steps, eval_every=args.eval_every,
                       device=args.device, bias=False, corpus=args.corpus, copy_fraction=args.copy_fraction,
                       n_words=N_CHARS if args.corpus == "text+copy" else TrainConfig.n_words,
                       seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                       min_period=4, max_period=16, eval_period=12)
    prepare_output_dir(args.out, args.overwrite, create=False)
    table = run_study(args.which, base, seeds, n_heads_list, ranks, args.rope)
    out = prepare_output_dir(args.out, args.overwrite)
    write_text(out / "results.csv", table.to_csv(index=False, float_format="%.5f"))
    head = headline(args.which, table)
    study_figure(args.which, table, out, f"{args.n_heads} heads, " if args.which == "layouts" else "",
                 f"d_model {args.d_model}, {args.steps} steps, {len(seeds)} seed{'s' if len(seeds) > 1 else ''}, {args.corpus}")
    grid = {"n_heads_list": n_heads_list} if args.which == "heads" else {"ranks": ranks, "rope": args.rope}
    self_check = {"all_ok": bool(table["self_check_ok"].all()),
                  "max_relative_error": float(f"{table['self_check_max_relative_error'].max():.3g}"),
                  "what": "per trained model: patterns and the per-head W_O decomposition (headprobe.probe.selfcheck)"}
    write_json(out / "study.json", {"which": args.which, "seeds": seeds, "base": dataclasses.asdict(base), **grid,
                                    "device": args.device, "self_check": self_check, "versions": package_versions(),
                                    **head})  # last
    print(table.groupby("variant", sort=False)[["eval_loss", "in_context_loss", "max_induction", "kv_bytes_per_token"]].mean().round(3))
    print(f"wrote results.csv, study.json and the figure to {out}/")
    return 0
