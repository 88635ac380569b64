"""The package's import rules (CONTRIBUTING.md), checked with import-linter on the real sources.

setuptools maps ``probe/`` and ``analyses/`` to ``headprobe.probe`` and ``headprobe.analyses``
(package-dir); grimp, import-linter's graph builder, reads the file tree instead, so the test
builds a mirror ``headprobe/`` whose subpackages are symlinks to the real folders.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mirror(tmp_path: Path) -> Path:
    """The symlinked mirror of scripts/typecheck.py (the one place that builds it)."""
    spec = importlib.util.spec_from_file_location("_typecheck", ROOT / "scripts" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mirror(tmp_path)


def _lint(tmp_path: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(_mirror(tmp_path))}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", code, "--no-cache", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


def test_import_rules_hold(tmp_path):
    p = _lint(tmp_path, ROOT / "pyproject.toml")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken" in p.stdout


def test_import_rules_can_fail(tmp_path):
    """The same check reports a forbidden import (probe importing analyses) in a copy of the config."""
    config = tmp_path / "strict.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["headprobe"]\n\n[[tool.importlinter.contracts]]\nname = "inverted"\n'
        'type = "layers"\nlayers = ["headprobe.probe", "headprobe.analyses"]\n'
    )
    (tmp_path / "m").mkdir()
    p = _lint(tmp_path / "m", config)
    assert p.returncode != 0 and "headprobe.analyses" in p.stdout and "broken" in p.stdout.lower()


def test_shape_annotations_are_checked_when_tests_run():
    """Pyproject's addopts turn on jaxtyping's import hook for headprobe: a call whose shapes contradict its
    annotation fails the type check (without the hook, einsum would raise a RuntimeError instead)."""
    import jaxtyping
    import pytest
    import torch

    from headprobe.probe.hooks.capture import head_results

    z = torch.zeros(1, 3, 4, 8)  # [batch, pos, head=4, d_head=8]
    W_O = torch.zeros(2, 8, 16)  # [head=2, d_head, d_model]: head disagrees
    with pytest.raises(jaxtyping.TypeCheckError):
        head_results(z, W_O)
    assert head_results(z, torch.zeros(4, 8, 16)).shape == (1, 3, 4, 16)


# ---------------------------------------------------------------------------------------------
# Analyses and commands program against the backend interface, not a backend's modules
# ---------------------------------------------------------------------------------------------

INTERNALS = {
    "blocks",
    "original_model",
    "hook_dict",
    "run_with_hooks",
    "unembed",
    "ln_final",
    "register_forward_pre_hook",
    "register_forward_hook",
}
"""Attributes of a backend's modules (native Transformer or TransformerBridge) that only the probe floor may read."""
NOT_A_MODULE = {"config", "cfg", "args", "self.config"}
"""Objects whose ``.model`` is a model name or path, not a module."""


