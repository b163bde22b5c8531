"""The error hierarchy of ggx: one base class, one subclass per kind of failure."""


class GGXError(Exception):
    """Base of every error ggx raises on purpose."""


class GGXShapeError(GGXError, ValueError):
    """Shapes, strides or types that an op or a tensor cannot take; raised at build time."""


class GGXUnsupported(GGXError):
    """A backend, buffer or device was asked for something it does not do."""


class GGXOutOfMemory(GGXError, MemoryError):
    """A buffer could not be allocated (size over max_size or the allocation failed)."""


class GGXPluginError(GGXError):
    """A plugin failed to load, or a backend asked for by name is not available."""


class GGXFormatError(GGXError, ValueError):
    """A model file (GGUF) is malformed."""
