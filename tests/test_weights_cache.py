"""The weights cache of dequantized GGUF checkpoints (headprobe.probe.backends.weights_cache).

The reference for every comparison is transformers' own GGUF load (``from_pretrained(dir,
gguf_file=...)``), made without headprobe's cache: a cached load must give the same tensors bit
for bit and the same token ids. Tiny tests use a 2-layer Llama GGUF written here with the
``gguf`` package (Q4_1 blocks, like SmolLM2's file, plus a byte-level BPE tokenizer); one
real-model test checks SmolLM2-135M itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from headprobe.probe.backends import weights_cache
from headprobe.probe.backends.hf_checkpoint import load_checkpoint, quiet_progress_bars

TEXTS = ["the then t e", "hello there, theta!", "<|endoftext|>the", ""]


def write_tiny_llama_gguf(
    path: Path, seed: int = 0, d: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv: int = 2, d_mlp: int = 128
) -> Path:
    """A tiny Llama GGUF: Q4_1 matrices (rows of 64, two 32-value blocks), float32 norms, a
    byte-level BPE vocabulary (GPT-2's 256 byte symbols, 4 merges, ``<|endoftext|>`` as BOS/EOS)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = [*bytes_to_unicode().values(), "th", "the", "Ġt", "Ġthe", "<|endoftext|>"]
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(d_mlp)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["t h", "th e", "Ġ t", "Ġ the"])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)

    def tensor(name, shape, quantized=True):
        a = rng.normal(0, 0.2, size=shape).astype(np.float32)
        if quantized:
            q = quantize(a, Q.Q4_1)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=Q.Q4_1)
        else:
            w.add_tensor(name, a)

    kv = n_kv * (d // n_heads)
    tensor("token_embd.weight", (len(tokens), d))
    for i in range(n_layers):
        tensor(f"blk.{i}.attn_norm.weight", (d,), quantized=False)
        tensor(f"blk.{i}.attn_q.weight", (d, d))
        tensor(f"blk.{i}.attn_k.weight", (kv, d))
        tensor(f"blk.{i}.attn_v.weight", (kv, d))
        tensor(f"blk.{i}.attn_output.weight", (d, d))
        tensor(f"blk.{i}.ffn_norm.weight", (d,), quantized=False)
        tensor(f"blk.{i}.ffn_gate.weight", (d_mlp, d))
        tensor(f"blk.{i}.ffn_up.weight", (d_mlp, d))
        tensor(f"blk.{i}.ffn_down.weight", (d, d_mlp))
    tensor("output_norm.weight", (d,), quantized=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf")


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """(hf_model, tokenizer) straight from transformers, no headprobe code involved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=tiny_gguf.name, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, dtype=torch.float32, **kw)
    return model, tok


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(weights_cache.ENV_VAR, str(root))
    return root


def assert_same(ckpt, model, tokenizer):
    """Bit-identical state dict (names, dtypes, values), the same config (read once, handed to the
    model's load) and identical token ids and special ids."""
    where = ("_name_or_path", "quantization_config")  # a cache entry's folder, its config without the GGUF's
    assert {k: v for k, v in ckpt.hf_model.config.to_dict().items() if k not in where} == {
        k: v for k, v in model.config.to_dict().items() if k not in where
    }
    got, want = ckpt.hf_model.state_dict(), model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype == torch.float32, name
        assert torch.equal(got[name], want[name]), name
    for text in TEXTS:
        for special in (True, False):
            assert (
                ckpt.tokenizer(text, add_special_tokens=special)["input_ids"]
                == tokenizer(text, add_special_tokens=special)["input_ids"]
            ), text
    assert ckpt.tokenizer.get_vocab() == tokenizer.get_vocab()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ckpt.tokenizer, attr) == getattr(tokenizer, attr), attr


def entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "gguf").iterdir() if p.is_dir())