def _reaches_into_modules(source: str) -> list[str]:
    """``line: expression`` for each ``X.model`` (X not a config) attribute read, each call of
    ``scoped_hooks`` (hooks on a raw module) and each read of a module-internal attribute
    (:data:`INTERNALS`) in ``source``."""
    import ast

    tree = ast.parse(source)
    # inside a command's Config dataclass, ``self.model`` is the --model name
    in_config = {
        id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name.endswith("Config") for n in ast.walk(c)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            if (
                node.attr == "model"
                and owner not in NOT_A_MODULE
                and not (owner == "self" and id(node) in in_config)
                or node.attr in INTERNALS
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id == "scoped_hooks":
            found.append(f"{node.lineno}: scoped_hooks")
    return found


def test_analyses_and_commands_use_only_the_backend_interface():
    """No module of analyses/ or headprobe/ (API, CLI, commands) reads a LoadedModel's ``.model`` or a
    module's internals: they program against headprobe.probe.backends.base.LoadedModel."""
    offences = {}
    for path in sorted([*(ROOT / "analyses").glob("*.py"), *(ROOT / "headprobe").rglob("*.py")]):
        found = _reaches_into_modules(path.read_text(encoding="utf-8"))
        if found:
            offences[str(path.relative_to(ROOT))] = found
    assert not offences, offences


def test_the_interface_check_can_fail():
    """The same check flags the reaches it forbids (what exact_sweep and the commands did before the interface)."""
    bad = (
        "net = model.model\nblock = net.blocks[3]\nn = sum(p.numel() for p in self.loaded.model.parameters())\n"
        "with scoped_hooks(net, hooks):\n    pass\nhf = loaded.model.original_model\n"
    )
    found = sorted(_reaches_into_modules(bad))
    assert found == [
        "1: model.model",
        "2: net.blocks",
        "3: self.loaded.model",
        "4: scoped_hooks",
        "6: loaded.model",
        "6: loaded.model.original_model",
    ], found
    fine = "cfg.model\nconfig.model\nargs.model\nmodel.spec.n_layers\nclass AblateConfig:\n    def f(self):\n        self.model\n"
    assert _reaches_into_modules(fine) == []
    assert _reaches_into_modules("class AblateResult:\n    def f(self):\n        self.model.blocks\n") != []


MODEL_PARAMETERS = {"model", "loaded"}
"""Parameter names that hold a loaded model in analyses/ and headprobe/."""


def _loose_model_parameters(source: str) -> list[str]:
    """``function(param: annotation)`` for each model parameter (:data:`MODEL_PARAMETERS`) that is
    unannotated or annotated ``Any`` / ``object`` (a name, ``model: str``, is a name, not a loose model)."""
    import ast

    found = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
                if a.arg in MODEL_PARAMETERS:
                    ann = ast.unparse(a.annotation) if a.annotation is not None else None
                    if ann is None or "Any" in ann or ann == "object":
                        found.append(f"{fn.name}({a.arg}: {ann})")
    return found


def _interface_members_used(source: str) -> dict[str, int]:
    """``attribute -> line`` of every ``model.attribute`` read on a parameter annotated ``LoadedModel``."""
    import ast

    used: dict[str, int] = {}
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            typed = {
                a.arg
                for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
                if a.annotation is not None and "LoadedModel" in ast.unparse(a.annotation)
            }
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in typed:
                    used.setdefault(node.attr, node.lineno)
    return used


def _sources() -> list[Path]:
    return sorted([*(ROOT / "analyses").glob("*.py"), *(ROOT / "headprobe").rglob("*.py")])


def test_every_model_parameter_names_the_interface():
    """No function in analyses/ or headprobe/ takes a model parameter that is unannotated or ``Any``:
    each says ``LoadedModel`` (the one interface, probe/backends/base.py), so a type checker and a reader
    see which members it may use."""
    offences = {
        str(p.relative_to(ROOT)): f for p in _sources() if (f := _loose_model_parameters(p.read_text(encoding="utf-8")))
    }
    assert not offences, model_parameter_message(offences)


def model_parameter_message(offences: dict[str, list[str]]) -> str:
    """The failure's message: the rule and the fix, then the offences (file -> ``function(param: annotation)``)."""
    return (
        "a function's model parameter must be annotated `model: LoadedModel` (from "
        "headprobe.probe.backends.base; the one model interface, CONTRIBUTING.md 'Layout and layering'), "
        f"not left unannotated or Any; annotate these: {offences}"
    )


def test_the_model_parameter_message_says_the_rule_and_the_fix():
    """It printed only ``{'analyses/detectors.py': ['_copy_suppression(model: None)']}``."""
    msg = model_parameter_message({"analyses/x.py": ["f(model: None)"]})
    assert "`model: LoadedModel`" in msg and "f(model: None)" in msg and "analyses/x.py" in msg


def test_the_model_parameter_count_can_fail():
    bad = (
        "def a(model): ...\ndef b(model: Any, x): ...\ndef c(*, loaded: object): ...\n"
        "def d(model: LoadedModel): ...\ndef e(model: str | LoadedModel = 'x'): ...\ndef f(model: str): ...\n"
    )
    assert _loose_model_parameters(bad) == ["a(model: None)", "b(model: Any)", "c(loaded: object)"]


def _loose_spec_fields(source: str) -> list[str]:
    """``Class.spec: annotation`` for each class field named ``spec`` that is annotated ``object`` or ``Any``."""
    import ast

    return [
        f"{c.name}.spec: {ast.unparse(f.annotation)}"
        for c in ast.walk(ast.parse(source))
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.AnnAssign)
        and isinstance(f.target, ast.Name)
        and f.target.id == "spec"
        and ast.unparse(f.annotation) in ("object", "Any")
    ]


def test_every_result_types_its_spec():
    """Results say their ``spec`` is a ``ModelSpec`` (circuit's and kv's said ``object``); the check can fail."""
    offences = {
        str(p.relative_to(ROOT)): f for p in _sources() if (f := _loose_spec_fields(p.read_text(encoding="utf-8")))
    }
    assert not offences, offences
    assert _loose_spec_fields("class R:\n    spec: object\n    x: int\nclass S:\n    spec: ModelSpec\n") == [
        "R.spec: object"
    ]


def test_the_interface_declares_every_member_used():
    """Every ``model.x`` that analyses/ and headprobe/ read on a ``LoadedModel`` parameter is declared on
    :class:`~headprobe.probe.backends.base.LoadedModel` (a method, property or annotated attribute): no member
    that only one backend has (the bridge's ``forward_with_cache`` once), none read through ``getattr``."""
    from headprobe.probe.backends.base import LoadedModel

    members = set(dir(LoadedModel)) | set(LoadedModel.__annotations__)
    missing = {
        f"{p.relative_to(ROOT)}:{line}": attr
        for p in _sources()
        for attr, line in _interface_members_used(p.read_text(encoding="utf-8")).items()
        if attr not in members
    }
    assert not missing, missing
    assert "model" not in members  # the wrapped module is an instance attribute for the probe floor, not the interface
    assert _interface_members_used("def f(model: LoadedModel):\n    model.forward_with_cache(t)\n    model.zzz\n") == {
        "forward_with_cache": 2,
        "zzz": 3,
    }


def test_every_subpackage_is_installed():
    """Pyproject's explicit package list names every folder with an __init__.py (a missing one is
    absent from a wheel, though an editable install hides it: ablate and prune once were)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in tool["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            found.add(".".join([package, *rel.parts]))
    assert set(tool["packages"]) == found


# ---------------------------------------------------------------------------------------------
# No long functions
# ---------------------------------------------------------------------------------------------

MAX_FUNCTION_LINES = 80
"""The most lines a function (or method) of probe/, analyses/ or headprobe/ may span, docstring
included: ``end_lineno - lineno + 1`` of its ``ast.FunctionDef``."""


def _long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``name -> lines`` of every function or method (nested ones included) in ``source`` longer
    than ``limit`` lines."""
    import ast

    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    }


