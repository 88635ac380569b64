"""The suite's run-time type checker: beartype, built once per signature.

jaxtyping's import hook (pyproject's addopts) decorates every function of headprobe, nested ones
too, with ``jaxtyped(typechecker=...)``, which hands the checker two synthetic functions made from
the signature. A nested function (a hook, a closure) is decorated again each time its outer function
runs, and beartype generated a new checker each time: about 40% of the suite's time. A checker
depends only on the signature, so this one keeps beartype's result per signature, with jaxtyping's
array annotations compared by what they check (dtype, array type, dimensions), since
``Float[Tensor, "b h"]`` written twice makes two classes. What is checked is unchanged.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import beartype
from jaxtyping import AbstractArray

CONF = beartype.BeartypeConf(is_pep484_tower=True)
_checked: dict[Any, Callable[..., Any]] = {}
stats = {"built": 0, "reused": 0}


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


def _key(fn: Callable[..., Any]) -> Any:
    signature = inspect.signature(fn)
    parameters = tuple(
        (p.name, p.kind, _freeze(p.annotation), p.default is inspect.Parameter.empty)
        for p in signature.parameters.values()
    )
    return (fn.__module__, fn.__qualname__, parameters, _freeze(signature.return_annotation))


def cached_beartype(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``beartype(fn, conf=CONF)``, reused for a later function with the same signature."""
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
    return checked