def test_cold_then_warm_load_equals_the_uncached_load(tiny_gguf, reference, cache, capfd):
    cold = load_checkpoint(str(tiny_gguf))
    err = capfd.readouterr().err
    assert err.splitlines() == [
        f"loading {tiny_gguf}: dequantizing GGUF file {tiny_gguf.name} (first time; cached for next time) ..."
    ]
    [entry] = entries(cache)
    assert (entry / "model.safetensors").is_file() and (entry / "config.json").is_file()
    assert weights_cache.Entry(cache, tiny_gguf).problem() is None

    warm = load_checkpoint(str(tiny_gguf))
    assert capfd.readouterr().err.splitlines() == [f"loading {tiny_gguf} from cache ..."]
    assert entries(cache) == [entry]
    for ckpt in (cold, warm):
        assert_same(ckpt, *reference)
    assert warm.precision == cold.precision == f"GGUF file {tiny_gguf.name}, dequantized to float32"
    assert "quantization_config" not in json.loads((entry / "config.json").read_text())


def test_quiet_prints_nothing_and_progress_bars_are_restored(tiny_gguf, cache, capfd):
    import huggingface_hub.utils as hub_utils
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    before = (hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled(), gguf_utils.tqdm)
    load_checkpoint(str(tiny_gguf), quiet=True)  # cold
    load_checkpoint(str(tiny_gguf), quiet=True)  # warm
    assert capfd.readouterr().err == ""
    assert (hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled(), gguf_utils.tqdm) == before

    hf_logging.disable_progress_bar()  # a caller's own setting survives too
    try:
        with quiet_progress_bars():
            pass
        assert not hf_logging.is_progress_bar_enabled() and hub_utils.are_progress_bars_disabled()
    finally:
        hf_logging.enable_progress_bar()


def _damage_truncate(entry: Path) -> None:
    f = entry / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


def _damage_truncate_and_fix_manifest(entry: Path) -> None:
    """A truncated weights file whose manifest was rewritten to match: only loading it can tell."""
    _damage_truncate(entry)
    meta = json.loads((entry / "manifest.json").read_text())
    f = entry / "model.safetensors"
    meta["files"]["model.safetensors"] = {"size": f.stat().st_size, "digest": weights_cache.file_digest(f)}
    (entry / "manifest.json").write_text(json.dumps(meta))


def _damage_config(entry: Path) -> None:
    f = entry / "config.json"
    f.write_bytes(b"{" + b" " * (f.stat().st_size - 1))  # same size, other bytes


