"""Flags given where they do nothing (``scan --keep-n-random --no-verify``, ``circuit --method eap
--steps 3``) are refused in one line before any work (:func:`headprobe.settings.refuse_inert`, from
each setting's ``needs``), from the command line and from Python, whatever its value (its default
too: ``--steps 5`` is given); a flag or keyword left out is not."""

from __future__ import annotations

import dataclasses

import pytest

from headprobe.cli import main
from headprobe.probe.core.errors import HeadprobeError

INERT = [
    (["scan", "--no-verify", "--keep-n-random"], "--keep-n-random only acts without --no-verify"),
    (["scan", "--no-verify", "--fixed-draws"], "--fixed-draws only acts without --no-verify"),
    (["scan", "--no-verify", "--n-random", "20"], "--n-random only acts without --no-verify"),
    (["scan", "--no-verify", "--top-k", "3"], "--top-k only acts without --no-verify"),
    (["circuit", "--method", "eap", "--steps", "3"], "--steps only acts with --method eap-ig, not --method eap"),
    (
        ["ablate", "--estimate", "gradient", "--n-probes", "4"],
        "--n-probes only acts with --estimate second-order, not --estimate gradient",
    ),
    (["ablate", "--estimate", "atp", "--max-batch", "2"], "--max-batch only acts without --estimate"),
    (
        ["ablate", "--estimate", "gradient", "--kind", "mean"],  # Michel et al.'s importance replaces nothing
        "--kind only acts without --estimate or with --estimate atp or attribution or second-order, "
        "not --estimate gradient",
    ),
    (["ablate", "--n-probes", "4"], "--n-probes only acts with --estimate second-order, not without --estimate"),
    (["prune", "--save-fraction", "0.5"], "--save-fraction only acts with --save-pruned"),
    # at their defaults (old code: accepted, a value equal to the default counted as not given)
    (["circuit", "--method", "eap", "--steps", "5"], "--steps only acts with --method eap-ig, not --method eap"),
    (["circuit", "--method", "eap", "--steps=5"], "--steps only acts with --method eap-ig, not --method eap"),
    (["prune", "--save-fraction", "0.3"], "--save-fraction only acts with --save-pruned"),
    (["scan", "--no-verify", "-k5"], "--top-k only acts without --no-verify"),
    (["prune", "--method", "michel", "--l0-steps", "3"], "--l0-steps only acts with l0 in --method"),
    (["prune", "--method", "l0", "--n-seeds", "2"], "--n-seeds only acts with random in --method"),
    (["prune", "--method", "random", "--no-rescore"], "--no-rescore only acts with michel in --method"),
    (["robustness", "--vary", "data", "--kinds", "zero"], "--kinds only acts with kind in --vary"),
    (["robustness", "--vary", "kind", "--other-period", "7"], "--other-period only acts with data in --vary"),
]


@pytest.mark.parametrize("argv, said", INERT, ids=[" ".join(a) for a, _ in INERT])
def test_a_flag_that_does_nothing_is_refused_in_one_line(tmp_path, capsys, monkeypatch, argv, said):
    """Old code: the run went on (the flag ignored; here it reaches the stubbed model load); now
    exit 2 before the model loads, one line naming the flag and what it needs, --out never made."""
    from headprobe import options

    monkeypatch.setattr(options, "load_for", _stop)
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headprobe: error: ") and said in err[0], err
    assert not out.exists()


def test_view_pattern_len_needs_model(tmp_path, capsys):
    assert main(["view", str(tmp_path), "--pattern-len", "64"]) == 2
    assert "--pattern-len only acts with --model" in capsys.readouterr().err


def _stop(config):
    raise HeadprobeError("stub: past the checks")


def _given(argv):
    from headprobe.cli import build_parser
    from headprobe.settings import given_on_command_line

    return set(given_on_command_line(build_parser(argv[0]).parse_args(argv))) - {"out"}


def test_a_flag_is_given_where_its_spelling_is_on_the_command_line():
    """Given is presence, in any spelling (``--flag value``, ``--flag=value``, ``-k 3``, ``-k3``), at
    any value, the default's included (old code: a value equal to the parser's default was not given)."""
    assert _given(["prune", "--out", "o"]) == set()
    assert _given(["prune", "--out", "o", "--save-fraction", "0.3", "--method", "michel"]) == {
        "save_fraction",
        "methods",
    }
    assert _given(["prune", "--out", "o", "--l0-lambdas", "1,3"]) == {"l0_lambdas"}
    assert _given(["circuit", "--out", "o", "--method", "eap", "--steps", "5"]) == {"method", "steps"}
    assert _given(["circuit", "--out=o", "--steps=5"]) == {"steps"}
    assert _given(["scan", "--out", "o", "--no-verify", "--seq-len", "9"]) == {"verify", "seq_len"}
    assert _given(["scan", "--out", "o", "-k", "5"]) == _given(["scan", "--out", "o", "-k5"]) == {"k"}
    assert _given(["scan", "--out", "o", "--top-k", "5"]) == {"k"}


