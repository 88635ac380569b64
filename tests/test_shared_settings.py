"""The settings groups as the commands compose them: ``settings.shared`` fields (kv, circuit), the
one maker of the commands' Python functions (``options.command_function``), and the model settings
that view and atlas now take. No model is loaded."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import types

import pytest

import headprobe
from headprobe import options, settings
from headprobe.cli import build_parser, main
from headprobe.probe.core.errors import HeadprobeError
from headprobe.settings import DataSettings, ModelSettings


def _flag(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


@pytest.mark.parametrize(
    "command, name, default",
    [
        ("kv", "seq_len", 1024),
        ("kv", "n_natural", 1),
        ("kv", "seed", 0),
        ("circuit", "period", 12),
        ("circuit", "seed", 0),
    ],
)
def test_a_shared_field_is_the_groups_flag_with_the_commands_default(command, name, default):
    """The flag a command makes from its ``shared`` field has the group's type and option string,
    the command's default; the group's own parser is the reference."""
    group = argparse.ArgumentParser()
    settings.add_flags(group, DataSettings, only=(name,))
    sub = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    mine, theirs = _flag(sub.choices[command], name), _flag(group, name)
    assert mine.option_strings == theirs.option_strings and mine.type is theirs.type and mine.default == default


def test_shared_fields_are_checked_as_the_groups_are():
    from headprobe.commands.circuit import CircuitConfig
    from headprobe.commands.kv import KVConfig

    with pytest.raises(HeadprobeError, match="--n-natural must be at least 1"):
        KVConfig(n_natural=0)
    with pytest.raises(HeadprobeError, match="--period 1 is too short"):
        CircuitConfig(period=1)
    from headprobe.commands.scan import ScanConfig

    with pytest.raises(HeadprobeError, match="--period 2 is too short"):  # induction's target: the previous token
        ScanConfig(period=2)
    assert KVConfig(dtype="bf16").dtype == "bfloat16"  # ModelSettings' normalisation, which kv lacked
    assert "n_repeated" not in {f.name for f in dataclasses.fields(KVConfig)}  # only the fields it uses


def test_kv_refuses_a_device_map_and_has_no_flag_for_it(capsys):
    from headprobe.commands.kv import KVConfig

    with pytest.raises(HeadprobeError, match="runs on one device"):
        KVConfig(device_map="auto")
    with pytest.raises(TypeError, match=r"^kv\(\) got an unknown setting 'device_map'"):  # as the flag: none
        headprobe.kv("smollm2-135m", device_map="sequential")  # before anything loads
    assert main(["kv", "--out", "x", "--device-map", "auto"]) == 2
    assert "unrecognized arguments: --device-map" in capsys.readouterr().err


@dataclasses.dataclass(frozen=True)
class _Config(ModelSettings):
    width: int = 3

    def preflight(self):
        pass


@dataclasses.dataclass
class _Result:
    config: _Config
    progress: bool
    load_s: float = -1.0


def _run(model, config: _Config, progress: bool = True) -> _Result:
    return _Result(config, progress)


def test_command_function_builds_the_config_and_runs_on_a_given_model():
    fn = options.command_function(_Config, _run, "hello", "Say hello", "``width=4``")
    model = types.SimpleNamespace(spec=types.SimpleNamespace(name="tiny"))
    result = fn(model, width=5, progress=True)
    assert result.config == _Config(model="tiny", width=5) and result.progress is True and result.load_s is None
    with pytest.raises(TypeError, match=r"hello\(\) got an unknown setting 'widht'; did you mean width\?"):
        fn(model, widht=5)
    with pytest.raises(HeadprobeError, match="--backend 'bogus' is not one of"):  # the config's own checks run too
        fn(model, backend="bogus")
    with pytest.raises(HeadprobeError, match="device_map= applies when the model is loaded by name"):
        fn(model, device="cuda", device_map="auto")


@pytest.mark.parametrize(
    "name, config",
    [
        ("scan", "ScanConfig"),
        ("ablate", "AblateConfig"),
        ("prune", "PruneConfig"),
        ("patch", "PatchConfig"),
        ("kv", "KVConfig"),
        ("circuit", "CircuitConfig"),
    ],
)
def test_each_commands_function_lists_its_configs_fields(name, config):
    fn = getattr(headprobe, name)
    cls = getattr(importlib.import_module(fn.__module__), config)
    params = inspect.signature(fn).parameters
    flags = options.flag_fields(cls)  # the fields its command has a flag for (kv: no --device-map)
    want = {f.name: f.default for f in dataclasses.fields(cls) if f.name != "model" and f.name in flags}
    assert name != "kv" or "device_map" not in want
    assert list(params)[:2] == ["model", "progress"] and params["model"].default == settings.DEFAULT_MODEL
    assert {k: p.default for k, p in list(params.items())[2:]} == want
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(params.values())[1:])
    assert (
        fn.__name__ == name
        and f"headprobe {name}" in fn.__doc__
        and config in fn.__doc__
        and "HeadprobeError" in fn.__doc__
    )


def test_atlas_hands_its_model_settings_to_every_models_scan():
    from headprobe.commands.atlas import AtlasConfig

    cfg = AtlasConfig(models="a,b", device_map="sequential", max_memory="cpu=1GB", dtype="bf16", backend="native")
    scan = cfg.scan_config("a")
    for f in dataclasses.fields(ModelSettings):
        assert getattr(scan, f.name) == ("a" if f.name == "model" else getattr(cfg, f.name)), f.name
    with pytest.raises(HeadprobeError, match="takes --models"):
        AtlasConfig(model="gpt2")
    args = build_parser("atlas").parse_args(["atlas", "--out", "x", "--device-map", "auto", "--max-memory", "cpu=2GiB"])
    assert settings.from_args(AtlasConfig, args).scan_config("m").max_memory == "cpu=2GiB"


def test_view_takes_the_model_settings_and_checks_its_own(tmp_path):
    from headprobe.commands.view import ViewConfig

    args = build_parser("view").parse_args(["view", str(tmp_path), "--model", "m", "--device-map", "auto"])
    cfg = settings.from_args(ViewConfig, args)
    assert (cfg.dir, cfg.model, cfg.device_map, cfg.prepend_bos) == (str(tmp_path), "m", "auto", True)
    assert ViewConfig(dir="d").model is None  # no model unless asked
    with pytest.raises(HeadprobeError, match="--pattern-len must be at least 2"):
        ViewConfig(dir="d", pattern_len=1)
    with pytest.raises(HeadprobeError, match="BOS setting"):
        ViewConfig(dir="d", prepend_bos=False)
    with pytest.raises(HeadprobeError, match="--max-memory needs --device-map"):
        ViewConfig(dir="d", max_memory="cpu=1GB")


def test_threads_follow_the_idle_cores_unless_asked(monkeypatch):
    """--threads wins, then OMP_NUM_THREADS, then the idle share of this process's cores."""
    import os

    import psutil

    from headprobe.options import choose_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for busy, want in (([0.0, 0.0], 2), ([100.0, 5.0], 1), ([100.0, 100.0], 1), ([60.0, 60.0], 1), ([30.0, 20.0], 2)):
        monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None, percpu=False, b=busy: list(b))
        n, why = choose_threads()
        assert n == want and "idle" in why, (busy, n, why)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None, percpu=False: [100.0, 0.0, 0.0, 0.0])
    assert choose_threads()[0] == 1  # idle cores outside this process's affinity do not count
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads() == (3, "OMP_NUM_THREADS")
    assert choose_threads(5) == (5, "--threads")


