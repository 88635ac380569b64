"""Models split over devices (``--device-map``, ``--max-memory``; headprobe.probe.backends.devicemap).

No GPU is needed: the split is forced onto the CPU and disk (a small CPU budget puts the later
blocks in an offload folder, read back for each forward), and every number is compared with the
same model loaded whole, on both backends. The tiny GQA Llama: the embedding takes 26 KB, each
block 140 KB, so on the native backend ``cpu=200KB`` keeps block 0 in memory and offloads block 1
to disk; transformers (the bridge) keeps room for the largest layer and offloads both blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

SPLIT = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "ln_final": "cpu", "unembed": "cpu"}


@pytest.fixture(scope="module", params=["native", "transformer-lens"])
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def whole(tiny_dir, backend):
    import headprobe

    return headprobe.load_model(str(tiny_dir), quiet=True, backend=backend)


@pytest.fixture(scope="module")
def split(tiny_dir, tmp_path_factory, backend):
    import headprobe

    return headprobe.load_model(
        str(tiny_dir),
        quiet=True,
        backend=backend,
        device_map="sequential",
        max_memory={"cpu": "200KB"},
        offload_dir=str(tmp_path_factory.mktemp("offload")),
    )


def test_budget_splits_blocks_onto_disk(split, whole, backend):
    assert whole.device_map is None and split.backend == backend
    if backend == "native":
        assert split.device_map == SPLIT
    else:
        assert split.device_map["model.embed_tokens"] == "cpu" and "disk" in split.device_map.values()
    assert split.device == torch.device("cpu")
    o_proj = [p for n, p in split.model.named_parameters() if "1" in n and "o_proj" in n]
    assert o_proj and all(p.is_meta for p in o_proj)  # really offloaded: not in memory outside a forward
    assert split.n_params == whole.n_params and split.self_check.ok


def test_weights_read_outside_forward_are_real(split, whole):
    for layer in range(2):
        assert torch.equal(split.W_O(layer), whole.W_O(layer))
        assert torch.equal(split.W_Q(layer), whole.W_Q(layer))
        assert torch.equal(split.norm_weights(layer).weight, whole.norm_weights(layer).weight)
    assert torch.equal(split.W_U(), whole.W_U())


def test_logits_and_capture_equal_unsplit(split, whole):
    from headprobe.probe.hooks.capture import capture_heads

    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(split.forward(tokens), whole.forward(tokens), rtol=0, atol=1e-6)
    a, b = capture_heads(split, tokens), capture_heads(whole, tokens)
    for key in ("pattern", "result", "attn_out"):
        for layer in range(2):
            torch.testing.assert_close(a[key][layer], b[key][layer], rtol=0, atol=1e-6)


def test_exact_sweep_equals_unsplit(split, whole):
    """The sweep resumes each forward at the swept block (Block.resume, outside accelerate's forward hook)."""
    from headprobe.analyses.ablation import exact_sweep

    tokens, source = torch.randint(0, 100, (2, 3, 20), generator=torch.Generator().manual_seed(1))
    for kind in ("zero", "resample"):
        a, b = (exact_sweep(m, tokens, kind=kind, source_tokens=source, first=2) for m in (split, whole))
        assert a.clean_loss == pytest.approx(b.clean_loss, abs=1e-6)
        assert (a.effect.abs() > 1e-4).all()  # every head matters: equal effects are not vacuous
        torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=1e-6)


def test_scan_scores_equal_unsplit(split, whole):
    import headprobe

    kw = dict(n_natural=2, seq_len=24, n_repeated=2, period=8, n_random=2, k=2, pattern_len=0)
    a, b = headprobe.scan(split, **kw), headprobe.scan(whole, **kw)
    num = b.table.select_dtypes("number").columns
    assert len(num) > 5
    np.testing.assert_allclose(a.table[num].to_numpy(float), b.table[num].to_numpy(float), rtol=0, atol=1e-6)


def test_auto_and_half_precision_split(tiny_dir):
    """``auto`` on a CPU-only budget and a bfloat16 model, cast before the split (load_model)."""
    from headprobe.options import load_model

    kw = dict(device="auto", dtype="bfloat16", backend="native")
    a = load_model(str(tiny_dir), device_map="auto", max_memory="cpu=100KB", **kw)  # bfloat16: half the bytes
    b = load_model(str(tiny_dir), **kw)
    assert a.device_map == SPLIT and a.dtype == torch.bfloat16
    tokens = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.forward(tokens), b.forward(tokens))


def test_hand_map_and_everything_on_disk_but_the_embedding(tiny_dir, whole):
    import headprobe

    m = headprobe.load_model(str(tiny_dir), quiet=True, device_map={**SPLIT, "blocks.0": "disk"})
    tokens = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(m.forward(tokens), whole.forward(tokens), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(device_map=SPLIT, backend="transformer-lens"),
            "a device map given by hand names the native model's pieces",
        ),
        (dict(max_memory={"cpu": "1GB"}), "--max-memory needs --device-map"),
        (dict(device_map="everywhere"), "is not one of auto, balanced, sequential"),
        (dict(device_map="sequential", max_memory={"cpu": "10KB"}), "do not fit"),
        (dict(device_map="sequential", max_memory={"cpu": "1XB"}), "--max-memory"),
        (dict(device_map={**SPLIT, "unembed": "disk"}), "together on one device that is not disk"),
        (dict(device_map={k: v for k, v in SPLIT.items() if k != "blocks.1"}), "missing blocks.1"),
        (dict(device_map=SPLIT, max_memory={"cpu": "1GB"}), "not to a device map given by hand"),
    ],
)
def test_refusals_at_load(tiny_dir, kwargs, message):
    import headprobe
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match=message):
        headprobe.load_model(str(tiny_dir), quiet=True, **kwargs)


