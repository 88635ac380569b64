"""The Python API's refusals of arguments the command line cannot give: a loaded model with another
``device``, devices, dtypes and models of the wrong kind or type, settings of the wrong type, and
the message of a non-empty output folder (which names the Python argument too)."""

from __future__ import annotations

import json

import pytest
import torch

import headprobe
from headprobe import options
from headprobe.probe.backends import loading
from headprobe.probe.core.errors import HeadprobeError

SMALL = dict(n_natural=2, seq_len=12, n_repeated=2, period=5)


@pytest.fixture(scope="module")
def cpu_model(tiny_dir):
    return headprobe.load_model(str(tiny_dir), device="cpu", quiet=True)


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("command", ["scan", "ablate", "show", "diff"])
def test_a_loaded_model_refuses_another_device(cpu_model, text_file, tmp_path, command):
    """The model runs where it was loaded (CPU here, no GPU needed): ``device="cuda"`` is refused
    in one line before anything runs, never run on the CPU under the name ``cuda``."""
    calls = {
        "scan": lambda: headprobe.scan(cpu_model, device="cuda", text=str(text_file), types="induction", **SMALL),
        "ablate": lambda: headprobe.ablate(cpu_model, device="cuda", text=str(text_file), heads="0.0", **SMALL),
        "show": lambda: headprobe.show(cpu_model, device="cuda", head="0.0", prompt="a b a b", out=tmp_path / "s"),
        "diff": lambda: headprobe.diff(cpu_model, cpu_model, device="cuda", types="induction", n_perm=9, **SMALL),
    }
    with pytest.raises(HeadprobeError) as e:
        calls[command]()
    assert "device='cuda', but the model given is loaded on cpu" in one_line(e)
    assert not (tmp_path / "s").exists()


def test_a_loaded_model_records_the_device_it_ran_on(cpu_model, text_file, tmp_path):
    """summary.json's ``config.device`` is the device the run used, as its ``device`` is, whether
    ``device`` was left at auto or named; and saving again without overwrite names both spellings."""
    for device in ("auto", "cpu"):
        result = headprobe.ablate(cpu_model, device=device, text=str(text_file), heads="0.0", **SMALL)
        assert result.config.device == "cpu"
        result.save(tmp_path / device)
        summary = json.loads((tmp_path / device / "summary.json").read_text())
        assert summary["device"] == summary["config"]["device"] == "cpu"
    with pytest.raises(HeadprobeError) as e:
        result.save(tmp_path / "cpu")
    assert "is not empty; pass --overwrite (overwrite=True in Python)" in one_line(e)


