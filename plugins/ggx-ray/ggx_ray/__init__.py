"""ggx-ray: remote ggx devices on Ray actors (RAY0, RAY1, ...), scheduled like local ones."""
__version__ = "0.1.0"

from .cluster import connect  # noqa: E402

__all__ = ["connect"]
