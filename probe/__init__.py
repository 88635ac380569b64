"""headprobe.probe: models, hook points, capture and loading.

Nothing here does work at import time; heavy libraries (transformers, transformer-lens) are
imported inside the functions that need them.
"""

from headprobe.probe.core.errors import HeadprobeError

__all__ = ["HeadprobeError"]
