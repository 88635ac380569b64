"""Every output of the native model on the zoo, saved by one commit and compared by another: a
refactor of probe/model/transformer.py must leave them equal.

For each zoo family (tests/zoo.py), six variants of them, BERT and three native-only configs
(MLA with learned positions, MLA with a query latent, attention-only GQA): the logits on the
fused and the eager path, with left padding (both paths), with a head mask ([layer, head] and
[batch, layer, head]), through hook_result, KV-cached decoding in steps (both paths) and the
cache's bytes, every run_with_cache activation, and a pruned copy's logits where the family
can be pruned. Seeded; CPU, float32.

usage (from the repository root, a checkout of each commit in turn):
    OMP_NUM_THREADS=1 python scripts/native_outputs.py save /tmp/before.pt
    OMP_NUM_THREADS=1 python scripts/native_outputs.py compare /tmp/before.pt   # max |diff| per model
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, "tests")
import zoo
from conftest import make_tiny_tokenizer

from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.model.cache import KVCache
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.transformer import Transformer

#: name -> (family, config changes) of the Hugging Face checkpoints compared.
VARIANTS = {
    **{f: (f, {}) for f in zoo.ZOO},
    "deepseek_v3+qlora": ("deepseek_v3", dict(q_lora_rank=24, rope_interleave=True)),
    "deepseek_v3+wide_v": ("deepseek_v3", dict(qk_nope_head_dim=12, v_head_dim=28, rope_interleave=False)),
    "gemma2+hd24": ("gemma2", dict(head_dim=24, query_pre_attn_scalar=20)),
    "qwen3+hd8": ("qwen3", dict(head_dim=8)),
    "qwen2+slide": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "gpt_neox+seq": ("gpt_neox", dict(use_parallel_residual=False, rotary_pct=0.5)),
}


#: name -> TransformerConfig fields of the native-only models compared (seeded default init).
NATIVE_ONLY = {
    "mla_learned": dict(bias=False, kv_lora_rank=8),
    "mla_rot_q": dict(
        bias=False, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=6, q_lora_rank=12, positional="rotary"
    ),
    "attn_only_gqa": dict(n_kv_heads=2, mlp=None, positional="rotary", bias=False),
}


def outputs(net: Transformer) -> dict[str, torch.Tensor]:
    """Every output listed in the module docstring, by name."""
    out = {}
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, zoo.VOCAB - 1, (2, 20), generator=g)
    with torch.no_grad():
        out["fused"] = net(x)
        net.force_eager = True
        out["eager"] = net(x)
        net.force_eager = False
        mask = torch.ones_like(x)
        mask[0, :5] = 0  # the first sequence left-padded
        out["padded"] = net(x, attention_mask=mask)
        net.force_eager = True
        out["padded_eager"] = net(x, attention_mask=mask)
        net.force_eager = False
        hm = torch.rand(net.cfg.n_layers, net.cfg.n_heads, generator=g)
        out["head_mask"] = net(x, head_mask=hm)
        out["head_mask_b"] = net(x, head_mask=torch.rand(2, net.cfg.n_layers, net.cfg.n_heads, generator=g))
        logits, cache = net.run_with_cache(x)
        out["cached_logits"] = logits
        for k, v in cache.items():
            out["act:" + k] = v
        res = {}
        hooks = [
            (f"blocks.{l}.attn.hook_result", lambda t, hook, l=l: res.__setitem__(l, t.clone()))
            for l in range(net.cfg.n_layers)
        ]
        out["result_path"] = net.run_with_hooks(x, fwd_hooks=hooks)
        for l, t in res.items():
            out[f"result{l}"] = t
        if net.cfg.causal:
            for eager in (False, True):
                net.force_eager = eager
                c = KVCache()
                steps = [net(x[:, :7], cache=c)]
                for i in range(7, 20, 3):
                    steps.append(net(x[:, i : i + 3], cache=c))
                out[f"kv_steps_{eager}"] = torch.cat(steps, 1)
                out[f"kv_nbytes_{eager}"] = torch.tensor(c.nbytes)
            net.force_eager = False
    return out


def pruned_outputs(net: Transformer) -> dict[str, torch.Tensor]:
    """A pruned copy's logits on both paths (empty for an architecture that cannot be pruned)."""
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.model.pruned import check_prunable, remove_heads

    try:
        check_prunable(net.cfg)
    except HeadprobeError:
        return {}
    keep = torch.ones(net.cfg.n_layers, net.cfg.n_heads, dtype=torch.bool)
    keep[0, 1] = keep[1, 0] = keep[1, 3] = False
    p = remove_heads(net, keep)
    x = torch.randint(0, zoo.VOCAB - 1, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        o = {"pruned": p(x)}
        p.force_eager = True
        o["pruned_eager"] = p(x)
    return o


def collect() -> dict[str, dict[str, torch.Tensor]]:
    """model name -> its outputs."""
    tok = make_tiny_tokenizer(Path(tempfile.mkdtemp()))
    allout = {}
    for name, (family, change) in VARIANTS.items():
        net = wrap(zoo.make_checkpoint(family, tok, **change), backend="native").model
        allout[name] = {**outputs(net), **pruned_outputs(net)}
    allout["bert"] = outputs(wrap(zoo.make_checkpoint("bert", tok), backend="native").model)
    for name, fields in NATIVE_ONLY.items():
        torch.manual_seed(0)
        net = Transformer(
            TransformerConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=zoo.VOCAB, n_ctx=64, **fields)
        ).eval()
        allout[name] = {**outputs(net), **pruned_outputs(net)}
    return allout


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, path = sys.argv[1], sys.argv[2]
    got = collect()
    if mode == "save":
        torch.save(got, path)
        print("saved", sum(len(v) for v in got.values()), "tensors of", len(got), "models")
    else:
        want = torch.load(path)
        worst = 0.0
        for name in want:
            w, g = want[name], got[name]
            assert set(w) == set(g), (name, set(w) ^ set(g))
            d = max(float((w[k].double() - g[k].double()).abs().max()) if w[k].numel() else 0.0 for k in w)
            worst = max(worst, d)
            print(f"{name:22s} {len(w):4d} tensors  max |diff| {d:.3g}")
        print("overall max |diff|", worst)
