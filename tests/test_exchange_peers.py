"""Head files the field publishes, read by headprobe as their own tools read them.

DuoAttention's six published patterns (tests/data/duo, MIT, copied from mit-han-lab/duo-attention at
fe93c31) must give the KV groups DuoAttention keeps full: ``load_attn_pattern`` (``duo_attn/utils.py``)
reads ``np.loadtxt(..., delimiter="\\t")`` and clips to [0, 1], and its eval patch keeps a group full
where ``full_attention_heads > 0.5`` (``duo_attn/patch/llama.py`` line 187, ``mistral.py`` line 187,
``patch/utils.py`` lines 17 and 41). kvpress's ``DuoAttentionPress`` (NVIDIA/kvpress 8bb29b9,
``kvpress/presses/duo_attention_press.py``) reads the same file, clipped, and streams the
``round(size * head_compression_ratio)`` lowest groups (``np.argsort``). HeadKV (FYYFU/HeadKV 0862a09,
``headkv/snapkv_utils.py`` lines 379-385) reads ``json.loads(file.readline())``, the mean of each list in
the file's key order, reshaped to ``[layers, heads]``.

Those rules are written here again, independently of headprobe's code, from the lines cited; the
models' layouts (layers x KV heads) are the published configs', typed in by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from headprobe.analyses.exchange import Layout, read_head_file
from headprobe.probe.core.errors import HeadprobeError

DUO = Path(__file__).parent / "data" / "duo"

# model folder -> (layers, query heads, KV heads): the Hugging Face configs' num_hidden_layers,
# num_attention_heads, num_key_value_heads
LAYOUTS = {
    "Llama-2-7B-32K-Instruct": (32, 32, 32),
    "Llama-3-8B-Instruct-Gradient-1048k": (32, 32, 8),
    "Llama-3-8B-Instruct-Gradient-4194k": (32, 32, 8),
    "Meta-Llama-3.1-8B-Instruct": (32, 32, 8),
    "Mistral-7B-Instruct-v0.2": (32, 32, 8),
    "Mistral-7B-Instruct-v0.3": (32, 32, 8),
}


def _plain_values(path: Path) -> list[list[float]]:
    """The TSV as DuoAttention's loader gives it, by plain Python: rows of tab-separated floats, clipped to [0, 1]."""
    rows = [[float(x) for x in line.split("\t")] for line in path.read_text().splitlines() if line.strip()]
    return [[min(1.0, max(0.0, v)) for v in row] for row in rows]


def _duo_full_groups(values: list[list[float]]) -> set[tuple[int, int]]:
    """DuoAttention's eval patch: a KV group is full where its (clipped) value is > 0.5."""
    return {(layer, g) for layer, row in enumerate(values) for g, v in enumerate(row) if v > 0.5}


def _layout(name: str) -> Layout:
    n_layers, n_heads, n_kv = LAYOUTS[name]
    return Layout(name, n_layers, n_heads, n_kv, n_kv)


def test_the_six_patterns_are_all_here():
    assert sorted(p.name for p in DUO.iterdir() if p.is_dir()) == sorted(LAYOUTS)
    assert (DUO / "LICENSE").read_text().startswith("MIT License")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_duo_published_pattern_gives_duoattentions_own_heads(name):
    """Every published pattern imports, its heads are the query heads of the groups DuoAttention keeps
    full (> 0.5 after clipping; 2 of the files hold a group at exactly 0.5, which streams), its scores are
    the clipped values and its policy streams the rest with config.json's sink and recent sizes."""
    n_layers, n_heads, n_kv = LAYOUTS[name]
    values = _plain_values(DUO / name / "full_attention_heads.tsv")
    assert (len(values), len(values[0])) == (n_layers, n_kv)
    full = _duo_full_groups(values)
    size = n_heads // n_kv
    want = sorted((layer, g * size + i) for layer, g in full for i in range(size))

    got = read_head_file(DUO / name, _layout(name), k=10)
    assert got.kind == "duo" and got.heads == want
    assert got.scores == {(layer, g): v for layer, row in enumerate(values) for g, v in enumerate(row)}
    config = json.loads((DUO / name / "config.json").read_text())
    assert got.policy is not None and set(got.policy.full_groups) == full
    streaming = {s for row in got.policy.groups for s in row if s is not None}
    assert {(s.sink, s.window) for s in streaming} == {(config["sink_size"], config["recent_size"])}


