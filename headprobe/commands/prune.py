"""``headprobe prune``: iterative head pruning (Michel et al. 2019, arXiv 1905.10650) against a
random-order baseline, recording the held-out natural-text loss and the induction (in-context)
loss after each step; optionally saves a model with the pruned heads' weights removed.

Data: ``2 n_natural`` disjoint natural-text windows, the first half scores head importance, the
second half is held out for the curve; repeated random tokens give the induction loss (the
repeated half, Olsson et al. 2022). Writes ``pruning_curve.csv``, ``summary.json``,
``pruning_curve.png/pdf`` and, with ``--save-pruned``, ``pruned_model.pt``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pandas as pd
import torch

from headprobe.analyses import figures
from headprobe.options import positive_int
from headprobe.commands.ablate import add_model_arguments, load_for_cli, open_checkpoint, task_tokens
from headprobe.analyses.ablation import first_scored, is_native
from headprobe.analyses.pruning import LossSet, iterative_pruning
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.hooks import format_head
from headprobe.probe.io import package_versions, prepare_output_dir, write_json, write_text

HELP = "iterative head pruning by gradient importance vs a random order: pruning_curve.csv + figure, optional pruned model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--n-natural", type=positive_int, default=8,
                   help="natural-text sequences for scoring, and as many held out for the curve (default %(default)s)")
    p.add_argument("--step-fraction", type=float, default=0.1, help="fraction of all heads removed per step (default %(default)s)")
    p.add_argument("--max-fraction", type=float, default=1.0, help="stop after removing this fraction (default %(default)s)")
    p.add_argument("--no-rescore", dest="rescore", action="store_false",
                   help="score importance once before pruning (as in the paper) instead of after every step")
    p.add_argument("--no-normalize", dest="normalize", action="store_false", help="skip per-layer L2 normalisation of importance")
    p.add_argument("--save-pruned", action="store_true",
                   help="save the model with the first --save-fraction of heads (importance order) really removed (native backend)")
    p.add_argument("--save-fraction", type=float, default=0.3, help="fraction of heads removed in the saved model (default %(default)s)")


def _median_time(fn, repeats: int = 3) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@torch.inference_mode()
def save_pruned_model(model, run, fraction: float, tokens: torch.Tensor, out) -> dict:
    """Remove the first ``fraction`` of ``run``'s heads for real, save, reload, compare with the
    masked model (max |logit difference|) and time both (median seconds per forward)."""
    from headprobe.probe.pruned import count_attention_parameters, load_pruned, remove_heads, save_pruned

    spec = model.spec
    n = round(fraction * spec.n_layers * spec.n_heads)
    keep = run.keep_mask_after(n, spec.n_layers, spec.n_heads)
    net = model.model
    pruned = remove_heads(net, keep)
    path = out / "pruned_model.pt"
    save_pruned(pruned, path)
    reloaded = load_pruned(path, model.device).to(next(net.parameters()).dtype)
    tokens = tokens.to(model.device)
    mask = keep.to(model.device, next(net.parameters()).dtype)
    masked_logits = net(tokens, head_mask=mask)
    diff = float((reloaded(tokens).float() - masked_logits.float()).abs().max())
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def timed(f):
        def g():
            f()
            sync()
        return _median_time(g)

    t_masked = timed(lambda: net(tokens, head_mask=mask))
    t_pruned = timed(lambda: reloaded(tokens))
    return {"file": path.name, "heads_removed": n, "fraction_removed": n / (spec.n_layers * spec.n_heads),
            "kv_heads_removed": int(sum(spec.n_kv_heads - len(b.attn.kept_kv_heads) for b in pruned.blocks)),
            "attention_parameters": {"full": count_attention_parameters(net), "pruned": count_attention_parameters(pruned)},
            "max_abs_logit_diff_vs_masked": diff, "forward_s": {"masked": t_masked, "pruned": t_pruned},
            "speedup": t_masked / t_pruned, "tokens": list(tokens.shape), "bytes": path.stat().st_size}


def run(args: argparse.Namespace) -> int:
    for name in ("step_fraction", "max_fraction", "save_fraction"):
        v = getattr(args, name)
        if not 0 < v <= 1:
            raise HeadprobeError(f"--{name.replace('_', '-')} must be in (0, 1], got {v}")
    if args.period < 2:
        raise HeadprobeError("--period must be at least 2")
    checkpoint, saved = open_checkpoint(args)
    if saved:
        done = ", ".join(f"{order}: {len(state['rows']) - 1} steps" for order, state in saved.items())
        print(f"resuming from {checkpoint.path} ({done} done)")
    t_start = time.perf_counter()
    model = load_for_cli(args)
    if args.save_pruned and not is_native(model):
        raise HeadprobeError("--save-pruned needs the native backend (--backend native; GPT-2 and Llama families)")
    spec = model.spec
    natural, repeated, _ = task_tokens(model, args, args.n_natural)
    score = LossSet(natural.tokens[: args.n_natural], first_scored("natural", natural.start, None))
    evals = {"natural": LossSet(natural.tokens[args.n_natural:], score.first),
             "induction": LossSet(repeated.tokens, first_scored("repeated", repeated.start, repeated.period))}
    runs = {}
    for order in ("importance", "random"):
        def on_step(state, order=order):
            saved[order] = state
            checkpoint.save(saved)

        runs[order] = iterative_pruning(model, score, evals, order=order, step_fraction=args.step_fraction,
                                        rescore=args.rescore, normalize=args.normalize, max_fraction=args.max_fraction,
                                        seed=args.seed, progress=True, resume=saved.get(order), on_step=on_step)
    table = pd.DataFrame([row for r in runs.values() for row in r.rows])
    out = prepare_output_dir(args.out, True)  # ours: only the checkpoint can be there unless --overwrite
    write_text(out / "pruning_curve.csv", table.to_csv(index=False, float_format="%.5f"))
    label = {"importance": "gradient importance" + ("" if args.rescore else " (scored once)"), "random": "random order"}
    curves = [(label[o], np.array([row["fraction_pruned"] for row in r.rows]),
               {c: np.array([row[c] for row in r.rows]) for c in ("natural_loss", "induction_loss")}) for o, r in runs.items()]
    fig = figures.pruning_curve_plot(curves, [("natural_loss", "held-out text loss (nats)"),
                                              ("induction_loss", "induction loss (nats)")],
                                     f"Head pruning, {spec.name}\n({figures.weights_label(spec.precision)}, {args.dtype} compute)")
    paths = figures.save_figure(fig, out / "pruning_curve")
    summary = {
        "model": spec.name, "weights_precision": spec.precision, "dtype": args.dtype, "device": str(model.device),
        "self_check": model.self_check.to_dict(),
        "units": "nats/token", "n_heads_total": spec.n_layers * spec.n_heads,
        "method": "Michel et al. 2019 gradient importance I_h = E_x |dL/dxi_h|"
                  + (", per-layer L2-normalised" if args.normalize else "") + ("; rescored after every step" if args.rescore else "; scored once"),
        "tokens": {"score": list(score.tokens.shape), "held_out_natural": list(evals["natural"].tokens.shape),
                   "induction": list(repeated.tokens.shape), "period": args.period},
        "curves": {o: [{k: v for k, v in row.items() if k != "removed"} for row in r.rows] for o, r in runs.items()},
        "importance_removal_order": [format_head(h) for h in runs["importance"].removal_order],
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "versions": package_versions(),
    }
    if args.save_pruned:
        summary["pruned_model"] = save_pruned_model(model, runs["importance"], args.save_fraction,
                                                    evals["natural"].tokens, out)
    summary["timings_s"] = {"total": round(time.perf_counter() - t_start, 1)}
    write_json(out / "summary.json", summary)
    checkpoint.clear()

    print(f"\n{'removed':>8} {'fraction':>8}  {'natural (imp / rand)':>22}  {'induction (imp / rand)':>24}")
    for a, b in zip(runs["importance"].rows, runs["random"].rows):
        print(f"{a['n_pruned']:>8} {a['fraction_pruned']:>8.2f}  {a['natural_loss']:>10.3f} / {b['natural_loss']:<9.3f}  "
              f"{a['induction_loss']:>11.3f} / {b['induction_loss']:<9.3f}")
    if args.save_pruned:
        p = summary["pruned_model"]
        print(f"pruned model: {p['heads_removed']} heads removed ({p['kv_heads_removed']} KV heads), attention parameters "
              f"{p['attention_parameters']['full']:,} -> {p['attention_parameters']['pruned']:,}; max |logit diff| vs masked "
              f"{p['max_abs_logit_diff_vs_masked']:.2e}; forward {p['forward_s']['masked']:.3f} s masked vs "
              f"{p['forward_s']['pruned']:.3f} s pruned ({p['speedup']:.2f}x)")
    print(f"wrote pruning_curve.csv, summary.json, {', '.join(x.name for x in paths)}"
          f"{', pruned_model.pt' if args.save_pruned else ''} to {out}/")
    return 0