DAMAGE = {
    "truncated weights": _damage_truncate,
    "truncated weights, manifest fixed to match": _damage_truncate_and_fix_manifest,
    "config rewritten": _damage_config,
    "manifest missing": lambda entry: (entry / "manifest.json").unlink(),
    "manifest garbage": lambda entry: (entry / "manifest.json").write_text("not json"),
    "weights missing": lambda entry: (entry / "model.safetensors").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_never_used_and_is_rebuilt(damage, tiny_gguf, reference, cache, capfd, caplog):
    load_checkpoint(str(tiny_gguf), quiet=True)
    [entry] = entries(cache)
    DAMAGE[damage](entry)
    assert weights_cache.Entry(cache, tiny_gguf).problem() is not None or damage.endswith("match")

    with caplog.at_level(logging.WARNING, logger="headprobe.probe.backends.weights_cache"):
        rebuilt = load_checkpoint(str(tiny_gguf))
    assert sum("is damaged" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records) == 1, (
        caplog.text
    )
    assert "dequantizing GGUF" in capfd.readouterr().err  # built again from the GGUF file, not read from the entry
    assert_same(rebuilt, *reference)
    assert entries(cache) == [entry] and weights_cache.Entry(cache, tiny_gguf).problem() is None
    assert_same(load_checkpoint(str(tiny_gguf), quiet=True), *reference)  # and the new entry is good


def test_key_follows_file_content_and_library_versions(tiny_gguf, tmp_path, monkeypatch):
    base = weights_cache.Entry(tmp_path, tiny_gguf)
    assert weights_cache.Entry(tmp_path, tiny_gguf).path == base.path
    copy = tmp_path / "copy" / tiny_gguf.name
    copy.parent.mkdir()
    copy.write_bytes(tiny_gguf.read_bytes())
    assert weights_cache.Entry(tmp_path, copy).path == base.path  # content, not place or mtime
    (tmp_path / "other").mkdir()
    other = write_tiny_llama_gguf(tmp_path / "other" / tiny_gguf.name, seed=1)  # same name and size, other weights
    assert other.stat().st_size == tiny_gguf.stat().st_size
    assert weights_cache.Entry(tmp_path, other).path != base.path
    assert base.key["sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    for dist in weights_cache.KEY_DISTRIBUTIONS:
        real = weights_cache.versions()
        monkeypatch.setattr(
            weights_cache, "versions", lambda real=real, dist=dist: {**real, dist: real[dist] + ".post9"}
        )
        assert weights_cache.Entry(tmp_path, tiny_gguf).path != base.path, dist
        monkeypatch.undo()


def test_cache_root_location(monkeypatch, tmp_path):
    monkeypatch.delenv(weights_cache.ENV_VAR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert weights_cache.cache_root() == tmp_path / "home" / ".cache" / "headprobe"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights_cache.cache_root() == tmp_path / "xdg" / "headprobe"
    monkeypatch.setenv(weights_cache.ENV_VAR, str(tmp_path / "mine"))
    assert weights_cache.cache_root() == tmp_path / "mine"
    for off in ("off", "OFF", "0"):
        monkeypatch.setenv(weights_cache.ENV_VAR, off)
        assert weights_cache.cache_root() is None


def test_cache_off_writes_nothing(tiny_gguf, reference, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(weights_cache.ENV_VAR, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert_same(load_checkpoint(str(tiny_gguf)), *reference)
    assert "cache off" in capfd.readouterr().err
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


def test_an_unusable_cache_directory_does_not_stop_the_load(tiny_gguf, reference, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(weights_cache.ENV_VAR, str(blocker))
    with caplog.at_level(logging.WARNING, logger="headprobe.probe.backends.weights_cache"):
        ckpt = load_checkpoint(str(tiny_gguf), quiet=True)
    assert_same(ckpt, *reference)
    assert "loading without it" in caplog.text
    assert len(caplog.records) == 1, caplog.text  # not also "cannot record the load time" in the same folder
    assert blocker.read_text() == "not a directory"


def test_a_failed_write_does_not_stop_the_load(tiny_gguf, reference, cache, monkeypatch, caplog):
    """A full disk surfaces as OSError or as safetensors' own error (here from inside the write)."""
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr("safetensors.torch.save_model", full_disk)
    with caplog.at_level(logging.WARNING, logger="headprobe.probe.backends.weights_cache"):
        ckpt = load_checkpoint(str(tiny_gguf), quiet=True)
    assert_same(ckpt, *reference)
    assert "cannot write the weights cache entry" in caplog.text
    assert entries(cache) == [] and not any(p.name.endswith(".tmp") for p in (cache / "gguf").iterdir())


CHILD = textwrap.dedent("""
    import hashlib, os, pathlib, sys, time
    import headprobe.probe.backends.hf_checkpoint as hf_checkpoint
    import transformers.modeling_gguf_pytorch_utils, transformers.models.llama.modeling_llama  # imports before the race

    build = hf_checkpoint._load_hf
    def slow_build(*args, **kwargs):  # hold the lock long enough for the other process to meet it
        out = build(*args, **kwargs)
        if kwargs.get("gguf_file"):
            time.sleep(3)
        return out
    hf_checkpoint._load_hf = slow_build
    barrier = pathlib.Path(sys.argv[2])  # both processes start loading once both have imported everything
    (barrier / str(os.getpid())).touch()
    while len(list(barrier.iterdir())) < 2:
        time.sleep(0.01)
    ckpt = hf_checkpoint.load_checkpoint(sys.argv[1])
    h = hashlib.sha256()
    for name, t in sorted(ckpt.hf_model.state_dict().items()):
        h.update(name.encode()); h.update(t.numpy().tobytes())
    print(h.hexdigest(), ckpt.tokenizer("the then")["input_ids"])
""")


def test_two_concurrent_cold_loads_both_succeed_and_leave_one_entry(tiny_gguf, reference, cache, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, weights_cache.ENV_VAR: str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tiny_gguf), str(barrier)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert outs[0][0] == outs[1][0]  # same tensors and token ids in both processes
    errs = sorted(err for _, err in outs)
    assert sum("dequantizing GGUF" in e for e in errs) == 1, errs  # built once ...
    assert sum("waiting for another process" in e and "from cache" in e for e in errs) == 1, errs  # ... read once
    [entry] = entries(cache)
    assert [p.name for p in (cache / "gguf").iterdir() if p.name.endswith((".tmp", ".trash"))] == []
    assert weights_cache.Entry(cache, tiny_gguf).problem() is None
    assert_same(load_checkpoint(str(tiny_gguf), quiet=True), *reference)


@pytest.mark.real_model
def test_smollm2_cached_load_equals_the_uncached_load(smollm2_checkpoint, tmp_path, monkeypatch, capfd):
    """SmolLM2-135M through an empty cache (a real GGUF parse, whatever the session fixture came
    from) and back from it: both bit-identical to the session's checkpoint."""
    import gguf

    from headprobe.probe.backends.loading import SMOLLM2_PRECISION

    monkeypatch.setenv(weights_cache.ENV_VAR, str(tmp_path))
    ref = smollm2_checkpoint
    reads = []  # transformers parsed the file for the tokenizer, the config and the weights: 37 s, not 13
    monkeypatch.setattr(
        gguf, "GGUFReader", lambda path, *a, _read=gguf.GGUFReader: reads.append(path) or _read(path, *a)
    )
    capfd.readouterr()
    cold = load_checkpoint("smollm2-135m")
    assert capfd.readouterr().err.splitlines() == [
        "loading smollm2-135m: dequantizing 4-bit GGUF (first time; cached for next time) ..."
    ]  # no time measured in this cache yet
    assert len(reads) == 1, reads
    assert gguf.get_tensor_name_map is gguf.tensor_mapping.get_tensor_name_map  # restored after the load
    assert_same(cold, ref.hf_model, ref.tokenizer)
    del cold
    t0 = time.perf_counter()
    warm = load_checkpoint("smollm2-135m")
    seconds = time.perf_counter() - t0
    assert capfd.readouterr().err.splitlines() == ["loading smollm2-135m from cache ..."]
    assert_same(warm, ref.hf_model, ref.tokenizer)
    assert warm.precision == ref.precision == SMOLLM2_PRECISION
    assert warm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    ) == ref.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    print(f"warm load_checkpoint: {seconds:.2f} s")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_finite_weights_fast_path_agrees_with_isfinite(dtype):
    """The sum-based shortcut must name the same parameter as the element-wise check, and must not
    flag finite weights whose sum overflows."""
    from headprobe.probe.backends.hf_checkpoint import check_finite_weights
    from headprobe.probe.core.errors import HeadprobeError

    big = torch.finfo(dtype).max
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(dtype)
    with torch.no_grad():
        model[0].weight.fill_(big)  # finite, but the sum overflows to inf
        model[1].weight[1, 2] = float("inf")
        model[1].weight[3, 0] = -float("inf")  # their sum is NaN
    check_finite_weights(model[0])
    expected = next(n for n, p in model.named_parameters() if not torch.isfinite(p).all())
    with pytest.raises(HeadprobeError, match=rf"parameter {expected} holds NaN or Inf"):
        check_finite_weights(model)
    with torch.no_grad():
        model[1].weight.fill_(0)
        model[2].bias[0] = float("nan")
    with pytest.raises(HeadprobeError, match=r"parameter 2\.bias holds"):
        check_finite_weights(model)


@pytest.mark.parametrize("backend", ["native", "auto", "transformer-lens"])
def test_models_from_cold_and_warm_loads_compute_the_same_logits(backend, tiny_gguf, cache, monkeypatch):
    """Config fields (rotary base, norm epsilon, tied embeddings) survive the cache: both
    backends give bit-identical logits and self-checks for the GGUF load and the cached one. A
    warm native load reads the entry directly (no Hugging Face model is built: load_checkpoint
    is not called) and gives the same tokenizer too."""
    from headprobe.probe.backends import loading
    from headprobe.probe.backends.hf_checkpoint import NATIVE_SOURCE_FILE
    from headprobe.probe.backends.loading import load_model

    cold = load_model(str(tiny_gguf), backend=backend, quiet=True)
    assert weights_cache.Entry(cache, tiny_gguf).problem() is None
    if backend != "transformer-lens":
        assert (weights_cache.Entry(cache, tiny_gguf).path / NATIVE_SOURCE_FILE).is_file()
        monkeypatch.setattr(
            loading, "load_checkpoint", lambda *a, **k: pytest.fail("the warm native load built the HF model")
        )
    warm = load_model(str(tiny_gguf), backend=backend, quiet=True)
    for text in TEXTS:
        for special in (True, False):
            assert (
                warm.tokenizer(text, add_special_tokens=special)["input_ids"]
                == cold.tokenizer(text, add_special_tokens=special)["input_ids"]
            ), text
    attrs = ("bos_token_id", "eos_token_id", "unk_token_id", "all_special_ids")
    for attr in attrs if backend == "transformer-lens" else (*attrs, "pad_token_id"):  # the bridge sets a pad token
        assert getattr(warm.tokenizer, attr) == getattr(cold.tokenizer, attr), attr
    tokens = cold.to_tokens("the then the t e h")  # [1, pos]
    assert torch.equal(tokens, warm.to_tokens("the then the t e h"))
    with torch.no_grad():
        assert torch.equal(cold.forward(tokens), warm.forward(tokens))
    assert cold.spec == warm.spec and cold.self_check.decomposition_ok and warm.self_check.decomposition_ok


def test_a_failed_fast_load_says_so_unless_quiet(tiny_gguf, cache, monkeypatch, caplog):
    """A warm native load that fails falls back to the usual load (the same model). Its warning
    ignored ``quiet``, which silences every other load message; with ``quiet`` it is a debug
    record now, and without it the one warning it was."""
    from headprobe.probe.backends.loading import load_model
    from headprobe.probe.model import convert

    reference = load_model(str(tiny_gguf), backend="native", quiet=True)  # cold: fills the entry
    tokens = reference.to_tokens("the then the t e h")

    def broken(*args, **kwargs):
        raise ValueError("unreadable native description")

    monkeypatch.setattr(convert.NativeSource, "from_json", broken)

    def fast_load_records(quiet: bool) -> list[int]:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="headprobe.probe.backends.loading"):
            model = load_model(str(tiny_gguf), backend="native", quiet=quiet)
        with torch.no_grad():
            assert torch.equal(model.forward(tokens), reference.forward(tokens))  # the usual way's model
        return [r.levelno for r in caplog.records if "fast load of" in r.getMessage()]

    assert fast_load_records(quiet=True) == [logging.DEBUG]
    assert fast_load_records(quiet=False) == [logging.WARNING]


def test_a_cold_native_load_keeps_one_copy_of_the_weights(tiny_gguf, cache, monkeypatch):
    """load_model hands the checkpoint over: the native model takes the Hugging Face model's
    tensors themselves (no second copy of the weights is ever alive, benchmarks/memory.py) and
    the Hugging Face model is gone once the load returns. wrap's default still copies."""
    import gc
    import weakref

    from headprobe.probe.backends import loading

    seen = {}
    real = loading.load_checkpoint

    def spy(*args, **kwargs):
        ckpt = real(*args, **kwargs)
        seen["ref"] = weakref.ref(ckpt.hf_model)
        seen["ptrs"] = {p.data_ptr() for p in ckpt.hf_model.parameters()}
        return ckpt

    monkeypatch.setattr(loading, "load_checkpoint", spy)
    model = loading.load_model(str(tiny_gguf), backend="native", quiet=True)
    gc.collect()
    assert seen["ref"]() is None, "the Hugging Face model outlived the load"
    params = list(model.model.parameters())
    assert params and all(p.data_ptr() in seen["ptrs"] for p in params), "the weights were copied"

    ckpt = real(str(tiny_gguf), quiet=True)
    copied = loading.wrap(ckpt, backend="native")  # the caller keeps its model: nothing shared
    hf_ptrs = {p.data_ptr() for p in ckpt.hf_model.parameters()}
    assert not any(p.data_ptr() in hf_ptrs for p in copied.model.parameters())


def test_a_warm_native_model_owns_its_weights(tiny_gguf, cache):
    """A warm native load maps the entry's safetensors file copy-on-write: changing a weight in
    place (as pruning or a user might) changes the model only, never the cache file, and the
    next load reads the original weights."""
    from headprobe.probe.backends.loading import load_model

    load_model(str(tiny_gguf), backend="native", quiet=True)  # cold: fills the cache
    weights = weights_cache.Entry(cache, tiny_gguf).path / "model.safetensors"
    before = weights_cache.sha256_file(weights)
    model = load_model(str(tiny_gguf), backend="native", quiet=True)
    W = model.model.blocks[0].attn.q_proj.weight
    original = W.detach().clone()
    with torch.no_grad():
        W.mul_(2).add_(1)
    assert torch.equal(W, original * 2 + 1)
    assert weights_cache.sha256_file(weights) == before
    again = load_model(str(tiny_gguf), backend="native", quiet=True)
    assert torch.equal(again.model.blocks[0].attn.q_proj.weight, original)


@pytest.mark.parametrize("clock", ["real", "fast"])
def test_a_cold_load_states_the_time_the_last_one_took_here(tiny_gguf, cache, capfd, monkeypatch, clock):
    """No fixed '~30 s' (a loaded machine took 168 s): the first cold load in a cache states no time,
    and records the one it measured (within the call's own wall time); the next cold load of the
    file (here: its entry deleted) states that recorded time, and records its own. ``fast``: a
    clock on which the load takes 3 ms (a fast idle machine) still records and states a time > 0."""
    import json
    import shutil

    if clock == "fast":  # every perf_counter() call advances 1 ms
        ticks = iter(range(10**9))
        monkeypatch.setattr(weights_cache.time, "perf_counter", lambda: next(ticks) / 1000)
    t0 = time.perf_counter()
    load_checkpoint(str(tiny_gguf))
    wall = time.perf_counter() - t0
    assert "(first time; cached for next time)" in capfd.readouterr().err
    recorded = json.loads((cache / weights_cache.LOAD_TIMES).read_text())[tiny_gguf.name]
    assert 0 < recorded <= wall + 0.05
    for entry in entries(cache):
        shutil.rmtree(entry)
    load_checkpoint(str(tiny_gguf))
    stated = weights_cache.format_seconds(recorded)
    assert f"(first time, last took {stated} here; cached for next time)" in capfd.readouterr().err
    assert stated != "0 s" and (clock == "real" or stated == "under 0.1 s")
    assert (cache / weights_cache.LOAD_TIMES).is_file()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (168.4, "168 s"),
        (10.0, "10 s"),
        (9.96, "10 s"),
        (9.94, "9.9 s"),
        (2.54, "2.5 s"),
        (0.1, "0.1 s"),
        (0.05, "0.1 s"),
        (0.04, "under 0.1 s"),
        (1e-4, "under 0.1 s"),
    ],
)
def test_load_times_read_as_a_person_reads_them(seconds, text):
    assert weights_cache.format_seconds(seconds) == text
