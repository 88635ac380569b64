"""AtP* (attribution patching with GradDrop, :mod:`headprobe.analyses.attribution`) against
independent references: a per-layer backward with that layer's residual contribution detached
by hooks, attribution patching of :func:`head_importance`, and the exact sweep; and
``headprobe ablate --estimate`` end to end."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.attention

from headprobe.analyses.ablation import capture_z, exact_sweep, head_importance, mean_z_from, spearman
from headprobe.analyses.attribution import (
    ESTIMATORS,
    atp_star,
    categorical_draws,
    forward_equivalents,
    second_order,
)


@pytest.fixture(scope="module")
def deep_native(tiny_tokenizer):
    """4 layers x 4 heads (GQA 2 KV heads), seeded, larger weights so that heads matter."""
    from headprobe.probe.backends.loading import LoadedModel
    from headprobe.probe.model.config import TransformerConfig
    from headprobe.probe.model.convert import spec_from_native
    from headprobe.probe.model.transformer import Transformer

    torch.manual_seed(3)
    cfg = TransformerConfig(
        n_layers=4,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_vocab=101,
        d_mlp=64,
        positional="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tied_unembed=False,
    )
    net = Transformer(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return LoadedModel(net, tiny_tokenizer, spec_from_native("deep", "deep", "random", cfg))


def _tokens(n=3, T=12, seed=0):
    return torch.randint(0, 100, (n, T), generator=torch.Generator().manual_seed(seed))


def _dropped_attribution(model, tokens, layer, **kw):
    """Reference for GradDrop_l: attribution patching (:func:`head_importance`, its own hooks) with
    layer ``layer``'s residual contribution detached in the forward graph by two more hooks
    (``resid_post = resid_pre + (resid_post - resid_pre).detach()``, plus a zero multiple of the
    contribution so that its heads stay in the graph: same values, and the
    backward passes the skip connection only)."""
    saved = {}

    def keep(x, hook):
        saved["pre"] = x
        return x

    def drop(x, hook):
        # `* 0` rather than leaving the layer out: the head's own z stays in the graph (gradient 0)
        return saved["pre"] + (x - saved["pre"]).detach() + 0 * (x - saved["pre"])

    with model.hooks([(f"blocks.{layer}.hook_resid_pre", keep), (f"blocks.{layer}.hook_resid_post", drop)]):
        return head_importance(model, tokens, **kw).attribution


@pytest.mark.parametrize("name, kind", [("deep_native", "zero"), ("deep_native", "mean"), ("tiny_gpt2", "zero")])
def test_graddrop_equals_backward_with_the_layer_detached(request, name, kind):
    model = request.getfixturevalue(name)
    tokens = _tokens()
    kw = dict(first=1, kind=kind)
    if kind == "mean":
        kw["mean_z"] = mean_z_from(capture_z(model, _tokens(seed=7)), 0)
    star = atp_star(model, tokens, **kw)
    L = model.spec.n_layers
    # no layer dropped: plain attribution patching
    torch.testing.assert_close(star.attribution, head_importance(model, tokens, **kw).attribution, atol=1e-6, rtol=1e-4)
    for layer in range(L):
        ref = _dropped_attribution(model, tokens, layer, **kw)
        torch.testing.assert_close(star.graddrop[layer], ref, atol=1e-6, rtol=1e-4)
    assert (star.graddrop[torch.arange(L), torch.arange(L)] == 0).all()  # a head's own layer carries all it writes
    torch.testing.assert_close(star.estimate, star.graddrop.abs().sum(0) / (L - 1))
    assert (star.graddrop[1:, 0] != star.attribution[0]).any()  # the drops below change something: not vacuous


def test_graddrop_off_is_plain_attribution(deep_native):
    star = atp_star(deep_native, _tokens(), graddrop=False)
    torch.testing.assert_close(star.estimate, star.attribution.abs())


def test_hand_made_cancellation_is_found_by_graddrop_only():
    """A linear hand-made case: ``f(a) = a * (1 - w)`` with the direct path ``a`` and a later layer
    writing ``-w a``; at ``w = 1`` the two paths cancel, the gradient is 0 (AtP's false negative),
    and dropping the later layer recovers the direct path: GradDrop's |c_l| average is nonzero."""
    a = torch.tensor(2.0, requires_grad=True)
    r1 = a  # layer 0 writes a
    r2 = r1 + (-1.0 * r1)  # layer 1 writes -a: cancels
    (g_total,) = torch.autograd.grad(r2, a, retain_graph=True)
    dropped = r1 + (-1.0 * r1).detach()  # layer 1's contribution detached
    (g_drop,) = torch.autograd.grad(dropped, a)
    assert float(g_total) == 0.0 and float(g_drop) == 1.0


def test_atp_star_ranks_like_exact_sweep(deep_native):
    """Both estimates rank heads like the exact sweep on this random model (the benchmark reports
    the SmolLM2 numbers); AtP* is reported, not required, to beat AtP."""
    tokens = _tokens(n=4, T=16)
    exact = exact_sweep(deep_native, tokens)
    star = atp_star(deep_native, tokens)
    assert abs(star.clean_loss - exact.clean_loss) < 1e-5
    assert spearman(star.attribution, exact.effect) > 0.5
    assert spearman(star.signed, exact.effect) > 0.5
    assert spearman(star.estimate, exact.effect.abs()) > 0.3


def _gauss_newton_loop(model, tokens, first=0):
    """Reference for the curvature term: ``1/2 d^T G d`` of every head, exactly, one head at a
    time. ``J d`` (the first-order change of every logit when head h's z moves by ``d = -z_h``)
    comes from a double backward (``u = J^T w`` with ``create_graph``, then ``du/dw`` along ``d``),
    and ``d^T G_b d = 1/T sum_t Var_{p_t}(J_t d)`` is taken over the vocabulary directly: no
    sampling, no shared code with :func:`second_order`."""
    L, H = model.spec.n_layers, model.spec.n_heads
    zs, deltas = {}, {}

    def probe(layer):
        def hook(z, hook):
            zs[layer] = z.detach()
            deltas[layer] = torch.zeros_like(z, requires_grad=True)
            return z + deltas[layer]

        return hook

    out = torch.zeros(L, H)
    # the math kernel: the fused CPU attention kernel has no double backward
    with torch.enable_grad(), torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        logits = model.forward(tokens, fwd_hooks=[(f"blocks.{l}.attn.hook_z", probe(l)) for l in range(L)])[:, first:-1]
        p = torch.softmax(logits.detach().double(), -1)
        T = logits.shape[1]
        w = torch.zeros_like(logits, requires_grad=True)
        for layer in range(L):
            u = torch.autograd.grad(logits, deltas[layer], grad_outputs=w, create_graph=True)[0]
            for head in range(H):
                d = torch.zeros_like(zs[layer])
                d[:, :, head] = -zs[layer][:, :, head]
                jd = torch.autograd.grad(u, w, grad_outputs=d, retain_graph=True)[0].double()  # [batch, T, vocab]
                var = (p * jd**2).sum(-1) - (p * jd).sum(-1) ** 2
                out[layer, head] = 0.5 * float(var.sum(-1).mean() / T)
    return out


@pytest.mark.parametrize("name", ["deep_native", "tiny_gpt2"])
def test_second_order_curvature_equals_gauss_newton_loop(request, name):
    """The Monte-Carlo curvature agrees with the exact Gauss-Newton term of every head within its
    own standard error (many probes), and its first-order part is attribution patching."""
    model = request.getfixturevalue(name)
    tokens = _tokens(n=3, T=12)
    ref = _gauss_newton_loop(model, tokens, first=2)
    est = second_order(model, tokens, first=2, n_probes=300)
    assert (ref > 0).all()
    z = (est.curvature - ref) / est.curvature_se
    assert z.abs().max() < 4.5, z
    assert torch.allclose(est.curvature, ref, rtol=0.25, atol=1e-6)
    attr = head_importance(model, tokens, first=2).attribution
    torch.testing.assert_close(est.attribution, attr, rtol=1e-4, atol=1e-6)
    assert abs(est.clean_loss - exact_sweep(model, tokens, first=2, heads=[(0, 0)]).clean_loss) < 1e-5


def _sampled_from(model, n, T, seed=0):
    """``n`` sequences of ``T`` tokens sampled from ``model`` itself (first token uniform): on its
    own samples the model is calibrated, where the Gauss-Newton matrix is the Hessian's expectation
    (the residual term ``sum (p - e_y) d2 logits`` has mean 0). On the uniform random tokens of
    :func:`_tokens` a random model is far from its data and the Gauss-Newton term overshoots."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (n, 1), generator=g)
    with torch.no_grad():
        for _ in range(T - 1):
            p = torch.softmax(model.forward(tokens)[:, -1].float(), -1)
            tokens = torch.cat([tokens, torch.multinomial(p, 1, generator=g)], dim=1)
    return tokens


def test_second_order_is_closer_to_the_exact_effect_than_attribution(deep_native):
    """On text the model predicts as it should (its own samples) the curvature term shrinks the error
    of attribution patching against the exact sweep and ranks heads better; deterministic per seed."""
    tokens = _sampled_from(deep_native, n=8, T=32)
    exact = exact_sweep(deep_native, tokens)
    est = second_order(deep_native, tokens, n_probes=8, seed=1)
    err1 = (est.attribution - exact.effect).abs().mean()
    err2 = (est.estimate - exact.effect).abs().mean()
    assert err2 < 0.5 * err1, (err1, err2)
    assert spearman(est.estimate, exact.effect) > spearman(est.attribution, exact.effect)
    again = second_order(deep_native, tokens, n_probes=8, seed=1)
    assert torch.equal(again.estimate, est.estimate)
    with pytest.raises(ValueError):
        second_order(deep_native, tokens, n_probes=0)


def test_categorical_draws_follow_the_probabilities_and_no_device(monkeypatch):
    """Inverse-CDF draws against a numpy loop on the same CPU uniforms (also across DRAW_ROWS
    chunks), zero-probability tokens never drawn, frequencies within 4 standard errors of ``probs``,
    and the same draws for probabilities held in another dtype or on the strict second device."""
    import numpy as np
    from strict_device import DEVICE, StrictDevice

    import headprobe.analyses.attribution as attribution

    monkeypatch.setattr(attribution, "DRAW_ROWS", 3)
    probs = torch.softmax(torch.randn(7, 11, generator=torch.Generator().manual_seed(0)) * 2, dim=-1)
    probs[:, 4] = 0.0  # rows need not sum to 1
    draws = categorical_draws(probs, 5000, seed=3)
    u = torch.rand(7, 5000, generator=torch.Generator().manual_seed(3), dtype=torch.float64).numpy()
    p = probs.double().numpy()
    ref = np.stack([np.searchsorted(np.cumsum(row), ur * row.sum(), side="right") for row, ur in zip(p, u)])
    assert np.array_equal(draws.numpy(), ref)
    assert not (draws == 4).any()
    freq = torch.stack([torch.bincount(row, minlength=11) for row in draws]).double() / 5000
    want = probs.double() / probs.double().sum(-1, keepdim=True)
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / 5000).sqrt() + 1e-12).all()
    assert torch.equal(categorical_draws(probs.double(), 5000, seed=3), draws)
    with StrictDevice():
        on_device = categorical_draws(probs.to(DEVICE), 5000, seed=3)
        assert on_device.device == DEVICE
        assert torch.equal(on_device.cpu(), draws)


def test_forward_equivalents():
    assert forward_equivalents("attribution", 30) == forward_equivalents("gradient", 30) == 3
    assert forward_equivalents("atp", 30) == pytest.approx(32)
    assert forward_equivalents("atp", 1) == 3
    assert forward_equivalents("second-order", 30, n_probes=8) == 19
    with pytest.raises(ValueError):
        forward_equivalents("bogus", 3)


def test_cli_estimates_match_the_command_choices():
    from headprobe.commands.ablate import ESTIMATES

    assert ESTIMATES == ESTIMATORS


SMALL = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "--device", "cpu"]


def _text(tmp_path):
    g = torch.Generator().manual_seed(0)
    p = tmp_path / "text.txt"
    p.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (2000,), generator=g).tolist()))
    return str(p)


@pytest.mark.figures
def test_ablate_estimate_cli(tiny_dir, tmp_path):
    from headprobe.cli import main

    text = _text(tmp_path)
    out = tmp_path / "est"
    assert (
        main(["ablate", "--model", str(tiny_dir), "--out", str(out), "--text", text, "--estimate", "atp", *SMALL]) == 0
    )
    table = pd.read_csv(out / "head_ablation.csv")
    assert len(table) == 16 and not any(c.endswith("loss_delta") for c in table.columns)  # no exact effect claimed
    assert {"natural_atp_star_estimate", "repeated_atp_star_estimate", "induction_score"} <= set(table.columns)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["estimate"]["method"] == "atp" and summary["estimate"]["exact"] is False
    assert (out / "ablation_estimate.png").is_file() and not (out / "ablation_effect.png").exists()
    # AtP*'s sign is attribution patching's (same tokens): checked against the attribution estimate
    out2 = tmp_path / "attr"
    assert (
        main(
            [
                "ablate",
                "--model",
                str(tiny_dir),
                "--out",
                str(out2),
                "--text",
                text,
                "--estimate",
                "attribution",
                *SMALL,
            ]
        )
        == 0
    )
    attr = pd.read_csv(out2 / "head_ablation.csv")["natural_attribution_estimate"]
    assert ((table["natural_atp_star_estimate"] > 0) == (attr > 0)).all()
    # second order = attribution + a curvature term >= 0, on the same tokens
    out3 = tmp_path / "second"
    assert (
        main(
            [
                "ablate",
                "--model",
                str(tiny_dir),
                "--out",
                str(out3),
                "--text",
                text,
                "--estimate",
                "second-order",
                "--n-probes",
                "2",
                *SMALL,
            ]
        )
        == 0
    )
    second = pd.read_csv(out3 / "head_ablation.csv")["natural_second_order_estimate"]
    assert (second >= attr - 1e-6).all() and (second > attr).any()
    summary = json.loads((out3 / "summary.json").read_text())["estimate"]
    assert summary["n_probes"] == 2 and summary["forward_equivalents_per_task"] == 7 and summary["signed"]


def test_ablate_bad_estimate_exits_2(tiny_dir, tmp_path, capsys):
    from headprobe.cli import main

    try:
        code = main(["ablate", "--model", str(tiny_dir), "--out", str(tmp_path / "x"), "--estimate", "bogus"])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headprobe: error:") and "--estimate" in err[0], err
    assert not (tmp_path / "x").exists()


def test_the_readmes_estimate_correlations_are_the_benchmarks():
    """README's ``headprobe ablate`` line names four estimates and gave three Spearman values, which
    one was whose unsaid. Each estimate it names must carry one value, the benchmark's output recorded in
    docs/results.md (lines ``Spearman over the 60 heads: ...``), rounded: the signed estimates against
    the signed exact effect, the unsigned importance against its size."""
    import re
    from pathlib import Path

    from headprobe.analyses.vocabulary import ESTIMATORS

    root = Path(__file__).resolve().parents[1]
    lines = [
        line
        for line in (root / "docs" / "results.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("Spearman over the 60 heads:")
    ]
    patterns = {
        "second-order": r"second order vs the signed effect (-?[0-9.]+)",
        "atp": r"signed AtP\* \(AtP's sign\) vs the signed effect (-?[0-9.]+)",
        "attribution": r"attribution patching vs the signed effect (-?[0-9.]+)",
        "gradient": r"importance vs \|exact effect\| (-?[0-9.]+)",
    }
    measured = {}
    for method, pattern in patterns.items():
        found = {float(m) for line in lines for m in re.findall(pattern, line)}
        assert len(found) == 1, (method, found)  # every recorded run agrees
        measured[method] = found.pop()
    row = next(
        line for line in (root / "README.md").read_text(encoding="utf-8").splitlines() if "`headprobe ablate`" in line
    )
    named = re.search(r"--estimate ([a-z\\|-]+)`", row)
    assert named is not None and set(named.group(1).split("\\|")) == set(ESTIMATORS) == set(measured), row
    quoted = row.split("Spearman", 1)[1]
    for method, rho in measured.items():
        said = re.findall(rf"(?<![\w-]){re.escape(method)} (-?[0-9.]+)", quoted)
        assert said == [f"{rho:.2f}"], (method, said, rho)


def _documented_columns() -> dict[str, set[str]]:
    """docs/ablate.md's **Column names** table: ``{"exact": names, "estimate": names}``, ``<task>``
    written out as both tasks."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "ablate.md").read_text(encoding="utf-8")
    table = doc.split("| quantity | exact run (`ablate`) | `--estimate` run | exact? |", 1)[1].split("\n\n", 1)[0]
    out: dict[str, set[str]] = {"exact": set(), "estimate": set()}
    for row in table.strip().splitlines()[1:]:
        cells = row.strip("|").split("|")
        for kind, cell in zip(("exact", "estimate"), cells[1:3]):
            for name in re.findall(r"`([a-z_<>0-9]+)`", cell):
                out[kind] |= {name.replace("<task>", t) for t in ("natural", "repeated")}
    return out


def test_the_column_names_table_maps_an_exact_run_onto_an_estimate_run(tiny_dir, tmp_path):
    """docs/ablate.md's table names every value column of head_ablation.csv in both kinds of run,
    and its mapping holds: an exact run's ``<task>_importance`` and ``<task>_attribution`` (with
    ``--heads``: for every head) are the numbers an ``--estimate gradient`` / ``attribution`` run
    writes as ``<task>_importance_estimate`` / ``<task>_attribution_estimate`` (same tokens)."""
    from headprobe.cli import main
    from headprobe.commands.ablate_core import ESTIMATE_COLUMN

    text = _text(tmp_path)
    run = ["ablate", "--model", str(tiny_dir), "--text", text, *SMALL]
    assert main([*run, "--out", str(tmp_path / "exact"), "--heads", "0.0,1.1"]) == 0
    exact = pd.read_csv(tmp_path / "exact" / "head_ablation.csv")
    tables = {}
    for method in ("gradient", "attribution"):
        assert main([*run, "--out", str(tmp_path / method), "--estimate", method]) == 0
        tables[method] = pd.read_csv(tmp_path / method / "head_ablation.csv")
    written = {
        "exact": set(exact.columns) - {"layer", "head", "kv_head"},
        "estimate": {f"{t}_{c}" for t in ("natural", "repeated") for c in ESTIMATE_COLUMN.values()}
        | {"induction_score"},
    }
    assert _documented_columns() == written
    for task in ("natural", "repeated"):
        assert exact[f"{task}_loss_delta"].isna().sum() == 14  # --heads: two of the 16 swept
        assert exact[f"{task}_importance"].notna().all()  # the gradient columns: every head
        for method, column in (("gradient", "importance"), ("attribution", "attribution")):
            np.testing.assert_allclose(
                tables[method][f"{task}_{column}_estimate"], exact[f"{task}_{column}"], rtol=1e-6, atol=1e-9
            )
