"""Loading into the native backend without a Hugging Face model: a headprobe checkpoint directory
(:func:`load_native`) and a GGUF model's weights-cache entry (:func:`_load_native_from_cache`, the
warm load). Called by :func:`headprobe.probe.backends.loading.load_model`."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path

import torch

from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.backends.hf_checkpoint import NATIVE_SOURCE_FILE, check_finite_weights
from headprobe.probe.backends.hf_tokenizers import _names_generic_tokenizer
from headprobe.probe.backends.native import NativeModel
from headprobe.probe.backends.sources import SMOLLM2_NAME, SMOLLM2_PRECISION
from headprobe.probe.backends.sources import resolve as _resolve
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.model.checkpoint import NATIVE_FORMAT, NATIVE_WEIGHTS


def _load_native_from_cache(
    name: str, device: str | torch.device, prepend_bos: bool, quiet: bool, cls: type[LoadedModel] = NativeModel
) -> LoadedModel | None:
    """A warm native load of a GGUF model (``smollm2-135m`` or a ``.gguf`` path) straight from its
    weights-cache entry: the tokenizer (``PreTrainedTokenizerFast``, what the entry holds), the
    safetensors weights and the entry's :data:`NATIVE_SOURCE_FILE`, without building the Hugging
    Face model (a whole warm ``load_model`` of SmolLM2-135M, self-check included, 4.5 s instead of
    about 8 s, most of it the imports it makes; the same tensors and token ids, see
    tests/test_weights_cache.py). None where this does not apply (another kind of name, no ready
    entry, no native description, a tokenizer of another class) or fails: the caller then loads
    the usual way, which reports or repairs whatever is wrong. A failure is logged as a warning,
    or, with ``quiet``, at debug level like the progress line it silences. ``cls``: the backend
    (with ``native_weights``) the model is wrapped in."""
    import json
    import sys

    from headprobe.probe.backends import weights_cache
    from headprobe.probe.model import convert

    if name != SMOLLM2_NAME and not name.endswith(".gguf"):
        return None
    try:
        hf_name, precision, kwargs = _resolve(name)
    except HeadprobeError:
        return None  # reported by the usual path
    entry = weights_cache.ready_entry(Path(kwargs["source"]) / kwargs["gguf_file"])
    if entry is None or not (entry / NATIVE_SOURCE_FILE).is_file():
        return None
    if not _names_generic_tokenizer(entry):
        return None  # a tokenizer class of its own: AutoTokenizer's job
    try:
        source = convert.NativeSource.from_json(json.loads((entry / NATIVE_SOURCE_FILE).read_text(encoding="utf-8")))
        if not quiet:
            print(f"loading {name} from cache ...", file=sys.stderr, flush=True)
        from safetensors.torch import load_file
        from transformers import PreTrainedTokenizerFast

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True)
        # load_file maps the file copy-on-write (MAP_PRIVATE) and the model takes those tensors:
        # one copy of the weights, paged in as read, and the model owns it (an in-place change
        # copies the page, never writes the file; entries are replaced by rename, never rewritten
        # in place). tests/test_weights_cache.py, benchmarks/memory.py.
        model = source.build(load_file(str(entry / "model.safetensors"))).to(device)
    except Exception as e:
        # Not a warning a user must see: the usual way loads the same model, and warns itself, quiet
        # or not, where the entry needs the user (damaged: rebuilt; an unusable cache directory).
        # Logged as headprobe.probe.backends.loading, the loader's logger, where this code lived before.
        logging.getLogger("headprobe.probe.backends.loading").log(
            logging.DEBUG if quiet else logging.WARNING,
            "headprobe: fast load of %s from %s failed (%s); loading the usual way",
            name,
            entry,
            type(e).__name__,
        )
        return None
    check_finite_weights(model)
    spec = convert.spec_from_native(name, hf_name, precision, model.cfg)
    return cls(model, tokenizer, spec, prepend_bos=prepend_bos)


def load_native(
    path: str | Path, device: str | torch.device = "cpu", prepend_bos: bool = True, cls: type[LoadedModel] = NativeModel
) -> LoadedModel:
    """Load a headprobe checkpoint directory (see :func:`save_native`) into the native backend
    (``cls``: a backend with ``native_weights``).

    Raises:
        HeadprobeError: config.json is missing or not a headprobe config, the weights do not
            match it, or the tokenizer files are missing (one line each).
    """
    import json
    import pickle

    from headprobe.probe.model.config import TransformerConfig
    from headprobe.probe.model.convert import spec_from_native
    from headprobe.probe.model.transformer import Transformer

    path = Path(path)
    try:
        meta = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if meta.get("format") != NATIVE_FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, expected {NATIVE_FORMAT!r}")
        cfg = TransformerConfig.from_json(meta["model"])
        removed: tuple[tuple[int, int], ...] = ()
        if "pruned" in meta:  # a pruned model directory: removed heads come back as zero weights (exact)
            from headprobe.probe.model.pruned import load_pruned_dir_full

            model, removed_per_layer = load_pruned_dir_full(path)
            removed = tuple((layer, head) for layer, heads in enumerate(removed_per_layer) for head in heads)
        else:
            model = Transformer.from_state_dict(
                cfg, torch.load(path / NATIVE_WEIGHTS, map_location="cpu", weights_only=True)
            )
    except HeadprobeError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, pickle.UnpicklingError) as e:
        msg = " ".join(str(e).split())[:300]
        raise HeadprobeError(f"cannot load headprobe checkpoint {path}: {msg}") from None
    check_finite_weights(model)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise HeadprobeError(
            f"headprobe checkpoint {path} has no readable tokenizer: {' '.join(str(e).split())[:200]}"
        ) from None
    weights = "float32 (headprobe checkpoint)"
    if "pruned" in meta:
        from headprobe.probe.model.checkpoint import pruned_weights

        p = meta["pruned"]
        # a checkpoint saved before source_weights was recorded: the embedded model's weights are known
        source = p.get("source_weights") or (SMOLLM2_PRECISION if meta.get("source") == SMOLLM2_NAME else None)
        weights = pruned_weights(p.get("dtype", "float32"), p.get("n_removed"), source)
    spec = dataclasses.replace(spec_from_native(str(path), str(path), weights, cfg), removed_heads=removed)
    loaded = cls(model.to(device).eval(), tokenizer, spec, prepend_bos=prepend_bos)
    train = meta.get("train") or {}
    if all(isinstance(train.get(k), int) for k in ("min_period", "max_period", "eval_period")):
        loaded.trained_periods = (train["min_period"], train["max_period"], train["eval_period"])
    return loaded
