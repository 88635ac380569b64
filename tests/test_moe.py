"""The native mixture-of-experts MLP (headprobe.probe.model.feedforward.MoE) against Hugging Face's own MoE
blocks, built from tiny configs with random weights and run on random inputs: Mixtral, Qwen3-MoE
(with and without ``norm_topk_prob``), GPT-OSS (router bias, expert biases, interleaved gate/up,
the clamp reached), Llama-4 (sigmoid weight on the expert input, shared expert) and Qwen3-Next
(shared expert behind a sigmoid gate). Each case also shows the comparison failing when one
option of the native config is flipped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import moe_weights
from headprobe.probe.model.feedforward import MoE
from headprobe.probe.model.transformer import Transformer

D, E, K, I = 64, 6, 2, 32
BASE = dict(
    n_layers=1,
    d_model=D,
    n_heads=4,
    d_vocab=11,
    mlp="swiglu",
    bias=False,
    n_experts=E,
    n_experts_per_token=K,
    d_expert=I,
)


def _mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf = MixtralSparseMoeBlock(
        MixtralConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    )
    return hf, {}, {}, dict(router_renorm=False)  # (renormalised softmax top-k is topk_softmax exactly)


def _qwen3_moe(norm: bool):
    def make():
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        hf = Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(
                hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm
            )
        )
        return hf, dict(router_renorm=norm), {}, dict(router_renorm=not norm)

    return make


def _gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf = GptOssMLP(
        GptOssConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K, swiglu_limit=0.5)
    )
    return (
        hf,
        dict(router="topk_softmax", router_bias=True, expert_bias=True, swiglu_limit=0.5),
        dict(router="router", layout="interleaved"),
        dict(swiglu_limit=None),
    )


def _llama4():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    hf = Llama4TextMoe(Llama4TextConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K))
    return (
        hf,
        dict(router="topk_sigmoid", router_on_input=True, d_shared_expert=I),
        dict(router="router", layout="transposed", shared="shared_expert"),
        dict(router_on_input=False),
    )


def _qwen3_next():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    hf = Qwen3NextSparseMoeBlock(
        Qwen3NextConfig(
            hidden_size=D,
            moe_intermediate_size=I,
            num_experts=E,
            num_experts_per_tok=K,
            shared_expert_intermediate_size=48,
        )
    )
    return (
        hf,
        dict(d_shared_expert=48, shared_expert_gate=True),
        dict(shared="shared_expert", shared_gate="shared_expert_gate"),
        dict(shared_expert_gate=False),
    )


CASES = {
    "mixtral": _mixtral,
    "qwen3_moe-norm_topk_prob": _qwen3_moe(True),
    "qwen3_moe": _qwen3_moe(False),
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "qwen3_next": _qwen3_next,
}


def _case(name):
    """(Hugging Face block with random weights, native MoE holding them, one option flipped)."""
    torch.manual_seed(0)
    hf, fields, conversion, flipped = CASES[name]()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    cfg = TransformerConfig(**BASE, **fields)
    moe = MoE(cfg)
    moe.load_state_dict(moe_weights(hf.state_dict(), "", "", **conversion), strict=True)
    return hf.eval(), moe.eval(), cfg, flipped


def _relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", list(CASES))
def test_moe_equals_hugging_faces_block(name):
    hf, moe, cfg, flipped = _case(name)
    x = torch.randn(3, 9, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x)
        want = (want[0] if isinstance(want, tuple) else want).view_as(
            x
        )  # GPT-OSS, Llama-4: router outputs too; Llama-4 flat
        got = moe(x)
        assert _relative(got, want) < 1e-5, name
        wrong = MoE(dataclasses.replace(cfg, **flipped))
        wrong.load_state_dict(moe.state_dict(), strict=False)  # Qwen3-Next flipped: no gate to load
        assert _relative(wrong(x), want) > 1e-3, name  # the comparison can fail
        if cfg.swiglu_limit is not None:  # the clamp is reached
            gate_up = torch.einsum("td,ejd->tej", x.reshape(-1, D), moe.gate_up) + moe.gate_up_bias
            assert (gate_up.abs() > cfg.swiglu_limit).float().mean() > 0.1


def test_moe_layers_and_dense_layers_in_one_model():
    """``moe_layers`` picks the mixture layers; the others keep the dense MLP of width ``d_mlp``."""
    from headprobe.probe.model.feedforward import MLP

    cfg = TransformerConfig(**{**BASE, "n_layers": 3}, d_mlp=40, moe_layers=(1,), positional="rotary", norm="rmsnorm")
    net = Transformer(cfg)
    assert [type(b.mlp) for b in net.blocks] == [MLP, MoE, MLP]
    assert net.blocks[0].mlp.fc_in.out_features == 40 and net.blocks[1].mlp.down.shape == (E, D, I)
    again = TransformerConfig.from_json(json_round_trip(dataclasses.asdict(cfg)))
    assert again == cfg


def json_round_trip(d):
    import json

    return json.loads(json.dumps(d))


@pytest.mark.parametrize(
    "change",
    [
        dict(n_experts_per_token=E + 1),
        dict(n_experts_per_token=0),
        dict(mlp="gelu"),
        dict(moe_layers=(3,)),
        dict(swiglu_limit=0.0),
    ],
)
def test_bad_moe_configs_are_refused_in_one_line(change):
    with pytest.raises(HeadprobeError) as e:
        TransformerConfig(**{**BASE, **change})
    assert "\n" not in str(e.value)


def test_moe_fields_without_experts_are_refused():
    with pytest.raises(HeadprobeError, match="n_experts"):
        TransformerConfig(n_layers=1, d_model=D, n_heads=4, d_vocab=11, moe_layers=(0,))
