"""Real head removal: a native :class:`~headprobe.probe.model.transformer.Transformer` whose pruned heads' weights are gone.

:func:`remove_heads` returns a copy of a native model in which each layer keeps only the query
heads not pruned: the rows of ``q_proj`` and the columns of ``o_proj`` of a removed query head
are dropped, so the projections are smaller. Under GQA a key/value head is removable only when
all the query heads of its group are (any kept query head still reads it), so ``k_proj`` and
``v_proj`` keep the key/value heads that at least one kept query head reads. A layer with no
query head left returns only the output bias (zero for Llama). The result equals the original
model with the removed heads' ``z`` multiplied by 0 (``head_mask``), to float rounding.

:func:`save_pruned` writes config, kept heads and state dict with ``torch.save`` (loaded back
with ``weights_only=True``); :func:`load_pruned` rebuilds the model from that file.
Pruning itself: Michel, Levy, Neubig 2019, arXiv 1905.10650.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import atomic_path
from headprobe.probe.hooks.names import attn_hook, block_path
from headprobe.probe.model.attention import QKV, Attention
from headprobe.probe.model.cache import KVCache, StreamingKVCache
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.transformer import Transformer

FORMAT = "headprobe-pruned-v1"


def check_prunable(cfg: TransformerConfig) -> None:
    """Refuse architectures whose heads cannot be removed exactly.

    Raises:
        HeadprobeError: multi-head latent attention (keys and values come from one shared
            latent), or a QK-norm over all heads' projection (OLMo-2: removing a head changes
            the norm of every other head's query).
    """
    if cfg.is_mla:
        raise HeadprobeError("real head removal is not implemented for multi-head latent attention (MLA)")
    if cfg.attn_gate:
        raise HeadprobeError(
            "real head removal is not implemented for gated attention (attn_gate); use head masks (headprobe ablate)"
        )
    if cfg.qk_norm == "full":
        raise HeadprobeError(
            "real head removal is not exact for a QK-norm over all heads (OLMo-2): removing a head "
            "changes the other heads' queries; use head masks (headprobe ablate) instead"
        )


class PrunedAttention(Attention):
    """Causal attention over a subset of query heads (and the key/value heads they read).

    Built by :class:`~headprobe.probe.model.attention.Attention` with fewer heads, so every option of
    the config (biases, per-head QK-norm, partial rotary, sliding window, soft-capping) is
    computed by the same code as the full model.

    Attributes:
        kept_heads: original indices of the kept query heads, ascending.
        kept_kv_heads: original indices of the kept key/value heads, ascending.
        kv_index: buffer ``[kept head]``: for each kept query head, the position of its key/value
            head among the kept ones (moves with ``.to(device)``).

    Hook points ``hook_q`` ``[batch, pos, kept head, d_qk]``, ``hook_k``/``hook_v`` ``[batch,
    pos, kept kv_head, d_qk | d_head]`` and ``hook_z`` ``[batch, pos, kept head, d_head]`` exist;
    the pattern is materialised only where soft-capping needs the eager path, and ``head_mask``
    is not accepted.

    Raises:
        HeadprobeError: an architecture :func:`check_prunable` refuses, or kept heads out of range.
    """

    kv_index: Tensor  # the buffer registered in __init__

    def __init__(self, cfg: TransformerConfig, kept_heads: Sequence[int], layer: int = 0):
        check_prunable(cfg)
        kept = sorted(set(int(h) for h in kept_heads))
        if any(not 0 <= h < cfg.n_heads for h in kept):
            raise HeadprobeError(f"kept heads {kept} out of range for {cfg.n_heads} heads")
        kept_kv = sorted({h // cfg.group_size for h in kept})
        with warnings.catch_warnings():  # a layer with every head removed has zero-size projections
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            super().__init__(cfg, layer, n_heads=len(kept), n_kv_heads=len(kept_kv))
        self.kept_heads, self.kept_kv_heads = kept, kept_kv
        self.register_buffer(
            "kv_index", torch.tensor([kept_kv.index(h // cfg.group_size) for h in kept], dtype=torch.long)
        )

    @property
    def n_kept(self) -> int:
        return len(self.kept_heads)

    def needs_pattern(self) -> bool:
        return self.softcap is not None

    @torch.no_grad()
    def load_from(self, attn: Attention) -> PrunedAttention:
        """Copy the kept heads' slices of a full :class:`Attention`'s weights into this module."""
        d_qk, d_head, dev = self.cfg.d_qk, self.cfg.d_head, attn.q_proj.weight.device
        assert d_head is not None  # filled by TransformerConfig.__post_init__
        self.to(attn.q_proj.weight)
        for name, heads, d in (
            ("q_proj", self.kept_heads, d_qk),
            ("k_proj", self.kept_kv_heads, d_qk),
            ("v_proj", self.kept_kv_heads, d_head),
        ):
            ours, theirs, sel = getattr(self, name), getattr(attn, name), head_rows(heads, d, dev)
            ours.weight.copy_(theirs.weight[sel])
            if ours.bias is not None:
                ours.bias.copy_(theirs.bias[sel])
        self.o_proj.weight.copy_(attn.o_proj.weight[:, head_rows(self.kept_heads, d_head, dev)])
        if self.o_proj.bias is not None:
            self.o_proj.bias.copy_(attn.o_proj.bias)
        if self.sinks is not None:  # learned sinks (GPT-OSS): one logit per query head
            assert attn.sinks is not None  # the same config
            self.sinks.copy_(attn.sinks[self.kept_heads])
        for name in ("q_norm", "k_norm"):  # per-head QK-norm (Qwen3): one weight shared by all heads
            if getattr(self, name) is not None:
                getattr(self, name).weight.copy_(getattr(attn, name).weight)
        return self

    def qkv(
        self,
        x: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "batch pos"],
        cache: KVCache | StreamingKVCache | None = None,
    ) -> QKV:
        """:class:`~headprobe.probe.model.attention.Attention`'s, with each kept query head given its own
        key/value head when the groups are no longer uniform (``kv_index``)."""
        q, k, v = super().qkv(x, positions)  # [batch, kept head | kept kv_head, pos, d]
        if self.n_kv_heads != self.n_heads:
            k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
        return q, k, v

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "batch pos"],
        padding: Bool[Tensor, "batch pos"] | None = None,
        head_mask: Tensor | None = None,
        cache: KVCache | StreamingKVCache | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """:meth:`~headprobe.probe.model.attention.SelfAttention.forward` over the kept heads (``hook_z``
        ``[batch, pos, kept head, d_head]``); a layer with no head left returns ``b_O``.

        Raises:
            HeadprobeError: a ``head_mask`` or a ``cache`` is given.
        """
        if head_mask is not None:
            raise HeadprobeError("a pruned model takes no head_mask: its removed heads are gone")
        if cache is not None:
            raise HeadprobeError("KV-cache generation is not implemented for pruned models; run them without a cache")
        if self.n_kept == 0:
            out = x.new_zeros(x.shape)
            return out if self.o_proj.bias is None else out + self.o_proj.bias
        return super().forward(x, positions, padding)


def head_rows(heads: Sequence[int], width: int, device: torch.device | str = "cpu") -> Int[Tensor, " n"]:
    """The rows ``h*width:(h+1)*width`` of every head ``h`` in ``heads``, in order: where those
    heads sit in a fused projection's output (``width``: ``d_qk`` for q/k, ``d_head`` for v, and
    for ``o_proj``'s input columns)."""
    return torch.tensor([i for h in heads for i in range(h * width, (h + 1) * width)], dtype=torch.long, device=device)


