"""The architecture zoo: tiny seeded random-init Hugging Face checkpoints of every family headprobe
claims (2 layers, d_model 64, 4 query heads on 2 KV heads where the family has GQA), made on the
fly with transformers, no download. Each is a few hundred KB.

The families and their tiny config fields come from the registry
(:data:`headprobe.probe.model.families.FAMILIES`, each family's ``TinySpec``), read when asked, so a
family registered at run time is in the zoo too. ``ZOO`` maps a causal family (Hugging Face
``model_type``) to the config fields that make it tiny, ``ENCODER_ZOO`` an encoder family;
:func:`make_checkpoint` builds the model (once per test run; each call gets its own copy) and
:func:`save_dir` writes a Hugging Face model directory (config, safetensors, tokenizer) for the
command-line tests.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from headprobe.probe.model.families import FAMILIES
from headprobe.probe.model.families.base import TINY_ENCODER_VOCAB as ENCODER_VOCAB  # noqa: F401 - the zoo's vocabularies
from headprobe.probe.model.families.base import (
    TINY_FIELDS,  # noqa: F401 - the sizes, for families outside the registry (Granite)
    TinySpec,
)
from headprobe.probe.model.families.base import TINY_VOCAB as VOCAB  # noqa: F401


def tiny(family: str) -> TinySpec:
    """The registered ``family``'s tiny checkpoint and the facts the tests check about it."""
    return FAMILIES.get(family).tiny


def names(encoder: bool = False) -> list[str]:
    """The registered causal families (or encoder families), in registration order."""
    return [name for name in FAMILIES.names() if FAMILIES.get(name).encoder == encoder]


class _TinyFields(Mapping):
    """Family -> a copy of its tiny config fields, over the registry's families of one kind."""

    def __init__(self, encoder: bool) -> None:
        self.encoder = encoder

    def __getitem__(self, family: str) -> dict:
        if family not in FAMILIES or FAMILIES.get(family).encoder != self.encoder:
            raise KeyError(family)
        return dict(tiny(family).fields)

    def __iter__(self) -> Iterator[str]:
        return iter(names(self.encoder))

    def __len__(self) -> int:
        return len(names(self.encoder))


ZOO: Mapping[str, dict] = _TinyFields(encoder=False)
"""Causal family -> tiny config fields."""
ENCODER_ZOO: Mapping[str, dict] = _TinyFields(encoder=True)
"""Encoder family -> tiny config fields (kept apart from :data:`ZOO`, whose families are causal LMs)."""


_BUILT: dict[tuple, tuple] = {}
"""(family, its Family, tokenizer, seed, changes) -> (checkpoint, torch's RNG state after building it, the
Family and tokenizer, kept alive so that their ids in the key are not reused): each model built once per run."""


def make_checkpoint(family: str, tokenizer, seed: int = 0, **change):
    """A :class:`~headprobe.probe.layout.spec.Checkpoint` holding a tiny random ``family`` model
    (float32, eager attention; ``AutoModelForCausalLM``, or ``AutoModel`` for an encoder: BERT's
    ``BertModel``, no head); every bias and every parameter named in the family's
    ``TinySpec.perturb`` is randomised so that each term is tested; ``change`` overrides config
    fields (variants of a family).

    Each model is built once per test run: every call returns its own deep copy of the model (a
    test may change its weights) with the caller's tokenizer, and leaves torch's global RNG as a
    fresh build would (seeded with ``seed``, then drawn from by the initialisation)."""
    family_ = FAMILIES.get(family)
    key = (family, id(family_), id(tokenizer), seed, repr(sorted(change.items())))
    if key not in _BUILT:
        _BUILT[key] = (_build(family, tokenizer, seed, change), torch.get_rng_state(), (family_, tokenizer))
    ckpt, rng, _ = _BUILT[key]
    torch.set_rng_state(rng)
    return dataclasses.replace(ckpt, hf_model=copy.deepcopy(ckpt.hf_model))


