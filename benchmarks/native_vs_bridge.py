"""Forward-pass time of the native model against TransformerLens' TransformerBridge, same weights.

Usage: ``PYTHONPATH=. python benchmarks/native_vs_bridge.py [--model smollm2-135m] [--batch 8]
[--pos 128] [--repeats 5] [--device cpu]``

Prints, per engine, the median wall time (seconds) of one forward pass over ``batch x pos``
random tokens, and the largest difference of logits and layer-0/last-layer patterns against the
bridge. Engines:

* ``native sdpa``: native model, no hooks (fused ``scaled_dot_product_attention``);
* ``native eager+patterns``: native model with a pattern hook on every layer (what a scan does);
* ``bridge+patterns``: the TransformerBridge with the same pattern hooks;
* ``hf eager``: the Hugging Face model itself, for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from headprobe.probe.backends.hf_checkpoint import _load_hf
from headprobe.probe.backends.loading import _resolve, boot_bridge, canonical_name
from headprobe.probe.model.convert import from_hf


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    hf_name, _, kwargs = _resolve(canonical_name(args.model))
    hf, tokenizer = _load_hf(**kwargs)
    native = from_hf(hf).to(args.device)
    bridge = boot_bridge(hf_name, hf, tokenizer).to(args.device)
    n_layers = native.cfg.n_layers
    torch.manual_seed(0)
    tokens = torch.randint(0, native.cfg.d_vocab, (args.batch, args.pos), device=args.device)

    sink: dict[str, dict[int, torch.Tensor]] = {"native": {}, "bridge": {}}

    def pattern_hooks(which: str):
        def make(layer: int):
            def hook(pattern, hook):
                if layer in (0, n_layers - 1):
                    sink[which][layer] = pattern.detach()

            return hook

        return [(f"blocks.{layer}.attn.hook_pattern", make(layer)) for layer in range(n_layers)]

    engines = {
        "native sdpa": lambda: native(tokens),
        "native eager+patterns": lambda: native.run_with_hooks(tokens, fwd_hooks=pattern_hooks("native")),
        "bridge+patterns": lambda: bridge.run_with_hooks(tokens, fwd_hooks=pattern_hooks("bridge")),
        "hf eager": lambda: hf(tokens).logits,
    }
    print(
        f"model {args.model}, tokens {args.batch}x{args.pos}, device {args.device}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, median of {args.repeats}"
    )
    results = {}
    with torch.inference_mode():
        for name, fn in engines.items():
            results[name] = timed(fn, args.repeats, args.device)
        ref = bridge(tokens)
        for name in ("native sdpa", "native eager+patterns"):
            diff = (engines[name]() - ref).abs().max().item()
            print(f"  {name:24s} {results[name]:8.3f} s   max |logits - bridge| = {diff:.2e}")
        print(f"  {'bridge+patterns':24s} {results['bridge+patterns']:8.3f} s")
        print(f"  {'hf eager':24s} {results['hf eager']:8.3f} s")
        for layer in (0, n_layers - 1):
            d = (sink["native"][layer] - sink["bridge"][layer]).abs().max().item()
            print(f"  layer {layer}: max |pattern native - bridge| = {d:.2e}")


if __name__ == "__main__":
    main()