def test_no_function_is_longer_than_80_lines():
    over = {}
    for folder in ("probe", "analyses", "headprobe"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for name, lines in _long_functions(path.read_text(encoding="utf-8")).items():
                over[f"{rel}:{name}"] = lines
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named helpers): {over}"


def test_the_function_length_check_can_fail():
    """An 81-line function is flagged, with its nested and method cousins; 80 lines are not."""
    body, deeper = "    x = 1\n", "        x = 1\n"
    source = (
        "def ok():\n"
        + body * 79
        + "def long():\n"
        + body * 80
        + "class C:\n    def method(self):\n"
        + deeper * 80
        + "def outer():\n    def inner():\n"
        + deeper * 80
        + "    return inner\n"
    )
    assert _long_functions(source) == {"long": 81, "method": 81, "inner": 81, "outer": 83}


# ---------------------------------------------------------------------------------------------
# Hook, module and parameter names of a block are built by probe/hooks/names.py
# ---------------------------------------------------------------------------------------------

NAMES_SPELLED_IN = {"probe/model/transformer.py", "probe/hooks/names.py"}
"""The only files of probe/, analyses/ and headprobe/ that may spell ``blocks.`` (the model declares the
hook points, hook_names builds their names)."""


def _hand_spelled_block_names(source: str) -> list[str]:
    """``line: text`` of each string constant, or literal part of an f-string, in ``source`` that
    starts with ``blocks.`` (``"blocks.0.hook_z"``, ``f"blocks.{layer}.attn.hook_{name}"``)."""
    import ast

    return [
        f"{node.lineno}: {node.value}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("blocks.")
    ]


