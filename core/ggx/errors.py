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


class GGXContextOverflow(GGXShapeError):
    """Tokens that do not fit in a model's context: `n_past` already there, `n_tokens` more, `n_ctx` slots."""

    def __init__(self, message: str, n_past: int, n_tokens: int, n_ctx: int):
        super().__init__(message)
        self.n_past, self.n_tokens, self.n_ctx = n_past, n_tokens, n_ctx


class GGXStateError(GGXError):
    """An object used out of turn: e.g. a generator resumed after its model's cache moved on."""


class GGXValueError(GGXError, ValueError):
    """An argument outside the values it may take (a NaN temperature, a negative count)."""


class GGXDeviceError(GGXError, RuntimeError):
    """A device that cannot be reached or stopped answering (a remote worker died, a call timed
    out); the message names the device. Other devices are unaffected."""


class SchedComputeError(GGXError, RuntimeError):
    """A backend failed while computing a split: `node` is the failing Tensor when known, `backend`
    the Backend (untyped here: this module sits below both)."""

    def __init__(self, message: str, node: object = None, backend: object = None):
        super().__init__(message)
        self.node = node
        self.backend = backend
