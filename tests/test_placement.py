"""Weight placement: the buffer-type list over several devices, select_buft, the placement report."""
import pytest
from sched_device import TestDevice

from ggx.backend import BufferUsage, ExtraBufferType
from ggx.errors import GGXUnsupported
from ggx.graph import Context
from ggx.host import HostBuffer, HostBufferType
from ggx.ops import Op
from ggx.placement import (
    PlacementReport,
    alloc_weights,
    buft_list,
    host_device,
    run_host,
    select_buft,
    supports_weight_op,
)
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

    def prepare_forward(self, op, n_threads=1):
        return None  # host layout: the host backend's own kernel runs it


class HostWithExtra(RefDevice):
    """A host device with its own extra buffer type (as the CPU device with repack installed)."""

    def __init__(self, name="hostx"):
        super().__init__()
        self.name = name
        self._buft = HostBufferType(self, name=name)
        self.extra = Q4Only(self)

    def extra_buffer_types(self):
        return [self.extra]


class PartialHost(RefDevice):
    """A plugin's host-memory CPU-type device with no extra buffer types that runs only MUL."""

    def __init__(self, name="partial"):
        super().__init__()
        self.name = name
        self._buft = HostBufferType(self, name=name)

    def supports_op(self, op):
        return op.op in (Op.NONE, Op.MUL)


def test_buft_list_takes_each_devices_own_buffer_types():
    host, gpu = HostWithExtra(), TestDevice()
    assert buft_list([gpu, host]) == [gpu.buffer_type(), host.extra, host.buffer_type()]
    assert buft_list([host]) == [host.extra, host.buffer_type()]
    # another host-memory device listed after the host must not hide the host's extra types
    other = PartialHost()
    assert buft_list([host, other]) == [host.extra, host.buffer_type(), other.buffer_type()]
    assert buft_list([other, host]) == [other.buffer_type(), host.extra, host.buffer_type()]
    assert buft_list([host, host]) == [host.extra, host.buffer_type()]  # duplicates removed


def test_host_device_is_chosen_by_name_not_listing_order():
    cpu, ref, partial = HostWithExtra("CPU"), RefDevice(), PartialHost("aaa")
    assert host_device([partial, ref, cpu]) is cpu
    assert host_device([partial, ref]) is ref
    assert host_device([partial]) is partial
    with pytest.raises(GGXUnsupported, match="no CPU device"):
        host_device([TestDevice()])


def test_run_host_is_a_listed_complete_device_or_the_registrys():
    ref, gpu, partial = RefDevice(), TestDevice(), PartialHost()
    assert run_host([gpu, ref]) is ref
    assert run_host([partial, HostWithExtra("CPU"), ref]).name == "CPU"
    assert run_host([partial]) is host_device() and host_device().name in ("CPU", "ref")


def test_select_buft_takes_the_first_that_supports_the_op():
    host = HostWithExtra()
    dev = TestDevice(ops={Op.ADD})  # no MUL_MAT on the device
    bufts = buft_list([dev, host])
    ctx = Context()
    x = ctx.tensor("F32", (64, 2))
    for gtype, expected in (("Q4_0", host.extra), ("Q8_0", host.buffer_type())):
        w = ctx.tensor(gtype, (64, 8), name=f"w_{gtype}")
        assert select_buft(w, lambda c, t: c.mul_mat(t, x), bufts) is expected
        assert w.buffer is None  # the probe left no trace
    w = ctx.tensor("F32", (64,), name="norm_w")
    assert select_buft(w, ctx.mul(x, w), buft_list([TestDevice(ops={Op.MUL}), host])) is not host.buffer_type()


def test_supports_weight_op_never_touches_the_weight():
    """The probe is a stand-in: a weight in use (placed, maybe read by another thread) keeps its
    storage while a buffer type is asked about it."""
    host = HostWithExtra()
    ctx = Context()
    w = ctx.tensor("Q4_0", (64, 8), name="w")
    op = ctx.mul_mat(w, ctx.tensor("F32", (64, 2)))
    alloc_weights({w: host.buffer_type()})
    placed = w.buffer, w.offset
    seen = []

    class Watching(Q4Only):
        def supports_op(self, probe):
            seen.append((probe.src[0] is w, probe is op, (w.buffer, w.offset) == placed))
            return super().supports_op(probe)

    assert supports_weight_op(Watching(host), w, op)
    assert seen == [(False, False, True)] and (w.buffer, w.offset) == placed


def test_select_buft_names_the_tensor_when_nothing_fits():
    ctx = Context()
    w = ctx.tensor("F32", (4, 4), name="blk.0.weird")
    op = ctx.mul_mat(w, ctx.tensor("F32", (4, 1)))
    with pytest.raises(GGXUnsupported, match="blk.0.weird"):
        select_buft(w, op, [TestDevice(ops=set()).buffer_type()])


def test_placement_report_says_what_went_where_and_why_not():
    host = HostWithExtra()
    dev = TestDevice(ops={Op.MUL})
    bufts = buft_list([dev, host])
    ctx = Context()
    x = ctx.tensor("F32", (64, 2))
    ws = [ctx.tensor("Q8_0", (64, 8), name="w_q8"), ctx.tensor("Q8_0", (64, 4), name="w2_q8")]
    refusals = {}
    placed = [(w, select_buft(w, ctx.mul_mat(w, x), bufts, refusals)) for w in ws]
    report = PlacementReport.of(placed, bufts, refusals)
    by_name = {u.name: u for u in report.bufts}
    assert [u.name for u in report.bufts] == [b.name for b in bufts]
    cpu = by_name[host.buffer_type().name]
    assert (cpu.n_tensors, cpu.nbytes, cpu.skipped) == (2, ws[0].nbytes + ws[1].nbytes, "")
    assert by_name["q4only"].skipped == "refused MUL_MAT over 'w_q8' Q8_0[64, 8, 1, 1]"  # the first refusal
    assert "MUL_MAT" in by_name[dev.buffer_type().name].skipped
    assert report.used == [cpu] and "q4only: refused MUL_MAT" in str(report)


def test_alloc_weights_groups_by_buffer_type():
    host, dev = RefDevice(), TestDevice()
    ctx = Context()
    ws = [ctx.tensor("F32", (8, 3), name=f"w{i}") for i in range(4)]
    bufs = alloc_weights({w: (host.buffer_type() if i % 2 else dev.buffer_type()) for i, w in enumerate(ws)})
    assert len(bufs) == 2 and all(b.usage == BufferUsage.WEIGHTS for b in bufs)
    assert ws[0].buffer is ws[2].buffer and ws[1].buffer is ws[3].buffer and ws[0].buffer is not ws[1].buffer
    assert ws[2].offset >= ws[0].nbytes and ws[2].offset % dev.buffer_type().alignment == 0
