"""ggx_ray.worker without Ray: the command set of an in-process `Worker` over the CPU device.

Every request is plain data a remote caller sent; a malformed one raises a GGXError subclass
naming the problem, and the worker keeps serving. Ray itself is never imported here: the
cache-miss path of write_hashed (`ray.get` of the sent object) is covered by the Ray tests.
"""
from __future__ import annotations

import random
import sys

import numpy as np
import pytest

from ggx import registry, wire
from ggx.alloc import alloc_tensors, layout_tensors
from ggx.backend import BufferUsage
from ggx.conformance.harness import storage_tensors
from ggx.errors import GGXError, GGXOutOfMemory, GGXShapeError, GGXStateError, GGXUnsupported
from ggx.graph import Context, Graph, build_graph
from ggx.tensor import Tensor
from ggx.types import GType
from ggx_ray.worker import PROTOCOL, Worker, digest

CPU = registry.get_device("CPU")
F32, I32, Q4_0 = GType.F32, GType.I32, GType.Q4_0
RNG = np.random.default_rng(11)


@pytest.fixture(scope="module")
def worker() -> Worker:
    return Worker(devices=[CPU])


@pytest.fixture
def buf(worker) -> int:
    """A 256-byte buffer holding the bytes 0..255."""
    bid = worker.alloc(0, 256)
    worker.write(bid, 0, bytes(range(256)))
    return bid


@pytest.fixture(scope="module")
def sid(worker) -> int:
    return worker.stream(0, 1)


def _still_serving(worker: Worker) -> None:
    assert worker.ping() == worker.session
    bid = worker.alloc(0, 8)
    worker.write(bid, 0, b"12345678")
    assert worker.read(bid, 0, 8).tobytes() == b"12345678"
    worker.free(bid)


# --- graphs laid out in worker buffers --------------------------------------------------------
def _lay_out(tensors: list[Tensor], start: int = 0) -> tuple[object, int]:
    """Give `tensors` offsets (layout_tensors) in a stand-in for a driver-side buffer; its size."""
    remote = object()
    offsets, size = layout_tensors(CPU.buffer_type(), tensors, start=start)
    for t, off in zip(tensors, offsets):
        t.buffer, t.offset = remote, off
    return remote, size


def _encode(graph: Graph, ids: dict[int, int]) -> tuple:
    """The graph's message; `ids` maps id(stand-in buffer) to the worker's buffer id."""
    return wire.encode_graph(graph, lambda b: ids[id(b)])


def _mlp():
    """softmax(w @ x + b): the graph, its weights (w, b) and activations (x, the product, y, z)."""
    ctx = Context()
    x = ctx.tensor(F32, [8, 3], "x")
    w = ctx.tensor(F32, [8, 5], "w")
    b = ctx.tensor(F32, [5], "b")
    y = ctx.add(ctx.mul_mat(w, x), b)
    z = ctx.soft_max(y, None, 0.5)
    graph = build_graph(z)
    return graph, (w, b), (x, graph.nodes[0], y, z)


