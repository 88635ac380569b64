"""Benchmark: scan's metric plans against the profiler's peak of each step (docs/scan.md's table).

Each step of ``scan_metrics`` (the copying score, the pattern pass, the retrieval needles, the
direct logit attribution, value-weighted attention, the composition scores) runs once to warm up,
then once under torch's profiler; its plan (``headprobe.analyses.metrics.metric_plans``) is divided
by the most bytes of CPU tensors alive at once. The steps, the profiler count and the models are
``tests/test_memory_plan.py``'s (``_metric_steps``, ``_peak_tensor_bytes``, ``smollm2_width``),
so the table measures what the suite checks (plan >= peak, within 10x). Float32, CPU, seed 0.

    OMP_NUM_THREADS=1 python benchmarks/metric_plans.py [--rows tiny,width,8x256,2x1024]

Rows: ``tiny`` the tests' tiny Llama (3 x 16, materialised and streamed); ``width`` a 2-layer
random-init Llama of SmolLM2-135M's width and vocabulary (2 x 64, both); ``8x256`` and ``2x1024``
the same with 3 layers and 2,048 positions (8 x 256 materialised; 2 x 1024 streamed). The last two
take minutes and a few GB.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
ROWS = {  # name -> (label, layers, positions, windows, tokens, streaming modes)
    "tiny": ("tests' tiny Llama", None, None, 3, 16, ("off", "on")),
    "width": ("2-layer, SmolLM2's width and vocabulary", 2, 512, 2, 64, ("off", "on")),
    "8x256": ("3-layer, SmolLM2's width and vocabulary", 3, 2048, 8, 256, ("off",)),
    "2x1024": ("3-layer, SmolLM2's width and vocabulary", 3, 2048, 2, 1024, ("on",)),
}
COLUMNS = (
    "copying score",
    "pattern metrics",
    "retrieval needles",
    "direct logit attribution",
    "value-weighted attention",
    "composition scores",
    "all of scan_metrics",
)


def build(layers: int | None, positions: int | None, tmp: Path):
    """The row's model: the tests' tiny GQA Llama (``layers`` None) or ``smollm2_width``'s config
    with ``layers`` layers and ``positions`` positions, native backend."""
    import torch
    from conftest import _checkpoint, _native, make_tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tiny_tokenizer(tmp / "tok")
    torch.manual_seed(0)
    if layers is None:
        cfg = LlamaConfig(
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
            intermediate_size=128, vocab_size=101, max_position_embeddings=128, bos_token_id=100,
            eos_token_id=100, pad_token_id=100, attn_implementation="eager", architectures=["LlamaForCausalLM"],
        )  # fmt: skip
    else:
        cfg = LlamaConfig(
            num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
            intermediate_size=1536, vocab_size=49152, max_position_embeddings=positions, bos_token_id=100,
            eos_token_id=100, pad_token_id=100, tie_word_embeddings=True, attn_implementation="eager",
            architectures=["LlamaForCausalLM"],
        )  # fmt: skip
    return _native(_checkpoint(LlamaForCausalLM(cfg), tok, "bench", "bench"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rows", default="tiny,width", help=f"comma-separated, of {', '.join(ROWS)} (default tiny,width)")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    if bad := [r for r in rows if r not in ROWS]:
        p.error(f"--rows: unknown {', '.join(bad)}; choose from {', '.join(ROWS)}")
    sys.path.insert(0, str(TESTS))
    from test_memory_plan import _metric_plans_bound_their_peaks

    print(f"| model, tokens | {' | '.join(COLUMNS)} | seconds |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    with tempfile.TemporaryDirectory() as d:
        text = Path(d) / "text.txt"
        text.write_text(" ".join(f"t{i % 97}" for i in range(20000)))
        for name in rows:
            label, layers, positions, n, T, modes = ROWS[name]
            model = build(layers, positions, Path(d) / name)
            for streaming in modes:
                t = time.perf_counter()
                ratios = _metric_plans_bound_their_peaks(model, str(text), n, T, streaming)
                cells = [f"{ratios[c]:.2f}x" if c in ratios else "-" for c in COLUMNS]
                tag = " (streamed)" if streaming == "on" else ""
                print(
                    f"| {label}, {n} x {T}{tag} | {' | '.join(cells)} | {time.perf_counter() - t:.0f} s |", flush=True
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
