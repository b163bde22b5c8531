"""qwen2, qwen3 and qwen3moe against llama.cpp, on tiny synthetic files quantized by llama.cpp.

benchmarks/llamacpp_logits.py made the data once with llama.cpp (llama-quantize, llama-logits):
each file's tensor types and sha256, the prompt (PROMPT_TOKENS random ids, past 200), and per
position llama.cpp's top logits with their ids and the row's mean, std and maximum. Here the
file is written again by ggx (the same random source, each tensor quantized by ggx's bit-exact
quantizers to the type llama-quantize chose: every tensor's bytes are checked against
llama-quantize's), run with its weights in plain CPU memory and in each extra buffer type of the
CPU, at 1 and 2 threads, and held to issue 32's bounds (llamacpp_logits.check). No llama.cpp is
needed here.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from bench_modules import load_benchmark
from weight_bufts import host_weight_bufts, only_weight_bufts

from ggx.models import GGUFFile, load_model
from ggx.models.weights import representative_op

lc = load_benchmark("llamacpp_logits")
# by type, then architecture: files of one type share their token embedding (encoded once)
CASES = sorted((p.stem for p in lc.DATA.glob("*.npz")), key=lambda c: (c.split("_", 1)[1], c))


def test_every_architecture_and_type_has_reference_data():
    assert sorted(CASES) == sorted(f"{a}_{t}" for a in lc.TINY for t in lc.TYPES)


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory, smollm2_path):
    """(name, remade file, llama.cpp's reference) of one architecture and type."""
    name = request.param
    arch = name.split("_")[0]
    ref, digests = lc.load(lc.DATA / f"{name}.npz")
    path = lc.remake(tmp_path_factory.mktemp("gguf") / f"{name}.gguf", arch,
                     {n: t for n, (t, _) in digests.items()}, smollm2_path)
    f = GGUFFile(str(path))
    assert sorted(f.tensors) == sorted(digests)
    for n, t in f.tensors.items():
        assert t.type.ggml_id == digests[n][0], n
        assert hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest() == digests[n][1], \
            f"{n}: ggx's {t.type.name} bytes differ from llama-quantize's"
    return name, path, ref


@pytest.mark.parametrize("buft", host_weight_bufts())
def test_logits_agree_with_llama_cpp(case, buft, record_property):
    name, path, ref = case
    with only_weight_bufts(buft):
        m = load_model(path, n_threads=1, warmup=False)
    if buft is not None:
        assert buft in {u.name for u in m.placement.used}
    if buft not in (None, "CPU") and m.hp.n_expert:  # MUL_MAT_ID stays on the repacked layouts
        extra = next(b for b in m.runner.weight_bufts if b.name == buft)
        exps = {n: w for n, w in m.weights.items() if n.endswith("_exps.weight")}
        taken = [n for n, w in exps.items() if extra.supports_op(representative_op(w, n, m.hp))]
        assert taken and all(exps[n].data_buffer.buft.name == buft for n in taken)
    assert len(ref.ids) > 200
    for n_threads in (1, 2):
        m.runner.set_n_threads(n_threads)
        logits = m.forward(ref.ids)
        bad = lc.check(logits, ref)
        assert not bad, f"{name}, weights in {buft}, {n_threads} threads: " + "; ".join(bad)