def _numpy_mlp(xv, wv, bv):
    y = (xv @ wv.T + bv) * 0.5
    e = np.exp(y - y.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _mlp_on_worker(worker: Worker):
    """(graph message, weights buffer id, activations buffer id, z) with w, b written."""
    graph, weights, acts = _mlp()
    wremote, wsize = _lay_out(list(weights))
    aremote, asize = _lay_out(list(acts))
    wbid, abid = worker.alloc(0, wsize), worker.alloc(0, asize)
    w, b = weights
    worker.write(wbid, w.offset, RNG.uniform(-1, 1, (5, 8)).astype(np.float32).tobytes())
    worker.write(wbid, b.offset, RNG.uniform(-1, 1, 5).astype(np.float32).tobytes())
    msg = _encode(graph, {id(wremote): wbid, id(aremote): abid})
    x, _, y, z = acts
    return msg, wbid, abid, weights, (x, y, z)


def _values(worker: Worker, bid: int, t: Tensor, shape) -> np.ndarray:
    return worker.read(bid, t.offset, t.nbytes).view(np.float32).reshape(shape)


# --- the happy path ---------------------------------------------------------------------------
def test_hello_memory_ping(worker):
    info = worker.hello()
    assert info["protocol"] == PROTOCOL and info["session"] == worker.session
    (dev,) = info["devices"]
    assert dev["name"] == "CPU" and dev["alignment"] == CPU.buffer_type().alignment
    assert dev["max_size"] <= 1 << 62
    free, total = worker.memory(0)
    assert 0 < free <= total
    assert worker.ping() == worker.session


def test_alloc_write_read(worker):
    bid = worker.alloc(0, 1000)
    data = RNG.integers(0, 256, 300, dtype=np.uint8)
    worker.write(bid, 100, data)
    worker.write(bid, 0, b"abc")
    worker.write(bid, 3, bytearray(b"def"))
    worker.write(bid, 6, memoryview(b"gh"))
    worker.write(bid, 8, data[::2][:4])  # a strided 1-D uint8 array
    assert worker.read(bid, 0, 8).tobytes() == b"abcdefgh"
    assert np.array_equal(worker.read(bid, 8, 4), data[::2][:4])
    got = worker.read(bid, 100, 300)
    assert got.dtype == np.uint8 and np.array_equal(got, data)
    got[:] = 0  # a copy, not the buffer's memory
    assert np.array_equal(worker.read(bid, 100, 300), data)
    assert worker.read(bid, 1000, 0).size == 0  # an empty range at the very end
    worker.write_many([(bid, 0, b"xy"), [bid, 1, b"z"]])  # in order: the second overwrites
    assert worker.read(bid, 0, 3).tobytes() == b"xzc"
    assert worker.alloc(0, 0) != bid  # a zero-byte buffer is a buffer
    worker.free(bid)


def test_memset_copy_usage(worker, buf):
    worker.memset(buf, 10, 20, 0xAB)
    assert worker.read(buf, 9, 22).tobytes() == bytes([9]) + b"\xab" * 20 + bytes([30])
    other = worker.alloc(0, 64)
    worker.memset(other, 0, 64, 0)
    worker.copy(buf, 100, other, 8, 16)
    assert worker.read(other, 0, 32).tobytes() == bytes(8) + bytes(range(100, 116)) + bytes(8)
    worker.copy(buf, 200, buf, 204, 40)  # overlapping, inside one buffer: as memmove
    assert worker.read(buf, 204, 40).tobytes() == bytes(range(200, 240))
    worker.usage(buf, int(BufferUsage.WEIGHTS))
    assert worker.buffers[buf].usage is BufferUsage.WEIGHTS
    worker.free(other)


def test_stream(worker):
    a, b = worker.stream(0), worker.stream(0, 2)
    assert a != b and a not in worker.buffers
    assert worker.streams[b].n_threads == 2


def test_compute(worker, sid):
    msg, wbid, abid, (w, b), (x, y, z) = _mlp_on_worker(worker)
    wv = _values(worker, wbid, w, (5, 8))
    bv = _values(worker, wbid, b, (5,))
    xv = RNG.uniform(-1, 1, (3, 8)).astype(np.float32)
    out = worker.compute(sid, 1, msg, [(abid, x.offset, xv.tobytes())], [])
    # the exports: the sink node's bytes, by (buffer id, offset); y is read by z, not exported
    assert list(out) == [(abid, z.offset)]
    assert np.array_equal(out[abid, z.offset], worker.read(abid, z.offset, z.nbytes))
    got = out[abid, z.offset].view(np.float32).reshape(3, 5)
    np.testing.assert_allclose(got, _numpy_mlp(xv, wv, bv), rtol=1e-5, atol=1e-6)

    # the same graph computed here on the CPU backend gives the same bytes
    graph, weights, acts = _mlp()
    local = alloc_tensors(CPU.buffer_type(), list(weights) + list(acts))
    for t, v in zip((weights[0], weights[1], acts[0]), (wv, bv, xv)):
        local.set_tensor(t, v.view(np.uint8).reshape(-1))
    CPU.init_backend(n_threads=1).graph_compute(graph)
    assert np.array_equal(local.get_tensor(acts[3]), out[abid, z.offset])

    # re-run by id only (GRAPH_RECOMPUTE) after new input bytes: here with the call's writes,
    # then written beforehand
    xv2 = RNG.uniform(-1, 1, (3, 8)).astype(np.float32)
    out2 = worker.compute(sid, 1, None, [(abid, x.offset, xv2.tobytes())], [])
    np.testing.assert_allclose(out2[abid, z.offset].view(np.float32).reshape(3, 5), _numpy_mlp(xv2, wv, bv),
                               rtol=1e-5, atol=1e-6)
    worker.write(abid, x.offset, xv.tobytes())
    out3 = worker.compute(sid, 1, None, [], [])
    assert np.array_equal(out3[abid, z.offset], out[abid, z.offset])

    # forgotten, then asked for by id
    with pytest.raises(GGXStateError, match=r"no graph 1 on stream \d+ \(send it again\)"):
        worker.compute(sid, 1, None, [], [1])
    # sent again under another id, and a stale id forgotten in the same call
    worker.compute(sid, 2, msg, [], [1, 99])
    worker.compute(sid, 2, None, [], [])


def test_graph_ids_are_per_stream(worker):
    """Each driver-side backend numbers its graphs from 1: two streams of one worker may send
    the same id, and each re-runs its own graph by it."""
    s1, s2 = worker.stream(0, 1), worker.stream(0, 1)
    m1, _, abid1, _, (x1, _, z1) = _mlp_on_worker(worker)
    m2, _, abid2, _, (x2, _, z2) = _mlp_on_worker(worker)
    xv = RNG.uniform(-1, 1, (3, 8)).astype(np.float32).tobytes()
    a = worker.compute(s1, 1, m1, [(abid1, x1.offset, xv)], [])
    b = worker.compute(s2, 1, m2, [(abid2, x2.offset, xv)], [])
    assert list(a) == [(abid1, z1.offset)] and list(b) == [(abid2, z2.offset)]
    assert list(worker.compute(s1, 1, None, [], [])) == [(abid1, z1.offset)]
    worker.compute(s2, 2, m2, [], [1])  # s2 forgets its graph 1 ...
    assert list(worker.compute(s1, 1, None, [], [])) == [(abid1, z1.offset)]  # ... not s1's
    with pytest.raises(GGXStateError, match="no graph 1"):
        worker.compute(s2, 1, None, [], [])


def test_free_drops_graphs(worker, sid):
    msg, wbid, abid, _, _ = _mlp_on_worker(worker)
    worker.compute(sid, 10, msg, [], [])
    worker.compute(sid, 11, msg, [], [])
    worker.free(wbid)  # the weights: every graph reading them goes
    for gid in (10, 11):
        with pytest.raises(GGXStateError, match=f"no graph {gid}"):
            worker.compute(sid, gid, None, [], [])
    with pytest.raises(GGXStateError, match=f"no buffer {wbid} "):
        worker.read(wbid, 0, 4)
    with pytest.raises(GGXStateError, match=f"no buffer {wbid} "):
        worker.free(wbid)
    with pytest.raises(GGXStateError, match=f"no buffer {wbid} "):  # sent again: refused
        worker.compute(sid, 12, msg, [], [])
    assert worker.read(abid, 0, 4).size == 4  # the other buffer stays
    _still_serving(worker)


def test_supports(worker):
    """Types and layout only: the tensors have no storage (the message's is ignored)."""
    ctx = Context()
    a = ctx.tensor(F32, [8, 4], "a")
    ids = ctx.tensor(I32, [2], "ids")
    rows = ctx.get_rows(a, ids)
    tr = ctx.transpose(a)
    strided = ctx.get_rows(tr, ids)  # rows that are not contiguous: the CPU kernels refuse them
    assert worker.supports(0, wire.encode_graph(Graph([rows], [a, ids]), lambda b: 0)) is True
    assert worker.supports(0, wire.encode_graph(Graph([tr, strided], [a, ids]), lambda b: 0)) is False


def test_compute_refuses_an_op_the_device_does_not_run(worker, sid):
    ctx = Context()
    a = ctx.tensor(F32, [8, 4], "a")
    ids = ctx.tensor(I32, [2], "ids")
    tr = ctx.transpose(a)
    out = ctx.get_rows(tr, ids)
    remote, size = _lay_out([a, ids, out])
    bid = worker.alloc(0, size)
    msg = _encode(Graph([tr, out], [a, ids]), {id(remote): bid})
    with pytest.raises(GGXUnsupported, match="CPU does not run GET_ROWS"):
        worker.compute(sid, 20, msg, [], [])
    with pytest.raises(GGXStateError, match="no graph 20"):
        worker.compute(sid, 20, None, [], [])


# --- write_hashed -----------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GGX_RAY_CACHE", str(tmp_path))
    return tmp_path


def test_write_hashed_from_the_cache(worker, cache):
    data = RNG.integers(0, 256, 5000, dtype=np.uint8)
    h = digest(data)
    assert len(h) == 32 and int(h, 16) >= 0
    (cache / h).write_bytes(data.tobytes())
    bid = worker.alloc(0, 6000)
    worker.memset(bid, 0, 6000, 0)
    # a hit: nothing is fetched (data is not even looked at), 0 bytes travelled
    assert worker.write_hashed(bid, 1000, data.size, h, ["never fetched"]) == 0
    assert np.array_equal(worker.read(bid, 1000, data.size), data)
    assert worker.read(bid, 0, 1000).max() == 0
    worker.free(bid)


def test_write_hashed_miss_needs_an_object_reference(worker, cache):
    """A cached file of another size is not used: the bytes must come from `data`, a list of
    one Ray object reference (fetched with ray.get: the Ray tests cover that path; here only
    the refusals of malformed `data`, which come before any fetch)."""
    data = RNG.integers(0, 256, 100, dtype=np.uint8)
    h = digest(data)
    (cache / h).write_bytes(data[:-1].tobytes())
    bid = worker.alloc(0, 100)
    worker.memset(bid, 0, 100, 0)
    for bad in ([], None, "ref", [1, 2], {"ref": 1}):
        with pytest.raises(GGXShapeError, match="data must be a list of one object reference"):
            worker.write_hashed(bid, 0, 100, h, bad)
    assert worker.read(bid, 0, 100).max() == 0  # nothing written
    # a hash that is in no cache at all: the same
    with pytest.raises(GGXShapeError, match="data must be a list of one object reference"):
        worker.write_hashed(bid, 0, 100, "0" * 32, [])
    worker.free(bid)


@pytest.mark.parametrize("h", ["XYZ", "A" * 32, "g" * 32, "0" * 31, "0" * 33, "../" + "0" * 29, 5, None,
                               b"0" * 32, ["0" * 32]])
def test_write_hashed_refuses_a_bad_hash(worker, cache, buf, h):
    with pytest.raises(GGXShapeError, match="hash must be 32 hex digits"):
        worker.write_hashed(buf, 0, 16, h, [])
    _still_serving(worker)


def test_write_hashed_checks_the_range_first(worker, cache, buf):
    data = np.zeros(64, np.uint8)
    (cache / digest(data)).write_bytes(data.tobytes())
    with pytest.raises(GGXShapeError, match=r"bytes 200\.\.264 are outside the 256-byte buffer"):
        worker.write_hashed(buf, 200, 64, digest(data), [])
    with pytest.raises(GGXStateError, match="no buffer"):
        worker.write_hashed(10**9, 0, 64, digest(data), [])


# --- malformed requests -----------------------------------------------------------------------
NOT_INTS = [(1.0, "float 1.0"), ("1", "str '1'"), (True, "bool True"), (None, "NoneType None"),
            (np.int64(1), r"int64 np\.int64\(1\)"), (np.uint8(1), r"uint8 np\.uint8\(1\)"), ([1], r"list \[1\]"),
            (1 << 63, "int 9223372036854775808")]


@pytest.mark.parametrize("value, shown", NOT_INTS, ids=[type(v).__name__ for v, _ in NOT_INTS])
@pytest.mark.parametrize("call, what", [
    (lambda w, b, v: w.read(b, v, 4), "offset"),
    (lambda w, b, v: w.read(b, 0, v), "size"),
    (lambda w, b, v: w.write(b, v, b"x"), "offset"),
    (lambda w, b, v: w.memset(b, 0, 4, v), "value"),
    (lambda w, b, v: w.copy(b, 0, b, v, 4), "offset"),
    (lambda w, b, v: w.read(v, 0, 4), "buffer id"),
    (lambda w, b, v: w.alloc(0, v), "size"),
    (lambda w, b, v: w.memory(v), "device index"),
    (lambda w, b, v: w.usage(b, v), "usage"),
], ids=["read-offset", "read-size", "write-offset", "memset-value", "copy-offset", "read-buffer", "alloc-size",
        "memory-device", "usage"])
def test_not_an_int(worker, buf, call, what, value, shown):
    """Ints only: bools and numpy ints are refused too (`type(v) is int`), so a caller cannot
    slip a value past a range check through another integer type; the driver sends ints."""
    with pytest.raises(GGXShapeError, match=rf"{what} must be an int in -?\d+\.\.\d+, got {shown}"):
        call(worker, buf, value)
    _still_serving(worker)


@pytest.mark.parametrize("call, error, pattern", [
    (lambda w, b: w.read(10**9, 0, 4), GGXStateError, r"no buffer 1000000000 \(freed, or given out by a worker"),
    (lambda w, b: w.read(b, -1, 4), GGXShapeError, r"offset must be an int in 0\.\.\d+, got int -1"),
    (lambda w, b: w.read(b, 0, -1), GGXShapeError, r"size must be an int in 0\.\.\d+, got int -1"),
    (lambda w, b: w.read(b, 250, 7), GGXShapeError, r"bytes 250\.\.257 are outside the 256-byte buffer \d+"),
    (lambda w, b: w.read(b, 257, 0), GGXShapeError, r"bytes 257\.\.257 are outside"),
    (lambda w, b: w.read(b, 1 << 62, 1 << 62), GGXShapeError, r"are outside the 256-byte buffer"),
    (lambda w, b: w.read(b, 1 << 20000, 1), GGXShapeError, r"offset must be an int in 0\.\.\d+, got int \.\.\."),
    (lambda w, b: w.read(b, b"x" * 10_000_000, 1), GGXShapeError, r"got bytes b'xxxxxx"),
    (lambda w, b: w.write(b, 250, b"x" * 7), GGXShapeError, r"bytes 250\.\.257 are outside"),
    (lambda w, b: w.write(b, 0, np.zeros(4, np.float32)), GGXShapeError,
     r"data must be bytes or a 1-D uint8 array, got ndarray"),
    (lambda w, b: w.write(b, 0, np.zeros((2, 2), np.uint8)), GGXShapeError, r"data must be bytes or a 1-D uint8"),
    (lambda w, b: w.write(b, 0, np.zeros((), np.uint8)), GGXShapeError, r"data must be bytes or a 1-D uint8"),
    (lambda w, b: w.write(b, 0, [1, 2, 3]), GGXShapeError, r"data must be bytes or a 1-D uint8 array, got list"),
    (lambda w, b: w.write(b, 0, "abc"), GGXShapeError, r"got str"),
    (lambda w, b: w.write(b, 0, None), GGXShapeError, r"got NoneType"),
    (lambda w, b: w.write_many("abc"), GGXShapeError, r"writes must be a list of \(buffer_id, offset, data\)"),
    (lambda w, b: w.write_many([(b, 0)]), GGXShapeError, r"each write is \(buffer_id, offset, data\)"),
    # the writes before a bad one are applied (in order): these rewrite the bytes there
    (lambda w, b: w.write_many([(b, 0, b"\x00\x01"), (b, 255, b"no")]), GGXShapeError, r"bytes 255\.\.257 are"),
    (lambda w, b: w.memset(b, 0, 300, 1), GGXShapeError, r"bytes 0\.\.300 are outside"),
    (lambda w, b: w.memset(b, 0, 4, 256), GGXShapeError, r"value must be an int in 0\.\.255, got int 256"),
    (lambda w, b: w.memset(b, 0, 4, -1), GGXShapeError, r"value must be an int in 0\.\.255, got int -1"),
    (lambda w, b: w.copy(b, 0, b, 200, 100), GGXShapeError, r"bytes 200\.\.300 are outside"),
    (lambda w, b: w.copy(b, 200, b, 0, 100), GGXShapeError, r"bytes 200\.\.300 are outside"),
    (lambda w, b: w.copy(b, 0, 10**9, 0, 4), GGXStateError, r"no buffer 1000000000"),
    (lambda w, b: w.alloc(0, 1 << 60), GGXOutOfMemory, r"CPU: cannot allocate 1152921504606846976 bytes"),
    (lambda w, b: w.alloc(0, -1), GGXShapeError, r"size must be an int in 0\.\.\d+, got int -1"),
    (lambda w, b: w.alloc(1, 16), GGXShapeError, r"device index must be an int in 0\.\.0, got int 1"),
    (lambda w, b: w.alloc(-1, 16), GGXShapeError, r"device index must be an int in 0\.\.0, got int -1"),
    (lambda w, b: w.memory(1), GGXShapeError, r"device index must be an int in 0\.\.0"),
    (lambda w, b: w.stream(2), GGXShapeError, r"device index must be an int in 0\.\.0"),
    (lambda w, b: w.stream(0, 0), GGXShapeError, r"n_threads must be an int in 1\.\.4096, got int 0"),
    (lambda w, b: w.stream(0, 2.0), GGXShapeError, r"n_threads must be an int in 1\.\.4096, got float 2\.0"),
    (lambda w, b: w.usage(b, 3), GGXShapeError, r"usage must be an int in 0\.\.2, got int 3"),
    (lambda w, b: w.read(b), GGXShapeError, r"worker: read refused the request: TypeError"),
    (lambda w, b: w.ping(1), GGXShapeError, r"worker: ping refused the request: TypeError"),
])
def test_malformed_request(worker, buf, call, error, pattern):
    before = worker.read(buf, 0, 256).copy()
    n_buffers, n_streams = len(worker.buffers), len(worker.streams)
    with pytest.raises(error, match=pattern) as e:
        call(worker, buf)
    assert len(str(e.value)) <= 500
    assert np.array_equal(worker.read(buf, 0, 256), before)  # nothing changed
    assert (len(worker.buffers), len(worker.streams)) == (n_buffers, n_streams)
    _still_serving(worker)


def _garbage_graphs(msg) -> list:
    """Graph messages that are not: from the wire tests' refusals, over the mlp's message."""
    tensors, nodes = [list(m) for m in msg[0]], list(msg[1])

    def with_(i, field, value):
        t = [list(m) for m in tensors]
        t[i][field] = value
        return (t, nodes)

    return ["garbage", 5, (tensors,), (tensors, nodes, nodes), ([None], [0]),
            with_(0, 0, "MATMUL"), with_(0, 1, "F64"), with_(0, 2, [8, -3, 1, 1]), with_(0, 4, 9),
            with_(0, 9, None), with_(0, 3, [4, 64, 256, 256]), with_(len(tensors) - 1, 8, [len(tensors)]),
            with_(len(tensors) - 1, 7, {"scale": "x"}), with_(0, 9, [1 << 20000, 0]),
            (tensors, [0]), (tensors, [len(tensors)])]


def test_garbage_graphs(worker, sid):
    msg, _, _, _, _ = _mlp_on_worker(worker)
    for i, g in enumerate(_garbage_graphs(msg)):
        with pytest.raises(GGXShapeError, match="graph message"):
            worker.compute(sid, 30 + i, g, [], [])
        with pytest.raises(GGXStateError, match=f"no graph {30 + i}"):
            worker.compute(sid, 30 + i, None, [], [])
        with pytest.raises(GGXShapeError, match="graph message"):
            worker.supports(0, g)
    _still_serving(worker)


@pytest.mark.parametrize("call, error, pattern", [
    (lambda w, s, m: w.compute(10**9, 1, m, [], []), GGXStateError, r"no stream 1000000000"),
    (lambda w, s, m: w.compute("1", 1, m, [], []), GGXShapeError, r"stream id must be an int"),
    (lambda w, s, m: w.compute(s, -1, m, [], []), GGXShapeError, r"graph id must be an int in 0\.\.\d+, got int -1"),
    (lambda w, s, m: w.compute(s, 40, None, [], []), GGXStateError, r"no graph 40 on stream \d+ \(send it again\)"),
    (lambda w, s, m: w.compute(s, 40, m, "x", []), GGXShapeError, r"writes must be a list"),
    (lambda w, s, m: w.compute(s, 40, m, [], "x"), GGXShapeError, r"forget must be a list of graph ids"),
    (lambda w, s, m: w.compute(s, 40, m, [], [None]), GGXShapeError, r"graph id must be an int in 0\.\.\d+, got"),
    (lambda w, s, m: w.supports(1, m), GGXShapeError, r"device index must be an int in 0\.\.0"),
])
def test_malformed_compute(worker, sid, call, error, pattern):
    msg, _, _, _, _ = _mlp_on_worker(worker)
    with pytest.raises(error, match=pattern):
        call(worker, sid, msg)
    _still_serving(worker)


def _one_leaf_graph(n: int, offset: int, bid: int, out_bid: int):
    """scale(a) with a F32[n] at `offset` of buffer `bid`, the result at 0 in `out_bid`."""
    ctx = Context()
    a = ctx.tensor(F32, [n], "a")
    y = ctx.scale(a, 2.0)
    a.buffer, a.offset = "in", offset
    y.buffer, y.offset = "out", 0
    return wire.encode_graph(Graph([y], [a]), lambda b: {"in": bid, "out": out_bid}[b])


@pytest.mark.parametrize("n, offset, end", [(32, 0, 128), (8, 48, 80), (1, 64, 68), (1, 1 << 62, (1 << 62) + 4)])
def test_storage_past_the_buffer_end_is_refused_before_compute(worker, sid, n, offset, end):
    """This is what keeps the kernels (which do not check bounds) inside the worker's memory."""
    small, out = worker.alloc(0, 64), worker.alloc(0, 256)
    worker.memset(out, 0, 256, 0x5A)
    msg = _one_leaf_graph(n, offset, small, out)
    with pytest.raises(GGXShapeError, match=rf"'a' F32\[{n}, 1, 1, 1\] at offset {offset} ends at byte {end}, "
                                            rf"past the 64-byte buffer {small}"):
        worker.compute(sid, 50, msg, [], [])
    assert worker.read(out, 0, 256).tobytes() == b"\x5a" * 256  # nothing ran
    with pytest.raises(GGXStateError, match="no graph 50"):
        worker.compute(sid, 50, None, [], [])
    # the result's storage past its buffer: the same
    msg = _one_leaf_graph(8, 0, out, small)
    worker.compute(sid, 51, msg, [], [])  # 32 bytes fit in 64
    msg = _one_leaf_graph(32, 0, out, small)
    with pytest.raises(GGXShapeError, match=r"<scale> F32\[32, 1, 1, 1\] at offset 0 ends at byte 128, past the 64"):
        worker.compute(sid, 52, msg, [], [])
    worker.free(small)
    worker.free(out)
    _still_serving(worker)


def test_a_view_cannot_reach_past_its_root(worker, sid):
    """Views have no storage of their own: the builder keeps them inside their root, and a
    quantized view must keep its blocks contiguous (else nbytes undercounts what a kernel
    reads: with nb[0] = 0 a Q4_0 view of one block at its root's end spans 0 bytes)."""
    ctx = Context()
    w = ctx.tensor(Q4_0, [32], "w")
    ids = ctx.tensor(I32, [1], "ids")
    v = ctx.view(w, [32], None, 0)
    out = ctx.get_rows(v, ids)
    remote, size = _lay_out([ids, out, w])  # w last: its end is the buffer's end
    bid = worker.alloc(0, w.offset + 18)
    ok = _encode(Graph([v, out], [w, ids]), {id(remote): bid})
    worker.write(bid, ids.offset, np.zeros(1, np.int32).tobytes())
    worker.compute(sid, 60, ok, [], [])
    for ne, nb, offset, pattern in [([32, 1, 1, 1], [0, 18, 18, 18], 18, r"nb\[0\]=0 is not 18"),
                                    ([32, 1, 1, 1], [18, 18, 18, 18], 18, r"view: .* past the 18 bytes"),
                                    ([64, 1, 1, 1], [18, 36, 36, 36], 0, r"view: .* past the 18 bytes")]:
        tensors = [list(m) for m in ok[0]]
        tensors[2][2], tensors[2][3], tensors[2][7] = ne, nb, {"offset": offset, "axes": [0, 1, 2, 3]}
        with pytest.raises(GGXShapeError, match=pattern):
            worker.compute(sid, 61, (tensors, ok[1]), [], [])
    worker.free(bid)
    _still_serving(worker)


def test_graph_in_a_freed_buffer(worker, sid):
    msg, wbid, abid, _, _ = _mlp_on_worker(worker)
    worker.free(abid)
    with pytest.raises(GGXStateError, match=f"no buffer {abid} "):
        worker.compute(sid, 70, msg, [], [])
    with pytest.raises(GGXStateError, match="no graph 70"):
        worker.compute(sid, 70, None, [], [])
    worker.free(wbid)
    _still_serving(worker)


# --- fuzz -------------------------------------------------------------------------------------
def _junk(rng: random.Random, bufs: list[int], depth: int = 0):
    kind = rng.randrange(15)
    return [None, "x", 1.5, float("nan"), True, 1 << rng.choice([60, 62, 63, 100, 20000]),
            -rng.randrange(1, 1 << 40), rng.randrange(0, 300), np.int64(3), np.zeros(4, np.float32),
            np.zeros((2, 2), np.uint8), b"abcd", {"a": 1},
            [_junk(rng, bufs, depth + 1) for _ in range(rng.randrange(3))] if depth < 2 else [],
            rng.choice(bufs)][kind]


def _to_lists(x):
    if isinstance(x, (list, tuple)):
        return [_to_lists(y) for y in x]
    if isinstance(x, dict):
        return {k: _to_lists(v) for k, v in x.items()}
    return x


#: each command's arguments, by kind (the fuzz draws a plausible value or junk for each)
SIGNATURES = {
    "hello": [], "ping": [], "memory": ["dev"], "alloc": ["dev", "size"], "free": ["bid"],
    "usage": ["bid", "usage"], "write": ["bid", "off", "data"], "write_many": ["writes"],
    "write_hashed": ["bid", "off", "size", "hash", "refs"], "read": ["bid", "off", "size"],
    "memset": ["bid", "off", "size", "byte"], "copy": ["bid", "off", "bid", "off", "size"],
    "stream": ["dev", "threads"], "supports": ["dev", "graph"],
    "compute": ["sid", "gid", "graph", "writes", "forget"],
}


def test_fuzz_commands(tmp_path, monkeypatch):
    had_ray = "ray" in sys.modules
    monkeypatch.setenv("GGX_RAY_CACHE", str(tmp_path))
    worker = Worker(devices=[CPU])
    rng = random.Random(4321)
    size = 1 << 14
    bufs = [worker.alloc(0, size) for _ in range(3)]
    sid = worker.stream(0, 1)
    (tmp_path / digest(np.zeros(64, np.uint8))).write_bytes(bytes(64))

    # valid graphs in bufs[0]: the mlp, and a few ops over views
    graph, weights, acts = _mlp()
    remote, _ = _lay_out(list(weights) + list(acts))
    ctx = Context()
    a = ctx.tensor(F32, [6, 4], "a")
    ids = ctx.tensor(I32, [3], "ids")
    r = ctx.get_rows(ctx.view(a, [6, 2], [a.nb[1]], a.nb[1]), ids)
    top = ctx.top_k(ctx.rms_norm(ctx.cont(ctx.transpose(a)), 1e-5), 2)
    g2 = build_graph([r, top])
    _lay_out(storage_tensors(g2), start=4096)
    graphs = [_to_lists(wire.encode_graph(graph, lambda b: 0)),
              _to_lists(wire.encode_graph(g2, lambda b: 0))]

    def graph_msg():
        m = _to_lists(rng.choice(graphs))
        for tm in m[0]:
            if tm[9] is not None:
                tm[9][0] = bufs[0]  # the graph buffer of the moment
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            tm = rng.choice(m[0])
            f = rng.randrange(10)
            cur = tm[f]
            if isinstance(cur, list) and cur:
                j = rng.randrange(len(cur))
                cur[j] = (rng.choice([0, 1, 4, 64, 4096, size, size - 4, -1, 1 << 62]) if rng.random() < 0.6
                          else _junk(rng, bufs))
            elif isinstance(cur, dict) and cur:
                cur[rng.choice(list(cur))] = _junk(rng, bufs)
            else:
                tm[f] = _junk(rng, bufs)
        return m

    plausible = {
        "dev": lambda: rng.choice([0, 0, 1, -1]),
        "size": lambda: rng.choice([0, 1, 4, 64, size // 2, size, size + 1, 1 << 60]),
        "bid": lambda: rng.choice(bufs),
        "usage": lambda: rng.choice([0, 1, 2, 3]),
        "off": lambda: rng.choice([0, 1, 64, 1000, size - 4, size, size + 1]),
        "data": lambda: rng.choice([b"\x01" * rng.randrange(100), np.ones(rng.randrange(100), np.uint8),
                                    bytearray(5), memoryview(b"xyz")]),
        "writes": lambda: [(rng.choice(bufs), rng.choice([0, 8, size - 2]), b"ab") for _ in range(rng.randrange(3))],
        "hash": lambda: rng.choice([digest(np.zeros(64, np.uint8)), "0" * 32, "zz"]),
        "refs": lambda: rng.choice([[], [None, None], None]),  # never one reference: that needs Ray
        "byte": lambda: rng.choice([0, 255, 256]),
        "threads": lambda: rng.choice([None, 1, 2, 0]),
        "graph": graph_msg,
        "sid": lambda: sid,
        "gid": lambda: rng.randrange(4),
        "forget": lambda: rng.choice([[], [], [rng.randrange(4)]]),
    }
    counts = {"ok": 0, "refused": 0}
    failures = []
    names = list(SIGNATURES) + ["compute"] * 4  # computes, the deepest path, more often
    for n in range(2000):
        name = rng.choice(names)
        junk = 0.1 if name == "compute" else 0.25
        args = [_junk(rng, bufs) if rng.random() < junk else plausible[k]() for k in SIGNATURES[name]]
        if name == "compute" and rng.random() < 0.3:
            args[2] = None  # re-run by id
        if rng.random() < 0.03:
            args.append(None)  # one argument too many
        if name == "write_hashed" and isinstance(args[4], (list, tuple)) and len(args[4]) == 1:
            args[4] = []  # one reference would be fetched with ray.get on a cache miss
        try:
            getattr(worker, name)(*args)
            counts["ok"] += 1
            counts[name] = counts.get(name, 0) + 1
        except GGXError:
            counts["refused"] += 1
        except BaseException as e:  # noqa: BLE001 - what the fuzz looks for
            failures.append(f"#{n} {name}{tuple(args)!r:.200}: {type(e).__name__}: {e}"[:400])
        bufs = [b if b in worker.buffers else worker.alloc(0, size) for b in bufs]
    assert not failures, "\n".join(failures[:20])
    # many requests got through, computes included (kernels ran over fuzzed graphs)
    assert counts["ok"] > 300 and counts["refused"] > 800 and counts.get("compute", 0) > 30, counts
    _still_serving(worker)
    msg, _, abid, _, (x, _, z) = _mlp_on_worker(worker)
    out = worker.compute(sid, 1000, msg, [(abid, x.offset, np.zeros(24, np.float32).tobytes())], [])
    np.testing.assert_allclose(out[abid, z.offset].view(np.float32).sum(), 3.0, rtol=1e-5)
    assert had_ray or "ray" not in sys.modules  # no request reached ray.get
