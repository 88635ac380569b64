"""TransformerLens names of the hook points, modules and parameters of a block (torch-free).

Every hook name the code registers or reads is built here, as TransformerLens names it
(``transformer_lens.utils.get_act_name`` and the ``HookPoint`` attributes of
``transformer_lens/components/``: ``TransformerBlock``, ``AbstractAttention``, ``LayerNorm``/``RMSNorm``,
``MLP``/``GatedMLP``); the native model (:mod:`headprobe.probe.model.transformer`) declares the same hook points,
and TransformerLens' ``TransformerBridge`` offers them too. Module and parameter paths of a
block (``blocks.{layer}.attn.q_proj.weight``) are built by :func:`block_path`. Nothing outside
this module and ``probe/model/transformer.py`` spells ``blocks.`` (``tests/test_architecture.py``).
"""

from __future__ import annotations

BLOCK_HOOKS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "normalized_resid_post")
"""Hook points of a block itself: ``blocks.{layer}.hook_<name>``."""
ATTN_HOOKS = ("q", "k", "v", "rot_q", "rot_k", "attn_scores", "pattern", "z", "result", "sinks", "gate")
"""Hook points of a block's attention: ``blocks.{layer}.attn.hook_<name>`` (``sinks``: learned sink
logits ``[head]``, GPT-OSS; ``gate``: an output gate's values multiplying ``z``, gated attention only)."""
NORMS = {
    "ln1": ("normalized", "scale"),
    "ln2": ("normalized", "scale"),
    "ln1_post": ("in", "out"),
    "ln2_post": ("in", "out"),
}
"""A block's norms and their hook points: ``blocks.{layer}.<norm>.hook_<name>`` (the pre-norms' ``hook_scale``
is TransformerLens'; the post norms' ``hook_in``/``hook_out`` are its bridge's)."""
MLP_HOOKS = ("pre", "pre_linear", "post")
"""Hook points of a block's MLP (``pre_linear``: gated MLPs only): ``blocks.{layer}.mlp.hook_<name>``."""
FINAL_NORM_HOOKS = ("normalized", "scale")
"""Hook points of the final norm: ``ln_final.hook_<name>``."""

EMBED = "hook_embed"
"""The token embedding, ``[batch, pos, d_model]``."""
POS_EMBED = "hook_pos_embed"
"""The learned position embedding (models that have one), ``[batch, pos, d_model]``."""
EMBED_NORM = "ln_embed.hook_normalized"
"""The embedding norm's output (BERT), ``[batch, pos, d_model]``."""
UNEMBED_IN = "unembed.hook_in"
"""The unembedding's input (the bridge's name: the final norm's output), ``[batch, pos, d_model]``."""


def _checked(name: str, allowed: tuple[str, ...] | dict, where: str) -> str:
    if name not in allowed:
        raise ValueError(f"no hook point {name!r} in {where}: one of {', '.join(allowed)}")
    return name


def block_path(layer: int, path: str = "") -> str:
    """Module or parameter path ``blocks.{layer}`` or ``blocks.{layer}.{path}`` in the native model."""
    return f"blocks.{layer}.{path}" if path else f"blocks.{layer}"


def block_hook(layer: int, name: str) -> str:
    """``blocks.{layer}.hook_{name}``, ``name`` one of :data:`BLOCK_HOOKS` (``resid_pre``, ...); ValueError else."""
    return block_path(layer, "hook_" + _checked(name, BLOCK_HOOKS, "a block"))


def attn_hook(layer: int, name: str) -> str:
    """``blocks.{layer}.attn.hook_{name}``, ``name`` one of :data:`ATTN_HOOKS` (``pattern``, ``z``, ...); ValueError else."""
    return block_path(layer, "attn.hook_" + _checked(name, ATTN_HOOKS, "attention"))


def norm_hook(layer: int, norm: str, name: str) -> str:
    """``blocks.{layer}.{norm}.hook_{name}`` for a norm and hook point of :data:`NORMS`; ValueError else."""
    return block_path(layer, f"{_checked(norm, NORMS, 'a block')}.hook_{_checked(name, NORMS[norm], norm)}")


def mlp_hook(layer: int, name: str) -> str:
    """``blocks.{layer}.mlp.hook_{name}``, ``name`` one of :data:`MLP_HOOKS`; ValueError else."""
    return block_path(layer, "mlp.hook_" + _checked(name, MLP_HOOKS, "an MLP"))


def final_norm_hook(name: str) -> str:
    """``ln_final.hook_{name}``, ``name`` one of :data:`FINAL_NORM_HOOKS`; ValueError else."""
    return "ln_final.hook_" + _checked(name, FINAL_NORM_HOOKS, "the final norm")