def _build(family: str, tokenizer, seed: int, change: dict):
    """:func:`make_checkpoint`'s model, built."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from headprobe.probe.layout.spec import Checkpoint

    family_ = FAMILIES.get(family)
    spec = family_.tiny
    cfg = AutoConfig.for_model(family, **{**spec.fields, **change})
    torch.manual_seed(seed)
    model = (
        (AutoModel if family_.encoder else AutoModelForCausalLM).from_config(cfg, attn_implementation="eager").eval()
    )
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or any(part in name for part in spec.perturb):
                p.add_(torch.randn_like(p) * 0.1)
    return Checkpoint(f"tiny-{family}", f"tiny-{family}", "float32 (random init)", model, tokenizer)


def save_dir(family: str, tokenizer, out: Path) -> Path:
    """Write the tiny ``family`` checkpoint as a Hugging Face model directory at ``out``."""
    ckpt = make_checkpoint(family, tokenizer)
    ckpt.hf_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def encoder_tokenizer(save_dir: Path):
    """A word-level tokenizer over ``t0 .. t99`` with BERT's special tokens ``[CLS]`` (100),
    ``[SEP]`` (101), ``[UNK]`` (102), ``[PAD]`` (103) and no BOS, as a BERT tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {**{f"t{i}": i for i in range(100)}, "[CLS]": 100, "[SEP]": 101, "[UNK]": 102, "[PAD]": 103}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tk, cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]", pad_token="[PAD]"
    ).save_pretrained(save_dir)
    return AutoTokenizer.from_pretrained(save_dir)


def with_sinks(model, seed: int = 0, scale: float = 1.0, **change):
    """A native copy of ``model`` (a native :class:`~headprobe.probe.backends.base.LoadedModel`) with
    learned attention sinks (``attn_sinks``, GPT-OSS's mechanism): the same weights, every head's
    sink logit drawn ``N(0, scale^2)`` (seeded), and ``change`` applied to the config (a sliding
    window, ...). The caller's model is left as it was."""
    from headprobe.probe.backends.base import LoadedModel
    from headprobe.probe.model.transformer import Transformer

    net = model.model
    cfg = dataclasses.replace(net.cfg, attn_sinks=True, **change)
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    for layer in range(cfg.n_layers):
        state[f"blocks.{layer}.attn.sinks"] = torch.randn(cfg.n_heads, generator=gen) * scale
    return LoadedModel(
        Transformer.from_state_dict(cfg, state), model.tokenizer, model.spec, prepend_bos=model.prepend_bos
    )


def tiny_train_flags(steps: int, eval_every: int, n_eval: int = 8) -> list[str]:
    """``headprobe train`` flags of the command-line tests' tiny run (d_model 16, 2 heads, 16 words,
    33 tokens, on the CPU): ``steps`` steps, evaluated every ``eval_every`` on ``n_eval`` sequences."""
    return [
        *("--steps", str(steps), "--eval-every", str(eval_every), "--n-eval", str(n_eval)),
        *("--d-model", "16", "--n-heads", "2", "--n-words", "16", "--seq-len", "33"),
        *("--max-period", "12", "--eval-period", "8", "--device", "cpu"),
    ]


TINY_SCAN_FLAGS = ["--n-natural", "3", "--seq-len", "16", "--n-repeated", "2", "--period", "6", "-k", "3"]
TINY_SCAN_FLAGS += ["--n-random", "2", "--device", "cpu"]
"""``headprobe scan`` flags of the command-line tests' tiny scan: 3 x 16 natural tokens, 2 repeated
sequences of period 6, k = 3 with 2 control sets, on the CPU."""
TINY_SCORE_FLAGS = ["--n-natural", "3", "--seq-len", "16", "--n-repeated", "2", "--period", "6", "--device", "cpu"]
"""The same with ``--no-verify`` in mind: without ``-k`` and ``--n-random``, which it refuses."""
