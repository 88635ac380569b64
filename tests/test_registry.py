"""The one registry type (headprobe.probe.core.registry): lazy "module:attr" targets, did-you-mean for
an unknown name, and the model-family registry built on it (headprobe.probe.model.families)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import Registry, did_you_mean


def test_a_lazy_target_is_imported_on_first_get_only(tmp_path, monkeypatch):
    (tmp_path / "hp_lazy_target.py").write_text("VALUE = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hp_lazy_target", raising=False)
    reg = Registry("thing")
    reg.register("a", "hp_lazy_target:VALUE")
    reg.register("b", 42)
    assert reg.names() == ("a", "b") and "a" in reg and len(reg) == 2 and list(reg) == ["a", "b"]
    assert "hp_lazy_target" not in sys.modules  # listing and membership import nothing
    got = reg.get("a")
    assert got is sys.modules["hp_lazy_target"].VALUE and reg.get("a") is got
    assert reg.get("b") == 42


def test_an_unknown_name_is_one_line_with_the_closest_names_and_the_hint():
    reg = Registry("colour", hint="pick a primary")
    for name in ("red", "green", "blue"):
        reg.register(name, len(name))
    with pytest.raises(HeadprobeError) as e:
        reg.get("gren")
    msg = str(e.value)
    assert msg == "unknown colour: 'gren' (did you mean 'green'?); known: red, green, blue; pick a primary"
    with pytest.raises(HeadprobeError, match=r"unknown colour: 'zzz'; known: red, green, blue; pick") as e:
        reg.get("zzz")  # nothing close: no suggestion
    assert did_you_mean("bleu", ["blue", "blew", "red"]) == " (did you mean 'blue' or 'blew'?)"


def test_registering_twice_or_a_malformed_lazy_target_is_a_programming_error():
    reg = Registry("thing")
    reg.register("a", 1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", 2)
    reg.register("a", 2, replace=True)
    assert reg.get("a") == 2
    for bad in ("no_colon", "a:b:c", ":attr", "module:"):
        with pytest.raises(ValueError, match="module:attr"):
            reg.register("x", bad)
    reg.unregister("a")
    assert "a" not in reg
    with pytest.raises(KeyError):
        reg.unregister("a")


EXPECTED = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "olmo2",
    "gemma2",
    "gpt_neox",
    "deepseek_v3",
    "bert",
    "mixtral",
    "qwen3_moe",
    "phi3",
    "granite",
    "smollm3",
    "olmo3",
    "gemma3_text",
    "cohere2",
    "gpt_oss",
    "llama4_text",
    "qwen3_next",
    "qwen3_5_text",
)
"""The registered families, in registration order (written by hand)."""


def test_every_registered_family_resolves_to_a_family():
    from headprobe.probe.model.families import FAMILIES
    from headprobe.probe.model.families.base import Family

    assert FAMILIES.names() == EXPECTED
    for name in FAMILIES.names():
        family = FAMILIES.get(name)
        assert isinstance(family, Family), name
        assert family.tiny.fields and family.encoder == (name == "bert")


def test_an_unknown_model_type_is_refused_with_the_closest_family_and_the_bridge():
    from headprobe.probe.model.convert import config_from_hf, supports

    with pytest.raises(HeadprobeError) as e:
        config_from_hf(SimpleNamespace(model_type="lama"))
    msg = str(e.value)
    assert "\n" not in msg and "'lama'" in msg and "did you mean 'llama'" in msg and "--backend transformer-lens" in msg
    assert not supports(SimpleNamespace(model_type="falcon"))


def test_the_registries_import_no_torch():
    """Listing the families (what a command may do before it loads a model) imports no torch."""
    code = (
        "import sys; from headprobe.probe.model.families import FAMILIES; names = FAMILIES.names(); "
        "print(len(names), [m for m in ('torch', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(len(EXPECTED)), "[]"]


def test_groups_and_live_choices():
    """A name filed under a group is listed with it (nothing imported); a choices view sees names
    registered after it was made, and compares equal to the tuple it stands for."""
    reg = Registry("column")
    reg.register("a", "no_such_module_is_imported:X", group="type")
    reg.register("b", 2, group="metric")
    view = reg.choices("auto")
    typed = reg.choices(group="type")
    assert reg.names("type") == ("a",) and reg.names("metric") == ("b",) and reg.names() == ("a", "b")
    assert view == ("auto", "a", "b") and typed == ("a",) and "b" not in typed
    reg.register("c", 3, group="type")
    assert view == ("auto", "a", "b", "c") and list(typed) == ["a", "c"] and ", ".join(typed) == "a, c"
    assert reg.group_of("c") == "type"
    reg.unregister("a")
    assert typed == ("c",) and view != ("auto", "a", "b", "c")
    with pytest.raises(HeadprobeError, match="unknown column: 'a'"):
        reg.group_of("a")


def test_backend_choices_follow_the_registry():
    from headprobe.probe.core.vocabulary import BACKEND_REGISTRY, BACKENDS

    assert BACKENDS == ("auto", "native", "transformer-lens") == ("auto", *BACKEND_REGISTRY.names())
    BACKEND_REGISTRY.register("other", object)
    try:
        assert "other" in BACKENDS and BACKENDS[-1] == "other"
    finally:
        BACKEND_REGISTRY.unregister("other")
    assert "other" not in BACKENDS
