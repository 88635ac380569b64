"""A block's MLP: dense (:class:`MLP`: GELU, SwiGLU, GeGLU) or a mixture of experts (:class:`MoE`,
with an optional shared expert).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from headprobe.probe.model.config import TransformerConfig

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's gelu_new
    "gelu_erf": F.gelu,
    "swiglu": F.silu,
    "geglu": functools.partial(F.gelu, approximate="tanh"),  # Gemma's gelu_pytorch_tanh
}


class MLP(nn.Module):
    """GPT-2: ``W_out gelu_tanh(W_in x + b_in) + b_out`` (GPT-NeoX: exact GELU); Llama:
    ``W_out (silu(W_gate x) * W_in x)``; Gemma: ``W_out (gelu_tanh(W_gate x) * W_in x)``."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        assert (
            cfg.mlp is not None and cfg.d_mlp is not None
        )  # an MLP is made only with cfg.mlp; d_mlp filled by __post_init__
        self.gated = cfg.mlp in ("swiglu", "geglu")
        self.act = _ACTIVATIONS[cfg.mlp]
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.bias)
        self.fc_gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.bias) if self.gated else None
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp], the activation's input
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp], W_in x (gated only)
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if self.gated:
            assert self.fc_gate is not None
            post = self.act(self.hook_pre(self.fc_gate(x))) * self.hook_pre_linear(self.fc_in(x))
        else:
            post = self.act(self.hook_pre(self.fc_in(x)))
        return self.fc_out(self.hook_post(post))


class SharedExpert(nn.Module):
    """An always-on gated expert beside the routed ones, ``W_out (act(W_gate x) * W_in x)``
    without biases or hook points (Llama-4's ``shared_expert``, Qwen3-Next's)."""

    def __init__(self, cfg: TransformerConfig, width: int):
        super().__init__()
        assert cfg.mlp is not None  # a mixture of experts is gated (TransformerConfig._check_moe)
        self.act = _ACTIVATIONS[cfg.mlp]
        self.fc_gate = nn.Linear(cfg.d_model, width, bias=False)
        self.fc_in = nn.Linear(cfg.d_model, width, bias=False)
        self.fc_out = nn.Linear(width, cfg.d_model, bias=False)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.fc_out(self.act(self.fc_gate(x)) * self.fc_in(x))


class MoE(nn.Module):
    """Mixture-of-experts MLP (Shazeer et al. 2017; Fedus et al. 2022): a router ``W_r x (+ b_r)``
    picks ``n_experts_per_token`` of ``n_experts`` gated experts per token and weights them
    (``cfg.router``), the output is the weighted sum of their outputs, plus a shared expert
    (times ``sigmoid(w . x)`` with ``shared_expert_gate``). Expert ``e`` is ``W_down[e] f(W_gate_up[e]
    x + b)``, ``W_gate_up[e]`` the gate rows then the up rows, ``f`` the gated activation (or
    GPT-OSS's clamped one, ``swiglu_limit``). The weight multiplies the expert's output, or its
    input (``router_on_input``, Llama-4).

    Sources (transformers): ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``, ``GptOssMLP``,
    ``Llama4TextMoe``, ``Qwen3NextSparseMoeBlock``. A loop over the experts each token picked, in
    expert order (as Hugging Face's); no hook points inside (``hook_mlp_out`` holds the sum).
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        E, D, d = cfg.n_experts, cfg.d_model, cfg.d_expert
        assert E is not None and d is not None and cfg.mlp is not None  # a MoE config (TransformerConfig._check_moe)
        self.cfg = cfg
        self.act = _ACTIVATIONS[cfg.mlp]
        self.router = nn.Linear(D, E, bias=cfg.router_bias)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * d, D) * 0.02)  # [expert, gate rows | up rows, d_model]
        self.down = nn.Parameter(torch.randn(E, D, d) * 0.02)  # [expert, d_model, d_expert]
        self.gate_up_bias = nn.Parameter(torch.zeros(E, 2 * d)) if cfg.expert_bias else None
        self.down_bias = nn.Parameter(torch.zeros(E, D)) if cfg.expert_bias else None
        self.shared = None if cfg.d_shared_expert is None else SharedExpert(cfg, cfg.d_shared_expert)
        self.shared_gate = nn.Linear(D, 1, bias=False) if cfg.shared_expert_gate else None

    def route(self, x: Float[Tensor, "token d_model"]) -> tuple[Float[Tensor, "token k"], Int[Tensor, "token k"]]:
        """The top-k experts of every token and their weights (``cfg.router``)."""
        cfg, k = self.cfg, self.cfg.n_experts_per_token
        logits = self.router(x)  # [token, expert]
        if cfg.router == "softmax_topk":  # Mixtral, Qwen3-MoE: softmax over all experts, then top-k
            weights, index = torch.topk(logits.float().softmax(dim=-1), k, dim=-1)
            if cfg.router_renorm:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(logits.dtype), index
        top, index = torch.topk(logits, k, dim=-1)
        if cfg.router == "topk_softmax":  # GPT-OSS: softmax over the k logits
            return top.softmax(dim=-1), index
        return torch.sigmoid(top.float()).to(top.dtype), index  # Llama-4: sigmoid of each

    def expert(self, e: int, x: Float[Tensor, "token d_model"]) -> Float[Tensor, "token d_model"]:
        """Expert ``e``'s output."""
        b_gu = None if self.gate_up_bias is None else self.gate_up_bias[e]
        gate, up = F.linear(x, self.gate_up[e], b_gu).chunk(2, dim=-1)
        limit = self.cfg.swiglu_limit
        if limit is None:
            h = self.act(gate) * up
        else:  # GPT-OSS (GptOssExperts._apply_gate)
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * self.cfg.swiglu_alpha))
        return F.linear(h, self.down[e], None if self.down_bias is None else self.down_bias[e])

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.route(flat)  # [token, k]
        out = torch.zeros_like(flat)
        for e in index.unique().tolist():
            token, slot = torch.where(index == e)
            w = weights[token, slot, None]
            if self.cfg.router_on_input:
                y = self.expert(e, flat[token] * w)
            else:
                y = self.expert(e, flat[token]) * w
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared is not None:
            shared = self.shared(flat)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        return out.view_as(x)


def make_mlp(cfg: TransformerConfig, layer: int = 0) -> nn.Module | None:
    """Layer ``layer``'s MLP: :class:`MoE` on a mixture-of-experts layer, else :class:`MLP`, or
    None for an attention-only model."""
    if cfg.mlp is None:
        return None
    return MoE(cfg) if cfg.is_moe(layer) else MLP(cfg)
