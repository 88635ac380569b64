"""Real head removal: the pruned model against the masked model, save/load, devices."""

from __future__ import annotations

import pytest
import torch

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.model.pruned import (
    count_attention_parameters,
    keep_mask_from,
    load_pruned,
    remove_heads,
    save_pruned,
)


def _tokens(n=3, T=12, seed=0):
    return torch.randint(0, 100, (n, T), generator=torch.Generator().manual_seed(seed))


CASES = {
    # tiny GPT-2: 2 layers x 4 heads, MHA with biases; all of layer 1 removed
    "tiny_gpt2_native": [(0, 1), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)],
    # tiny Llama: 2 layers x 8 heads on 2 KV heads (group 4): layer 0 loses a whole group
    # (KV head 0 goes) and one head of the other; layer 1 loses heads of both groups
    "tiny_llama_gqa_native": [(0, 0), (0, 1), (0, 2), (0, 3), (0, 6), (1, 1), (1, 4), (1, 7)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_pruned_model_equals_masked_model_and_reloads(request, name, tmp_path):
    model = request.getfixturevalue(name)
    net, spec = model.model, model.spec
    keep = keep_mask_from(CASES[name], spec.n_layers, spec.n_heads)
    tokens = _tokens()
    masked = net(tokens, head_mask=keep.float())
    pruned = remove_heads(net, keep)
    torch.testing.assert_close(pruned(tokens), masked, atol=1e-4, rtol=0)
    torch.testing.assert_close(net(tokens, head_mask=keep.float()), masked)  # the original is untouched
    # the weights are gone
    for layer, block in enumerate(pruned.blocks):
        n_kept = int(keep[layer].sum())
        assert block.attn.q_proj.weight.shape[0] == n_kept * spec.d_head
        assert block.attn.o_proj.weight.shape[1] == n_kept * spec.d_head
        kv_kept = {h // spec.group_size for h in keep[layer].nonzero().flatten().tolist()}
        assert block.attn.k_proj.weight.shape[0] == len(kv_kept) * spec.d_head
    assert count_attention_parameters(pruned) < count_attention_parameters(net)
    path = tmp_path / "pruned.pt"
    save_pruned(pruned, path)
    again = load_pruned(path)
    torch.testing.assert_close(again(tokens), masked, atol=1e-4, rtol=0)
    assert again.kept_heads == pruned.kept_heads
    # padding path (explicit key mask) also works
    am = torch.ones_like(tokens)
    am[0, :3] = 0
    torch.testing.assert_close(
        again(tokens, attention_mask=am), net(tokens, head_mask=keep.float(), attention_mask=am), atol=1e-4, rtol=0
    )


def test_gqa_kv_head_kept_while_any_query_head_reads_it(tiny_llama_gqa_native):
    keep = keep_mask_from([(0, 0), (0, 1), (0, 2)], 2, 8)  # 3 of group 0's 4 heads: KV head 0 stays
    pruned = remove_heads(tiny_llama_gqa_native.model, keep)
    assert pruned.blocks[0].attn.kept_kv_heads == [0, 1]
    assert pruned.blocks[0].attn.kv_index.tolist() == [0, 1, 1, 1, 1]


def test_prune_everything_and_move_devices(tiny_gpt2_native):
    net = tiny_gpt2_native.model
    keep = torch.zeros(2, 4, dtype=torch.bool)
    tokens = _tokens()
    pruned = remove_heads(net, keep)
    torch.testing.assert_close(pruned(tokens), net(tokens, head_mask=keep.float()), atol=1e-4, rtol=0)
    assert count_attention_parameters(pruned) == 2 * 32  # only the two o_proj biases remain
    moved = pruned.to(torch.float64).to("cpu")
    assert moved(tokens).dtype == torch.float64
    if torch.cuda.is_available():
        torch.testing.assert_close(
            pruned.float().cuda()(tokens.cuda()).cpu(), net(tokens, head_mask=keep.float()), atol=1e-4, rtol=0
        )


def test_errors(tiny_gpt2, tiny_gpt2_native, tmp_path):
    with pytest.raises(HeadprobeError):
        remove_heads(tiny_gpt2.model, torch.ones(2, 4, dtype=torch.bool))  # bridge, not native
    with pytest.raises(HeadprobeError):
        remove_heads(tiny_gpt2_native.model, torch.ones(3, 4, dtype=torch.bool))
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a model")
    with pytest.raises(HeadprobeError):
        load_pruned(bad)
    with pytest.raises(HeadprobeError):
        save_pruned(tiny_gpt2_native.model, tmp_path / "x.pt")
