"""The names the probe floor offers, each defined once, torch-free (``headprobe scan --backend x``
is refused before torch loads): the backends (a :class:`~headprobe.probe.registry.Registry` of lazy
``"module:attr"`` targets, the one registry of backends), the devices and the device-map strategies.

Commands' flags, the loader (:func:`headprobe.probe.loading.wrap`) and
:mod:`headprobe.probe.devicemap` read these; nothing else spells them.
"""

from __future__ import annotations

from typing import Any

from headprobe.probe.registry import Choices, Registry

# Any: LoadedModel subclasses (probe/backend.py), not imported in this torch-free module
BACKEND_REGISTRY: Registry[Any] = Registry("backend")
"""Backend name (``--backend``, ``ModelSpec.backend``) -> its :class:`~headprobe.probe.backend.LoadedModel`
subclass, imported on first use. Registration order is ``--backend auto``'s preference: the first
backend whose :meth:`~headprobe.probe.backend.LoadedModel.supports` accepts the Hugging Face config."""
BACKEND_REGISTRY.register("native", "headprobe.probe.native:NativeModel")
BACKEND_REGISTRY.register("transformer-lens", "headprobe.probe.bridge:BridgeModel")

AUTO_FALLBACK = "transformer-lens"
"""The backend ``--backend auto`` takes when no registered backend supports the architecture (its
error then says why the model cannot be wrapped)."""

BACKENDS: Choices = BACKEND_REGISTRY.choices("auto")
"""``--backend`` choices: ``auto`` and every registered backend (a live view of :data:`BACKEND_REGISTRY`)."""
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
"""``--device`` choices: ``auto`` is cuda when a GPU is present, else cpu."""
DEVICE_MAPS: tuple[str, ...] = ("auto", "balanced", "sequential")
"""``--device-map`` placement strategies, as transformers names them: ``auto`` and ``balanced`` spread the
blocks evenly over the GPUs (accelerate's ``get_balanced_memory``) before CPU memory and disk;
``sequential`` fills each device up to its budget before the next (:mod:`headprobe.probe.devicemap`)."""
