"""Shared fixtures: tiny seeded random models (MHA GPT-2, GQA Llama) behind TransformerLens'
bridge, and the real SmolLM2-135M model, loaded once per test session."""

from __future__ import annotations

import copy
import dataclasses
import os

# The suite runs on the CPU on every machine, subprocesses included: its references and tolerances are
# CPU computations, and what only a GPU run meets is caught by tests/strict_device.py's second CPU
# device. On a GPU machine the GPU check is benchmarks/gpu_check.sh (README). Set before torch
# initialises CUDA (it reads the variable then).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch

from headprobe.analyses.vocabulary import FIGURE_FORMATS_ENV, NO_FIGURES


def pytest_report_header(config):
    return "headprobe: the suite runs on the CPU (CUDA_VISIBLE_DEVICES=''); on a GPU: benchmarks/gpu_check.sh"


def pytest_configure(config):
    """No figures for the whole run, subprocesses included (``$HEADPROBE_FIGURE_FORMATS=none``:
    drawing is most of a tiny model's command); a test that checks its figures asks for them with
    ``@pytest.mark.figures`` (PNG) or ``@pytest.mark.all_figure_formats`` (PNG, PDF and SVG, the
    default of a real run) (:func:`_figure_formats`)."""
    config.addinivalue_line("markers", "figures: the test writes its figures as PNG (the suite writes none)")
    config.addinivalue_line(
        "markers", "all_figure_formats: the test writes figures as PNG, PDF and SVG (the default), not none"
    )
    os.environ[FIGURE_FORMATS_ENV] = NO_FIGURES
    _share_cores_between_workers()
    _heaviest_files_first(config)
    if os.environ.get(FAST_CLOCK_ENV):
        _fast_clock(float(os.environ[FAST_CLOCK_ENV]))


HEAVIEST_FILES = (
    "test_distributed.py",
    "test_models_matrix.py",
    "test_notebooks.py",
    "test_gpu_check.py",
    "test_scan_resume.py",
    "test_result_repr.py",  # every command at tiny settings, then saves with PNG figures: about 60 s (16 s before)
    "test_ablate_prune_cli.py",
    "test_encoder.py",
    "test_weights_cache.py",
    "test_progress.py",
    "test_docs_site.py",
    "test_text_input.py",
    "test_output_dirs.py",
    "test_loading.py",
    # ~30 s each (2026-12-07, alone, 2 shared cores), near the end of the alphabet: among the last files handed
    # out, where a 30 s file can leave the other worker idle; the files after them take ~5 s
    "test_where_to_add.py",
    "test_viewer.py",
)
"""The test files that take longest, longest first (2026-12-05, -n 0 on 2 shared cores: 25-160 s each
without cached bytecode; with it test_models_matrix 74 s, test_distributed 75 s, test_gpu_check 52 s; the
rest take less): under pytest-xdist they are handed out first (:func:`pytest_collection_modifyitems`).
``make test`` gives each worker whole files (``--dist loadfile``), the next file when it has two
tests or fewer left; a heavy file handed out last (xdist's default order is by the number of tests,
which put test_scan_resume's one 65 s test near the end) kept one worker busy while the other was
idle. A file missing from here only runs later; tests/test_suite_order.py names a renamed one."""


def _heaviest_files_first(config) -> None:
    """Under ``--dist loadfile`` (or ``loadscope``), make xdist hand out the files in the collection's
    order (``--no-loadscope-reorder``; its default sorts them by number of tests), which
    :func:`pytest_collection_modifyitems` begins with :data:`HEAVIEST_FILES`."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """In an xdist worker (whose collection is the order the controller hands out), the files of
    :data:`HEAVIEST_FILES` first, in that order; within a file and among the rest the order is kept."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


FAST_CLOCK_ENV = "HEADPROBE_TEST_FAST_CLOCK"
"""``HEADPROBE_TEST_FAST_CLOCK=1000 make test``: ``time.perf_counter`` runs 1000x slow, so every
duration the code measures reads as on a machine 1000x faster: a test that passes only on a slow or
busy machine fails (CONTRIBUTING, "Running the tests")."""


def _fast_clock(factor: float) -> None:
    """Make ``time.perf_counter`` advance ``factor`` times slower than real time (monotonic still)."""
    import time

    real, start = time.perf_counter, time.perf_counter()
    time.perf_counter = lambda: start + (real() - start) / factor  # type: ignore[assignment]


