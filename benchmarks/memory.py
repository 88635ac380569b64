"""Peak host memory (RSS) of loading SmolLM2-135M, a scan-like pass and an exact sweep.

Usage: ``.venv/bin/python benchmarks/memory.py [--model smollm2-135m] [--seq-lens 128,512,2048]
[--batch 1] [--skip-cold] [--skip-bridge]``

Each measurement is a fresh Python process pointed at one temporary weights cache
(``HEADPROBE_CACHE``, removed at the end). A process imports torch, transformers and headprobe's
loading module, resets the kernel's peak-RSS counter (``/proc/self/clear_refs``, Linux) and
reads its RSS: the baseline. It then does one thing and reports ``VmHWM`` (the peak RSS since
the reset) minus the baseline, as a multiple of the weight bytes (the sum of the loaded model's
parameter bytes, a tied matrix counted once):

* cold load: ``load_model`` with the cache empty (GGUF dequantized through transformers, the
  entry written, then converted to the native backend); run first, it fills the cache;
* warm load: ``load_model`` from the cache entry (native backend), what every later run pays;
* bridge load: ``load_model(..., backend="transformer-lens")`` from the cache entry;
* scan: with a warm-loaded model, after a fresh baseline, one forward pass of ``batch`` random
  sequences of ``seq_len`` tokens with every layer's pattern streamed to a callback (as
  ``headprobe scan`` scores them: each pattern reduced, then dropped), logits returned;
* sweep: ``exact_sweep`` (zero ablation) of one head in each of ``--sweep-layers`` layers
  (default 3: layers 0, n/2, n-1), and, at ``--all-layers-seq-len``, of one head in every
  layer, to show whether the stored clean activations grow with the number of layers swept.

Prints a table, then a last line of ``key=value`` pairs: ``load_peak_x`` (the warm load),
``cold_load_peak_x``, ``bridge_load_peak_x``, ``scan_<T>_x``, ``sweep_<T>_x`` and
``sweep_all_layers_<T>_x`` (2 decimals), and ``weight_mb``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import gc, json, sys, time
import torch, transformers  # noqa: F401 - in the baseline: every command imports them
from headprobe.probe.backends.loading import load_model
import safetensors.torch, headprobe.probe.model.convert, headprobe.probe.backends.weights_cache  # noqa: F401 - code the load imports

def rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)

def reset_peak():
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    return rss_kb("VmRSS")

def weight_bytes(module):
    seen, n = set(), 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel() * p.element_size()
    return n

mode, model_name, backend, seq_len, batch, layers_arg = sys.argv[1:7]
seq_len, batch = int(seq_len), int(batch)
torch.manual_seed(0)
base = reset_peak()
t0 = time.perf_counter()
model = load_model(model_name, backend="native" if mode != "load" else backend, quiet=True)
out = {"load_s": time.perf_counter() - t0}
out["weight_bytes"] = weight_bytes(model.model)
if mode == "load":
    out["peak_kb"] = rss_kb("VmHWM") - base
    out["after_kb"] = rss_kb("VmRSS") - base
else:
    spec = model.spec
    tokens = torch.randint(0, spec.d_vocab, (batch, seq_len))
    base = reset_peak()
    t0 = time.perf_counter()
    if mode == "scan":
        from headprobe.probe.hooks.capture import patterns_by_layer
        kept = {}
        def on_pattern(layer, pattern):
            kept[layer] = pattern.amax(dim=(-1, -2)).mean(0)  # a per-head score; the pattern is dropped
        with torch.inference_mode():
            logits = patterns_by_layer(model, tokens, on_pattern)
    else:
        from headprobe.analyses.ablation import exact_sweep
        L = spec.n_layers
        if layers_arg == "all":
            layers = list(range(L))
        else:
            k = int(layers_arg)
            layers = sorted({round(i * (L - 1) / max(1, k - 1)) for i in range(k)})
        heads = [(layer, layer % spec.n_heads) for layer in layers]
        result = exact_sweep(model, tokens, heads=heads, kind="zero", first=1)
        out["n_heads_swept"] = len(heads)
    out["run_s"] = time.perf_counter() - t0
    out["peak_kb"] = rss_kb("VmHWM") - base
print(json.dumps(out))
"""


