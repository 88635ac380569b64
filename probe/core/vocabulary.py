"""The names the probe floor offers, each defined once, torch-free (``headprobe scan --backend x``
is refused before torch loads): the backends (a :class:`~headprobe.probe.core.registry.Registry` of lazy
``"module:attr"`` targets, the one registry of backends), the devices and the device-map strategies.

Commands' flags, the loader (:func:`headprobe.probe.backends.wrapping.wrap`) and
:mod:`headprobe.probe.backends.devicemap` read these; nothing else spells them. What a backend can do is
asked of its class's capability flags (:data:`CAPABILITIES`), by name only
here (:func:`backend_class`, :func:`backend_with`, :func:`backend_lacks`); before the load, torch-free,
from the flags declared beside the registry (:data:`BACKEND_CAPABILITIES`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import Choices, Registry, did_you_mean

# Any: LoadedModel subclasses (probe/backends/base.py), not imported in this torch-free module
BACKEND_REGISTRY: Registry[Any] = Registry("backend")
"""Backend name (``--backend``, ``ModelSpec.backend``) -> its :class:`~headprobe.probe.backends.base.LoadedModel`
subclass, imported on first use. Registration order is ``--backend auto``'s preference: the first
backend whose :meth:`~headprobe.probe.backends.base.LoadedModel.supports` accepts the Hugging Face config."""
BACKEND_REGISTRY.register("native", "headprobe.probe.backends.native:NativeModel")
BACKEND_REGISTRY.register("transformer-lens", "headprobe.probe.backends.bridge:BridgeModel")

CAPABILITIES: tuple[str, ...] = (
    "streams_statistics",
    "kv_policies",
    "path_patching",
    "half_precision",
    "native_weights",
    "splits_after_load",
    "removes_heads",
)
"""The capability flags of :class:`~headprobe.probe.backends.base.LoadedModel` (class attributes, False
there; each backend sets those it has). Features check a flag, never a backend's name."""

BACKEND_CAPABILITIES: dict[str, frozenset[str]] = {
    "native": frozenset(CAPABILITIES),
    "transformer-lens": frozenset(),
}
"""Registered backend name -> the capability flags (:data:`CAPABILITIES`)
its class sets True, declared here so that a command can refuse ``--backend X`` for a feature before
torch loads (:func:`backend_has`); ``tests/test_where_to_add.py`` checks each equals its class's own
flags. A backend registered without an entry here has its class imported and asked instead."""

AUTO_FALLBACK = "transformer-lens"
"""The backend ``--backend auto`` takes when no registered backend supports the architecture (its
error then says why the model cannot be wrapped)."""

BACKENDS: Choices = BACKEND_REGISTRY.choices("auto")
"""``--backend`` choices: ``auto`` and every registered backend (a live view of :data:`BACKEND_REGISTRY`)."""


def check_backend(name: str) -> None:
    """Raise unless ``name`` is a :data:`BACKENDS` choice.

    Raises:
        HeadprobeError: an unknown backend (one line, the closest choices named).
    """
    if name not in BACKENDS:
        raise HeadprobeError(
            f"unknown backend {name!r}{did_you_mean(str(name), BACKENDS)}; choose one of {', '.join(BACKENDS)}"
        )


def chosen_at_load(name: str) -> bool:
    """Whether ``--backend name`` leaves the backend to be chosen at load from the architecture
    (``auto``: :func:`backend_class`), rather than naming one."""
    return name == "auto"


def backend_class(name: str, hf_config: Callable[[], Any]) -> Any:
    """The :class:`~headprobe.probe.backends.base.LoadedModel` subclass ``--backend name`` wraps a model in
    (imported on first use). ``auto``: the first registered backend whose ``supports`` accepts the
    Hugging Face config ``hf_config()`` (called for ``auto`` only), else :data:`AUTO_FALLBACK`'s.

    Raises:
        HeadprobeError: an unknown backend; whatever ``hf_config`` raises.
    """
    check_backend(name)
    if name == "auto":
        config = hf_config()
        name = next((n for n in BACKEND_REGISTRY.names() if BACKEND_REGISTRY.get(n).supports(config)), AUTO_FALLBACK)
    return BACKEND_REGISTRY.get(name)


