"""Compile-time tokens: Python objects a kernel takes as arguments whose numba *type* is a choice.

A kernel `k(isa, lay, w, ...)` called with a token compiles (and caches: the signature is part
of numba's cache key) one specialization per token type, and inside it `@overload`s and
`token_constant`s read the type's attributes at typing time, so one kernel source holds the code
of every choice and each compiled kernel holds only its own. Nothing is passed at run time
(opaque model, unboxed to nothing).

To make a class of objects tokens: subclass `TokenType` (its `__init__` takes the token and
gives a `name` that identifies it, e.g. "Layout(q4_0_8x8)"), then `register_token(cls, type_cls)`.
ggx-cpu's own: `IsaToken` / `IsaType` (the ISA variant, `ggx_cpu.isa.token()`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba.core import types
from numba.extending import NativeValue, models, overload, register_model, typeof_impl, unbox


class TokenType(types.Type):
    """Base class of the numba types of compile-time tokens. A subclass's instances must be
    equal exactly when their `name`s are (numba compares and interns types by name)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_model(cls)(models.OpaqueModel)  # numba looks models up by exact class


@unbox(TokenType)  # looked up along the MRO: serves every subclass
def _unbox_token(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


def register_token(py_class: type, type_class: Callable[[Any], TokenType]) -> None:
    """Make every instance of `py_class` a compile-time token of numba type `type_class(instance)`.

    The type is built once per token object (the token is kept alive with it): building a
    numba type costs ~2 us, and binding a launch types its tokens."""
    built: dict[int, tuple[Any, TokenType]] = {}

    @typeof_impl.register(py_class)
    def _typeof(val, c):
        hit = built.get(id(val))
        if hit is None:
            hit = built[id(val)] = (val, type_class(val))
        return hit[1]


def token_constant(fn: Callable[[TokenType], Any]) -> Callable:
    """Decorator: `fn(token_type)` evaluated at compile time becomes a jit-callable `f(token)`
    returning that constant (a bool, int or float), e.g.

        @token_constant
        def rows(lay):            # lay: the numba type of a layout token
            return lay.nrows

    so that kernel code reads `rows(lay)` and LLVM folds what depends on it. `f.value_of(t)` is
    the same constant for a numba type t, for `@overload` typing functions that pick an
    implementation by it (so only the chosen one is compiled)."""
    def stub(token):
        raise NotImplementedError(f"{fn.__name__} is only callable from compiled code")

    stub.__name__, stub.__qualname__, stub.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    stub.__module__ = fn.__module__
    stub.value_of = fn

    @overload(stub, inline="always")
    def _ol(token):
        value = fn(token)
        return lambda token: value

    return stub


# --- the ISA variant ----------------------------------------------------------------------------------
class IsaToken:
    """The `isa` argument of ggx-cpu's kernels: names an ISA variant ("avx512_vnni", "avx2",
    "portable"); get one from `ggx_cpu.isa.token()`, which checks the host can run it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"IsaToken({self.name!r})"


class IsaType(TokenType):
    """numba type of an `IsaToken`; `isa_name` is the variant."""

    def __init__(self, token: IsaToken):
        self.isa_name = token.name
        super().__init__(name=f"Isa({token.name})")


register_token(IsaToken, IsaType)
