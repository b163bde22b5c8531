"""Weight placement: buffer-type priority list and select_buft."""
import pytest
from sched_device import TestDevice

from ggx.backend import BufferUsage, ExtraBufferType
from ggx.errors import GGXUnsupported
from ggx.graph import Context
from ggx.host import HostBuffer
from ggx.ops import Op
from ggx.placement import alloc_weights, buft_list, select_buft
from ggx.reference import RefDevice


class Q4Only(ExtraBufferType):
    """An extra buffer type that takes Q4_0 weights of MUL_MAT only (like repack)."""

    name = "q4only"

    def __init__(self, device):
        self._device = device

    @property
    def device(self):
        return self._device

    @property
    def is_host(self):
        return True

    def alloc_buffer(self, size):
        return HostBuffer(self, size)

    def supports_op(self, op):
        return op.op is Op.MUL_MAT and op.src[0].type.name == "Q4_0" and op.src[0].buffer.usage == BufferUsage.WEIGHTS

    def compute_forward(self, op, n_threads=1):
        return False


def test_buft_list_priority_order():
    host = RefDevice()
    dev = TestDevice()
    extra = Q4Only(host)
    assert buft_list(dev, host=host, extra=[extra]) == [dev.buffer_type(), extra, host.buffer_type()]
    assert buft_list(host, host=host, extra=[extra]) == [extra, host.buffer_type()]


def test_select_buft_takes_the_first_that_supports_the_op():
    host = RefDevice()
    extra = Q4Only(host)
    dev = TestDevice(ops={Op.ADD})  # no MUL_MAT on the device
    bufts = buft_list(dev, host=host, extra=[extra])
    ctx = Context()
    x = ctx.tensor("F32", (64, 2))
    for gtype, expected in (("Q4_0", extra), ("Q8_0", host.buffer_type())):
        w = ctx.tensor(gtype, (64, 8), name=f"w_{gtype}")
        assert select_buft(w, lambda c, t: c.mul_mat(t, x), bufts) is expected
        assert w.buffer is None  # the probe left no trace
    w = ctx.tensor("F32", (64,), name="norm_w")
    assert select_buft(w, ctx.mul(x, w), buft_list(TestDevice(ops={Op.MUL}), host=host, extra=[])) \
        is not host.buffer_type()


def test_select_buft_names_the_tensor_when_nothing_fits():
    ctx = Context()
    w = ctx.tensor("F32", (4, 4), name="blk.0.weird")
    op = ctx.mul_mat(w, ctx.tensor("F32", (4, 1)))
    with pytest.raises(GGXUnsupported, match="blk.0.weird"):
        select_buft(w, op, [TestDevice(ops=set()).buffer_type()])


def test_alloc_weights_groups_by_buffer_type():
    host, dev = RefDevice(), TestDevice()
    ctx = Context()
    ws = [ctx.tensor("F32", (8, 3), name=f"w{i}") for i in range(4)]
    bufs = alloc_weights({w: (host.buffer_type() if i % 2 else dev.buffer_type()) for i, w in enumerate(ws)})
    assert len(bufs) == 2 and all(b.usage == BufferUsage.WEIGHTS for b in bufs)
    assert ws[0].buffer is ws[2].buffer and ws[1].buffer is ws[3].buffer and ws[0].buffer is not ws[1].buffer
    assert ws[2].offset >= ws[0].nbytes and ws[2].offset % dev.buffer_type().alignment == 0
