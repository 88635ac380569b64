"""Exact single-head ablation sweep: the plain TransformerLens hook loop against headprobe's engine.

Usage: ``PYTHONPATH=. python benchmarks/ablation_sweep.py [--model smollm2-135m] [--n-seqs 8]
[--seq-len 100] [--all-heads] [--device cpu] [--max-batch 64]``

``--model`` takes what every command's does (``headprobe.load_model``): a built-in name, a Hugging
Face name or model directory, a ``.gguf`` file, or a headprobe checkpoint directory (``headprobe
train --out DIR``). A checkpoint directory has no Hugging Face weights for TransformerLens: its
reference (a) is then the same hook loop on the native model. Bad input (an unknown model, a
non-positive count) is one line on stderr and exit status 2.

In one process on one machine, on the same ``n_seqs x seq_len`` natural-text tokens (CPython's
documentation, BOS first) and the same heads (default: 60 heads, two per layer; ``--all-heads``:
every head), it times

(a) the plain loop: one full forward pass of TransformerLens' ``TransformerBridge`` per head
    (a headprobe checkpoint: of the native model), with that head zero-ablated by a ``hook_z`` hook
    (:func:`headprobe.analyses.ablation.sweep_loop`);
(b) the engine: :func:`headprobe.analyses.ablation.exact_sweep` on the native model (shared prefix,
    ablations batched along the batch axis, logits only where scored);

and prints both times (seconds), their ratio (a / b), the largest difference in loss (nats),
then the time of Michel et al.'s gradient importance (one forward + one backward,
:func:`headprobe.analyses.ablation.head_importance`) and its Spearman rank correlation with the size
``|effect|`` of the exact sweep's loss changes over the swept heads (the importance is an
absolute sensitivity; the signed correlation is printed too), and attribution patching's with
the signed effect; then AtP* (Kramár et al. 2024, arXiv 2403.00745: attribution patching with
GradDrop, :func:`headprobe.analyses.attribution.atp_star`), its time and cost in
forward-equivalents (a backward counted as two forwards), and its Spearman correlations: the
paper's unsigned estimate with ``|effect|`` and with the signed effect, and the signed AtP*
(AtP's sign, AtP*'s magnitude) with the signed effect; then the second-order estimate
(attribution patching plus the Monte-Carlo Gauss-Newton curvature term,
:func:`headprobe.analyses.attribution.second_order`, ``--n-probes`` sampled-target probes), its
time, cost and Spearman correlation with the signed effect. The last line reads ``ratio=<x>
max_loss_diff=<y> spearman=<z> atp_spearman=<w> atp_method=second-order
atp_forward_equivalents=<f> atpstar_spearman=<v>``: ``w`` is the best attribution-patching-family
estimate, the second-order one, against the signed exact effect, ``v`` the signed AtP* against
it. Not a timed test: numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load_both(name: str, device: str):
    """``(native, reference, what the reference is)``: ``name`` loaded as ``--model NAME`` is by every
    command (:func:`headprobe.load_model`, self-checked), once on the native backend for the engine and
    once on TransformerLens' bridge for the hook loop; a headprobe checkpoint directory, which the
    bridge cannot read, is its own reference (the hook loop on the native model).

    Raises:
        HeadprobeError: the model cannot be found or read, or ``device`` is unknown or absent (one line).
    """
    import headprobe
    from headprobe.options import check_model
    from headprobe.probe.model.checkpoint import is_native_dir

    check_model(name)  # an unknown name or a folder without weights, before torch loads anything
    native = headprobe.load_model(name, device=device, backend="native")
    if is_native_dir(Path(name).expanduser()):
        return native, native, "the native model's hook loop (a headprobe checkpoint: no TransformerLens weights)"
    bridge = headprobe.load_model(name, device=device, backend="transformer-lens", quiet=True)
    return native, bridge, "TransformerLens hook loop"


def main(argv: list[str] | None = None) -> None:
    from headprobe.analyses.ablation import exact_sweep, head_importance, spearman, sweep_loop
    from headprobe.analyses.attribution import N_PROBES, atp_star, forward_equivalents, second_order
    from headprobe.analyses.data import natural_text_tokens
    from headprobe.cli import OneLineErrorParser
    from headprobe.settings import positive_int

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = OneLineErrorParser(
        prog="ablation_sweep.py", description=__doc__.splitlines()[0]
    )  # one-line usage errors, exit 2
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seqs", type=positive_int, default=8)
    ap.add_argument("--seq-len", type=positive_int, default=100)
    ap.add_argument("--all-heads", action="store_true", help="sweep every head (default: two per layer)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-batch", type=positive_int, default=64, help="sequences per engine forward pass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--n-probes",
        type=positive_int,
        default=N_PROBES,
        help="probes of the second-order estimate (default %(default)s)",
    )
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    native, bridge, reference = load_both(args.model, args.device)
    device = str(native.device)
    print(
        f"loaded {args.model} on {device} in {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}"
    )
    spec = native.spec
    tokens = natural_text_tokens(native, args.n_seqs, args.seq_len, args.seed).tokens.to(device)
    if args.all_heads:
        heads = [(l, h) for l in range(spec.n_layers) for h in range(spec.n_heads)]
    else:  # two per layer, spread over the heads and KV groups
        heads = [
            (l, h)
            for l in range(spec.n_layers)
            for h in sorted({l % spec.n_heads, (l + spec.n_heads // 2) % spec.n_heads})
        ]
    print(f"sweep: {len(heads)} heads, tokens {tuple(tokens.shape)}, zero ablation, loss over every prediction")

    exact_sweep(native, tokens[:, :8], heads=heads[:1])  # warm-up of both paths (allocations, kernels)
    sweep_loop(bridge, tokens[:, :8], heads=heads[:1])

    _sync(device)
    t0 = time.perf_counter()
    ref = sweep_loop(bridge, tokens, heads=heads)
    _sync(device)
    t_loop = time.perf_counter() - t0
    print(f"(a) {reference}: {t_loop:.2f} s ({t_loop / len(heads) * 1e3:.0f} ms/head)", flush=True)

    _sync(device)
    t0 = time.perf_counter()
    fast = exact_sweep(native, tokens, heads=heads, max_batch=args.max_batch)
    _sync(device)
    t_engine = time.perf_counter() - t0
    print(f"(b) headprobe engine:          {t_engine:.2f} s ({t_engine / len(heads) * 1e3:.0f} ms/head)", flush=True)

    idx = torch.tensor(heads).T
    diff = float((fast.loss[idx[0], idx[1]] - ref.loss[idx[0], idx[1]]).abs().max())
    ratio = t_loop / t_engine
    print(
        f"ratio {ratio:.2f}; max |loss difference| {diff:.2e} nats; clean loss {fast.clean_loss:.4f} "
        f"(loop {ref.clean_loss:.4f}); largest effect {float(fast.effect[idx[0], idx[1]].max()):+.4f} nats"
    )

    _sync(device)
    t0 = time.perf_counter()
    imp = head_importance(native, tokens)
    _sync(device)
    t_grad = time.perf_counter() - t0
    effect = fast.effect[idx[0], idx[1]]
    # Michel et al.'s importance is an expected *absolute* sensitivity: it cannot tell a head whose
    # ablation raises the loss from one whose ablation lowers it (a third or more of the heads
    # here), so its rank correlation is taken with the size of the exact effect; the signed
    # comparison is printed too. Attribution patching is signed and compared with the signed effect.
    rho = spearman(imp.importance[idx[0], idx[1]], effect.abs())
    rho_signed = spearman(imp.importance[idx[0], idx[1]], effect)
    rho_attr = spearman(imp.attribution[idx[0], idx[1]], effect)
    print(
        f"gradient importance (all {spec.n_layers * spec.n_heads} heads, 1 forward + 1 backward): {t_grad:.2f} s; "
        f"{int((effect < 0).sum())} of the {len(heads)} swept heads lower the loss when ablated"
    )
    print(
        f"Spearman over the {len(heads)} heads: importance vs |exact effect| {rho:.3f} "
        f"(vs the signed effect {rho_signed:.3f}); attribution patching vs the signed effect {rho_attr:.3f}"
    )

    _sync(device)
    t0 = time.perf_counter()
    star = atp_star(native, tokens)
    _sync(device)
    t_star = time.perf_counter() - t0
    fe_star, fe_attr = forward_equivalents("atp", spec.n_layers), forward_equivalents("attribution", spec.n_layers)
    fe_sweep = 1 + sum((spec.n_layers - l) / spec.n_layers for l, _ in heads)  # clean pass + resumed layers
    rho_star_abs = spearman(star.estimate[idx[0], idx[1]], effect.abs())
    rho_star = spearman(star.estimate[idx[0], idx[1]], effect)
    rho_star_signed = spearman(star.signed[idx[0], idx[1]], effect)
    print(
        f"AtP* (GradDrop; the QK fix does not apply to z ablation): {t_star:.2f} s, {fe_star:.0f} forward-equivalents "
        f"(attribution patching {fe_attr:.0f}, this exact sweep ~{fe_sweep:.0f})"
    )
    print(
        f"Spearman over the {len(heads)} heads: AtP* (unsigned) vs |exact effect| {rho_star_abs:.3f}, vs the signed "
        f"effect {rho_star:.3f}; signed AtP* (AtP's sign) vs the signed effect {rho_star_signed:.3f}; "
        f"attribution patching vs |effect| {spearman(imp.attribution[idx[0], idx[1]].abs(), effect.abs()):.3f}"
    )

    _sync(device)
    t0 = time.perf_counter()
    second = second_order(native, tokens, n_probes=args.n_probes, seed=args.seed)
    _sync(device)
    t_second = time.perf_counter() - t0
    fe_second = forward_equivalents("second-order", spec.n_layers, args.n_probes)
    rho_second = spearman(second.estimate[idx[0], idx[1]], effect)
    resid = effect - second.attribution[idx[0], idx[1]]
    print(
        f"second order (attribution patching + Monte-Carlo Gauss-Newton term, {args.n_probes} probes): {t_second:.2f} s, "
        f"{fe_second:.0f} forward-equivalents; exact minus first order: median {float(resid.median()):+.4f} nats "
        f"(curvature term median {float(second.curvature[idx[0], idx[1]].median()):.4f}, standard error median "
        f"{float(second.curvature_se[idx[0], idx[1]].median()):.4f})"
    )
    print(
        f"Spearman over the {len(heads)} heads: second order vs the signed effect {rho_second:.3f} "
        f"(attribution patching alone {rho_attr:.3f})"
    )
    print(
        f"ratio={ratio:.2f} max_loss_diff={diff:.2e} spearman={rho:.3f} atp_spearman={rho_second:.3f} "
        f"atp_method=second-order atp_forward_equivalents={fe_second:.0f} atpstar_spearman={rho_star_signed:.3f}"
    )


if __name__ == "__main__":
    from headprobe.probe.core.errors import HeadprobeError

    try:
        main()
    except HeadprobeError as e:  # bad input: one line and exit 2, as every headprobe command
        print(f"ablation_sweep.py: error: {e}", file=sys.stderr)
        sys.exit(2)