def keep_mask_from(removed: Sequence[tuple[int, int]], n_layers: int, n_heads: int) -> Bool[Tensor, "layer head"]:
    """``[layer, head]`` True for kept heads, False for the ``(layer, head)`` pairs in ``removed``."""
    keep = torch.ones(n_layers, n_heads, dtype=torch.bool)
    for layer, head in removed:
        keep[layer, head] = False
    return keep


def _install(net: Transformer, keep: Tensor) -> Transformer:
    cfg = net.cfg
    if tuple(keep.shape) != (cfg.n_layers, cfg.n_heads):
        raise HeadprobeError(f"keep mask has shape {tuple(keep.shape)}; expected [{cfg.n_layers}, {cfg.n_heads}]")
    for layer, block in enumerate(net.blocks):
        kept = keep[layer].nonzero().flatten().tolist()
        new = PrunedAttention(cfg, kept, layer)
        if not isinstance(block.attn, PrunedAttention):
            assert isinstance(block.attn, Attention)  # check_prunable refused MLA
            new.load_from(block.attn)
        block.attn = new
    net.kept_heads = [keep[layer].nonzero().flatten().tolist() for layer in range(cfg.n_layers)]
    net.setup()  # re-register the hook points of the new modules
    return net


def remove_heads(net: torch.nn.Module, keep: Bool[Tensor, "layer head"]) -> Transformer:
    """A copy of the native model ``net`` with the heads where ``keep`` is False removed.

    Raises:
        HeadprobeError: ``net`` is not a full native Transformer, ``keep`` has the wrong shape,
            or the architecture's heads cannot be removed exactly (:func:`check_prunable`).
    """
    if not isinstance(net, Transformer) or any(isinstance(b.attn, PrunedAttention) for b in net.blocks):
        raise HeadprobeError("real head removal needs an unpruned native model (load it with --backend native)")
    check_prunable(net.cfg)
    return _install(copy.deepcopy(net), keep.bool().cpu())