def test_threads_do_not_change_a_checkpoints_key():
    """A run resumed with another --threads computes the same numbers: it resumes."""
    from headprobe.commands.ablate import AblateConfig
    from headprobe.options import checkpoint_key

    a, b = AblateConfig(model="m", threads=1), AblateConfig(model="m", threads=2)
    assert checkpoint_key(a) == checkpoint_key(b) and "threads" not in checkpoint_key(a)
    assert checkpoint_key(a) != checkpoint_key(AblateConfig(model="m", seed=1))


def test_threads_zero_is_refused_in_one_line(capsys):
    from headprobe.cli import main

    code = main(["ablate", "--threads", "0", "--out", "x"])
    err = capsys.readouterr().err
    assert code == 2 and "--threads" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2


def test_thousands_of_threads_are_refused_in_one_line_before_any_work(capsys, tmp_path):
    """``--threads 20000`` ended in ``libgomp: Thread creation failed`` (exit 1) and 100000 in an
    "out of memory" line that advised a smaller --memory-budget; a few per CPU are still taken."""
    import os

    from headprobe.cli import main
    from headprobe.commands.ablate import AblateConfig

    most = 4 * (os.cpu_count() or 1)
    assert AblateConfig(model="m", threads=most).threads == most  # oversubscription, as benchmarks/threads.py measures
    code = main(
        ["ablate", "--model", str(tmp_path / "no-model"), "--threads", str(most + 1), "--out", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("headprobe: error: --threads"), err
    assert f"give at most {most}" in err[0] and not (tmp_path / "o").exists()


@dataclasses.dataclass(frozen=True)
class _Flags(ModelSettings):
    dir: str = settings.setting(dataclasses.MISSING, "d", positional=True, metavar="DIR", kw_only=True)
    a: int = settings.setting(1, "a (default %(default)s)", type=int)
    b: int | None = settings.setting(None, "b", type=int, exclusive="x", required=True)
    c: int | None = settings.setting(None, "c", type=int, exclusive="x")


def test_layout_orders_blocks_titles_exclusive_groups_and_positionals():
    """The Flags blocks come in their order (OUTPUT's flags from a class the
    Config does not compose), ``title`` makes an argument group, ``exclusive`` one mutually
    exclusive group however many members (required when a member is), ``positional`` an argument;
    from_args reads them back."""
    p = argparse.ArgumentParser()
    settings.add_layout(
        p,
        _Flags,
        (
            settings.Flags(only=("dir",)),
            settings.OUTPUT,
            settings.Flags(only=("b", "a", "c"), title="S"),
            settings.Flags(group=ModelSettings, skip=("device_map",)),
        ),
    )
    assert [a.dest for a in p._actions[1:]] == [
        "dir",
        "out",
        "overwrite",
        "formats",
        "b",
        "a",
        "c",
        "model",
        "device",
        "dtype",
        "backend",
        "prepend_bos",
        "max_memory",
        "threads",
        "memory_budget",
    ]
    assert [a.option_strings for a in p._actions[1:3]] == [[], ["--out"]]
    assert {g.title: [a.dest for a in g._group_actions] for g in p._action_groups}["S"] == ["b", "a", "c"]
    (group,) = p._mutually_exclusive_groups
    assert group.required and [a.dest for a in group._group_actions] == ["b", "c"]
    p.format_help()  # an empty exclusive group would break the usage line
    for argv in (["d", "--out", "o"], ["d", "--out", "o", "--b", "1", "--c", "2"], ["--out", "o", "--b", "1"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    args = p.parse_args(["d", "--out", "o", "--c", "2", "--a", "3"])
    assert settings.from_args(_Flags, args) == _Flags(dir="d", a=3, c=2)
    with pytest.raises(KeyError):
        settings.add_flags(argparse.ArgumentParser(), _Flags, only=("nosuchfield",))


def test_a_setting_without_a_default_is_a_required_keyword_of_the_function():
    fn = getattr(headprobe, "import")  # ImportConfig.heads_file has no default
    heads_file = inspect.signature(fn).parameters["heads_file"]
    assert heads_file.kind is inspect.Parameter.KEYWORD_ONLY and heads_file.default is inspect.Parameter.empty
    assert "heads_file: ``--heads-file``: " in fn.__doc__  # each setting documented by its flag and help
