"""The suite's run-time type checker: beartype, built once per signature.

jaxtyping's import hook (pyproject's addopts) decorates every function of headprobe, nested ones
too, with ``jaxtyped(typechecker=...)``, which hands the checker two synthetic functions made from
the signature. A nested function (a hook, a closure) is decorated again each time its outer function
runs, and beartype generated a new checker each time: about 40% of the suite's time. A checker
depends only on the signature, so this one keeps beartype's result per signature, with jaxtyping's
array annotations compared by what they check (dtype, array type, dimensions), since
``Float[Tensor, "b h"]`` written twice makes two classes. What is checked is unchanged.

jaxtyping also writes and ``exec``s those two synthetic functions anew for each definition (0.23 ms
a nested hook, 0.06 ms with them kept; tests/test_models_matrix.py makes 16,000 such definitions):
they too depend only on the signature (the same key), so :func:`_make_fn_with_signature` keeps
them, and :func:`cached_beartype` finds the checker of a synthetic function it has seen by identity.
The functions returned are the same as before, so what is checked is unchanged.

A function with nothing to check (no annotation but ``Any``, or none: :func:`headprobe.probe.core.io.finite_json`, which
recurses through every number of a JSON document, is a sixth of the calls the hook wraps in
tests/test_models_matrix.py) is left as it is (:func:`jaxtyped`): its wrapper checked nothing.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

import beartype
import jaxtyping._decorator
from jaxtyping import AbstractArray

CONF = beartype.BeartypeConf(is_pep484_tower=True)
_checked: dict[Any, Callable[..., Any]] = {}
_checked_fn: dict[Callable[..., Any], Callable[..., Any]] = {}
_made: dict[Any, Any] = {}
_made_fns: set[Callable[..., Any]] = set()
stats = {"built": 0, "reused": 0, "made": 0, "remade": 0, "unwrapped": 0}


class _Unkeyable(Exception):
    pass


def _freeze(annotation: Any) -> Any:
    """A hashable key equal for annotations that check the same (raises _Unkeyable otherwise)."""
    if isinstance(annotation, type) and issubclass(annotation, AbstractArray):
        return ("array", annotation.dtype, annotation.array_type, annotation.dim_str)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is not None:
        return ("generic", origin, tuple(_freeze(a) for a in args))
    try:
        hash(annotation)
    except TypeError as error:
        raise _Unkeyable from error
    return annotation


def _signature_key(signature: inspect.Signature) -> Any:
    parameters = tuple(
        (p.name, p.kind, _freeze(p.annotation), p.default is inspect.Parameter.empty)
        for p in signature.parameters.values()
    )
    return (parameters, _freeze(signature.return_annotation))


def _key(fn: Callable[..., Any]) -> Any:
    return (fn.__module__, fn.__qualname__, _signature_key(inspect.signature(fn)))


_make_fn_with_signature_uncached = jaxtyping._decorator._make_fn_with_signature


def _make_fn_with_signature(name: str, qualname: str, module: str, signature: inspect.Signature, output: bool) -> Any:
    """jaxtyping's synthetic function for ``signature`` (and its output argument's name where
    ``output``), made once per :func:`_signature_key` and reused."""
    try:
        key = (name, qualname, module, output, _signature_key(signature))
    except _Unkeyable:
        return _make_fn_with_signature_uncached(name, qualname, module, signature, output)
    made = _made.get(key)
    if made is None:
        made = _made[key] = _make_fn_with_signature_uncached(name, qualname, module, signature, output)
        _made_fns.add(made[0] if output else made)
        stats["made"] += 1
    else:
        stats["remade"] += 1
    return made


jaxtyping._decorator._make_fn_with_signature = _make_fn_with_signature


def checks_nothing(fn: Any) -> bool:
    """Whether ``fn`` is a plain function whose every annotation (strings too) is ``typing.Any``, or
    that has none: the typechecker has nothing to check in its arguments or its return value."""
    if not inspect.isfunction(fn):
        return False
    names = fn.__globals__
    return all(a is Any or (a == "Any" and names.get("Any") is Any) for a in fn.__annotations__.values())


_jaxtyped = jaxtyping.jaxtyped


def jaxtyped(fn: Any = None, **kwargs: Any) -> Any:
    """``jaxtyping.jaxtyped`` as the import hook calls it, except that a function with nothing to
    check (:func:`checks_nothing`) is returned undecorated."""
    if fn is None:
        return functools.partial(jaxtyped, **kwargs)
    if checks_nothing(fn):
        stats["unwrapped"] += 1
        return fn
    return _jaxtyped(fn, **kwargs)


jaxtyping.jaxtyped = jaxtyped


def cached_beartype(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``beartype(fn, conf=CONF)``, reused for a later function with the same signature."""
    checked = _checked_fn.get(fn)
    if checked is not None:  # a synthetic function made once (_make_fn_with_signature)
        stats["reused"] += 1
        return checked
    try:
        key = _key(fn)
    except _Unkeyable:
        return beartype.beartype(fn, conf=CONF)
    checked = _checked.get(key)
    if checked is None:
        checked = _checked[key] = beartype.beartype(fn, conf=CONF)
        stats["built"] += 1
    else:
        stats["reused"] += 1
    if fn in _made_fns:  # made once: met again, found by identity
        _checked_fn[fn] = checked
    return checked