def run_child(
    cache: str, mode: str, model: str, backend: str = "native", seq_len: int = 0, batch: int = 1, layers: str = "3"
) -> dict:
    env = {**os.environ, "HEADPROBE_CACHE": cache}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, model, backend, str(seq_len), str(batch), layers],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        sys.exit(f"memory: the child process ({mode} {backend} {seq_len}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF model: smollm2-135m or a .gguf path")
    parser.add_argument("--seq-lens", default="128,512,2048", help="comma-separated sequence lengths")
    parser.add_argument("--batch", type=int, default=1, help="sequences per pass (scan and sweep)")
    parser.add_argument("--sweep-layers", default="3", help="layers with one head swept each (a number)")
    parser.add_argument(
        "--all-layers-seq-len",
        type=int,
        default=512,
        help="also sweep one head of every layer at this length (0: skip)",
    )
    parser.add_argument(
        "--cache", default=None, help="an existing HEADPROBE_CACHE to use (then the cold load is skipped)"
    )
    parser.add_argument("--skip-bridge", action="store_true", help="do not measure the bridge load")
    args = parser.parse_args(argv)
    seq_lens = [int(s) for s in args.seq_lens.split(",") if s]

    rows: list[tuple[str, dict]] = []
    keys: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="headprobe-memory-") as tmp:
        cache = args.cache or tmp

        def measure(label: str, key: str | None, **kw) -> dict:
            r = run_child(cache, model=args.model, **kw)
            r["x"] = r["peak_kb"] * 1024 / r["weight_bytes"]
            if key:
                keys[key] = r["x"]
            rows.append((label, r))
            secs = r.get("run_s", r["load_s"])
            print(
                f"{label:<34} peak +{r['peak_kb'] / 1024:8.0f} MB  {r['x']:5.2f}x weights  ({secs:.1f} s)", flush=True
            )
            return r

        if args.cache is None:
            measure("cold load (native)", "cold_load_peak_x", mode="load", backend="native")
        else:
            run_child(cache, "load", args.model)  # make sure the entry exists
        w = measure("warm load (native)", "load_peak_x", mode="load", backend="native")
        if not args.skip_bridge:
            measure(
                "warm load (transformer-lens bridge)", "bridge_load_peak_x", mode="load", backend="transformer-lens"
            )
        for T in seq_lens:
            measure(f"scan pass, {args.batch} x {T}", f"scan_{T}_x", mode="scan", seq_len=T, batch=args.batch)
        for T in seq_lens:
            measure(
                f"exact sweep, {args.sweep_layers} layers, {args.batch} x {T}",
                f"sweep_{T}_x",
                mode="sweep",
                seq_len=T,
                batch=args.batch,
                layers=args.sweep_layers,
            )
        if args.all_layers_seq_len:
            T = args.all_layers_seq_len
            measure(
                f"exact sweep, all layers, {args.batch} x {T}",
                f"sweep_all_layers_{T}_x",
                mode="sweep",
                seq_len=T,
                batch=args.batch,
                layers="all",
            )
    weight_mb = w["weight_bytes"] / 2**20
    print(
        f"weights: {weight_mb:.0f} MB (float32 parameters); peaks are above the RSS after importing torch, "
        f"transformers and headprobe (load) or after the load (scan, sweep)"
    )
    first = ["load_peak_x", "cold_load_peak_x", "bridge_load_peak_x"]
    order = [k for k in first if k in keys] + [k for k in keys if k not in first]
    print(" ".join(f"{k}={keys[k]:.2f}" for k in order) + f" weight_mb={weight_mb:.0f}")


if __name__ == "__main__":
    main()
