"""``--text FILE``: a large file is read only as far as the token sets need (bounded memory and
time, measured in a subprocess with resource.getrusage), a normal-size one whole as before (the
same windows as its text as a string); binary, non-UTF-8, non-regular and, for files read whole,
too large files are refused with one line before any model loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from headprobe.analyses.data import natural_text_tokens
from headprobe.cli import main
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import WHOLE_TEXT_BYTES, open_text_file, read_text_file


def _words(n_words: int, seed: int = 0) -> str:
    """``n_words`` of the tiny tokenizer's vocabulary (t0 .. t99), 20 to a line."""
    words = np.array([f"t{i}" for i in range(100)])[np.random.default_rng(seed).integers(0, 100, n_words)]
    return "\n".join(" ".join(line) for line in words.reshape(-1, 20)) + "\n"


def test_pieces_join_to_the_file_and_end_at_line_breaks(tmp_path):
    """Multi-byte characters cut by the piece boundaries decode as in the whole file."""
    text = "".join(f"caf\u00e9 \u20ac{i} \U0001f600\n" if i % 3 else f"\u00fcber{i} " for i in range(400))
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    f = open_text_file(path)
    for piece_bytes in (7, 64, 1000):
        pieces = list(f.pieces(piece_bytes=piece_bytes))
        assert "".join(p for p, _ in pieces) == text == f.read()
        assert all(p.endswith(("\n", " ")) for p, _ in pieces[:-1])
        assert pieces[-1][1] == len(text.encode()) and [r for _, r in pieces] == sorted(r for _, r in pieces)
    capped = "".join(p for p, _ in f.pieces(piece_bytes=64, max_bytes=640))
    assert text.startswith(capped) and 600 <= len(capped.encode()) <= 640