def test_the_default_values_of_inert_flags_still_run(tmp_path, capsys, monkeypatch):
    """The same commands without the inert flag, or with what it needs, get past the check (to the
    model load, stubbed)."""
    from headprobe import options

    monkeypatch.setattr(options, "load_for", _stop)
    for argv in (
        ["scan", "--no-verify"],
        ["circuit", "--method", "eap"],
        ["circuit", "--method", "eap-ig", "--steps", "5"],
        ["prune", "--method", "l0"],
        ["prune", "--save-pruned", "--save-fraction", "0.3"],
    ):
        assert main([*argv, "--out", str(tmp_path / "o")]) == 2
        assert "stub: past the checks" in capsys.readouterr().err


def test_the_python_functions_refuse_the_same_and_accept_defaults(monkeypatch):
    import headprobe
    from headprobe import options

    monkeypatch.setattr(options, "load_for", _stop)
    with pytest.raises(HeadprobeError, match="--keep-n-random only acts without --no-verify"):
        headprobe.scan("smollm2-135m", verify=False, keep_n_random=True)
    with pytest.raises(HeadprobeError, match="--steps only acts with --method eap-ig"):
        headprobe.circuit("smollm2-135m", method="eap", steps=3)
    with pytest.raises(HeadprobeError, match="--n-probes only acts with --estimate second-order"):
        headprobe.ablate("smollm2-135m", estimate="gradient", n_probes=4)
    with pytest.raises(HeadprobeError, match="--save-fraction only acts with --save-pruned"):
        headprobe.prune("smollm2-135m", save_fraction=0.5)
    # a default passed by name is given as well (old code: accepted)
    with pytest.raises(HeadprobeError, match="--steps only acts with --method eap-ig"):
        headprobe.circuit("smollm2-135m", method="eap", steps=5)
    with pytest.raises(HeadprobeError, match="--save-fraction only acts with --save-pruned"):
        headprobe.prune("smollm2-135m", save_fraction=0.3, save_pruned=False)
    for call in (  # left out, or where it acts, it is accepted
        lambda: headprobe.scan("smollm2-135m", verify=False),
        lambda: headprobe.circuit("smollm2-135m", method="eap"),
        lambda: headprobe.circuit("smollm2-135m", method="eap-ig", steps=5),
        lambda: headprobe.prune("smollm2-135m", save_fraction=0.3, save_pruned=True),
    ):
        with pytest.raises(HeadprobeError, match="stub: past the checks"):
            call()


def test_every_needs_names_a_setting_of_its_command():
    """A ``needs`` whose field the Config lacks would never refuse: each names a field of the
    Config that declares it, or a property of it (atlas' trains_toy) (a Config that inherits one
    without that field, none here, is skipped on purpose by refuse_inert)."""
    from headprobe.commands import COMMANDS
    from headprobe.settings import _meta, decides

    seen = 0
    for name in COMMANDS.names():
        cls = COMMANDS.get(name).config_class()
        fields = {f.name for f in dataclasses.fields(cls)}
        for f in fields:
            needs = _meta(cls, f).get("needs")
            if needs is not None:
                seen += 1
                assert decides(cls, needs.field), (name, f, needs)
    assert seen >= 15


VIEW_LOADING = [
    ["--device", "cpu"],
    ["--dtype", "bf16"],
    ["--backend", "native"],
    ["--device-map", "auto"],
    ["--threads", "2"],
    ["--memory-budget", "1GiB"],
]


