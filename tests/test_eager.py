"""`ggx.compute` from several threads at once, with real threads on every available device: each
call sees only its own inputs and results, also when the threads share tensors and devices."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import ggx
from ggx import registry

DEVICES = [d.name for d in registry.devices()]
N_THREADS = 4
N_CALLS = 12
NE = (4096, 32)  # big enough that the kernels of one call overlap another thread's


def run_threads(work) -> list[str]:
    """Run work(i) on N_THREADS threads started together; returns every failure message."""
    errors: list[str] = []
    barrier = threading.Barrier(N_THREADS)

    def body(i):
        try:
            barrier.wait()
            work(i)
        except Exception as e:  # reported by the assertion, with the thread that saw it
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=body, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def inputs_of(i: int, call: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * i + call)
    shape = NE[::-1]
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_threads_with_their_own_tensors_get_their_own_results(device):
    def work(i):
        ctx = ggx.Context()
        a, b = (ctx.tensor(ggx.GType.F32, NE, name=f"{n}{i}") for n in "ab")
        y = ctx.scale(ctx.add(a, b), float(i + 2))  # an intermediate in the scheduler's buffer
        for call in range(N_CALLS):
            xa, xb = inputs_of(i, call)
            (out,) = ggx.compute([y], inputs={a: xa, b: xb}, device=device)
            np.testing.assert_allclose(out, (xa + xb) * (i + 2), rtol=1e-6, err_msg=f"call {call}")

    assert run_threads(work) == []


def test_threads_sharing_tensors_across_every_device():
    """One graph, its leaves set by every thread with its own values, on alternating devices:
    each call places the inputs, computes and reads back before another call touches them."""
    ctx = ggx.Context()
    a, b = (ctx.tensor(ggx.GType.F32, NE, name=n) for n in "ab")
    y = ctx.mul(ctx.add(a, b), b)

    def work(i):
        for call in range(N_CALLS):
            device = DEVICES[(i + call) % len(DEVICES)]
            xa, xb = inputs_of(i, call)
            (out,) = ggx.compute([y], inputs={a: xa, b: xb}, device=device)
            np.testing.assert_allclose(out, (xa + xb) * xb, rtol=1e-5, err_msg=f"call {call} on {device}")

    assert run_threads(work) == []


def test_a_weight_set_once_is_shared_by_every_thread():
    """The README's pattern: a weight passed once, then used by calls from several threads."""
    ctx = ggx.Context()
    w = ctx.tensor(ggx.GType.F32, (64, 48), name="w")
    xs = [ctx.tensor(ggx.GType.F32, (64, 8), name=f"x{i}") for i in range(N_THREADS)]
    ys = [ctx.mul_mat(w, x) for x in xs]
    device = DEVICES[0]
    wv = np.random.default_rng(7).standard_normal((48, 64), dtype=np.float32)
    ggx.compute([ctx.scale(w, 1.0)], inputs={w: wv}, device=device)

    def work(i):
        for call in range(N_CALLS):
            xv = np.random.default_rng(10 * i + call).standard_normal((8, 64), dtype=np.float32)
            (out,) = ggx.compute([ys[i]], inputs={xs[i]: xv}, device=device)
            np.testing.assert_allclose(out, xv @ wv.T, rtol=1e-4, atol=1e-4, err_msg=f"call {call}")

    assert run_threads(work) == []