def test_a_loaded_model_runs_in_its_own_dtype_and_records_it(tiny_dir, text_file):
    """A model loaded in bfloat16 runs in bfloat16: summary.json's ``config.dtype`` says so (not
    the default float32) and another ``dtype`` is refused, never recorded beside the model's."""
    model = headprobe.load_model(str(tiny_dir), device="cpu", dtype="bf16", quiet=True)
    for dtype in ({}, {"dtype": "bf16"}, {"dtype": torch.bfloat16}):
        result = headprobe.ablate(model, text=str(text_file), heads="0.0", **SMALL, **dtype)
        assert result.config.dtype == "bfloat16" == result.summary()["config"]["dtype"]
    with pytest.raises(HeadprobeError) as e:
        headprobe.ablate(model, dtype="float32", text=str(text_file), heads="0.0", **SMALL)
    assert "dtype='float32', but the model given is loaded in bfloat16" in one_line(e)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"backend": "transformer-lens"}, "backend='transformer-lens', but the model given is loaded on the native"),
        ({"prepend_bos": False}, "prepend_bos=False, but the model given was loaded with prepend_bos=True"),
        ({"device_map": "auto"}, "device_map= applies when the model is loaded by name"),
        ({"max_memory": "cpu=1GiB"}, "max_memory= applies when the model is loaded by name"),
    ],
)
def test_a_loaded_model_refuses_other_load_settings(cpu_model, text_file, fields, expected):
    """A loaded model runs on its own backend, with its own BOS rule and placement: a load setting
    other than its own is refused in one line, never recorded in summary.json beside a run that did
    not use it; its own is recorded."""
    with pytest.raises(HeadprobeError) as e:
        headprobe.ablate(cpu_model, text=str(text_file), heads="0.0", **SMALL, **fields)
    assert expected in one_line(e)
    summary = headprobe.ablate(cpu_model, backend="native", text=str(text_file), heads="0.0", **SMALL).summary()
    assert (
        summary["config"]["prepend_bos"] is cpu_model.prepend_bos and "native backend" in summary["weights_precision"]
    )
    no_bos = headprobe.load_model(str(cpu_model.spec.name), device="cpu", prepend_bos=False, quiet=True)
    summary = headprobe.ablate(no_bos, text=str(text_file), heads="0.0", **SMALL).summary()
    assert summary["config"]["prepend_bos"] is False  # the model's rule, not the setting's default


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("gpu", "--device 'gpu' is not one of auto, cpu, cuda, cuda:N"),
        ("mps", "--device 'mps' is not one of auto, cpu, cuda, cuda:N"),
        ("cuda:x", "--device 'cuda:x' is not one of"),
        ("cuda", "--device cuda was asked for but no CUDA GPU is available"),
        ("cuda:0", "--device cuda:0 was asked for but no CUDA GPU is available"),
        ("cuda:1", "--device cuda:1 was asked for but no CUDA GPU is available"),
    ],
)
def test_load_model_refuses_a_device_before_loading(device, expected, monkeypatch, capsys):
    """One line, nothing printed and nothing loaded (the loader here fails the test if reached)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def not_reached(*args, **kwargs):
        raise AssertionError("load_model reached the loader")

    monkeypatch.setattr(loading, "load_model", not_reached)
    with pytest.raises(HeadprobeError) as e:
        headprobe.load_model(device=device, quiet=True)
    assert expected in one_line(e)
    assert capsys.readouterr().err == ""


def test_cuda_n_is_checked_against_the_gpus_present(monkeypatch):
    """``cuda:N`` stays valid where GPU N exists; beyond ``torch.cuda.device_count()`` it is refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:1"):
        options.check_device_present(device)
    with pytest.raises(HeadprobeError, match=r"--device cuda:2: this machine has 2 CUDA GPUs \(cuda:0 to cuda:1\)"):
        options.check_device_present("cuda:2")


def test_load_model_takes_a_torch_dtype(tiny_dir):
    model = headprobe.load_model(tiny_dir, device="cpu", dtype=torch.bfloat16, quiet=True)  # a Path, too
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("model", [123, None, 1.5])
@pytest.mark.parametrize("command", ["scan", "ablate", "show"])
def test_a_command_refuses_a_model_that_is_no_name_path_or_loaded_model(model, command):
    kwargs = dict(head="0.0", prompt="a b", out="unused") if command == "show" else {}
    with pytest.raises(HeadprobeError) as e:
        getattr(headprobe, command)(model, **kwargs)
    assert f"{command}(): model must be a model name, a path or a model loaded by headprobe.load_model" in one_line(e)


WRONG_TYPES = {
    "ablate(tiny, heads='0.0', n_natural='2')": "n_natural (--n-natural) must be an integer, got '2' (str)",
    "ablate(tiny, heads='0.0', n_natural=2.5)": "n_natural (--n-natural) must be an integer, got 2.5 (float)",
    "ablate(tiny, heads='0.0', seq_len=True)": "seq_len (--seq-len) must be an integer, got True (bool)",
    "ablate(tiny, heads='0.0', seed='0')": "seed (--seed) must be an integer, got '0' (str)",
    "ablate(tiny, heads='0.0', n_probes=[8])": "n_probes (--n-probes) must be an integer, got [8] (list)",
    "load_model(123)": "load_model(): name must be a model name or path, got 123 (int)",
    "load_model(dtype=16)": "dtype must be a name such as float32 or a torch.dtype, got 16 (int)",
    "load_model(dtype=torch.int8)": "dtype 'torch.int8' is not supported: headprobe computes in float32, bfloat16, float16",
    "load_model(tiny, prepend_bos='no')": "load_model(): prepend_bos must be True or False, got 'no'",
    "load_model(tiny, quiet=0)": "load_model(): quiet must be True or False, got 0",
}
"""Arguments of the wrong type given to ``headprobe``'s functions (ablate's composed settings and
one of its own, load_model's), and the start of the one line each is refused with."""

