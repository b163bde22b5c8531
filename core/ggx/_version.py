"""The core's version: a leaf module, so any module of the package can import it."""

__version__ = "0.1.0"
