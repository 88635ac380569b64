"""MkDocs hooks and a griffe extension for the documentation site (mkdocs.yml; ``mkdocs build --strict``).

* The site keeps the repository's layout: README.md is the home page ``index.md``, the pages of
  ``docs/`` (and the notebooks in ``docs/notebooks/``) sit under ``docs/``, CONTRIBUTING.md and
  ``figures/`` beside them, so every relative link (``docs/scan.md``, ``../figures/...``) resolves
  as it does on GitHub and a broken one fails the strict build.
* mkdocstrings reads the package from a mirror (scripts/typecheck.py's ``mirror``: setuptools maps
  ``probe/`` and ``analyses/`` to ``headprobe.probe`` and ``headprobe.analyses``, which griffe does
  not follow), made when the build starts and removed when it ends.
* :class:`PublicNames` gives the ``headprobe`` module its public names (``headprobe.scan``,
  ``headprobe.load_model``, ...), which ``headprobe/__init__.py`` makes on first use and a static
  reader cannot see: each is an alias of the object the name returns, wherever that lives. A
  command's function that :func:`headprobe.options.command_function` makes (``scan = command_function(
  ScanConfig, run, ...)``) is, to a static reader, an attribute with no signature: it is replaced
  by the function griffe inspects at run time (its ``__signature__``: every setting of the Config
  with its type and default; its ``__doc__``), so the page shows what ``help(headprobe.scan)`` shows.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import tempfile
from pathlib import Path

import griffe
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
BESIDE_DOCS = ("CONTRIBUTING.md",)
"""Files of the repository root that the pages link to, published at the same place."""
ASSET_DIRS = ("figures",)
"""Folders of the repository root whose files the pages link to or show."""

_mirror: list[Path] = []


def _typecheck_mirror():
    spec = importlib.util.spec_from_file_location("_typecheck", ROOT / "scripts" / "typecheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mirror


@event_priority(100)
def on_config(config):
    tmp = Path(tempfile.mkdtemp(prefix="headprobe-docs-"))
    _mirror.append(tmp)
    _typecheck_mirror()(tmp)
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(tmp)]
    return config


def on_shutdown():
    while _mirror:
        shutil.rmtree(_mirror.pop(), ignore_errors=True)


def _file(config, path: Path) -> File:
    """``path`` (in the repository) published at its place in the repository."""
    return File(
        path.relative_to(ROOT).as_posix(),
        src_dir=str(ROOT),
        dest_dir=config.site_dir,
        use_directory_urls=config.use_directory_urls,
    )


@event_priority(100)  # before mkdocs-jupyter wraps the notebooks
def on_files(files: Files, config) -> Files:
    docs = ROOT / config.docs_dir
    laid = [
        _file(config, Path(f.abs_src_path)) if f.abs_src_path and Path(f.abs_src_path).is_relative_to(docs) else f
        for f in files
    ]  # the theme's own files stay as they are
    laid.append(File.generated(config, "index.md", abs_src_path=str(ROOT / "README.md")))
    laid += [_file(config, ROOT / name) for name in BESIDE_DOCS]
    for folder in ASSET_DIRS:
        laid += [_file(config, p) for p in sorted((ROOT / folder).rglob("*")) if p.is_file()]
    return Files(laid)


SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")
"""A Sphinx cross-reference in a docstring (``:class:`~headprobe.probe.backends.base.LoadedModel```)."""


class PublicNames(griffe.Extension):
    """Every name of ``headprobe.__all__`` as a member of the ``headprobe`` module: an alias of the
    object it returns (``headprobe.scan`` -> ``headprobe.commands.scan_core.scan``); Sphinx roles in
    docstrings shown as code (Markdown has none)."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = SPHINX_ROLE.sub(r"`\1`", obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.path != "headprobe":
            return
        import headprobe

        for name in headprobe.__all__:
            if name.startswith("_"):
                continue
            obj = getattr(headprobe, name)
            target = f"{obj.__module__}.{obj.__qualname__}"
            pkg.set_member(name, griffe.Alias(name, target, parent=pkg))
            _inspect_if_made(pkg, obj, loader)


def _inspect_if_made(pkg: griffe.Module, obj, loader: griffe.GriffeLoader) -> None:
    """Where the static reader saw ``obj`` (a function) as a module attribute (``scan =
    command_function(...)``), put in its place the function as griffe inspects it at run time."""
    module = pkg.modules_collection.get_member(obj.__module__)
    static = module.members.get(obj.__qualname__)
    if not callable(obj) or static is None or not static.is_attribute:
        return
    inspector = griffe.Inspector(
        module.name,
        filepath=None,
        extensions=griffe.Extensions(),
        docstring_parser=loader.docstring_parser,
        docstring_options=loader.docstring_options,
    )
    inspector.current = module  # its annotations resolve in the module's names; the function lands there
    inspector.inspect_function(griffe.ObjectNode(obj, obj.__qualname__))
    function = module.members[obj.__qualname__]
    function.lineno, function.endlineno = static.lineno, static.endlineno  # the assignment's place in the source