def count_attention_parameters(net: Transformer) -> int:
    """Parameters in all attention projections (q, k, v, o; biases included)."""
    return sum(p.numel() for b in net.blocks for p in b.attn.parameters())


def count_kv_heads(net: Transformer) -> int:
    """Key/value heads left in all layers of a model from :func:`remove_heads` (a count)."""
    total = 0
    for b in net.blocks:
        assert isinstance(b.attn, PrunedAttention)  # a model from remove_heads
        total += len(b.attn.kept_kv_heads)
    return total


def save_pruned(net: Transformer, path: str | os.PathLike[str]) -> None:
    """Write a pruned model (config, kept heads per layer, state dict) to ``path`` atomically.

    Raises:
        HeadprobeError: ``net`` is not a model from :func:`remove_heads`.
    """
    if not hasattr(net, "kept_heads"):
        raise HeadprobeError("save_pruned needs a model from remove_heads")
    payload = {
        "format": FORMAT,
        "config": dataclasses.asdict(net.cfg),
        "kept_heads": net.kept_heads,
        "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_pruned(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> Transformer:
    """Rebuild a pruned model saved by :func:`save_pruned`, on ``device``.

    Raises:
        HeadprobeError: the file is missing, unreadable or not a headprobe pruned model.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise HeadprobeError(f"cannot read pruned model {path}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise HeadprobeError(f"{path} is not a headprobe pruned model (format {FORMAT})")
    cfg = TransformerConfig.from_json(payload["config"])
    net = Transformer(cfg)
    keep = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.bool)
    for layer, kept in enumerate(payload["kept_heads"]):
        keep[layer, kept] = True
    _install(net, keep)
    dtype = next(iter(payload["state_dict"].values())).dtype
    net.to(dtype)
    net.load_state_dict(payload["state_dict"], strict=True)
    return net.to(device).eval()


from headprobe.probe.model.checkpoint import PRUNED_WEIGHTS  # noqa: E402 - the weights file of a pruned model directory


def _attn_keys(layer: int) -> dict[str, str]:
    return {
        n: block_path(layer, "attn." + n)
        for n in (
            "q_proj.weight",
            "q_proj.bias",
            "k_proj.weight",
            "k_proj.bias",
            "v_proj.weight",
            "v_proj.bias",
            "o_proj.weight",
            "kv_index",
            "sinks",
        )
    }


def save_pruned_dir(
    net: Transformer,
    out: str | os.PathLike[str],
    tokenizer: Any = None,
    source: str | None = None,
    source_weights: str | None = None,
) -> None:
    """Write a pruned model as a model directory that ``headprobe --model DIR`` and
    :func:`headprobe.probe.backends.loading.load_model` load: ``headprobe_model.safetensors`` (the smaller
    tensors, in the model's dtype; safetensors), ``config.json`` (the headprobe checkpoint format of
    :mod:`headprobe.probe.model.checkpoint`, with ``pruned``: the kept and the removed heads per layer in
    the original numbering and ``source_weights``, the unpruned model's ``ModelSpec.weights``
    (:func:`~headprobe.probe.model.checkpoint.source_weights`), and ``source``) and the tokenizer's files (``tokenizer.save_pretrained``)
    when ``tokenizer`` is given. :func:`load_pruned_dir` rebuilds the small model.

    Raises:
        HeadprobeError: ``net`` is not a model from :func:`remove_heads`.
    """
    from pathlib import Path

    from safetensors.torch import save_file

    from headprobe.probe.core.io import write_json
    from headprobe.probe.model.checkpoint import NATIVE_FORMAT

    if not hasattr(net, "kept_heads"):
        raise HeadprobeError("save_pruned_dir needs a model from remove_heads")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = net.cfg
    state = {
        k: v.detach().cpu().contiguous()
        for k, v in net.state_dict().items()
        if not k.endswith("attn.kv_index") and not (cfg.tied_unembed and k == "unembed.weight")
    }
    with atomic_path(out / PRUNED_WEIGHTS) as tmp:
        save_file(state, str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    removed = [[h for h in range(cfg.n_heads) if h not in kept] for kept in net.kept_heads]
    write_json(
        out / "config.json",
        {
            "format": NATIVE_FORMAT,
            "model": dataclasses.asdict(cfg),
            "source": source,
            "pruned": {
                "kept_heads": net.kept_heads,
                "removed_heads": removed,
                "n_removed": sum(len(r) for r in removed),
                "dtype": str(next(iter(state.values())).dtype).removeprefix("torch."),
                **({"source_weights": source_weights} if source_weights else {}),
            },
        },
    )


def _read_pruned_dir(path: str | os.PathLike[str]) -> tuple[TransformerConfig, list[list[int]], dict[str, Tensor]]:
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(path)
    try:
        meta = json.loads((path / "config.json").read_text(encoding="utf-8"))
        cfg = TransformerConfig.from_json(meta["model"])
        kept = [list(map(int, k)) for k in meta["pruned"]["kept_heads"]]
        state = load_file(str(path / PRUNED_WEIGHTS))
    except HeadprobeError:  # the config's own refusal (a ValueError too), as it reads
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise HeadprobeError(f"cannot read pruned model directory {path}: {' '.join(str(e).split())[:200]}") from None
    if len(kept) != cfg.n_layers:
        raise HeadprobeError(
            f"pruned model directory {path}: kept heads for {len(kept)} layers, config has {cfg.n_layers}"
        )
    if cfg.tied_unembed:
        state["unembed.weight"] = state["embed.W_E.weight"]
    return cfg, kept, state


def is_pruned_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory written by :func:`save_pruned_dir`."""
    from pathlib import Path

    return (Path(path) / PRUNED_WEIGHTS).is_file()


def load_pruned_dir(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> Transformer:
    """The small pruned model (removed heads' weights absent, as :func:`remove_heads` made it) from
    a directory of :func:`save_pruned_dir`, in the saved dtype, on ``device``.

    Raises:
        HeadprobeError: the directory is missing, unreadable or its weights do not match its config.
    """
    cfg, kept, state = _read_pruned_dir(path)
    net = Transformer(cfg)
    keep = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.bool)
    for layer, k in enumerate(kept):
        keep[layer, k] = True
    _install(net, keep)
    net.to(next(iter(state.values())).dtype)
    for layer, b in enumerate(net.blocks):
        assert isinstance(b.attn, PrunedAttention)  # installed just above
        state[block_path(layer, "attn.kv_index")] = b.attn.kv_index
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise HeadprobeError(
            f"pruned model directory {path}: weights do not match its config: {' '.join(str(e).split())[:200]}"
        ) from None
    return net.to(device).eval()


def load_pruned_dir_full(path: str | os.PathLike[str]) -> tuple[Transformer, list[list[int]]]:
    """The pruned model of :func:`save_pruned_dir` as a full-shape native model for analysis:
    every head present, a removed head's rows of ``q_proj`` / ``k_proj`` / ``v_proj`` (a key/value
    head only when no kept head reads it) and its columns of ``o_proj`` set to zero, so its output
    contribution ``z_h W_O^(h)`` is exactly 0 and the logits equal the small model's (to float
    rounding). Returns the model (saved dtype, CPU) and the removed heads per layer.

    Raises:
        HeadprobeError: as :func:`load_pruned_dir`.
    """
    cfg, kept, state = _read_pruned_dir(path)
    full = {}
    for k, v in state.items():
        full[k] = v
    for layer, heads in enumerate(kept):
        keys = _attn_keys(layer)
        kv = sorted({h // cfg.group_size for h in heads})
        assert cfg.n_kv_heads is not None and cfg.d_head is not None  # filled by TransformerConfig.__post_init__
        for name, hs, n, d in (
            ("q_proj", heads, cfg.n_heads, cfg.d_qk),
            ("k_proj", kv, cfg.n_kv_heads, cfg.d_qk),
            ("v_proj", kv, cfg.n_kv_heads, cfg.d_head),
        ):
            for part in ("weight", "bias"):
                key = keys[f"{name}.{part}"]
                if key not in state:
                    continue
                small = state[key]
                big = small.new_zeros((n * d, *small.shape[1:]))
                big[head_rows(hs, d)] = small
                full[key] = big
        if keys["sinks"] in state:  # learned sinks (GPT-OSS): one logit per kept head; a removed head's is 0
            sinks = state[keys["sinks"]]
            full[keys["sinks"]] = sinks.new_zeros(cfg.n_heads).index_copy(
                0, torch.tensor(heads, dtype=torch.long), sinks
            )
        w = state[keys["o_proj.weight"]]
        big = w.new_zeros(w.shape[0], cfg.n_heads * cfg.d_head)
        big[:, head_rows(heads, cfg.d_head)] = w
        full[keys["o_proj.weight"]] = big
    try:
        net = Transformer.from_state_dict(cfg, full)
    except RuntimeError as e:
        raise HeadprobeError(
            f"pruned model directory {path}: weights do not match its config: {' '.join(str(e).split())[:200]}"
        ) from None
    return net, [[h for h in range(cfg.n_heads) if h not in k] for k in kept]


def attention_sizes(model: Any, n_tokens: int) -> dict[str, list[int]]:
    """What each layer of a native model holds and computes, measured on its modules and one
    forward pass of ``n_tokens`` tokens (ids ``0, 1, ...`` modulo the vocabulary):
    ``heads_per_layer`` (query heads: ``o_proj``'s input width over ``d_head``),
    ``kv_heads_per_layer`` and ``kv_numbers_per_token_per_layer`` (the key/value heads and the
    key and value numbers per token that ``hook_k`` and ``hook_v`` see, what a key/value cache
    without weight absorption holds; 0 for a layer with no head left) and
    ``attn_params_per_layer`` (parameters of each attention module). Counts.

    ``model`` is a native :class:`~headprobe.probe.model.transformer.Transformer` (full, or pruned by
    :func:`remove_heads` / :func:`load_pruned_dir`) or a native-backend LoadedModel around one.
    ``headprobe budget`` checks its formulas against these (``--model DIR``).
    """
    net = model.model if isinstance(getattr(model, "model", None), Transformer) else model
    cfg = net.cfg
    device = next(net.parameters()).device
    tokens = (torch.arange(n_tokens, device=device) % cfg.d_vocab)[None]
    seen: dict[tuple[int, str], tuple[int, ...]] = {}

    def keep_shape(layer: int, kind: str) -> Any:
        def hook(x: Tensor, hook: Any) -> None:
            seen[layer, kind] = tuple(x.shape)  # [batch, pos, kv_head, d]

        return hook

    hooks = [(attn_hook(l, kind), keep_shape(l, kind)) for l in range(cfg.n_layers) for kind in ("k", "v")]
    with torch.no_grad():
        net.run_with_hooks(tokens, fwd_hooks=hooks)
    layers = range(cfg.n_layers)
    return {
        "heads_per_layer": [b.attn.o_proj.weight.shape[1] // cfg.d_head for b in net.blocks],
        "kv_heads_per_layer": [seen[l, "k"][2] if (l, "k") in seen else 0 for l in layers],
        "kv_numbers_per_token_per_layer": [
            sum(seen[l, k][2] * seen[l, k][3] for k in ("k", "v") if (l, k) in seen) for l in layers
        ],
        "attn_params_per_layer": [sum(p.numel() for p in b.attn.parameters()) for b in net.blocks],
    }
