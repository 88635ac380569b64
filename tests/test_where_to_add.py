"""README's "Where to add": each row names one place; adding a thing in that place alone makes it
appear everywhere it must (the CLI, its flags, the Python API). One test function per row.

Rows checked here: "a command" (a module and one entry in :data:`headprobe.commands.COMMANDS`)
and "a shared setting" (one field of a settings dataclass in ``headprobe/settings.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HELLO = '''
"""A command written in a test: ``headprobe hello``."""
import argparse
from dataclasses import dataclass

from headprobe import settings
from headprobe.commands import Command
from headprobe.probe.errors import HeadprobeError
from headprobe.settings import DataSettings, setting

HELP = "say hello a given number of times (a command added by a test)"


@dataclass(frozen=True)
class HelloConfig(DataSettings):
    times: int = setting(2, "how many times to say it (default %(default)s)", type=int)

    def __post_init__(self):
        super().__post_init__()
        if self.times < 1:
            raise HeadprobeError(f"--times must be at least 1, got {self.times}")


def hello(**fields) -> str:
    cfg = HelloConfig(**fields)
    return " ".join(["hello"] * cfg.times) + f" (seed {cfg.seed})"


def add_arguments(p: argparse.ArgumentParser) -> None:
    settings.add_flags(p, HelloConfig)


def main(args: argparse.Namespace) -> int:
    cfg = settings.from_args(HelloConfig, args)
    print(hello(times=cfg.times, seed=cfg.seed))
    return 0


COMMAND = Command(HELP, add_arguments, main, api=hello)
'''


@pytest.fixture
def hello_command(tmp_path, monkeypatch):
    """``headprobe hello``: a module in a temporary folder and one registry entry, removed afterwards."""
    import headprobe
    from headprobe.commands import COMMANDS

    (tmp_path / "hp_hello_command.py").write_text(HELLO, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    COMMANDS.register("hello", "hp_hello_command:COMMAND")
    try:
        yield
    finally:
        COMMANDS.unregister("hello")
        vars(headprobe).pop("hello", None)  # the API caches what it resolved
        sys.modules.pop("hp_hello_command", None)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from headprobe.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_command_is_one_module_and_one_registry_entry(hello_command, capsys):
    import headprobe

    code, out, _ = _cli(capsys, "--help")
    assert code == 0 and "hello" in out and "say hello a given number of times" in out
    code, out, _ = _cli(capsys, "hello", "--help")
    assert code == 0 and "--times" in out and "how many times to say it (default 2)" in out
    assert "--seed" in out and "--seq-len" in out  # the settings it composes (DataSettings) come as flags
    code, out, _ = _cli(capsys, "hello", "--times", "3", "--seed", "7")
    assert code == 0 and out.strip() == "hello hello hello (seed 7)"
    code, _, err = _cli(capsys, "hello", "--times", "0")
    assert code == 2 and err.strip() == "headprobe: error: --times must be at least 1, got 0"
    code, _, err = _cli(capsys, "helo")
    assert code == 2 and "did you mean 'hello'?" in err
    assert headprobe.hello(times=1, seed=4) == "hello (seed 4)"  # the Python API, same keywords as the flags
    assert "hello" in headprobe.__all__ and "hello" in dir(headprobe)


def test_a_command_not_registered_is_nowhere(capsys):
    """The check above can fail: without the registry entry there is no command and no function."""
    import headprobe

    code, out, _ = _cli(capsys, "--help")
    assert code == 0 and "hello" not in out
    assert _cli(capsys, "hello")[0] == 2
    assert "hello" not in headprobe.__all__
    with pytest.raises(AttributeError):
        headprobe.hello  # noqa: B018


# A field added to ModelSettings or DataSettings in headprobe/settings.py, and nowhere else: the
# edited module is executed as headprobe.settings before any command imports it.
ADD_SETTING = textwrap.dedent('''
    import json, sys, types
    from pathlib import Path

    group, field_src = sys.argv[1], sys.argv[2]
    path = Path("headprobe/settings.py")
    src = path.read_text(encoding="utf-8")
    anchor = "    def __post_init__(self):\\n        check_settings(self)\\n"
    start = src.index(f"class {group}:")
    at = src.index(anchor, start)
    src = src[:at] + field_src + "\\n" + src[at:]
    module = types.ModuleType("headprobe.settings")
    module.__file__ = str(path)
    sys.modules["headprobe.settings"] = module
    exec(compile(src, str(path), "exec"), module.__dict__)

    import argparse, dataclasses, importlib
    from headprobe import options, settings
    from headprobe.cli import build_parser
    from headprobe.commands import COMMANDS

    assert settings is module
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flagged = sorted(name for name, p in sub.choices.items()
                     if any("--trust-remote-code" in a.option_strings for a in p._actions))
    configs = {}
    for name, module_name, config in [("scan", "headprobe.commands.scan", "ScanConfig"),
                                      ("ablate", "headprobe.commands.ablate", "AblateConfig"),
                                      ("prune", "headprobe.commands.prune", "PruneConfig"),
                                      ("patch", "headprobe.commands.patch", "PatchConfig"),
                                      ("show", "headprobe.commands.show", "ShowConfig"),
                                      ("atlas", "headprobe.commands.atlas", "AtlasConfig")]:
        cls = getattr(importlib.import_module(module_name), config)
        if "trust_remote_code" in {f.name for f in dataclasses.fields(cls)}:
            extra = ["--head", "1.1", "--prompt", "x"] if name == "show" else []
            args = build_parser(name).parse_args([name, "--out", "x", "--trust-remote-code", *extra])
            changes = {"prompt": "x"} if name == "show" else {}
            options.check_fields(cls, {"trust_remote_code": True})  # the Python API takes it as a keyword
            configs[name] = settings.from_args(cls, args, **changes).trust_remote_code
    if "atlas" in configs:
        atlas = importlib.import_module("headprobe.commands.atlas").AtlasConfig(models="m", trust_remote_code=True)
        configs_scan = atlas.scan_config("m").trust_remote_code
    help_text = " ".join(sub.choices["scan"].format_help().split())
    print(json.dumps({"flagged": flagged, "configs": configs, "help": "run the repository's own code" in help_text,
                      "atlas_scan": configs_scan if "atlas" in configs else None}))
''')

FIELD = ('    trust_remote_code: bool = setting(False, "run the repository\'s own code", action="store_true")\n'
         '    """Run the model repository\'s own code."""')