RUN_WRONG_TYPES = """
import json, sys
import numpy as np
import torch
import headprobe
from headprobe import ablate, load_model
from headprobe.commands.ablate import AblateConfig
from headprobe.probe.core.errors import HeadprobeError
said = {}
expected = json.loads(sys.argv[2])
for case in expected:
    try:
        eval(case, {**globals(), "tiny": sys.argv[1]})
        said[case] = None
    except HeadprobeError as e:
        said[case] = str(e) if "\\n" in str(e) else str(e)[: len(expected[case])]  # one line
config = AblateConfig(heads="0.0", n_natural=np.int64(3), seed=np.int32(1))
said["numpy"] = [type(config.n_natural).__name__, config.n_natural, type(config.seed).__name__]
print(json.dumps(said))
"""


def test_arguments_of_the_wrong_type_are_refused_by_name(tiny_dir):
    """From Python no flag parses a value: the shared settings check the types once for every
    command, in one line naming the setting, before the model loads (load_model its name and dtype,
    before loading); NumPy integers are taken and stored as ``int``. Run as a user runs it:
    without the test suite's runtime type checker, which would refuse some of these first."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", RUN_WRONG_TYPES, str(tiny_dir), json.dumps(WRONG_TYPES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said.pop("numpy") == ["int", 3, "int"]
    assert said == WRONG_TYPES


@pytest.mark.parametrize("command", ["scan", "prune", "kv", "circuit"])
def test_the_python_function_checks_the_memory_plan_the_command_checks(cpu_model, text_file, command, monkeypatch):
    """``headprobe.<command>(...)`` went straight to the run: the plan the command line checks before
    it (the core module's ``batch_line``) was never read, so a budget the command refuses in one line
    ran on. The plan is now read first and its refusal raised before the run."""
    import importlib

    from headprobe.commands import COMMANDS

    module = importlib.import_module(COMMANDS.get(command).function().__module__)
    calls = []

    def spy(model, config):
        calls.append(command)
        return original(model, config)

    original = module.batch_line
    monkeypatch.setattr(module, "batch_line", spy)
    text = str(text_file)
    kwargs = {
        "scan": dict(text=text, types="induction", **SMALL),
        "prune": dict(text=text, **SMALL),
        "kv": dict(text=text, seq_len=64),
        "circuit": dict(n_seqs=1, period=5, steps=2, verify=0),
    }[command]
    with pytest.raises(HeadprobeError) as e:
        getattr(headprobe, command)(cpu_model, memory_budget="1KiB", **kwargs)
    assert calls == [command], calls
    assert "the stated budget 1 KiB" in one_line(e), one_line(e)


def test_a_module_given_as_the_model_is_refused_in_one_line(cpu_model, tiny_llama_gqa_checkpoint):
    """A ``torch.nn.Module`` where a name or a loaded model belongs: its repr spans many lines, and
    load_model and capture_heads put it in the message whole (a message of many lines); scan quoted
    ``str(model)`` so its newlines read as ``\\n``. Each now shows one line of the repr."""
    hf = tiny_llama_gqa_checkpoint.hf_model
    calls = {
        "load_model": lambda: headprobe.load_model(hf),
        "scan": lambda: headprobe.scan(hf),
        "capture_heads": lambda: headprobe.capture_heads(hf, torch.zeros(1, 3, dtype=torch.long)),
    }
    for name, call in calls.items():
        with pytest.raises((HeadprobeError, TypeError)) as e:
            call()
        text = one_line(e)
        assert "\\n" not in text and "(LlamaForCausalLM)" in text and len(text) < 200, (name, text)


def test_wrap_refuses_a_base_model_and_a_tokenizer_name(tiny_llama_gqa_checkpoint):
    """``headprobe.wrap`` of a decoder without its LM head (``AutoModel``'s ``LlamaModel``) raised a
    KeyError from the weight conversion (native) or an AttributeError (bridge); a tokenizer's name
    was taken (to fail at the first text)."""
    ckpt = tiny_llama_gqa_checkpoint
    refused = [
        (dict(hf_model=ckpt.hf_model.model), "takes a causal language model with its LM head"),
        (dict(hf_model=ckpt.hf_model.model, backend="transformer-lens"), "takes a causal language model"),
        (dict(tokenizer="tiny-tokenizer"), "tokenizer must be the model's tokenizer object"),
    ]
    for change, message in refused:
        kwargs = dict(hf_model=ckpt.hf_model, tokenizer=ckpt.tokenizer) | change
        with pytest.raises(HeadprobeError) as e:
            headprobe.wrap(**kwargs)
        assert message in one_line(e), one_line(e)


def test_a_functions_memory_budget_is_for_its_own_run(cpu_model, text_file, no_stated_budget):
    """``headprobe.kv(..., memory_budget="1KiB")`` left 1 KiB stated for the whole process, refused or
    not: what the notebook (or the next test) planned afterwards, without stating any, was held to it."""
    from headprobe.probe.core import memory

    with pytest.raises(HeadprobeError, match="the stated budget 1 KiB"):
        headprobe.kv(cpu_model, memory_budget="1KiB", text=str(text_file), seq_len=64)
    assert memory.stated() is None
    memory.set_budget("3GiB")  # stated by the notebook itself: kept across a function's run
    headprobe.ablate(cpu_model, memory_budget="2GiB", text=str(text_file), heads="0.0", **SMALL)
    assert memory.stated() == (3 * 2**30, "stated budget 3 GiB")


@pytest.fixture
def threads_at_load(monkeypatch) -> list[int]:
    """torch's thread count at each model load (``options.load_for``), in order."""
    seen: list[int] = []
    load_for = options.load_for

    def spy(cfg):
        model = load_for(cfg)
        seen.append(torch.get_num_threads())
        return model

    monkeypatch.setattr(options, "load_for", spy)
    return seen


def test_a_functions_threads_are_for_its_own_run(tiny_dir, text_file, no_stated_budget, threads_at_load):
    """``headprobe.scan("m", threads=2)`` set torch's CPU threads (load_for -> set_threads) for the
    whole process, and kept them after a refusal too: what ran next in the notebook ran on 2. The
    run itself has 2 (seen at the load); afterwards torch has the process's own again."""
    seen = threads_at_load
    before = torch.get_num_threads()
    asked = before + 1
    small = dict(text=str(text_file), types="induction", device="cpu", **SMALL)
    headprobe.scan(str(tiny_dir), threads=asked, verify=False, metrics=False, **small)
    assert seen == [asked] and torch.get_num_threads() == before
    with pytest.raises(HeadprobeError, match="the stated budget 1 KiB"):  # refused after the load
        headprobe.scan(str(tiny_dir), threads=asked, memory_budget="1KiB", **small)
    assert seen == [asked, asked] and torch.get_num_threads() == before
    headprobe.diff(str(tiny_dir), str(tiny_dir), threads=asked, n_perm=9, requantize_b="int8", **small)  # B differs
    assert seen == [asked] * 4 and torch.get_num_threads() == before


def test_the_cli_main_and_run_scan_leave_the_threads_as_they_were(
    tiny_dir, text_file, tmp_path, no_stated_budget, threads_at_load
):
    """``headprobe.cli.main([... "--threads", "1"])`` called from Python and ``scan_core.run_scan``
    with ``threads=1`` set torch's threads for the rest of the process (as the functions did before
    ``own_run``); now the caller's count is back afterwards, after a refusal too. The run itself
    has 1 (seen at the load)."""
    from headprobe.cli import main
    from headprobe.commands import scan_core
    from headprobe.commands.scan import ScanConfig

    seen = threads_at_load
    before = torch.get_num_threads()
    k = 3 if before != 3 else 2
    flags = ["--text", str(text_file), "--types", "induction", "--no-metrics", "--device", "cpu", "--threads", "1"]
    flags += ["--n-natural", "2", "--seq-len", "12", "--n-repeated", "2", "--period", "5"]
    try:
        torch.set_num_threads(k)
        assert main(["scan", "--model", str(tiny_dir), "--out", str(tmp_path / "a"), *flags, "--no-verify"]) == 0
        assert seen == [1] and torch.get_num_threads() == k
        refused = [*flags, "-k", "2", "--n-random", "2", "--memory-budget", "1KiB"]
        assert main(["scan", "--model", str(tiny_dir), "--out", str(tmp_path / "b"), *refused]) == 2  # after the load
        assert seen == [1, 1] and torch.get_num_threads() == k
        small = dict(text=str(text_file), types=("induction",), verify=False, metrics=False, device="cpu", **SMALL)
        scan_core.run_scan(ScanConfig(model=str(tiny_dir), threads=1, **small), progress=False)
        assert seen == [1, 1, 1] and torch.get_num_threads() == k
        with pytest.raises(HeadprobeError, match="the stated budget 1 KiB"):
            scan_core.run_scan(
                ScanConfig(model=str(tiny_dir), threads=1, memory_budget="1KiB", **{**small, "verify": True})
            )
        assert seen == [1, 1, 1, 1] and torch.get_num_threads() == k
    finally:
        torch.set_num_threads(before)
