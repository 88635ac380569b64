"""``HeadprobeError`` is a ``ValueError``: a Python caller's ``except ValueError`` catches headprobe's
refusals of bad input, as it catches the standard library's; the handlers inside headprobe that
catch ``ValueError`` pass a refusal on unchanged (its message is not wrapped in another's), and the
command line still prints it as one line with exit status 2."""

from __future__ import annotations

import json

import pytest

from headprobe.cli import main
from headprobe.probe.core.errors import HeadprobeError, InputValueError


def test_a_refusal_is_a_value_error():
    """Caught by ``except ValueError`` (not a ``TypeError``, ``OSError`` or ``RuntimeError``)."""
    assert issubclass(HeadprobeError, ValueError) and issubclass(InputValueError, HeadprobeError)
    assert not issubclass(HeadprobeError, (TypeError, OSError, RuntimeError))
    with pytest.raises(ValueError, match="is not a multiple of n_heads"):
        from headprobe.probe.model.config import TransformerConfig

        TransformerConfig(n_layers=1, d_model=10, n_heads=3, d_vocab=8, n_ctx=8)


def _policy(**change) -> dict:
    from headprobe.probe.layout.attention import KVPolicy

    d = KVPolicy(((None, None), (None, None)), "m").to_dict() | change
    return json.loads(json.dumps(d))


@pytest.mark.parametrize(
    "change, said",
    [
        ({"n_layers": "2"}, "p.json: 'n_layers' must be an integer, got '2'"),
        ({"groups": [{"layer": 0, "kv_group": 5, "cache": "full"}]}, "p.json: group (layer 0, kv_group 5) is out of"),
        ({"groups": [{"layer": 0, "kv_group": 0, "cache": "half"}]}, 'p.json: a group\'s cache is "full" or "str'),
    ],
)
def test_a_policy_refusal_inside_the_malformed_policy_handler_keeps_its_own_message(change, said):
    """``KVPolicy.from_dict`` turns a ``ValueError`` of a malformed entry into "malformed policy
    (ValueError: ...)"; its own one-line refusals, raised inside that handler, pass through as they are."""
    from headprobe.probe.layout.attention import KVPolicy

    with pytest.raises(HeadprobeError) as e:
        KVPolicy.from_dict(_policy(**change), "p.json")
    assert str(e.value).startswith(said) and "malformed" not in str(e.value), str(e.value)


def test_a_pruned_folder_whose_config_is_refused_says_so_as_before(tmp_path):
    """A pruned model folder whose config the model refuses: the config's own message (the handler
    that names an unreadable folder catches ``ValueError`` and no longer sees a ``HeadprobeError``)."""
    from headprobe.probe.model.pruned import load_pruned_dir_full

    (tmp_path / "config.json").write_text(
        json.dumps({"model": {"n_layers": 1, "d_model": 10, "n_heads": 3, "d_vocab": 8, "n_ctx": 8}, "pruned": {}})
    )
    with pytest.raises(HeadprobeError) as e:
        load_pruned_dir_full(tmp_path)
    assert str(e.value).startswith("d_model=10 is not a multiple of n_heads=3"), str(e.value)


def test_the_command_line_still_prints_one_line_and_exits_2(tmp_path, capsys):
    """A refusal raised in a command's run: ``headprobe: error: <message>``, one line, status 2."""
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps(_policy(n_layers="2")))
    capsys.readouterr()
    code = main(["import", "--heads-file", str(policy), "--model", str(tmp_path / "nothing"), "--device", "cpu"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("headprobe: error:"), err