@pytest.mark.parametrize(
    "data, piece_bytes, what, at",
    [
        (b"ok\n" * 10 + b"caf\xe9 x", 4, "not UTF-8 (byte {} is invalid)", 33),  # a Latin-1 byte
        (b"ok\n" * 10 + b"\xe2\x82", 7, "not UTF-8 (byte {} is invalid)", 30),  # a sequence the file cuts off
        (b"ok\n" * 10 + b"\xe2\x82\xac\xe2\x28", 31, "not UTF-8 (byte {} is invalid)", 33),  # valid euro, then not
        (b"abc\n" * 5 + b"\x00\x01\x02", 3, "NUL byte at byte {}: a binary file", 20),
        ("\ufeffhello".encode("utf-16-le"), 4, "NUL byte at byte {}", 3),  # UTF-16: FF FE 68 00
    ],
)
def test_binary_and_non_utf8_bytes_are_named_wherever_the_pieces_cut(data, piece_bytes, what, at, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    with pytest.raises(HeadprobeError, match=re.escape(what.format(at))):
        open_text_file(path)
    big = tmp_path / "big.txt"  # the same bytes after 1 MiB of good text: found as they are read
    big.write_bytes(b"x\n" * (WHOLE_TEXT_BYTES // 2) + data)
    f = open_text_file(big)
    with pytest.raises(HeadprobeError, match=re.escape(what.format(WHOLE_TEXT_BYTES + at))):
        for _ in f.pieces(piece_bytes=piece_bytes * 4099):
            pass


def test_a_normal_size_file_gives_the_windows_of_its_text(tiny_llama_gqa_native, tmp_path):
    """Up to WHOLE_TEXT_BYTES a file is tokenized whole: the windows of the same text as a string
    (what every command did before, so earlier results stay the same)."""
    text = _words(180_000)  # ~0.8 MiB
    assert len(text.encode()) < WHOLE_TEXT_BYTES
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    got = natural_text_tokens(tiny_llama_gqa_native, 8, 64, seed=3, text=open_text_file(path), source=str(path))
    ref = natural_text_tokens(tiny_llama_gqa_native, 8, 64, seed=3, text=text, source=str(path))
    assert got.tokens.tolist() == ref.tokens.tolist() and got.n_available == ref.n_available > 1000
    assert got.source == str(path)


def _big_file(path, mib: int) -> int:
    """``mib`` MiB of the tiny tokenizer's words, written in a second or so; returns the size."""
    block = _words(250_000).encode()  # ~1 MiB
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)
    return path.stat().st_size


MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    import headprobe
    from headprobe.analyses.data import natural_text_tokens
    from headprobe.probe.core.io import open_text_file

    model = headprobe.load_model(sys.argv[1], device="cpu", quiet=True)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    ts = natural_text_tokens(model, 8, 128, seed=0, text=open_text_file(sys.argv[2]), source=sys.argv[2])
    print(json.dumps({"seconds": time.perf_counter() - t0, "kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0,
                      "tokens": ts.tokens.tolist(), "source": ts.source, "n_available": ts.n_available}))
""")


def test_a_large_file_is_read_only_as_far_as_needed(tiny_dir, tiny_tokenizer, tmp_path):
    """A 96 MiB file (whole, tokenizing it took ~150 bytes of memory per byte of text: 3.1 GB for 20 MB)
    for 8 windows of 128 tokens: measured in a child process, whose address space is capped so that a
    regression ends there instead of in the machine's memory."""
    path = tmp_path / "big.txt"
    size = _big_file(path, 96)
    cap = 6 << 30

    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    try:
        p = subprocess.run(
            [sys.executable, "-c", MEASURE, str(tiny_dir), str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=limit,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"},
        )
        with open(path, "rb") as f:
            head = f.read(1 << 20).decode()
    finally:
        path.unlink()  # pytest keeps its last temporary directories: not 96 MiB of them
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["seconds"] < 5 and got["kib"] < 100 * 1024, got  # bounded: it reads ~64 KiB, whatever the size
    assert f"of {size / 2**20:.1f} MiB" in got["source"] and "first" in got["source"]
    # the windows are token runs of the file's beginning, non-overlapping, drawn from more than 8
    ref = tiny_tokenizer(head, add_special_tokens=False)["input_ids"]
    body = 127  # after BOS
    starts = []
    for row in got["tokens"]:
        assert row[0] == tiny_tokenizer.bos_token_id and len(row) == 128
        hits = [i for i in range(0, len(ref) - body, body) if ref[i : i + body] == row[1:]]
        assert hits, "a window that is no run of the file's tokens"
        starts.append(hits[0])
    assert len(set(starts)) == 8 and got["n_available"] >= 8 * 8


def _cli_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_text_files_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from headprobe.probe.backends import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "bin").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "latin1.txt").write_bytes("na\u00efve caf\u00e9\n".encode("latin-1"))
    os.mkfifo(tmp_path / "fifo")
    for name, fragment in [
        ("bin", "NUL byte at byte 0"),
        ("latin1.txt", "not UTF-8 (byte 2 is invalid)"),
        ("fifo", "not a regular file"),
    ]:
        for command in ("scan", "ablate", "prune"):
            out = tmp_path / f"out-{command}"
            line = _cli_error([command, "--text", str(tmp_path / name), "--out", str(out)], capsys)
            assert fragment in line and str(tmp_path / name) in line, line
            assert not out.exists()


def test_files_read_whole_refuse_a_too_large_one(tmp_path, capsys):
    big = tmp_path / "pairs.jsonl"
    big.write_bytes(b'{"clean": "a", "corrupted": "b", "correct": " c", "wrong": " d"}\n' * 300_000)  # 19 MB
    with pytest.raises(HeadprobeError, match=r"is 18\.\d MiB; at most 16 MiB is read whole"):
        read_text_file(big)
    line = _cli_error(["patch", "--prompts", str(big), "--out", str(tmp_path / "o")], capsys)
    assert "at most 16 MiB" in line and not (tmp_path / "o").exists()


def _scan_text(tiny_dir, tmp_path, capsys, text: str, n_natural: int) -> tuple[dict, list[str]]:
    """A quick scan of ``text`` in 16-token windows (15 text tokens): summary.json's
    ``natural_text`` and the NOTE lines the run printed."""
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    argv = ["scan", "--model", str(tiny_dir), "--text", str(path), "--n-natural", str(n_natural), "--seq-len", "16"]
    argv += ["--n-repeated", "2", "--period", "4", "--no-verify", "--no-metrics", "--formats", "none"]
    assert main([*argv, "--out", str(out)]) == 0
    said = capsys.readouterr()
    natural = json.loads((out / "summary.json").read_text())["tokens"]["natural_text"]
    return natural, [line for line in (said.out + said.err).splitlines() if line.startswith("NOTE:")]


def test_scan_says_when_the_text_holds_fewer_windows_than_n_natural(tiny_dir, tmp_path, capsys):
    """A text of 6 windows asked for 20: the run scores the 6 it has and says so on the terminal
    and in summary.json (``requested`` beside ``sequences``), instead of silently using fewer."""
    natural, notes = _scan_text(tiny_dir, tmp_path, capsys, _words(100), n_natural=20)
    windows = natural["windows_available"]
    assert natural["sequences"] == windows < 20 and natural["requested"] == 20
    notes = [line for line in notes if "--n-natural" in line]
    assert len(notes) == 1 and f"{windows} natural-text sequences scored, not the 20 asked for" in notes[0], notes


def test_scan_says_how_many_windows_it_left_out_as_mostly_one_token(tiny_dir, tmp_path, capsys):
    """100 words, then 60 times one word, in 15-token windows: windows 7-9 are that word alone (window
    6 is 5 of it in 15), so the scan says it left 3 of 10 out (terminal and summary.json's
    ``windows_left_out``) and draws from the other 7."""
    text = _words(100) + " ".join(["t1"] * 60) + "\n"
    natural, notes = _scan_text(tiny_dir, tmp_path, capsys, text, n_natural=3)
    assert (natural["windows_left_out"], natural["windows_available"], natural["sequences"]) == (3, 7, 3)
    notes = [line for line in notes if "left out" in line]
    assert len(notes) == 1 and "3 of the text's 10 windows left out" in notes[0], notes


def test_windows_mostly_one_token_are_left_out_and_the_others_drawn_as_before(tiny_llama_gqa_native):
    """Under WordPiece a reStructuredText underline is one token per character: all-MiniLM's default
    natural text held a window 88% '-'. A window more than half one token is left out (counted in
    ``n_skipped``, never drawn); the windows drawn are the seed's permutation with those passed
    over, so a text without such windows gives exactly the windows it always did."""
    from collections import Counter

    import torch

    from headprobe.analyses.data import MAX_ONE_TOKEN_SHARE, one_token_share

    model, seq_len = tiny_llama_gqa_native, 33  # BOS + 32 text tokens a window
    body = seq_len - 1
    rng = np.random.default_rng(0)
    good = [[f"t{j}" for j in rng.integers(0, 100, body)] for _ in range(40)]
    runs = {3: ["t7"] * 20 + good[3][:12], 11: ["t5"] * body, 17: ["t9"] * 16 + good[17][:16]}  # 62%, 100%, 50%
    windows = [runs.get(i, w) for i, w in enumerate(good)]
    text = "\n".join(" ".join(w) for w in windows)
    ids = torch.tensor(model.tokenizer(text, add_special_tokens=False)["input_ids"]).view(40, body)
    share = [max(Counter(row.tolist()).values()) / body for row in ids]  # by hand
    assert one_token_share(ids).tolist() == pytest.approx(share)
    left_out = {i for i, s in enumerate(share) if s > MAX_ONE_TOKEN_SHARE}
    assert left_out == {3, 11}  # exactly half one token (window 17) stays
    for seed in range(6):
        got = natural_text_tokens(model, 12, seq_len, seed=seed, text=text)
        order = torch.randperm(40, generator=torch.Generator().manual_seed(seed)).tolist()
        expect = sorted([i for i in order if i not in left_out][:12])
        assert got.tokens[:, 1:].tolist() == ids[expect].tolist(), seed
        assert (got.n_skipped, got.n_available) == (2, 38)
    clean = "\n".join(" ".join(w) for w in good)
    for seed in range(3):  # no window left out: the draw of the permutation's first 12
        got = natural_text_tokens(model, 12, seq_len, seed=seed, text=clean)
        first = torch.randperm(40, generator=torch.Generator().manual_seed(seed))[:12].sort().values
        assert got.n_skipped == 0 and got.tokens[:, 1:].tolist() == ids_of(model, clean, body)[first].tolist()
    with pytest.raises(HeadprobeError, match="more than half one token"):
        natural_text_tokens(model, 2, seq_len, seed=0, text=" ".join(["t1"] * 200))
    unknown = natural_text_tokens(model, 2, seq_len, seed=0, text=" ".join(["qqq"] * 200))  # the unknown token:
    assert unknown.n_skipped == 0 and (unknown.tokens[:, 1:] == model.tokenizer.unk_token_id).all()  # its own rule


def ids_of(model, text: str, body: int):
    import torch

    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[: len(ids) // body * body]).view(-1, body)
