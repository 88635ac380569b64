"""Benchmark: the scan's verification, fixed-size against sequential, with one control design.

Loads the model once and runs the scan's verification (scores, then the ablations; no metrics or
patterns) twice with the same settings and seed: every test ablating ``--n-random`` control sets
of both kinds (fixed-size, ``--fixed-draws``), and the sequential design
(Besag & Clifford stopping, a look after every draw; the untested kind on the first 5 sets). Prints, for each, the sets
ablated, the verification's wall time and every verdict, and the ratios; ``--control`` picks the
control design (run it once per design to compare layer-matched with uniform). With
``--replay`` the sequential design is not run but replayed on the fixed-size run's control
effects (the same seeded sets in the same order, so the same stopping points and verdicts up to
float rounding of batched sums): its sets are counted, its wall time is not measured. Not a test:
times depend on the machine.

    python benchmarks/verification.py [--model smollm2-135m] [--n-random 50] [--control layer-matched]
        [--correction bh] [--types induction,previous_token] [--replay]
"""

from __future__ import annotations

import argparse
import time

import torch

from headprobe.commands.scan import ScanConfig, run
from headprobe.probe.backends.loading import load_model


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n-random", type=int, default=ScanConfig.n_random)
    p.add_argument("--control", default="layer-matched", choices=("layer-matched", "uniform"))
    p.add_argument("--correction", default="bh", choices=("bh", "holm"))
    p.add_argument("--types", default=None, help="comma-separated head types (default: the scan's five)")
    p.add_argument("--replay", action="store_true", help="replay the sequential design on the fixed-size run's effects")
    args = p.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model, quiet=True)
    out = {}
    for name, sequential in (
        (("fixed-size", False), ("sequential", True)) if not args.replay else (("fixed-size", False),)
    ):
        cfg = ScanConfig(
            model=args.model,
            n_random=args.n_random,
            control=args.control,
            correction=args.correction,
            sequential=sequential,
            metrics=False,
            pattern_len=0,
            **({"types": tuple(args.types.split(","))} if args.types else {}),
        )
        t0 = time.perf_counter()
        result = run(model, cfg, progress=False)
        out[name] = (result, time.perf_counter() - t0)
        sets = result.verification["sets_ablated"]
        print(
            f"{name:<11} sets ablated {sets:4d}  verification {result.timings['ablate_s']:7.1f} s  "
            f"(whole run {out[name][1]:.1f} s)"
        )
        for v in result.verifications:
            if v.tested or v.no_verdict:
                print(
                    f"    {v.head_type:<16} {v.kind:<5} draws {v.draws:3d}  top Δ {v.top_effect:+.3f}  control mean/max "
                    f"{v.random_mean:+.3f}/{v.random_max:+.3f}  {'p<=' if v.p_value_is_bound else 'p  '} {v.p_value:.4f}  "
                    f"adj {v.p_adjusted:.4f}  {v.stop_reason}, {v.exceedances} reached  {v.verdict}"
                )
    if args.replay:
        replay(out["fixed-size"][0], args)
        return
    (fixed, _), (seq, _) = out["fixed-size"], out["sequential"]
    same = [a.confirmed for a in fixed.verifications if a.tested] == [
        b.confirmed for b in seq.verifications if b.tested
    ]
    ratio = seq.verification["sets_ablated"] / fixed.verification["sets_ablated"]
    time_ratio = seq.timings["ablate_s"] / fixed.timings["ablate_s"]
    print(
        f"\ncontrol={args.control} correction={args.correction} n_random={args.n_random}: sets ratio "
        f"(sequential / fixed) {ratio:.3f}, verification time ratio {time_ratio:.3f}, same verdicts: {same}"
    )


def replay(fixed, args) -> None:
    """The sequential design on ``fixed``'s control effects: each tested kind's draws fed in batches
    to :class:`~headprobe.analyses.statistics.SequentialMCTest`, curtailed as the scan curtails,
    the untested kind counted on its first sets, the family corrected as the scan does."""
    from headprobe.analyses import statistics as st
    from headprobe.analyses import verification as verif
    from headprobe.analyses.ablation import LOSS_METRIC  # a decoder's scan: effects in nats/token

    cfg = fixed.config
    tested = [v for v in fixed.verifications if v.tested]
    sets, ps, rows = 0, [], []
    # each test's most draws: its stream (n_random sets, or every distinct set where fewer exist), all ablated by the fixed run
    tests = [st.SequentialMCTest(v.top_effect, v.draws, cfg.alpha, tie=1e-5) for v in tested]
    while not all(t.done for t in tests):  # rounds of one batch per open test, then curtailment, as the scan runs
        for v, t in zip(tested, tests):
            if not t.done:
                t.add(v.random_effects[len(t.draws) : len(t.draws) + verif.BATCH])
        verif.curtail_family(tests, cfg.correction, cfg.alpha)
    for v, test in zip(tested, tests):
        sets += (
            len(test.draws) + min(verif.SECONDARY_DRAWS, v.draws) + 2
        )  # both kinds' top-k sets, the other kind's sets
        ps.append(test.p_value())
        rows.append((v, test))
    adjusted = st.adjust_p_values(ps, cfg.correction)
    print(f"sequential (replayed on the same sets) sets ablated {sets:4d}")
    same = True
    for (v, test), p, adj in zip(rows, ps, adjusted):
        confirmed = bool(adj <= cfg.alpha and verif.effect_is_large(v.top_effect, test.draws, LOSS_METRIC.min_effect))
        same &= confirmed == v.confirmed
        print(
            f"    {v.head_type:<16} {v.kind:<5} draws {len(test.draws):3d}  {'p<=' if test.curtailed else 'p  '} {p:.4f}  adj {adj:.4f}  "
            f"{'CONFIRMED' if confirmed else 'not confirmed'}"
        )
    total = fixed.verification["sets_ablated"]
    print(
        f"\ncontrol={cfg.control} correction={cfg.correction} n_random={cfg.n_random}: sets ratio (sequential / fixed) "
        f"{sets / total:.3f} ({sets} / {total}), same verdicts: {same}"
    )


if __name__ == "__main__":
    main()
