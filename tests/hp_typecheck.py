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
Every other function whose annotations resolve gets a lean wrapper (:func:`_checked_lean`): beartype
checks its parameters, then its return value against the dimensions they bound, raising jaxtyping's
TypeCheckError, without jaxtyping's per-call argument binding and second check of the parameters
(a symbolic dimension such as ``n+1``, which reads the arguments, keeps jaxtyping's wrapper).
tests/test_models_matrix.py took 117 s with jaxtyping's wrapper, 68 s with this one and 61 s with no
checks (2026-12-07, one process, 2 cores).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

import beartype
import beartype.roar
import jaxtyping
import jaxtyping._decorator
from jaxtyping import AbstractArray
from jaxtyping._storage import pop_shape_memo, push_shape_memo

CONF = beartype.BeartypeConf(is_pep484_tower=True)
_checked: dict[Any, Callable[..., Any]] = {}
_checked_fn: dict[Callable[..., Any], Callable[..., Any]] = {}
_made: dict[Any, Any] = {}
_made_fns: set[Callable[..., Any]] = set()
stats = {"built": 0, "reused": 0, "made": 0, "remade": 0, "unwrapped": 0, "lean": 0}


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
    checkers = _lean_checkers(fn)
    if checkers is not None:
        return _checked_lean(fn, *checkers)
    return _jaxtyped(fn, **kwargs)


def _kinds(hint: Any) -> set[str]:
    """What ``hint`` holds that decides its wrapper: ``array`` (a jaxtyping array of named or fixed
    dimensions), ``other`` (what only jaxtyping's own wrapper handles: a symbolic dimension, which
    reads the arguments, a PyTree, a TypeVar, a forward reference left unresolved)."""
    if isinstance(hint, (str, typing.ForwardRef, typing.TypeVar)):
        return {"other"}
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        symbolic = any(type(d).__name__ == "_SymbolicDim" for d in hint.dims)
        return {"other" if symbolic else "array"}
    if "jaxtyping" in getattr(type(hint), "__module__", "") or "jaxtyping" in getattr(hint, "__module__", ""):
        return {"other"}
    return set().union(*(_kinds(a) for a in typing.get_args(hint)))


def _resolved_hints(fn: Any) -> tuple[dict[str, Any], bool] | None:
    """``fn``'s resolved annotations and whether any is a jaxtyping array, where the lean wrapper can
    check them all (:func:`_kinds`), else None (also where one cannot be resolved)."""
    if not inspect.isfunction(fn):
        return None
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:
        return None
    kinds = set().union(*(_kinds(h) for h in hints.values()))
    if len(hints) != len(fn.__annotations__) or "other" in kinds:
        return None
    return hints, "array" in kinds


_lean: dict[Any, Any] = {}


def _lean_checkers(fn: Any) -> tuple[Callable[..., Any], Callable[..., Any] | None, bool] | None:
    """beartype's checkers of ``fn``'s parameters and of its return value (None: not annotated) and
    whether it has arrays, where the lean wrapper can check it (:func:`_resolved_hints`), else None;
    kept per module, name and annotations (a nested function is defined again on every call of the
    one around it)."""
    try:
        key = (fn.__module__, fn.__qualname__, tuple(fn.__annotations__.items()))
        hash(key)
    except (AttributeError, TypeError):
        key = None
    if key is not None and key in _lean:
        return _lean[key]
    resolved = _resolved_hints(fn)
    checkers = None
    if resolved is not None:
        hints, arrays = resolved
        signature = inspect.signature(fn)
        signature = signature.replace(
            parameters=[p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()],
            return_annotation=typing.Any,
        )
        name, qualname, module = fn.__name__, fn.__qualname__, fn.__module__
        check_parameters = cached_beartype(_make_fn_with_signature(name, qualname, module, signature, False))
        check_return = None
        if "return" in hints:
            returned = inspect.Parameter("returned", inspect.Parameter.POSITIONAL_ONLY, annotation=hints["return"])
            check_return = cached_beartype(
                _make_fn_with_signature(name, qualname, module, inspect.Signature([returned]), False)
            )
        checkers = (check_parameters, check_return, arrays)
    if key is not None:
        _lean[key] = checkers
    return checkers


def _checked_lean(
    fn: Callable[..., Any], check_parameters: Callable[..., Any], check_return: Callable[..., Any] | None, arrays: bool
) -> Callable[..., Any]:
    """``fn`` with its parameters, then its return value, checked by beartype as jaxtyping's wrapper
    checks them (synthetic functions of the same annotations, the same TypeCheckError), the return
    value against the dimensions the parameters bound (one shape memo, pushed only where there are
    arrays), without binding the arguments on every call or checking the parameters twice."""
    where = f"{fn.__module__}.{fn.__qualname__}"
    stats["lean"] += 1

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if arrays:
            push_shape_memo({})
            try:
                return _call(args, kwargs)
            finally:
                pop_shape_memo()
        return _call(args, kwargs)

    def _call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        try:
            check_parameters(*args, **kwargs)
        except beartype.roar.BeartypeCallHintViolation as error:
            raise jaxtyping.TypeCheckError(
                f"Type-check error whilst checking the parameters of {where}: {error}"
            ) from error
        out = fn(*args, **kwargs)
        if check_return is not None:
            try:
                check_return(out)
            except beartype.roar.BeartypeCallHintViolation as error:
                raise jaxtyping.TypeCheckError(
                    f"Type-check error whilst checking the return value of {where}: {error}"
                ) from error
        return out

    return checked


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