def _share_cores_between_workers():
    """Under pytest-xdist (``make test`` runs ``-n 2``), give each worker its share of the cores:
    torch's CPU kernels use one thread per core and wait for the slowest, so two workers with
    two threads each on two cores run slower than one (README, "On a machine shared with other
    jobs"). Subprocesses a test starts (``OMP_NUM_THREADS``) get the same share."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture
def no_stated_budget(monkeypatch):
    """No working-memory budget stated (neither ``--memory-budget``'s process setting nor
    ``$HEADPROBE_MEMORY_BUDGET``) before and after the test."""
    from headprobe.probe.core import memory

    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    memory.set_budget(None)
    yield
    memory.set_budget(None)


@pytest.fixture(autouse=True)
def _figure_formats(request, monkeypatch):
    """``@pytest.mark.figures``: this test (and the processes it starts) writes PNG figures;
    ``@pytest.mark.all_figure_formats``: every format. A test that finds another setting was left
    behind by an earlier one (which would make later tests draw, or pass only after it) fails."""
    left = os.environ.get(FIGURE_FORMATS_ENV)
    assert left == NO_FIGURES, f"an earlier test left ${FIGURE_FORMATS_ENV}={left!r} (the suite's is {NO_FIGURES!r})"
    if request.node.get_closest_marker("all_figure_formats"):
        monkeypatch.delenv(FIGURE_FORMATS_ENV)
    elif request.node.get_closest_marker("figures"):
        monkeypatch.setenv(FIGURE_FORMATS_ENV, "png")


def make_tiny_tokenizer(tmp_dir, n_words: int = 100):
    """A word-level tokenizer over ``t0 .. t{n-1}`` with ``<|endoftext|>`` as BOS/EOS/unknown."""
    from headprobe.probe.model.tokenizers import word_level_tokenizer

    return word_level_tokenizer(tmp_dir, n_words)


def _checkpoint(hf_model, tokenizer, name, hf_name):
    from headprobe.probe.layout.spec import Checkpoint

    return Checkpoint(name, hf_name, "float32 (random init)", hf_model.eval(), tokenizer)


def _bridge(ckpt):
    from headprobe.probe.backends.wrapping import wrap

    return wrap(dataclasses.replace(ckpt, hf_model=copy.deepcopy(ckpt.hf_model)), backend="transformer-lens")


def _native(ckpt):
    from headprobe.probe.backends.wrapping import wrap

    return wrap(ckpt, backend="native")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """A UTF-8 text of 2000 words of the tiny tokenizer's vocabulary (``t0 .. t99``, seeded), for
    ``--text`` in command tests on the tiny models."""
    g = torch.Generator().manual_seed(0)
    p = tmp_path_factory.mktemp("text") / "words.txt"
    p.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (2000,), generator=g).tolist()), encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def tiny_gpt2_checkpoint(tiny_tokenizer):
    """2 layers x 4 heads, d_model 32, MHA with biases (GPT-2's Conv1D (in, out) weight layout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=32,
        vocab_size=101,
        n_positions=128,
        bos_token_id=100,
        eos_token_id=100,
        attn_implementation="eager",
    )
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():  # non-zero biases, so the b_O term of the W_O decomposition is tested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return _checkpoint(model, tiny_tokenizer, "tiny-gpt2", "gpt2")


@pytest.fixture(scope="session")
def tiny_llama_gqa_checkpoint(tiny_tokenizer):
    """2 layers x 8 query heads on 2 KV heads (GQA, group size 4), rotary, RMSNorm, no biases."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=101,
        max_position_embeddings=128,
        bos_token_id=100,
        eos_token_id=100,
        pad_token_id=100,
        attn_implementation="eager",
        architectures=["LlamaForCausalLM"],
    )
    return _checkpoint(LlamaForCausalLM(cfg), tiny_tokenizer, "tiny-llama-gqa", "tiny-llama-gqa")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_tokenizer, tiny_llama_gqa_checkpoint):
    """The tiny GQA Llama saved as a local Hugging Face model directory (for command-line tests)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama_gqa_checkpoint.hf_model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_gpt2(tiny_gpt2_checkpoint):
    """The tiny GPT-2 behind TransformerLens' TransformerBridge."""
    return _bridge(tiny_gpt2_checkpoint)


@pytest.fixture(scope="session")
def tiny_llama_gqa(tiny_llama_gqa_checkpoint):
    """The tiny GQA Llama behind TransformerLens' TransformerBridge."""
    return _bridge(tiny_llama_gqa_checkpoint)


@pytest.fixture(scope="session")
def tiny_gpt2_native(tiny_gpt2_checkpoint):
    return _native(tiny_gpt2_checkpoint)


@pytest.fixture(scope="session")
def tiny_llama_gqa_native(tiny_llama_gqa_checkpoint):
    return _native(tiny_llama_gqa_checkpoint)


TINY_MODELS = ["tiny_gpt2", "tiny_llama_gqa", "tiny_gpt2_native", "tiny_llama_gqa_native"]
"""Fixture names of every tiny model: both families, MHA and GQA, both backends."""


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """The real SmolLM2-135M-Instruct (4-bit Q4_1 GGUF, dequantized to float32), loaded once (~30 s)."""
    from headprobe.probe.backends.hf_checkpoint import load_checkpoint

    return load_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_checkpoint):
    """(hf_model, tokenizer): the untouched Hugging Face model, the independent reference."""
    return smollm2_checkpoint.hf_model, smollm2_checkpoint.tokenizer


@pytest.fixture(scope="session")
def smollm2(smollm2_checkpoint):
    """SmolLM2 behind TransformerLens' TransformerBridge (on a copy, so smollm2_hf stays pristine)."""
    return _bridge(smollm2_checkpoint)


@pytest.fixture(scope="session")
def smollm2_native(smollm2_checkpoint):
    """SmolLM2 in headprobe's own transformer (weights copied from the checkpoint)."""
    return _native(smollm2_checkpoint)