def test_no_block_name_is_spelled_by_hand():
    """Hook names and a block's module/parameter paths come from headprobe.probe.hooks.names."""
    offences = {}
    for folder in ("probe", "analyses", "headprobe"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in NAMES_SPELLED_IN and (found := _hand_spelled_block_names(path.read_text(encoding="utf-8"))):
                offences[rel] = found
    assert not offences, f"use headprobe.probe.hooks.names: {offences}"


def test_the_block_name_check_can_fail():
    """Hand-spelled names in constants and f-strings are flagged; a docstring mentioning one and the
    module's functions are not."""
    source = (
        '"""Reads ``blocks.{l}.hook_z``."""\nA = "blocks.0.attn.hook_pattern"\nB = f"blocks.{l}.hook_resid_pre"\n'
        'h, b = f"model.layers.{l}.", f"blocks.{l}."\nC = attn_hook(l, "z")\nD = "blocks"\n'
    )
    assert _hand_spelled_block_names(source) == ["2: blocks.0.attn.hook_pattern", "3: blocks.", "4: blocks."]


def _add_argument_calls(source: str) -> list[int]:
    """Lines of ``source`` that call ``add_argument`` (``p.add_argument(...)``, ``group.add_argument(...)``)."""
    import ast

    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
    ]


def test_no_command_writes_its_flags_by_hand():
    """A command's flags are its Config's setting() fields, made by headprobe.settings' generator:
    no module under headprobe/commands calls argparse's add_argument."""
    found = {}
    for path in sorted((ROOT / "headprobe" / "commands").rglob("*.py")):
        if lines := _add_argument_calls(path.read_text(encoding="utf-8")):
            found[path.relative_to(ROOT).as_posix()] = lines
    assert not found, f"add_argument calls (declare the flag as a setting() field instead): {found}"


def test_the_hand_written_flag_check_can_fail():
    """A planted command module with a hand-written flag is caught; a setting() field is not."""
    planted = (
        "from headprobe.settings import setting\n\n"
        "class Config:\n    steps: int = setting(3, 'steps')\n\n"
        "def add_arguments(p):\n    group = p.add_argument_group('x')\n    group.add_argument('--steps', type=int)\n"
    )
    assert _add_argument_calls(planted) == [8]
    assert _add_argument_calls(planted.replace("group.add_argument('--steps', type=int)", "pass")) == []


# ---------------------------------------------------------------------------------------------
# The native model, one module per concern
# ---------------------------------------------------------------------------------------------

MAX_MODEL_FILE_LINES = 500
"""The most lines a module under probe/model may have: the model is split by concern (config,
positions, norms, masks, cache, attention, feed-forward, the model), not grown in one file."""


def test_no_model_module_is_longer_than_500_lines():
    over = {
        path.relative_to(ROOT).as_posix(): n
        for path in sorted((ROOT / "probe" / "model").rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODEL_FILE_LINES
    }
    assert not over, f"modules over {MAX_MODEL_FILE_LINES} lines under probe/model (split them by concern): {over}"