def test_duo_patterns_hold_what_the_readers_must_clip_and_a_tie_at_the_threshold():
    """The data the test above is about: five files go below 0 (clipped by DuoAttention and kvpress), and
    two hold a group at exactly 0.5 (streaming under ``> 0.5``, full under ``>= 0.5``)."""
    raw = {
        n: [
            [float(x) for x in line.split("\t")]
            for line in (DUO / n / "full_attention_heads.tsv").read_text().splitlines()
        ]
        for n in LAYOUTS
    }
    below = {n for n, rows in raw.items() if min(map(min, rows)) < 0}
    at_half = {n for n, rows in raw.items() if any(v == 0.5 for row in rows for v in row)}
    assert len(below) == 5 and min(min(map(min, rows)) for rows in raw.values()) > -0.01
    assert at_half == {"Llama-2-7B-32K-Instruct", "Llama-3-8B-Instruct-Gradient-1048k"}


def _kvpress_load(directory: Path):
    """kvpress ``DuoAttentionPress.load_attention_pattern`` with the HTTP GET replaced by a local read."""
    from io import StringIO

    config = json.loads((directory / "config.json").read_text())
    head_scores = np.loadtxt(
        StringIO((directory / "full_attention_heads.tsv").read_text()), dtype=float, delimiter="\t"
    )
    head_scores = np.clip(head_scores, 0, 1)
    return config["sink_size"], config["recent_size"], head_scores


def _kvpress_streaming(head_scores: np.ndarray, head_compression_ratio: float) -> set[tuple[int, int]]:
    """kvpress ``post_init_from_model``: the ``round(size * ratio)`` lowest-scored groups stream."""
    n_pruned = round(head_scores.size * head_compression_ratio)
    indices = np.argsort(head_scores, axis=None)[:n_pruned]
    return {(int(a), int(b)) for a, b in zip(*np.unravel_index(indices, head_scores.shape))}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_kvpress_reads_the_published_patterns_as_headprobe_does(name):
    """kvpress's scores are headprobe's, and kvpress at the compression ratio of headprobe's policy
    streams exactly the groups headprobe streams."""
    sink, recent, scores = _kvpress_load(DUO / name)
    got = read_head_file(DUO / name / "full_attention_heads.tsv", _layout(name), k=10)
    assert got.scores == {
        (layer, g): float(scores[layer, g]) for layer in range(scores.shape[0]) for g in range(scores.shape[1])
    }
    assert got.policy is not None
    stream = {(layer, g) for layer, row in enumerate(got.policy.groups) for g, s in enumerate(row) if s is not None}
    assert _kvpress_streaming(scores, len(stream) / scores.size) == stream
    assert {(s.sink, s.window) for row in got.policy.groups for s in row if s is not None} == {(sink, recent)}


# ---- the edges of the rule: clipping, refusals, the threshold ----------------------------------------------


def _tsv(tmp_path: Path, rows: list[list[float | str]]) -> Path:
    path = tmp_path / "full_attention_heads.tsv"
    path.write_text("".join("\t".join(str(v) for v in row) + "\n" for row in rows))
    return path


def test_duo_overshoot_is_clipped_and_a_group_at_one_half_streams(tmp_path):
    """-0.005 and 1.005 are a trained gate's overshoot: clipped to 0 and 1; 0.5 streams, 0.5000001 is full."""
    path = _tsv(tmp_path, [[-0.005, 1.005], [0.5, 0.5000001]])
    got = read_head_file(path, Layout("m", 2, 4, 2, 2), k=1)
    assert got.scores == {(0, 0): 0.0, (0, 1): 1.0, (1, 0): 0.5, (1, 1): 0.5000001}
    assert got.heads == [(0, 2), (0, 3), (1, 2), (1, 3)]


