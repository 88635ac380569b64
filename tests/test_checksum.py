"""The weights fingerprint's on-device digest equals the same sums taken with Python's unbounded
integers, changes with any one word or any exchange of two words, and does not copy weights to
the host; the fingerprint of a loaded model moves with one weight's last bit."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from headprobe.probe.core.checksum import ROW, row_weights, tensor_digest


def _reference(t: torch.Tensor) -> bytes:
    """The digest by its definition, word by word in Python integers."""
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    whole = len(raw) // (4 * ROW) * (4 * ROW)
    w = [((j * 2654435761) % (1 << 19)) * 2 + 1 for j in range(ROW)]
    out = b""
    for r in range(0, whole, 4 * ROW):
        words = struct.unpack(f"<{ROW}i", raw[r : r + 4 * ROW])
        out += struct.pack("<q", sum(a * b for a, b in zip(words, w, strict=True)))
    return out + raw[whole:]


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(3 * ROW + 5, generator=torch.Generator().manual_seed(0)),
        torch.randn(2 * ROW + 3, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        torch.arange(ROW + 7, dtype=torch.uint8),
        torch.full((2 * ROW,), -(2**31), dtype=torch.int32),  # the largest terms: no overflow
        torch.full((ROW,), 2**31 - 1, dtype=torch.int32),
        torch.ones(3),
    ],
    ids=["float32", "bfloat16-odd", "uint8", "int32-min", "int32-max", "short"],
)
def test_the_digest_is_its_definition_in_python_integers(t):
    assert tensor_digest(t) == _reference(t)


def test_the_row_weights_are_distinct_odd_and_small_enough_for_exact_sums():
    w = row_weights().tolist()
    assert len(set(w)) == ROW and all(x % 2 == 1 and 0 < x < 2**20 for x in w)
    assert 2**31 * max(w) * ROW < 2**63


def test_any_one_word_or_an_exchange_of_two_changes_the_digest():
    rng = np.random.default_rng(0)
    base = torch.randn(4 * ROW + 9, generator=torch.Generator().manual_seed(2))
    ref = tensor_digest(base)
    for i in [*rng.integers(0, base.numel(), 50), 0, ROW - 1, 4 * ROW, base.numel() - 1]:
        t = base.clone()
        t[i] = torch.nextafter(t[i], torch.tensor(float("inf")))  # the last bit of one float
        assert tensor_digest(t) != ref, i
    for _ in range(50):
        i, j = rng.integers(0, base.numel(), 2)
        if base[i] == base[j]:
            continue
        t = base.clone()
        t[[i, j]] = t[[j, i]]
        assert tensor_digest(t) != ref, (i, j)


def test_the_fingerprint_of_a_model_moves_with_one_weights_last_bit(tiny_llama_gqa_checkpoint):
    import copy
    import dataclasses

    from headprobe.probe.backends.wrapping import wrap

    def fingerprint(hf_model):
        return wrap(
            dataclasses.replace(tiny_llama_gqa_checkpoint, hf_model=hf_model), backend="native"
        ).weights_fingerprint()

    a = copy.deepcopy(tiny_llama_gqa_checkpoint.hf_model)
    same, moved = fingerprint(a), fingerprint(copy.deepcopy(a))
    assert same == moved
    w = a.model.layers[1].self_attn.o_proj.weight
    with torch.no_grad():
        w[5, 7] = torch.nextafter(w[5, 7], torch.tensor(float("inf")))
    assert fingerprint(a) != same


def test_only_the_digest_is_copied_off_the_tensors_device():
    from torch.overrides import TorchFunctionMode

    class Copies(TorchFunctionMode):
        nbytes = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.cpu:
                Copies.nbytes += args[0].numel() * args[0].element_size()
            return func(*args, **(kwargs or {}))

    t = torch.randn(64 * ROW + 3)
    with Copies():
        digest = tensor_digest(t)
    assert Copies.nbytes == len(digest) == 64 * 8 + 12  # 64 row sums and the 3 words past them