@pytest.mark.parametrize("group, commands", [
    ("ModelSettings", ["ablate", "patch", "prune", "scan", "show"]),
    ("DataSettings", ["ablate", "atlas", "prune", "scan"]),
])
def test_a_shared_setting_is_one_field(group, commands):
    r = subprocess.run([sys.executable, "-c", ADD_SETTING, group, FIELD], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["flagged"] == commands  # every command that composes the group, and no other
    assert found["configs"] == {c: True for c in commands}  # the flag sets the config's field
    if group == "DataSettings":  # atlas hands its data settings to every model's scan
        assert found["atlas_scan"] is True
    assert found["help"]  # its help is the field's


def test_an_output_setting_reaches_every_command_that_writes_files():
    """A field added to OutputSettings (where the files go, not part of any Config: the Config is
    the checkpoint's key and summary.json's record) becomes a flag of every command with --out,
    and of no other (budget prints, view writes into the scan's folder); no Config gains it, so
    the exact list above is not what every field gets."""
    script = ADD_SETTING.replace('anchor = "    def __post_init__(self):\\n        check_settings(self)\\n"',
                                 'anchor = "    def __post_init__(self):\\n        if self.formats is not None:"')
    r = subprocess.run([sys.executable, "-c", script, "OutputSettings", FIELD], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["flagged"] == ["ablate", "atlas", "patch", "prune", "scan", "show", "study", "train"]
    assert found["configs"] == {}


def _where_to_add_row(name: str) -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.split("## Where to add", 1)[1].splitlines() if line.startswith(f"| {name} |")]
    assert len(rows) == 1, f"README's Where to add has {len(rows)} rows for {name!r}"
    return rows[0]


def test_the_readme_names_the_places_these_tests_use():
    """The rows say where the tests above add things: the registry entry and the settings module."""
    command = _where_to_add_row("a command")
    assert "`COMMANDS` in `headprobe/commands/__init__.py`" in command and "headprobe/commands/<name>.py" in command
    setting = _where_to_add_row("a shared setting")
    assert "`headprobe/settings.py`" in setting and "SUBCOMMANDS" not in command and "options.py" not in setting