@pytest.mark.parametrize(
    "bad, says",
    [
        (-0.02, "-0.02, outside [-0.01, 1.01]"),
        (1.5, "1.5, outside [-0.01, 1.01]"),
        ("nan", "NaN or infinite"),
        ("inf", "NaN or infinite"),
    ],
)
def test_duo_values_that_are_no_gate_are_refused_in_one_line(tmp_path, bad, says):
    path = _tsv(tmp_path, [[0.2, bad], [0.9, 0.1]])
    with pytest.raises(HeadprobeError, match=r"full_attention_heads.tsv holds") as e:
        read_head_file(path, Layout("m", 2, 4, 2, 2), k=1)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_import_refuses_a_nan_pattern_before_loading(tmp_path, capsys):
    """On the command line: exit 2, one ``headprobe: error:`` line, from the embedded model's config."""
    from headprobe.cli import main

    path = _tsv(tmp_path, [[0.2, 0.3, float("nan")]] * 30)
    code = main(["import", "--heads-file", str(path), "--model", "smollm2-135m"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("headprobe: error: full_attention_heads.tsv holds NaN")


def test_a_kv_policy_exported_for_duoattention_keeps_its_full_groups(tmp_path):
    """Export writes a policy as 1 (full) / 0 (streaming) and states DuoAttention's rule; read back under
    ``> 0.5``, the same groups are full."""
    from headprobe.analyses import exchange as ex
    from headprobe.probe.layout.attention import KVPolicy, Streaming

    policy = KVPolicy.with_full(3, 2, [(0, 1), (2, 0), (2, 1)], Streaming(4, 8), model="m")
    values, sink, window = ex.policy_values(policy)
    (tmp_path / ex.DUO_TSV).write_text(ex.duo_text(values))
    config = ex.duo_config(sink, window, {"model": "m"}, "test")
    (tmp_path / ex.DUO_CONFIG).write_text(json.dumps(config))
    assert config["headprobe"]["full_cache"] == "value > 0.5"
    back = read_head_file(tmp_path, Layout("m", 3, 4, 2, 2), k=1)
    assert back.policy is not None and back.policy.groups == policy.groups
    assert _duo_full_groups(_plain_values(tmp_path / ex.DUO_TSV)) == set(policy.full_groups)


# ---- HeadKV --------------------------------------------------------------------------------------------------


def _headkv_load(path: Path, num_hidden_layers: int, num_attention_heads: int) -> np.ndarray:
    """HeadKV's reader (snapkv_utils.py 379-385, temperature 1): the mean of each list in the file's
    order, normalised to sum 1, reshaped to ``[layers, heads]`` (the key is not read)."""
    with open(path) as file:
        head_list = json.loads(file.readline())
    head_score_list = np.array([np.mean(l[1]) for l in head_list.items()])
    head_score_list = head_score_list / head_score_list.sum()
    return head_score_list.reshape(num_hidden_layers, num_attention_heads)


def test_headkv_reads_headprobes_file_on_the_right_heads(tmp_path):
    """HeadKV places scores by position, not by key: headprobe's file (layer-major, every head, 10 layers
    so that "10-0" sorts after "9-3", not after "1-3") puts each head's score where HeadKV reads it, and
    headprobe reads HeadKV's layout (one line, per-sample 0/1 lists) back as each head's mean."""
    from headprobe.analyses import exchange as ex

    rng = np.random.default_rng(0)
    samples = {(layer, h): rng.integers(0, 2, 7).tolist() for layer in range(10) for h in range(4)}
    samples[(3, 1)] = [1] * 7  # the top head
    path = tmp_path / "m.json"
    path.write_text(ex.headkv_text(samples))
    assert len(path.read_text().splitlines()) == 1
    theirs = _headkv_load(path, 10, 4)
    means = np.array([[np.mean(samples[(layer, h)]) for h in range(4)] for layer in range(10)])
    np.testing.assert_allclose(theirs, means / means.sum(), rtol=0, atol=1e-12)
    got = read_head_file(path, Layout("m", 10, 4, 4, 4), k=1)
    assert got.heads == [(3, 1)]
    np.testing.assert_allclose([[got.scores[(layer, h)] for h in range(4)] for layer in range(10)], means, atol=1e-12)