@pytest.mark.parametrize("flag", VIEW_LOADING, ids=[f[0] for f in VIEW_LOADING])
def test_view_loading_flags_need_model(tmp_path, capsys, flag):
    """view shares ModelSettings with the commands that always load a model, where these always act;
    view's Config redeclares them with ``needs`` (settings.shared). Old code: accepted and ignored
    (the run went on to read DIR, here a folder without a scan: another error)."""
    assert main(["view", str(tmp_path), *flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"headprobe: error: {flag[0]} only acts with --model: add --model or leave {flag[0]} out"]
    assert not (tmp_path / "index.html").exists()


def test_view_loading_flags_left_out_or_with_model_pass_the_check(tmp_path, capsys, monkeypatch):
    from headprobe import options

    monkeypatch.setattr(options, "load_for", _stop)
    assert main(["view", str(tmp_path)]) == 2
    assert "holds neither" in capsys.readouterr().err  # past the check, to reading DIR
    assert main(["view", str(tmp_path), "--device", "auto"]) == 2  # given, at its default: refused
    assert "--device only acts with --model" in capsys.readouterr().err
    assert main(["view", str(tmp_path), "--model", "smollm2-135m", "--device", "cpu"]) == 2
    assert "holds neither" in capsys.readouterr().err


def test_view_python_function_refuses_loading_settings_without_model(tmp_path):
    import headprobe

    with pytest.raises(HeadprobeError, match="^--dtype only acts with --model"):
        headprobe.view(tmp_path, dtype="bfloat16")
    with pytest.raises(HeadprobeError, match="^--pattern-len only acts with --model"):
        headprobe.view(tmp_path, pattern_len=64)
    with pytest.raises(HeadprobeError, match="^--dtype only acts with --model"):  # its default too
        headprobe.view(tmp_path, dtype="float32")
    with pytest.raises(HeadprobeError, match="holds neither"):  # left out: past the check
        headprobe.view(tmp_path)


def test_atlas_toy_steps_needs_a_toy_model(tmp_path, capsys):
    """Old code: accepted and ignored (no toy model is trained); the run went on (here: to a
    model that cannot be found, another error). The property trains_toy decides it from --models and
    --checkpoints together (a Needs on a property, its condition in words)."""
    from headprobe.commands.atlas import AtlasConfig

    run = tmp_path / "run"
    (run / "checkpoints" / "step-5").mkdir(parents=True)
    for argv in (["--models", "no-such-model-x"], ["--checkpoints", str(run)]):
        out = tmp_path / "out"
        assert main(["atlas", *argv, "--toy-steps", "5", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("headprobe: error: --toy-steps only acts when toy is among"), err
        assert not out.exists()
    assert AtlasConfig().trains_toy and AtlasConfig(models=("toy", "gpt2")).trains_toy
    assert not AtlasConfig(models=("gpt2",)).trains_toy
    assert (
        not AtlasConfig(checkpoints=str(run)).trains_toy and AtlasConfig(checkpoints=str(run), models="toy").trains_toy
    )


def test_atlas_python_function_refuses_toy_steps_without_toy(tmp_path):
    import headprobe

    with pytest.raises(HeadprobeError, match="^--toy-steps only acts when toy is among the models"):
        headprobe.atlas(out=tmp_path / "a", models=("no-such-model-x",), toy_steps=5)
    assert not (tmp_path / "a").exists()


EXPORT_INERT = [
    (["--format", "headkv", "--sink", "4"], "--sink only acts with --format duo or all, not --format headkv"),
    (["--format", "parquet", "--recent", "64"], "--recent only acts with --format duo or all, not --format parquet"),
    (
        ["--format", "mib", "--score", "induction"],
        "--score only acts with --format duo or headkv or all, not --format mib",
    ),
]


@pytest.mark.parametrize("argv, said", EXPORT_INERT, ids=[" ".join(a) for a, _ in EXPORT_INERT])
def test_export_flags_the_format_makes_inert_are_refused_before_the_source_is_read(tmp_path, capsys, argv, said):
    """Decided by --format alone, so refused before the source is read. Old code: read the source
    first (here a folder that is none: 'is not a folder'), and refused only once it was read."""
    out = tmp_path / "out"
    assert main(["export", "--from", str(tmp_path / "nowhere"), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert not out.exists()


def test_export_python_function_refuses_the_same(tmp_path):
    import headprobe

    with pytest.raises(HeadprobeError, match="^--sink only acts with --format duo or all"):
        headprobe.export(str(tmp_path / "nowhere"), format="headkv", sink=4)


IMPORT_INERT = [
    (["-k", "3"], "--top-k only acts on score files (HeadKV, Parquet, CSV); "),
    (["--score", "induction"], "--score only acts on score files"),
    (["--kv"], "--kv only acts on a DuoAttention or policy file"),
]


@pytest.mark.parametrize("argv, said", IMPORT_INERT, ids=[" ".join(a) for a, _ in IMPORT_INERT])
def test_import_flags_a_list_file_makes_inert_are_refused_before_the_model_loads(
    tmp_path, capsys, monkeypatch, argv, said
):
    """A layer.head list names its heads (no score to rank, no KV policy): known once the file is
    read, in the preflight, before the weights load. Old code: a NOTE after the whole verification
    (here it reached the stubbed load)."""
    from headprobe import options

    monkeypatch.setattr(options, "load_for", _stop)
    heads = tmp_path / "heads.txt"
    heads.write_text("0.1\n1.2\n")
    assert main(["import", "--heads-file", str(heads), "--model", "smollm2-135m", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and "a list file" in err[0], err
    assert main(["import", "--heads-file", str(heads), "--model", "smollm2-135m"]) == 2  # without it: to the load
    assert "stub: past the checks" in capsys.readouterr().err
