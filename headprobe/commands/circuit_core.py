"""The run of ``headprobe circuit`` (torch): :func:`run`, the result and the Python function
:func:`circuit`. The command, its settings (:class:`~headprobe.commands.circuit.CircuitConfig`) and its flags are
:mod:`headprobe.commands.circuit`, which imports none of this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from headprobe import options
from headprobe.analyses.outputs import WritesOutputs
from headprobe.commands.circuit import HELP, CircuitConfig, parse_qk_head, parse_receivers  # noqa: F401 - the light module's names, re-exported
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import summary_envelope
from headprobe.probe.core.reprs import CompactRepr, load_seconds

if TYPE_CHECKING:
    import pandas as pd

    from headprobe.analyses.qk_attribution import QKAttribution
    from headprobe.probe.backends.base import LoadedModel
    from headprobe.probe.layout.spec import ModelSpec


@dataclass(repr=False)
class CircuitResult(CompactRepr, WritesOutputs):
    """A finished ``circuit`` run: ``config``, the model's ``spec``, ``edges`` (edges.csv),
    ``agreement`` (EAP(-IG) against exact path patching on the verified edges, or None),
    ``paths`` (path_patching.csv or None), ``qk`` (:class:`~headprobe.analyses.qk_attribution.QKAttribution`
    or None), ``clean_loss`` (nats/token), ``baseline_error``, ``seconds`` (the run's) and ``load_s``
    (seconds loading the model where circuit loaded it; None where the caller passed a model it loaded (:func:`~headprobe.probe.core.reprs.load_seconds`)), ``parallel_attn_mlp`` (the model's
    :attr:`~headprobe.probe.backends.base.LoadedModel.parallel_attn_mlp`, None where unknown)."""

    config: CircuitConfig
    spec: ModelSpec
    edges: pd.DataFrame
    agreement: dict | None
    paths: pd.DataFrame | None
    qk: QKAttribution | None
    clean_loss: float
    baseline_error: float
    seconds: float = 0.0
    model_info: dict = field(default_factory=dict)
    load_s: float | None = load_seconds()
    parallel_attn_mlp: bool | None = None

    def qk_table(self):
        """qk_attribution.csv: :meth:`~headprobe.analyses.qk_attribution.QKAttribution.totals`."""
        return self.qk.totals()

    def summary(self) -> dict:
        """summary.json: the task, the clean loss, the top edges with their exact effects, the
        agreement, the receivers' top senders, the QK attribution's largest terms, definitions."""
        top = self.edges.head(self.config.top)
        info = dict(self.model_info)
        device, self_check = info.pop("device", None), info.pop("self_check", None)
        spec = self.spec
        s = {
            **info,
            "hf_name": spec.hf_name,
            "layout": {**spec.layout_summary(), "parallel_attn_mlp": self.parallel_attn_mlp},
            "task": f"{self.config.n_seqs} repeated random sequences of {self.config.period} tokens; corrupted: "
            f"other repeated random sequences (seed + 1)",
            "metric": "next-token loss (nats/token) on the second copy from its second token; effect = patched - clean",
            "clean_loss": round(self.clean_loss, 4),
            "baseline_error": float(f"{self.baseline_error:.3g}"),
            "method": self.config.method,
            "steps": self.config.steps if self.config.method == "eap-ig" else 1,
            "ig_alphas": "right Riemann, 1/m..1" if self.config.method == "eap-ig" else "1 (the clean run)",
            "n_edges": int(len(self.edges)),
            "top_edges": [
                {
                    "edge": r.edge,
                    "score": round(float(r.score), 5),
                    "exact": None if r.exact != r.exact else round(float(r.exact), 5),
                }
                for r in top.itertuples()
            ],
            "agreement": self.agreement,
            **self._null_reasons(top),
            "path_patching": "direct-path patching: clean run; the sender's corrupted - clean result added only to the "
            "receiver's input residual (the MLPs between sender and receiver stay clean, unlike Wang et "
            "al. 2022, who recompute them), the receiver's input norm recomputed; every later layer recomputed",
        }
        if self.paths is not None:
            s["receivers"] = {
                rec: [
                    {"sender": r.sender, "effect": round(float(r.effect), 5), "score": round(float(r.score), 5)}
                    for r in grp.head(8).itertuples()
                ]
                for rec, grp in self.paths.groupby("receiver", sort=False)
            }
        if self.qk is not None:
            q = self.qk
            s["qk_attribution"] = {
                "head": f"{q.layer}.{q.head}",
                "q_pos": q.q_pos,
                "k_pos": q.k_pos,
                "score": round(q.score, 4),
                "identity_error": float(f"{q.identity_error:.3g}"),
                "key_side_top": {k: round(float(v), 4) for k, v in q.key_side().head(8).items()},
                "query_side_top": {k: round(float(v), 4) for k, v in q.query_side().head(8).items()},
            }
        return summary_envelope(
            s,
            model=self.spec.name,
            precision=self.spec.precision,
            backend=self.spec.backend,
            device=device,
            self_check=self_check,
            config=self.config,
            timings_s={"load_s": self.load_s, "run_s": self.seconds},
        )

    def _null_reasons(self, top) -> dict:
        """Why the summary's nulls are null, where there are any: ``exact_null_reason`` (a listed edge
        that was not path patched) and ``agreement_null_reason`` (no agreement: fewer than 3 edges patched)."""
        out = {}
        if top["exact"].isna().any():
            out["exact_null_reason"] = (
                f"not path patched: --verify {self.config.verify} patches the {self.config.verify} "
                "edges largest in |score| and as many drawn at random from the rest"
            )
        if self.agreement is None:
            out["agreement_null_reason"] = (
                f"fewer than 3 edges path patched (--verify {self.config.verify}); a correlation needs at least 3"
            )
        return out

    def figure(self):
        """``circuit``: the ``top`` edges as a graph (:func:`circuit_figure`)."""
        spec = self.spec
        return circuit_figure(
            self.edges, self.config.top, self.config.method, spec.name, spec.n_layers, spec.n_heads, spec.precision
        )

    @options.reports_for_readers("circuit")
    def report(self) -> str:
        s = self.summary()
        lines = [f"clean loss {s['clean_loss']:.3f} nats/token; {s['n_edges']} edges scored by {s['method']}"]
        if self.agreement:
            a = self.agreement
            r = {k: "n/a" if a.get(k) is None else f"{a[k]:.3f}" for k in ("spearman", "pearson", "top_k_recall")}
            why = "; ".join(dict.fromkeys(a.get("null_reasons", {}).values()))
            lines.append(
                f"against exact path patching on {a['n_edges']} edges: Spearman {r['spearman']}, "
                f"Pearson {r['pearson']}, top-{a['top_k']} recall {r['top_k_recall']}"
                + (f" (n/a: {why})" if why else "")
            )
        top = s["top_edges"][:10]
        verified = any(t["exact"] is not None for t in top)  # --verify 0: no exact column
        lines.append(f"largest edges (score{', exact' if verified else ''}):")
        lines += [
            f"  {t['edge']:>18}  {t['score']:+.4f}" + ("" if t["exact"] is None else f"  {t['exact']:+.4f}")
            for t in top
        ]
        for rec, rows in s.get("receivers", {}).items():
            lines.append(
                f"path patching into {rec}: " + ", ".join(f"{r['sender']} {r['effect']:+.4f}" for r in rows[:5])
            )
        if self.qk is not None:
            q = s["qk_attribution"]
            lines.append(
                f"QK attribution of {q['head']} ({q['q_pos']} -> {q['k_pos']}): score {q['score']:+.3f} "
                f"(identity error {q['identity_error']:.1g}); key side: "
                + ", ".join(f"{k} {v:+.2f}" for k, v in list(q["key_side_top"].items())[:5])
            )
        return "\n".join(lines)

    def outputs(self) -> dict[str, Any]:
        """save's files: edges.csv, path_patching.csv, qk_attribution.csv, the figures (circuit; with
        ``--receivers``, path_patching: :func:`path_patching_figure`) and, last, summary.json."""
        tables = {"edges.csv": self.edges.to_csv(index=False, float_format="%.6g")}
        if self.paths is not None:
            tables["path_patching.csv"] = self.paths.to_csv(index=False, float_format="%.6g")
        if self.qk is not None:
            tables["qk_attribution.csv"] = self.qk_table().to_csv(index=False, float_format="%.6g")
        figures = {"circuit": self.figure}
        if self.paths is not None and len(self.paths):
            spec = self.spec
            figures["path_patching"] = lambda: path_patching_figure(
                self.paths, self.config.method, spec.name, spec.n_layers, spec.n_heads, spec.precision
            )
        return dict(summary=self.summary, tables=tables, figures=figures)


def batch_line(model: LoadedModel, config: CircuitConfig) -> str:
    """The header line of the circuit engines' chunks (:func:`~headprobe.analyses.circuit.plan_rows`
    on ``n_seqs`` repeated sequences of ``1 + 2 * period`` tokens, under ``--memory-gb`` or the
    shared budget).

    Raises:
        HeadprobeError: one sequence does not fit in the budget (before any forward).
    """
    from headprobe.analyses import circuit as circuit_analysis

    pos = 1 + 2 * config.period
    budget = None if config.memory_gb is None else config.memory_gb * circuit_analysis.GIB
    rows, stack = circuit_analysis.plan_rows(model, config.n_seqs, pos, budget)
    scoring, patching = circuit_analysis.row_bytes(model, pos)
    return (
        f"batch: {rows} of {config.n_seqs} sequences per scoring chunk (about {scoring / 2**20:.1f} MiB each), "
        f"{stack} stacked copies per path-patched forward (about {patching / 2**20:.1f} MiB each)"
    )


def run(model: LoadedModel, config: CircuitConfig, progress: bool = True) -> CircuitResult:
    """Score, verify and explain on the loaded ``model`` (module docstring).

    Raises:
        HeadprobeError: the bridge, an encoder, MLA, a receiver or head outside the model, a
            sequence longer than the context, or a resumed forward that does not reproduce the clean run.
    """
    import time

    from headprobe.analyses import circuit as circuit_analysis
    from headprobe.analyses.data import repeated_random_tokens

    spec, t0 = model.spec, time.perf_counter()
    if 2 * config.period + 1 > spec.n_ctx:
        raise HeadprobeError(
            f"--period {config.period} gives sequences longer than the model's context ({spec.n_ctx} tokens)"
        )
    receivers = parse_receivers(config.receivers, spec.n_layers, spec.n_heads) if config.receivers else []
    qk_head = parse_qk_head(config.qk_head, spec.n_layers, spec.n_heads) if config.qk_head else None
    options.refuse_removed([h for h, _ in receivers if h is not None] + ([qk_head] if qk_head else []), model)
    clean = repeated_random_tokens(model, config.n_seqs, config.period, config.seed)
    corrupted = repeated_random_tokens(model, config.n_seqs, config.period, config.seed + 1)
    budget = None if config.memory_gb is None else config.memory_gb * circuit_analysis.GIB
    rows, stack = circuit_analysis.plan_rows(model, config.n_seqs, clean.tokens.shape[1], budget)
    runs = circuit_analysis.RunChunks(
        model, clean.tokens, corrupted.tokens, rows, stack, first=clean.start + config.period
    )
    layers = sorted({r[0] for r, _ in receivers if r is not None} | set(range(1, spec.n_layers)))
    base = circuit_analysis.baseline_error(model, runs, layers if config.verify or receivers else [])
    clean_loss = runs.clean_metric()
    tolerance, rule = circuit_analysis.baseline_tolerance(model, clean_loss)
    if base > tolerance:
        raise HeadprobeError(
            f"a forward resumed at a layer, unpatched, changes the clean loss by {base:.2g} nats/token, "
            f"more than float rounding allows ({tolerance:.2g}: {rule}): direct-path patching refused"
        )
    scores = circuit_analysis.edge_scores(model, runs, config.method, config.steps, progress=progress)
    edges, agreement = circuit_analysis.verify_edges(
        model, runs, scores.table, config.verify, config.seed, progress=progress
    )
    sweep = circuit_analysis.receiver_sweep(model, runs, receivers, scores, progress=progress) if receivers else None
    qk = None
    if qk_head is not None:
        from headprobe.analyses.qk_attribution import qk_attribution

        q_pos = clean.start + config.period + config.period // 2  # the middle of the second copy
        qk = qk_attribution(model, clean.tokens[:1], qk_head[0], qk_head[1], q_pos, q_pos - config.period + 1)
    dtype = str(model.dtype).removeprefix("torch.")
    return CircuitResult(
        config,
        spec,
        edges,
        agreement,
        sweep,
        qk,
        clean_loss,
        base,
        seconds=time.perf_counter() - t0,
        model_info={
            "device": str(model.device),
            "dtype": dtype,
            "self_check": model.self_check.to_dict(),
            "baseline_tolerance": float(f"{tolerance:.3g}"),
            "baseline_tolerance_rule": rule,
            "sequences_per_chunk": rows,
        },
        parallel_attn_mlp=model.parallel_attn_mlp,
    )


circuit = options.command_function(
    CircuitConfig,
    run,
    "circuit",
    "Head circuits on the induction task: edge attribution checked by exact path patching",
    '``n_seqs=2``, ``receivers="18.6:k"``',
)
"""``headprobe circuit`` as a function: :func:`headprobe.options.command_function` over :func:`run`."""


TRAINED_WEIGHTS = "(headprobe checkpoint)"
"""What the weights of a model ``headprobe train`` saved say (a pruned checkpoint's say "pruned")."""


def model_title(name: str, weights: str, n_layers: int, n_heads: int) -> str:
    """How a figure's title names the model ``name`` (a ModelSpec's, or summary.json's ``model``): a
    registered or Hugging Face name as it is; a model ``headprobe train`` saved (its ``weights``, the
    spec's or summary.json's ``weights_precision``, say :data:`TRAINED_WEIGHTS`) by its shape and its
    folder's name, never the path it was loaded from ("figures/train-default" read as a file name); any
    other as every title names it (:func:`~headprobe.analyses.figures.title_name`: a local folder by its name)."""
    from headprobe.analyses.figures import title_name

    if TRAINED_WEIGHTS in weights:
        return f"{n_layers}-layer, {n_heads}-head model trained with headprobe ({title_name(name, weights)})"
    return title_name(name, weights)


def circuit_figure(
    edges: pd.DataFrame, top: int, method: str, name: str, n_layers: int, n_heads: int, weights: str = ""
):
    """circuit.png: the first ``top`` rows of edges.csv (``edges``, ordered by ``|score|``) as a graph
    (:func:`headprobe.analyses.figures.circuit_graph`), outlined where ``exact`` was measured (the legend calls
    the width an estimate and gives the largest exact effect drawn), titled
    with the model as :func:`model_title` names it (``weights``: the model's weights description); what
    ``headprobe circuit`` draws and scripts/redraw_figures.py redraws from a saved edges.csv."""
    from headprobe.analyses import figures
    from headprobe.analyses.circuit import parse_edge

    rows = edges.head(top)
    drawn = [
        (e.sender, e.receiver, e.input, float(score))
        for e, score in zip((parse_edge(n) for n in rows["edge"]), rows["score"])
    ]
    label = method.upper()
    return figures.circuit_graph(
        drawn,
        n_layers,
        n_heads,
        f"{model_title(name, weights, n_layers, n_heads)}: top {len(drawn)} edges by |{label}|",
        f"{label} score (nats/token)",
        exact=rows["exact"].to_numpy(dtype=float),
    )


FIGURE_SENDERS = 10
"""How many senders per receiver path_patching.png draws (largest ``|effect|`` first)."""


def path_patching_figure(
    paths: pd.DataFrame,
    method: str,
    name: str,
    n_layers: int,
    n_heads: int,
    weights: str = "",
    top: int = FIGURE_SENDERS,
):
    """path_patching.png: for each receiver of path_patching.csv (``paths``: ``receiver, sender,
    effect, score``, in the file's receiver order) its ``top`` senders by ``|effect|``, the exact
    effect as bars and the ``method``'s score of the same edge as a marker
    (:func:`headprobe.analyses.figures.path_patching_bars`), titled with the model as
    :func:`model_title` names it and its weights; what ``headprobe circuit --receivers`` draws and
    scripts/redraw_figures.py redraws from a saved path_patching.csv."""
    import numpy as np

    from headprobe.analyses import figures

    panels = []
    for receiver, group in paths.groupby("receiver", sort=False):
        order = np.argsort(-np.abs(group["effect"].to_numpy(dtype=float)), kind="stable")[:top]
        rows = group.iloc[order]
        panels.append(
            (
                str(receiver),
                [str(s) for s in rows["sender"]],
                rows["effect"].to_numpy(dtype=float),
                rows["score"].to_numpy(dtype=float),
                len(group),
            )
        )
    label = method.upper()
    title = (
        f"{model_title(name, weights, n_layers, n_heads)}, {figures.weights_label(weights)}: "
        f"exact direct-path patching effect vs {label} score"
    )
    return figures.path_patching_bars(panels, title, f"{label} score")
