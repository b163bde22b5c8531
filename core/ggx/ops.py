"""The op catalogue: op names and their typed parameters (ggml semantics)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(enum.Enum):
    NONE = "NONE"  # a leaf: data comes from outside the graph
    GET_ROWS = "GET_ROWS"
    SET_ROWS = "SET_ROWS"
    CPY = "CPY"
    DUP = "DUP"
    CONT = "CONT"
    VIEW = "VIEW"
    RESHAPE = "RESHAPE"
    PERMUTE = "PERMUTE"
    TRANSPOSE = "TRANSPOSE"
    ADD = "ADD"
    MUL = "MUL"
    SCALE = "SCALE"
    SILU = "SILU"
    GELU = "GELU"
    GLU = "GLU"
    RMS_NORM = "RMS_NORM"
    NORM = "NORM"
    MUL_MAT = "MUL_MAT"
    MUL_MAT_ID = "MUL_MAT_ID"
    ROPE = "ROPE"
    SOFT_MAX = "SOFT_MAX"
    FLASH_ATTN_EXT = "FLASH_ATTN_EXT"
    ARGSORT = "ARGSORT"
    TOP_K = "TOP_K"
    SUM_ROWS = "SUM_ROWS"

    @property
    def is_view(self) -> bool:
        """View ops only re-describe memory: they never copy and never reach a kernel."""
        return self in VIEW_OPS

    def __repr__(self) -> str:
        return f"Op.{self.name}"


VIEW_OPS = frozenset({Op.VIEW, Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE})

# Ops whose result may take the memory of src[0] when src[0] dies at this node (same size,
# elementwise, each output element written after its input element is read).
INPLACE_OPS = frozenset({Op.ADD, Op.MUL, Op.SCALE, Op.SILU, Op.GELU, Op.CPY, Op.DUP, Op.CONT})


@dataclass(frozen=True)
class ViewParams:
    offset: int = 0  # byte offset into the view source (VIEW only)
    axes: tuple[int, int, int, int] = (0, 1, 2, 3)  # PERMUTE: source dim i goes to dim axes[i]


@dataclass(frozen=True)
class ScaleParams:
    s: float
    b: float = 0.0  # out = a * s + b


class GeluKind(enum.Enum):
    TANH = "gelu"  # ggml_gelu: the F16 lookup table on CPU
    ERF = "gelu_erf"
    QUICK = "gelu_quick"  # x * sigmoid(1.702 x), F16 lookup table on CPU


@dataclass(frozen=True)
class GeluParams:
    kind: GeluKind = GeluKind.TANH


class GluKind(enum.Enum):
    SWIGLU = "swiglu"
    GEGLU = "geglu"


@dataclass(frozen=True)
class GluParams:
    kind: GluKind = GluKind.SWIGLU
    swapped: bool = False  # False: the first half of a row is the activated (gate) half


@dataclass(frozen=True)
class NormParams:
    eps: float


class RopeMode(enum.IntEnum):
    NORMAL = 0  # rotates (x[2i], x[2i+1])
    NEOX = 2  # rotates (x[i], x[i + n_dims/2])


@dataclass(frozen=True)
class RopeParams:
    n_dims: int
    mode: RopeMode = RopeMode.NORMAL
    n_ctx_orig: int = 0
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class SoftMaxParams:
    scale: float = 1.0
    max_bias: float = 0.0  # ALiBi; 0 disables


class Prec(enum.Enum):
    DEFAULT = "default"
    F32 = "f32"


@dataclass(frozen=True)
class FlashAttnParams:
    scale: float
    max_bias: float = 0.0
    logit_softcap: float = 0.0
    prec: Prec = Prec.DEFAULT


class SortOrder(enum.Enum):
    ASC = "asc"
    DESC = "desc"


@dataclass(frozen=True)
class ArgsortParams:
    order: SortOrder = SortOrder.ASC


@dataclass(frozen=True)
class TopKParams:
    k: int
