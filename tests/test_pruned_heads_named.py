"""A head named by a flag (``show --head``, ``patch --heads``, ``circuit --receivers`` / ``--qk-head``,
``import``'s head file, ``ablate --heads``) on a pruned checkpoint (``prune --save-pruned``'s
directory) that the checkpoint's ``config.json`` lists under ``removed_heads``. ``show --head`` of
one drew a uniform causal pattern titled as the head (exit 0); each command now refuses in one line
(exit 2, nothing written) or, where the others it names are measured (ablate), says so. Reference:
the ``removed_heads`` the test wrote into the checkpoint itself. Tiny GQA Llama, 2 layers x 8 heads."""

from __future__ import annotations

import json
import re

import pytest

from headprobe.cli import main

REMOVED = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 5), (1, 6)]
SMALL = ["--device", "cpu"]


@pytest.fixture(scope="module")
def pruned_dir(tiny_dir, tmp_path_factory):
    """The tiny Llama with :data:`REMOVED` removed, saved as ``prune --save-pruned`` saves it."""
    import headprobe
    from headprobe.probe.model.pruned import keep_mask_from, remove_heads, save_pruned_dir

    base = headprobe.load_model(str(tiny_dir), device="cpu", backend="native", quiet=True)
    d = tmp_path_factory.mktemp("pruned") / "pruned_model"
    save_pruned_dir(remove_heads(base.model, keep_mask_from(REMOVED, 2, 8)), d, base.tokenizer, source=str(tiny_dir))
    removed = json.loads((d / "config.json").read_text())["pruned"]["removed_heads"]
    assert {(layer, h) for layer, hs in enumerate(removed) for h in hs} == set(REMOVED)  # the reference
    return d


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A prompt-pair file for patch (tiny tokenizer words) and a head list for import naming 1.5."""
    d = tmp_path_factory.mktemp("inputs")
    pairs = [
        {"clean": "t1 t2 t3 t4 t5 t6", "corrupted": "t7 t8 t9 t10 t11 t12", "correct": " t3", "wrong": " t9"},
        {
            "clean": "t13 t14 t15 t16 t17 t18",
            "corrupted": "t19 t20 t21 t22 t23 t24",
            "correct": " t15",
            "wrong": " t21",
        },
    ]
    (d / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    (d / "heads.txt").write_text("1.5\n1.0\n", encoding="utf-8")
    return d


CASES = {
    "show": (["show", "--head", "1.5", "--prompt", "t1 t2 t3 t4 t5 t6 t7"], "head 1.5"),
    "patch": (["patch", "--heads", "0.4,1.5", "--prompts", "{inputs}/pairs.jsonl"], "head 1.5"),
    "circuit receivers": (
        ["circuit", "--n-seqs", "2", "--period", "6", "--steps", "3", "--receivers", "1.6:k"],
        "head 1.6",
    ),
    "circuit qk-head": (["circuit", "--n-seqs", "2", "--period", "6", "--steps", "3", "--qk-head", "0.2"], "head 0.2"),
    "import": (["import", "--heads-file", "{inputs}/heads.txt"], "head 1.5"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_removed_head_named_by_a_flag_is_refused_in_one_line(case, pruned_dir, inputs, tmp_path, capsys):
    argv, head = CASES[case]
    argv = [a.replace("{inputs}", str(inputs)) for a in argv]
    out = tmp_path / "out"
    outs = [] if argv[0] == "import" else ["--out", str(out)]
    code = main([*argv, "--model", str(pruned_dir), *outs, *SMALL])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("headprobe: error:")]
    assert code == 2 and len(lines) == 1, (code, err[-1500:])
    assert f"{head} was removed by pruning (removed_heads in {pruned_dir / 'config.json'})" in lines[0], lines[0]
    assert "Traceback" not in err and not out.exists()


def test_show_from_python_refuses_a_removed_head_of_a_loaded_model(pruned_dir, tmp_path):
    """A model loaded first (no config.json read by show): the loaded spec's removed heads."""
    import headprobe
    from headprobe.probe.core.errors import HeadprobeError

    model = headprobe.load_model(str(pruned_dir), device="cpu", quiet=True)
    with pytest.raises(HeadprobeError, match=r"head 0\.3 was removed by pruning \(removed_heads in .*config\.json\)"):
        headprobe.show(model, head="0.3", prompt="t1 t2 t3 t4 t5", out=tmp_path / "s")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "call, head",
    [
        (lambda m, d: __import__("headprobe").patch(m, prompts=str(d / "pairs.jsonl"), heads="1.5"), "1.5"),
        (lambda m, d: __import__("headprobe").circuit(m, n_seqs=2, period=6, steps=3, receivers="1.6:k"), "1.6"),
        (lambda m, d: __import__("headprobe").circuit(m, n_seqs=2, period=6, steps=3, qk_head="0.2"), "0.2"),
        (lambda m, d: __import__("headprobe").import_heads(m, heads_file=str(d / "heads.txt")), "1.5"),
    ],
    ids=["patch", "circuit-receivers", "circuit-qk-head", "import"],
)
def test_a_loaded_pruned_model_refuses_a_removed_head_in_each_function(call, head, pruned_dir, inputs):
    """A model given loaded skips the preflight's config.json: each run checks its spec.removed_heads."""
    import headprobe
    from headprobe.probe.core.errors import HeadprobeError

    model = headprobe.load_model(str(pruned_dir), device="cpu", quiet=True)
    with pytest.raises(HeadprobeError, match=rf"head {re.escape(head)} was removed by pruning \(removed_heads in "):
        call(model, inputs)