def backend_with(name: str, capability: str) -> Any:
    """The class ``--backend name`` gives a model where ``capability`` (a
    :data:`CAPABILITIES` flag) decides: the named backend's class if it has
    the flag, else None; for ``auto`` the first registered backend that has it (imported on first use).

    Raises:
        HeadprobeError: an unknown backend.
    """
    check_backend(name)
    names = BACKEND_REGISTRY.names() if name == "auto" else (name,)
    return next((cls for cls in map(BACKEND_REGISTRY.get, names) if getattr(cls, capability)), None)


def backend_has(name: str, capability: str) -> bool:
    """Whether the registered backend ``name`` has ``capability``: its class's flag where the class is
    imported already (or registered as a class), else the declared :data:`BACKEND_CAPABILITIES` (no
    import, no torch), else its class's flag (imported).

    Raises:
        HeadprobeError: an unknown backend.
    """
    cls = BACKEND_REGISTRY.loaded(name)
    if cls is None and name in BACKEND_CAPABILITIES:
        return capability in BACKEND_CAPABILITIES[name]
    return bool(getattr(cls if cls is not None else BACKEND_REGISTRY.get(name), capability))


def backend_lacks(name: str, capability: str) -> bool:
    """Whether ``--backend name`` is a registered backend without ``capability`` (:func:`backend_has`:
    torch-free for the declared backends); False for ``auto``, which picks a backend at load (the
    loaded model's flag decides then).

    Raises:
        HeadprobeError: an unknown backend.
    """
    check_backend(name)
    return name != "auto" and not backend_has(name, capability)


def lacks_line(what: str, backend: str, capability: str) -> str:
    """The one-line refusal of ``what`` (a sentence naming the feature) on ``backend``, which lacks
    ``capability``: before the load (:func:`refuse_lacking`) and after it
    (:meth:`~headprobe.probe.backends.base.LoadedModel.lacks`) alike."""
    return f"{what} (the {backend} backend lacks {capability})"


def refuse_lacking(name: str, capability: str, what: str) -> None:
    """A command's pre-load check of ``--backend name`` (:func:`backend_lacks`): refused in the words of
    :func:`lacks_line`, as the loaded model would be.

    Raises:
        HeadprobeError: ``name`` is a registered backend without ``capability``, or unknown.
    """
    if backend_lacks(name, capability):
        raise HeadprobeError(lacks_line(what, name, capability))


DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
"""``--device`` choices: ``auto`` is cuda when a GPU is present, else cpu."""
DEVICE_MAPS: tuple[str, ...] = ("auto", "balanced", "sequential")
"""``--device-map`` placement strategies, as transformers names them: ``auto`` and ``balanced`` spread the
blocks evenly over the GPUs (accelerate's ``get_balanced_memory``) before CPU memory and disk;
``sequential`` fills each device up to its budget before the next (:mod:`headprobe.probe.backends.devicemap`)."""

DTYPES = ("float32", "bfloat16", "float16")
"""Compute precisions, by torch's names."""
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
"""Short names accepted everywhere for :data:`DTYPES`."""
TORCH_DTYPES: frozenset[str] = frozenset(
    {
        *("bfloat16", "bool", "cdouble", "cfloat", "chalf", "complex128", "complex32", "complex64", "double"),
        *("float", "float16", "float32", "float64", "half", "int", "long", "short", "bit"),
        *("float4_e2m1fn_x2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"),
        *(f"int{n}" for n in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)),
        *(f"uint{n}" for n in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)),
        *("bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8"),
    }
)
"""Every dtype torch names (``torch.<name>`` is a ``torch.dtype``; torch-free here, equal to torch's
own set by ``tests/test_cli.py``): a ``--dtype`` among them that a command does not support is refused
as unsupported, with what is, not as a misspelling (:func:`unsupported_dtype`)."""
OTHER_DTYPE_SPELLINGS = ("fp64", "f64", "fp8", "fp4")
"""Short names of real dtypes that are not torch's attribute names, refused as :data:`TORCH_DTYPES` are."""


def unsupported_dtype(text: str) -> bool:
    """Whether ``text`` (any case, ``torch.`` or not) names a real dtype (:data:`TORCH_DTYPES`,
    :data:`OTHER_DTYPE_SPELLINGS`): one not accepted is unsupported, not misspelt."""
    name = str(text).strip().lower().removeprefix("torch.")
    return name in TORCH_DTYPES or name in OTHER_DTYPE_SPELLINGS
