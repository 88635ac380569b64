"""``headprobe kv``: a head-level KV-cache policy, chosen from the heads and measured causally.

Each KV group (the unit that owns cache: a key/value head, or an MLA layer's latent) either keeps
a full cache or becomes *streaming*: its query heads read only the first ``--sink`` keys and the
last ``--window`` (StreamingLLM, arXiv:2309.17453; DuoAttention, arXiv:2410.10819, keeps full
caches only for its "retrieval heads"). The command

1. measures the full model on natural text and on the long-range retrieval task (a random block
   planted early in natural text and repeated at the end, at ``--distances``): the loss in
   nats/token and the repeat's top-1 copy accuracy;
2. scores each group's cost of streaming: ``--method retrieval`` (default; the attention its heads
   put on the planted block's first occurrence from the repeat, and outside the sink and window on
   natural text), ``estimate`` (the attention mass outside the sink and the window) or
   ``measured`` (the model with only that group streaming, one forward pass per group);
3. keeps the highest-cost groups full within ``--kv-budget`` (a fraction of the full cache) or,
   with ``--loss-tolerance``, the fewest whose natural-text loss increase stays within it (a
   binary search, each step measured exactly);
4. measures the chosen policy exactly (attention masked per KV group) against the same window on
   every group and random groups at the same memory (``--n-random`` seeds), for ``--budgets``.

Outputs: ``policy.json`` (format in docs/kv.md; ``headprobe budget --policy`` reads it),
``policy_budget.json`` (its KV bytes, FLOPs and attention bytes), ``group_costs.csv``,
``curve.csv``, ``kv_curve.{png,pdf,svg}`` and ``summary.json`` (last).

As a library::

    result = headprobe.kv("smollm2-135m", seq_len=1024, kv_budget=0.5)   # KVResult
    result.policy, result.curve
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from headprobe import options
from headprobe.commands import Command
from headprobe.options import positive_int
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.io import summary_envelope, write_json
from headprobe.probe.vocabulary import backend_lacks
from headprobe.settings import OUTPUT, DataSettings, Flags, ModelSettings, setting, shared

if TYPE_CHECKING:  # torch-free module: the flags are checked before torch loads
    from headprobe.probe.backend import LoadedModel
    from headprobe.probe.spec import ModelSpec

HELP = "head-level KV-cache policy: which KV groups keep a full cache, measured causally against uniform and random"

METHODS = ("estimate", "retrieval", "measured")
DEFAULT_BUDGETS = (0.25, 0.5, 0.75)


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions such as 0.25,0.5,0.75, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"budgets are fractions in (0, 1], got {text!r}")
    return values


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 128,512, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"distances are positive token counts, got {text!r}")
    return values


@dataclass(frozen=True)
class KVConfig(ModelSettings):
    """Settings of ``headprobe kv``: the shared :class:`~headprobe.settings.ModelSettings` (how the
    model is loaded, :func:`headprobe.options.load_model_as`) composed, the natural-text settings of
    :class:`~headprobe.settings.DataSettings` it uses (``text``, ``seq_len``, ``n_natural``,
    ``seed``, declared there: :func:`~headprobe.settings.shared`; it has no repeated-token set), and
    its own. Every field's help is its flag's.

    Attributes:
        model: model name or path (the native backend: policies mask its attention per KV group).
        device_map, max_memory: refused (not ``--device-map``: the per-group masks and the
            streaming cache are checked on one device only); ``prepend_bos`` takes no flag (always true).
        text: a UTF-8 file instead of CPython's pydoc_data.topics.
        seq_len: tokens per sequence of both tasks (natural text and long-range). n_natural: natural-text windows.
        distances: long-range task: tokens from the planted block to its repeat (None: 1/4, 1/2,
            3/4 of the room and the farthest that fits). block_len: the planted block's tokens.
        n_per_distance: long-range sequences per distance.
        sink: attention-sink positions a streaming group keeps. window: recent positions it keeps
            (None: ``seq_len // 8``).
        kv_budget: the chosen policy's KV cache as a fraction of the full one (ignored with loss_tolerance).
        loss_tolerance: instead of a budget, the most natural-text loss increase (nats/token) allowed.
        budgets: KV fractions of the quality-memory curve (kv_budget is added).
        method: ``estimate`` (attention mass outside sink + window), ``retrieval`` (attention on the
            planted block from its repeat; max over a group's heads) or ``measured`` (one group streaming at a time).
        n_random: random policies per budget (seeds seed .. seed + n_random - 1).
        seed: seeds the text windows, the random tokens and the random policies.
    """

    text: str | None = shared(DataSettings, "text")
    seq_len: int = shared(DataSettings, "seq_len", 1024)
    n_natural: int = shared(DataSettings, "n_natural", 1)
    distances: tuple[int, ...] | None = setting(
        None, "long-range task: tokens from the planted block to its repeat (default: 1/4, 1/2, 3/4 of the "
        "sequence and the farthest that fits)", type=_ints, metavar="D,...")
    block_len: int = setting(16, "planted block length (default %(default)s)", type=positive_int)
    n_per_distance: int = setting(1, "long-range sequences per distance (default %(default)s)", type=positive_int)
    sink: int = setting(4, "attention-sink positions a streaming group keeps (default %(default)s)", type=int)
    window: int | None = setting(None, "recent positions a streaming group keeps (default seq-len / 8)", type=positive_int)
    kv_budget: float = setting(0.5, "the policy's KV cache as a fraction of the full cache (default %(default)s)", type=float,
                               exclusive="budget")
    loss_tolerance: float | None = setting(
        None, "instead: the most natural-text loss increase (nats/token); the fewest full groups that meet it", type=float,
        exclusive="budget")
    budgets: tuple[float, ...] = setting(DEFAULT_BUDGETS, "KV fractions of the curve (default 0.25,0.5,0.75; --kv-budget is added)",
                                         type=_fractions, metavar="B,...")
    method: str = setting("retrieval", "group costs: retrieval (default: attention on the planted block's first occurrence "
                          "from its repeat, max over a group's heads), estimate (attention mass outside sink + window, mean "
                          "over a group's heads) or measured (one group streaming at a time, a forward pass per group)",
                          choices=METHODS)
    n_random: int = setting(3, "random policies per budget (default %(default)s)", type=positive_int)
    seed: int = shared(DataSettings, "seed")

    def __post_init__(self):
        super().__post_init__()  # the shared settings' checks (headprobe.settings.check_settings)
        if self.device_map is not None:
            raise HeadprobeError("headprobe kv runs on one device: its per-KV-group masks and streaming cache are not "
                                 "checked on a model split by a device map (leave device_map and max_memory unset)")
        if self.method not in METHODS:
            raise HeadprobeError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 0 < self.kv_budget <= 1:
            raise HeadprobeError(f"--kv-budget must be in (0, 1], got {self.kv_budget}")
        if self.loss_tolerance is not None and self.loss_tolerance < 0:
            raise HeadprobeError(f"--loss-tolerance is an increase in nats/token, >= 0; got {self.loss_tolerance}")
        if self.sink < 0 or self.n_random < 1 or self.seq_len < 8:
            raise HeadprobeError("--sink must be >= 0, --n-random >= 1 and --seq-len >= 8")
        if self.window is None:
            object.__setattr__(self, "window", max(1, self.seq_len // 8))
        if self.sink + self.window >= self.seq_len:
            raise HeadprobeError(f"--sink {self.sink} + --window {self.window} cover all {self.seq_len} tokens: nothing would stream")
        budgets = tuple(sorted({*map(float, self.budgets), float(self.kv_budget)} if self.loss_tolerance is None
                               else set(map(float, self.budgets))))
        object.__setattr__(self, "budgets", budgets)
        if self.distances is None:
            room = self.seq_len - self.block_len - 1
            object.__setattr__(self, "distances", tuple(sorted({max(self.block_len, room * i // 4) for i in (1, 2, 3)} | {room})))
        object.__setattr__(self, "distances", tuple(int(d) for d in self.distances))

    @property
    def floor(self) -> float:
        """The KV fraction of every group streaming."""
        return (self.sink + self.window) / self.seq_len

    def preflight(self) -> None:
        """Checks that need no model: the backend, budgets above the all-streaming floor, distances in range."""
        if backend_lacks(self.backend, "kv_policies"):
            raise HeadprobeError("headprobe kv masks attention per KV group in headprobe's native model; use --backend "
                                 f"native (or auto) with a family it supports (the {self.backend} backend lacks kv_policies)")
        low = [b for b in (*self.budgets, self.kv_budget) if b < self.floor]
        if low:
            raise HeadprobeError(f"budget {low[0]} is below what every group streaming costs ({self.floor:.3f} of the cache "
                                 f"at {self.seq_len} tokens with --sink {self.sink} --window {self.window})")
        bad = [d for d in self.distances if not self.block_len <= d <= self.seq_len - self.block_len - 1]
        if bad:
            raise HeadprobeError(f"--distances must lie in [{self.block_len}, {self.seq_len - self.block_len - 1}]; got {bad[0]}")


@dataclass
class KVResult:
    """A finished ``headprobe kv`` run.

    Attributes:
        config: the settings. spec: the model's spec. layout: its attention layout (bytes per
            element of its dtype). policy: the chosen :class:`~headprobe.probe.layout.KVPolicy`.
        policy_cost: :func:`~headprobe.probe.cost.policy_cost` of the policy at ``seq_len``.
        costs: :class:`~headprobe.analyses.kvpolicy.GroupCosts`. full, chosen: :class:`Quality`
            of the full cache and of the policy. comparison: curve rows at the policy's memory.
        curve: the quality-memory rows (:func:`~headprobe.analyses.kvpolicy.curve_row`).
        cache_check: the native model's allocated StreamingKVCache bytes against the formula, and
            (``loss``) the chosen policy's natural-text loss against the backend's own scoring.
        sources: where the token sets came from. seconds: the run's; device, self_check: the
            model's; load_s: the model's load (set by the caller that loaded it).
    """

    config: KVConfig
    spec: ModelSpec
    layout: object
    policy: object
    policy_cost: object
    costs: object
    full: object
    chosen: object
    comparison: list
    curve: list
    cache_check: dict
    sources: dict = field(default_factory=dict)
    seconds: float = 0.0
    device: str | None = None
    self_check: dict | None = None
    load_s: float = 0.0

    def group_table(self):
        """group_costs.csv: one row per (layer, kv_group) with its costs and whether it stays full."""
        import pandas as pd

        c, full = self.costs, set(self.policy.full_groups)
        L, G = c.natural.shape
        return pd.DataFrame([{"layer": layer, "kv_group": g, "natural_cost": float(c.natural[layer, g]),
                              "long_range_cost": float(c.long_range[layer, g]), "score": float(c.score[layer, g]),
                              **({"copy_accuracy_drop": float(c.accuracy_drop[layer, g])} if c.accuracy_drop is not None else {}),
                              "full_cache": (layer, g) in full} for layer in range(L) for g in range(G)])

    def summary(self) -> dict:
        """summary.json: the policy, its bytes, its quality against full, uniform and random."""
        by = {r["policy"]: r for r in self.comparison if r["policy"] != "random"}
        rnd = [r for r in self.comparison if r["policy"] == "random"]
        c = self.config
        return summary_envelope({
            "n_layers": self.policy.n_layers, "n_kv_groups": self.policy.n_kv_groups,
            "unit": "latent (MLA: one per layer)" if self.layout.is_mla else "kv_head",
            "seq_len": c.seq_len, "sink": c.sink, "window": c.window, "method": self.costs.method,
            "target": {"kv_budget": c.kv_budget} if c.loss_tolerance is None else {"loss_tolerance": c.loss_tolerance},
            "full_groups": [f"{layer}.{g}" for layer, g in self.policy.full_groups],
            "kv_bytes": self.policy_cost.kv_bytes, "kv_bytes_full": self.policy_cost.kv_bytes_full,
            "kv_fraction": self.policy_cost.kv_fraction, "cache_check": self.cache_check,
            "full": self.full.to_dict(), "chosen": by["chosen"], "uniform": by["uniform"],
            "random": {"rows": rnd, "natural_loss_increase_mean": _mean(r["natural_loss_increase"] for r in rnd),
                       "copy_accuracy_mean": _mean(r["copy_accuracy"] for r in rnd)},
            "beats_uniform": _beats(by["chosen"], [by["uniform"]]), "beats_random": _beats(by["chosen"], rnd),
            "sources": self.sources,
            "definitions": {"natural_loss": "mean next-token loss on natural text, nats/token",
                            "long_range": "a random block planted early and repeated at the end; loss and top-1 accuracy "
                                          "on its tokens 2..block_len", "streaming": "a KV group's query heads read only "
                                          "the first sink and the last window keys; exact, the attention masked per group; "
                                          "the window slides for every query, prompt included (kvpress's StreamingLLM "
                                          "press instead prunes the cache once after a full-attention prefill)",
                            "uniform": "every group streaming with one window at the same KV memory",
                            "random": "as many groups full as the chosen policy, drawn at random"},
        }, model=self.spec.name, precision=self.spec.precision, device=self.device, self_check=self.self_check,
            config=c, timings_s={"load_s": self.load_s, "run_s": self.seconds})

    def report(self) -> str:
        s = self.summary()
        lines = [f"policy: {len(s['full_groups'])} of {s['n_layers'] * s['n_kv_groups']} KV groups full, the rest "
                 f"sink {s['sink']} + window {s['window']}; KV cache {s['kv_fraction']:.3f} of full at {s['seq_len']} tokens",
                 f"{'':>10} {'natural loss +':>15} {'copy accuracy':>14} {'long-range loss':>16}",
                 f"{'full':>10} {0:>15.4f} {s['full']['copy_accuracy']:>14.3f} {s['full']['long_range_loss']:>16.3f}"]
        for name in ("chosen", "uniform"):
            r = s[name]
            lines.append(f"{name:>10} {r['natural_loss_increase']:>15.4f} {r['copy_accuracy']:>14.3f} {r['long_range_loss']:>16.3f}")
        for r in s["random"]["rows"]:
            lines.append(f"{'random ' + str(r['seed']):>10} {r['natural_loss_increase']:>15.4f} {r['copy_accuracy']:>14.3f} "
                         f"{r['long_range_loss']:>16.3f}")
        return "\n".join(lines)

    def save(self, out_dir: str | Path, overwrite: bool = False) -> list[Path]:
        """Write policy.json, policy_budget.json, group_costs.csv, curve.csv, the figure and, last, summary.json.

        Raises:
            HeadprobeError: ``out_dir`` is a file, not writable, or not empty without ``overwrite``.
        """
        import pandas as pd

        from headprobe.analyses import figures
        from headprobe.analyses.outputs import write_outputs

        def policy_files(out: Path) -> list[Path]:
            write_json(out / "policy.json", self.policy.to_dict())
            write_json(out / "policy_budget.json", {"layout": self.layout.to_dict(), **self.policy_cost.to_dict(),
                                                    "command": f"headprobe budget --model {self.spec.name} --seq-len "
                                                               f"{self.config.seq_len} --dtype {self.config.dtype} --policy policy.json"})
            return [out / "policy.json", out / "policy_budget.json"]

        def curve_figure():
            return figures.kv_policy_curve(self.curve, f"{self.spec.name}: KV policy at {self.config.seq_len} tokens "
                                                       f"(sink {self.config.sink}, window {self.config.window})")

        tables = {"group_costs.csv": self.group_table().to_csv(index=False, float_format="%.6f"),
                  "curve.csv": pd.DataFrame(self.curve).to_csv(index=False, float_format="%.6f")}
        return write_outputs(out_dir, overwrite, summary=self.summary, tables=tables, figures={"kv_curve": curve_figure},
                             extra=policy_files)


def _mean(values) -> float:
    v = list(values)
    return sum(v) / len(v)


def _beats(chosen: dict, others: list[dict]) -> bool:
    """Lower natural-text loss increase and higher copy accuracy than the mean of ``others``
    (ties in accuracy count, so a budget where both copy perfectly is judged on loss)."""
    return (chosen["natural_loss_increase"] <= _mean(r["natural_loss_increase"] for r in others)
            and chosen["copy_accuracy"] >= _mean(r["copy_accuracy"] for r in others))


def _token_sets(model: LoadedModel, config: KVConfig):
    """The natural-text windows and the long-range set (:func:`~headprobe.analyses.data.long_range_tokens`)."""
    from headprobe.analyses.data import long_range_tokens, natural_text_tokens
    from headprobe.probe.io import open_text_file

    text = open_text_file(config.text) if config.text else None
    if config.seq_len > model.spec.n_ctx:
        raise HeadprobeError(f"--seq-len {config.seq_len} is longer than the model's context ({model.spec.n_ctx} tokens)")
    natural = natural_text_tokens(model, config.n_natural, config.seq_len, config.seed, text)
    if natural.tokens.shape[0] < config.n_natural:
        raise HeadprobeError(f"the text holds {natural.tokens.shape[0]} windows of {config.seq_len} tokens; "
                             f"{config.n_natural} are needed")
    lr = long_range_tokens(model, config.seq_len, list(config.distances), config.block_len, config.seed + 1,
                           config.n_per_distance, text)
    return natural, lr


def run(model: LoadedModel, config: KVConfig, progress: bool = True) -> KVResult:
    """Choose and measure a head-level KV policy for the loaded ``model`` (see the module docstring).

    Raises:
        HeadprobeError: a non-native backend, an encoder, sliding-window layers, bad lengths,
            budgets below the all-streaming floor, or an allocated cache that disagrees with the formula.
    """
    import time

    from tqdm.auto import tqdm

    from headprobe.analyses import kvpolicy as kp
    from headprobe.probe.cost import policy_cost
    from headprobe.probe.layout import Streaming

    config.preflight()
    kp.check_kv_backend(model)
    layout = model.kv_layout
    if layout.windows is not None:
        raise HeadprobeError(f"{model.spec.name} has sliding-window layers; headprobe kv streams groups of global layers only")
    t0 = time.perf_counter()
    natural, lr = _token_sets(model, config)
    tokens, start = natural.tokens.to(model.device), natural.start
    lr = dataclasses.replace(lr, tokens=lr.tokens.to(model.device))
    streaming = Streaming(config.sink, config.window)
    L, G = model.spec.n_layers, model.n_kv_groups
    seeds = list(range(config.seed, config.seed + config.n_random))
    n_evals = 1 + (L * G if config.method == "measured" else 0) + len(config.budgets) * (2 + len(seeds))
    bar = tqdm(total=n_evals, desc="kv policies", disable=not progress)
    full = kp.evaluate(model, tokens, start, lr)
    bar.update()
    if config.method == "measured":
        costs = kp.measured_group_costs(model, tokens, start, lr, streaming, full, progress=bar.update)
    else:
        costs = (kp.retrieval_group_costs if config.method == "retrieval" else kp.estimated_group_costs)(model, tokens, lr, streaming)
    curve = kp.kv_curve(model, tokens, start, lr, costs.score, streaming, list(config.budgets), seeds, layout, full,
                        progress=bar.update)
    if config.loss_tolerance is None:
        k = kp.n_full_for_budget(L * G, config.seq_len, streaming.span, config.kv_budget)
        comparison = [r for r in curve if r["budget"] == config.kv_budget and r["policy"] != "full"]
    else:
        k = kp.tolerance_k(model, tokens, start, lr, costs.score, streaming, config.loss_tolerance, full)
        comparison = kp.compare_at(model, tokens, start, lr, costs.score, streaming, k, seeds, layout, full,
                                   label=(k * config.seq_len + (L * G - k) * streaming.span) / (L * G * config.seq_len))
    bar.close()
    policy = dataclasses.replace(kp.chosen_policy(costs.score, k, streaming), model=model.spec.name)
    chosen_row = next(r for r in comparison if r["policy"] == "chosen")
    chosen = kp.Quality(chosen_row["natural_loss"], chosen_row["long_range_loss"], chosen_row["copy_accuracy"], {})
    check = {**kp.allocated_cache_check(model, tokens, policy, layout),
             "loss": kp.loss_identity_check(model, tokens, start, policy, chosen.natural_loss)}
    return KVResult(config, model.spec, layout, policy, policy_cost(layout, policy, config.seq_len), costs, full, chosen,
                    comparison, curve, check, sources={"natural": natural.source, "long_range": lr.source},
                    seconds=time.perf_counter() - t0, device=str(model.device), self_check=model.self_check.to_dict())


kv = options.command_function(
    KVConfig, run, "kv", "A head-level KV-cache policy, chosen from the heads and measured causally",
    '``seq_len=1024``, ``kv_budget=0.5``')
"""``headprobe kv`` as a function: :func:`headprobe.options.command_function` over :func:`run`."""


# No --device-map/--max-memory (the config refuses a device map: the per-group masks and the
# streaming cache are checked on one device only) and no --no-bos (as ablate and prune).
FLAGS = (Flags(group=ModelSettings, skip=("prepend_bos", "device_map", "max_memory")), OUTPUT,
         Flags(only=("text", "seq_len", "n_natural", "distances", "block_len", "n_per_distance", "sink", "window", "kv_budget",
                     "loss_tolerance", "budgets", "method", "n_random", "seed"),
               helps={"seq_len": "tokens per sequence (default %(default)s)",
                      "n_natural": "natural-text windows (default %(default)s)"}))
"""``--help``'s blocks: the model's flags, the output's, the command's own."""


def main(args: argparse.Namespace, config: KVConfig) -> int:
    return options.run_command(args, config, options.Run("headprobe.commands.kv", wrote=_wrote))


def _wrote(paths: list, out: Path) -> str:
    return f"\nwrote {len(paths)} files to {out}/ (policy.json, policy_budget.json, curve.csv, summary.json, figures)"


__all__ = ["HELP", "COMMAND", "KVConfig", "KVResult", "run", "kv", "main"]

COMMAND = Command(HELP, config=KVConfig, run="headprobe.commands.kv:main", flags=FLAGS, api=kv)
"""``headprobe kv``, registered in :data:`headprobe.commands.COMMANDS`."""