def test_refusals_on_a_split_model(split, tmp_path):
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="--save-pruned"):
        split.check_prunable()
    with pytest.raises(HeadprobeError, match="--save-pruned"):
        split.remove_heads(torch.ones(2, 8, dtype=torch.bool))
    if split.backend == "native":
        with pytest.raises(HeadprobeError, match="cannot be saved"):
            split.save(tmp_path / "x")
    with pytest.raises(HeadprobeError, match="keeps the dtype"):
        split.to(torch.bfloat16)
    with pytest.raises(HeadprobeError, match="split over devices already|split only as transformers loads it"):
        split.dispatch("auto")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-memory", "cpu=lots"], "bad --max-memory entry 'cpu=lots'"),
        (["--device-map", "auto", "--max-memory", "gpu0=1GB"], "bad --max-memory entry"),
        (["--max-memory", "cpu=1GB"], "--max-memory needs --device-map"),
        (["--device-map", "auto", "--save-pruned"], "--save-pruned needs the whole model on one device"),
        (["--device-map", "auto", "--device", "cpu", "--max-memory", "cpu=1GB,cpu=2GB"], "names cpu twice"),
    ],
)
def test_cli_refuses_bad_flags_in_one_line(tiny_dir, tmp_path, capsys, flags, message):
    from headprobe.cli import main

    out = tmp_path / "out"
    command = "prune" if "--save-pruned" in flags else "ablate"
    assert main([command, "--model", str(tiny_dir), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("headprobe: error:") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and not out.exists()


def test_cli_device_cuda_with_device_map_refused(tiny_dir, tmp_path, capsys):
    from headprobe.cli import main

    assert (
        main(
            ["scan", "--model", str(tiny_dir), "--out", str(tmp_path / "o"), "--device", "cuda", "--device-map", "auto"]
        )
        == 2
    )
    assert "leave --device at auto" in capsys.readouterr().err


def test_parse_max_memory():
    from headprobe.options import parse_max_memory

    assert parse_max_memory("cpu=2GiB, cuda:0=10GB,1=512MiB,disk=100000") == {
        "cpu": "2GiB",
        0: "10GB",
        1: "512MiB",
        "disk": 100000,
    }


def test_bridge_half_precision_split_refused_before_loading(tiny_dir, monkeypatch):
    from headprobe.options import load_model
    from headprobe.probe.backends import loading
    from headprobe.probe.core.errors import HeadprobeError

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(HeadprobeError, match="loads float32 only"):
        load_model(str(tiny_dir), backend="transformer-lens", device_map="auto", dtype="bfloat16")


def test_cli_ablate_split_writes_the_unsplit_table(tiny_dir, text_file, tmp_path, capsys):
    """``headprobe ablate --device-map auto --max-memory cpu=200KB``: block 1 on disk, the same table."""
    import pandas as pd

    from headprobe.cli import main

    small = [
        "--model",
        str(tiny_dir),
        "--text",
        str(text_file),
        "--seq-len",
        "16",
        "--n-natural",
        "3",
        "--n-repeated",
        "2",
        "--period",
        "6",
    ]
    assert main(["ablate", *small, "--out", str(tmp_path / "whole")]) == 0
    assert (
        main(["ablate", *small, "--out", str(tmp_path / "split"), "--device-map", "auto", "--max-memory", "cpu=200KB"])
        == 0
    )
    a, b = (pd.read_csv(tmp_path / d / "head_ablation.csv") for d in ("split", "whole"))
    num = b.select_dtypes("number").columns
    pd.testing.assert_frame_equal(a[num], b[num], rtol=0, atol=1e-6)
    assert '"device_map": "auto"' in (tmp_path / "split" / "summary.json").read_text()
    assert "on cpu, disk (--device-map) (float32)" in capsys.readouterr().out


def test_gradient_importance_equals_unsplit(split, whole):
    """A backward through offloaded blocks (Michel et al.'s importance, attribution patching)."""
    from headprobe.analyses.ablation import head_importance

    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    a, b = head_importance(split, tokens, first=2), head_importance(whole, tokens, first=2)
    assert (b.importance > 0).all()
    torch.testing.assert_close(a.importance, b.importance, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.attribution, b.attribution, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["auto", "balanced", "sequential"])
def test_every_strategy_takes_a_disk_budget(tiny_dir, strategy):
    """``disk=`` in --max-memory (the documented example) is accepted by every strategy: accelerate
    balances over real devices only, so the disk budget joins after balancing (it raised a
    RuntimeError from torch.device('disk') with auto and balanced)."""
    import headprobe
    from headprobe.probe.backends.devicemap import infer_device_map

    native = headprobe.load_model(str(tiny_dir), quiet=True, backend="native")
    assert infer_device_map(native.model, strategy, {"cpu": "200KB", "disk": "2GB"}) == SPLIT


def test_the_flags_strategies_are_the_loaders():
    """options keeps its own copy so that --help needs no torch: the two must not drift."""
    from headprobe import options
    from headprobe.probe.backends import devicemap

    assert options.DEVICE_MAPS == devicemap.DEVICE_MAPS
