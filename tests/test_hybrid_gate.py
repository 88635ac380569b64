"""The output gate of a hybrid Qwen3-Next (linear-attention layers among gated attention layers):
``gate_closure`` read in its attention layers against Hugging Face's own gate, and the one-line
refusals that name the hybrid, not a backend, as the reason."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import zoo

from headprobe.analyses import metrics
from headprobe.analyses.data import TokenSet
from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.core.errors import HeadprobeError


@pytest.fixture(scope="module")
def hybrid(tiny_tokenizer):
    """The tiny hybrid Qwen3-Next (layers 0 and 2 linear attention, 1 and 3 gated attention), its
    checkpoint and the native model."""
    ckpt = zoo.make_checkpoint("qwen3_next", tiny_tokenizer, **zoo.tiny("qwen3_next").hybrid)
    model = wrap(ckpt, backend="native")
    assert model.backend == "native" and model.spec.attention_layers == (1, 3)
    return ckpt, model


def _tokens():
    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 1
    return tokens


def test_gate_closure_of_a_hybrid_is_one_minus_hugging_faces_gate(hybrid):
    """Per attention layer and head, 1 - the mean of sigmoid(the gate half of Hugging Face's q_proj output,
    ``[query, gate]`` per head); the linear layers' rows NaN; no reason recorded for the column."""
    ckpt, model = hybrid
    tokens = _tokens()
    q_out = {}
    handles = [
        ckpt.hf_model.model.layers[l].self_attn.q_proj.register_forward_hook(
            lambda m, a, out, l=l: q_out.__setitem__(l, out.detach())
        )
        for l in (1, 3)
    ]
    try:
        with torch.no_grad():
            ckpt.hf_model(tokens)
    finally:
        for h in handles:
            h.remove()
    H, d = model.spec.n_heads, model.spec.d_head
    want = np.full((4, H), np.nan)
    for l, out in q_out.items():
        gate = torch.sigmoid(out.view(2, 24, H, 2 * d)[..., d:].double())
        want[l] = (1 - gate.mean(dim=(0, 1, 3))).numpy()
    scores, skipped = metrics.scan_metrics(model, TokenSet(tokens, 1, "random"), None, 1, streaming="off")
    assert "gate_closure" not in skipped
    np.testing.assert_allclose(scores["gate_closure"], want, atol=1e-5, rtol=0)
    assert np.isnan(scores["gate_closure"][[0, 2]]).all() and not np.isnan(scores["gate_closure"][[1, 3]]).any()
    assert skipped["entropy"] == metrics.HYBRID_SKIP and skipped["value_share_token0"] == metrics.HYBRID_SKIP
    assert skipped["learned_sink_mass"] == metrics.NO_SINKS


def test_a_gate_on_some_attention_layers_only_is_refused_in_one_line(hybrid, monkeypatch):
    """hook_names without layer 3's gate: refused naming both layers, not "no output gate"."""
    _, model = hybrid
    names = [n for n in model.hook_names() if n != "blocks.3.attn.hook_gate"]
    monkeypatch.setattr(model, "hook_names", lambda: names)
    with pytest.raises(HeadprobeError, match=r"attention layers \[1\] but not in \[3\]") as e:
        metrics.gate_closures(model, _tokens())
    assert "\n" not in str(e.value)


def test_streaming_on_a_native_hybrid_names_the_hybrid_not_a_backend(hybrid, tiny_tokenizer, tmp_path, capsys):
    """``scan --streaming on`` on the native hybrid: one line naming its linear-attention layers, not
    "need the native backend, not native"; the bridge's refusal still names the backend."""
    from headprobe.cli import main

    ckpt, model = hybrid
    d = tmp_path / "model"
    ckpt.hf_model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{i}" for i in range(200)))
    capsys.readouterr()
    code = main(
        [
            "scan",
            "--model",
            str(d),
            "--out",
            str(tmp_path / "scan"),
            "--text",
            str(text),
            "--seq-len",
            "24",
            "--n-natural",
            "2",
            "--n-repeated",
            "2",
            "--n-random",
            "2",
            "--device",
            "cpu",
            "--streaming",
            "on",
        ]
    )
    stderr = capsys.readouterr().err
    err = re.findall(r"headprobe: error: [^\r\n]*", stderr)  # a progress bar may share its line
    assert code == 2 and len(err) == 1 and "Traceback" not in stderr, stderr  # the other lines: progress bars
    assert err[0].startswith("headprobe: error: streaming head statistics") and "not native" not in err[0]
    assert "linear-attention layers [0, 2], lacks streams_statistics" in err[0] and "--streaming off" in err[0]
    assert not (tmp_path / "scan").exists()

    from headprobe.probe.hooks.online_stats import streaming_refusal

    class Bridge:
        name = "transformer-lens"
        streams_statistics = False

    assert "need the native backend, not transformer-lens" in streaming_refusal(Bridge())
