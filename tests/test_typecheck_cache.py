"""The suite's cached type checker (tests/hp_typecheck.py) reuses beartype's checker for a signature it
has seen and still checks what a fresh one would: two closures with the same annotations share it, a
closure with other dimensions gets its own."""

import hp_typecheck
import jaxtyping
import pytest
import torch
from jaxtyping import Float, Int
from torch import Tensor


def _closure(dims: str, dtype=Float):
    @jaxtyping.jaxtyped(typechecker=hp_typecheck.cached_beartype)
    def head_sum(x: dtype[Tensor, dims], k: int = 1) -> dtype[Tensor, dims]:  # type: ignore[valid-type]
        return x * k

    return head_sum


def test_a_closure_made_again_reuses_the_checker_and_still_checks():
    first = _closure("batch head")
    built, reused = hp_typecheck.stats["built"], hp_typecheck.stats["reused"]
    again = _closure("batch head")  # Float[Tensor, "batch head"] written again: another class
    assert hp_typecheck.stats["built"] == built and hp_typecheck.stats["reused"] == reused + 2
    for f in (first, again):
        assert f(torch.ones(2, 3)).shape == (2, 3)
        with pytest.raises(jaxtyping.TypeCheckError):
            f(torch.ones(2, 3, 4))  # one dimension too many
        with pytest.raises(jaxtyping.TypeCheckError):
            f(torch.ones(2, 3, dtype=torch.int64))  # not a float tensor
        with pytest.raises(jaxtyping.TypeCheckError):
            f(torch.ones(2, 3), k="2")  # k: int


def test_a_closure_made_again_reuses_jaxtypings_synthetic_functions_and_still_checks():
    """jaxtyping's two synthetic functions (parameters; parameters and return) are made once per
    signature: a closure made again gets them back, and its checks still refuse what they refused."""
    _closure("batch head")
    made, remade = hp_typecheck.stats["made"], hp_typecheck.stats["remade"]
    again = _closure("batch head")
    assert hp_typecheck.stats["made"] == made and hp_typecheck.stats["remade"] == remade + 2
    other = _closure("batch head pos")
    assert hp_typecheck.stats["made"] == made + 2
    assert again(torch.ones(2, 3)).shape == (2, 3) and other(torch.ones(2, 3, 4)).shape == (2, 3, 4)
    for f, x in ((again, torch.ones(2, 3, 4)), (other, torch.ones(2, 3))):
        with pytest.raises(jaxtyping.TypeCheckError):
            f(x)
    with pytest.raises(jaxtyping.TypeCheckError):
        again(torch.ones(2, 3), k="2")


def test_a_function_with_nothing_to_check_is_left_undecorated():
    """The hook leaves a function annotated with ``Any`` alone or none undecorated (its wrapper checked
    nothing); one with any other annotation is decorated and checked."""
    from typing import Any

    from headprobe.probe.core.io import finite_json
    from headprobe.probe.hooks.capture import head_results

    assert not hasattr(finite_json, "__wrapped__") and hasattr(head_results, "__wrapped__")

    def anything(x: Any, y) -> Any:
        return x

    def an_int(x: Any) -> int:
        return x

    assert hp_typecheck.checks_nothing(anything) and not hp_typecheck.checks_nothing(an_int)
    decorate = jaxtyping.jaxtyped(typechecker=hp_typecheck.cached_beartype)
    assert decorate(anything) is anything
    checked = decorate(an_int)
    assert checked is not an_int and checked(3) == 3
    with pytest.raises(jaxtyping.TypeCheckError):
        checked("3")


def test_other_annotations_get_their_own_checker():
    built = hp_typecheck.stats["built"]
    flat, ints = _closure("pos"), _closure("batch head", Int)
    assert hp_typecheck.stats["built"] >= built + 2
    assert flat(torch.ones(5)).shape == (5,)
    with pytest.raises(jaxtyping.TypeCheckError):
        flat(torch.ones(2, 3))  # the "batch head" checker would pass this
    assert ints(torch.ones(2, 3, dtype=torch.int64)).shape == (2, 3)
    with pytest.raises(jaxtyping.TypeCheckError):
        ints(torch.ones(2, 3))


def test_the_suite_runs_headprobe_under_the_cached_checker():
    """pyproject's addopts name this checker: importing headprobe (conftest does) built checkers with it."""
    import headprobe.probe.hooks.capture  # noqa: F401

    assert hp_typecheck.stats["built"] > 0


def test_the_lean_wrapper_checks_what_jaxtypings_wrapper_checks():
    """A function of plain annotations, or of arrays with named dimensions, gets the lean wrapper (no
    argument binding per call); it still refuses a wrong parameter and a wrong return value with
    jaxtyping's error, relates the dimensions of its parameters and of its return value, and a call
    with a wrong number of arguments is Python's TypeError. A symbolic dimension (which reads the
    arguments) keeps jaxtyping's own wrapper."""
    decorate = jaxtyping.jaxtyped(typechecker=hp_typecheck.cached_beartype)
    lean = hp_typecheck.stats["lean"]

    def halve(n: int, label: str = "x") -> int:
        return n // 2 if label == "x" else label  # type: ignore[return-value]

    checked = decorate(halve)
    assert hp_typecheck.stats["lean"] == lean + 1
    assert checked(6) == 3 and checked.__wrapped__ is halve
    with pytest.raises(jaxtyping.TypeCheckError, match="parameters of .*halve"):
        checked(6.5)
    with pytest.raises(jaxtyping.TypeCheckError, match="return value of .*halve"):
        checked(6, "y")
    with pytest.raises(TypeError, match="argument") as error:
        checked(1, "x", 3)
    assert not isinstance(error.value, jaxtyping.TypeCheckError)

    def pair(x: Float[Tensor, " n"], y: Float[Tensor, " n"], drop: int = 0) -> Float[Tensor, "n 2"]:
        return torch.stack([x, y], dim=1)[drop:]

    shaped = decorate(pair)
    assert hp_typecheck.stats["lean"] == lean + 2
    assert shaped(torch.ones(3), torch.ones(3)).shape == (3, 2)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameters"):
        shaped(torch.ones(3), torch.ones(4))  # n is 3, then 4
    with pytest.raises(jaxtyping.TypeCheckError, match="return value"):
        shaped(torch.ones(3), torch.ones(3), drop=1)  # [2, 2]: n was 3
    assert shaped(torch.ones(2), torch.ones(2), drop=0).shape == (2, 2)  # the last call's memo is gone

    def longer(x: Float[Tensor, " n"]) -> Float[Tensor, " n+1"]:
        return torch.cat([x, x[:1]])

    symbolic = decorate(longer)
    assert hp_typecheck.stats["lean"] == lean + 2  # jaxtyping's wrapper: n+1 reads the arguments
    assert symbolic(torch.ones(3)).shape == (4,)
