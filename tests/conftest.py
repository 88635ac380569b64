"""Shared fixtures: real-model tests share one loaded SmolLM2-135M per session."""

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model, loaded once (about 30-40 s on a CPU)."""
    from probe.loading import load_model

    return load_model("smollm2-135m")
