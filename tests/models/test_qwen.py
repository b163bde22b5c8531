"""qwen2, qwen3 and qwen3moe on tiny synthetic GGUF files: the graph on the reference backend
against an independent float64 numpy model, ggx-cpu (fused or not, extra buffer types) against
ref, and every key and tensor these architectures read refused by name when wrong.
(tests/models/test_llamacpp_logits.py holds the comparison with llama.cpp.)"""
from __future__ import annotations

import numpy as np
import pytest
from gguf_synth import write_tiny_qwen
from numpy_model import numpy_logits

from ggx.errors import GGXFormatError
from ggx.models import GGUFFile, load_model, read_hparams
from ggx.ops import RopeMode

# the three architectures with the shape that tests each one's own part
CONFIGS = {"qwen2": {}, "qwen3": {"head_dim": 32}, "qwen3moe": {"head_dim": 24, "n_expert": 4, "n_expert_used": 2}}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny_qwen(request, tmp_path_factory):
    arch = request.param
    return arch, write_tiny_qwen(tmp_path_factory.mktemp("gguf") / f"tiny-{arch}.gguf", arch, **CONFIGS[arch])


def _prompt(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(2, n_vocab, size=n).tolist()


def test_hparams(tiny_qwen):
    name, path = tiny_qwen
    arch, hp = read_hparams(GGUFFile(path))
    assert arch.name == name and hp.rope_mode is RopeMode.NEOX and hp.rope_freq_base == 1e6 and hp.tied_output
    assert hp.head_dim == CONFIGS[name].get("head_dim", 16) and hp.n_embd_q == 4 * hp.head_dim
    assert (hp.n_expert, hp.n_expert_used) == ((4, 2) if name == "qwen3moe" else (0, 0))


@pytest.mark.parametrize("flash_attn", [True, False], ids=["flash_attn", "soft_max"])
def test_forward_matches_numpy(tiny_qwen, flash_attn):
    _, path = tiny_qwen
    m = load_model(path, devices=["ref"], flash_attn=flash_attn, warmup=False)
    ids = _prompt(37, m.n_vocab)
    got, want = m.forward(ids), numpy_logits(path, ids)
    # ggx rounds K/V to F16 in the cache; everything else is float64 on ref
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-3 * np.abs(want).max())


def test_decode_steps_match_the_batch(tiny_qwen):
    """The KV cache path: a prompt then tokens one by one give the one-batch logits."""
    _, path = tiny_qwen
    m = load_model(path, devices=["ref"], warmup=False)
    ids = _prompt(20, m.n_vocab, seed=1)
    whole = m.forward(ids)
    m.reset()
    steps = [m.eval(ids[:12], all_logits=True)] + [m.eval([t]) for t in ids[12:]]
    np.testing.assert_allclose(np.concatenate(steps), whole, rtol=0, atol=1e-5 * np.abs(whole).max())


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_cpu_matches_ref(tiny_qwen, fuse):
    """ggx-cpu (weights where placement puts them: extra buffer types included) against ref."""
    pytest.importorskip("ggx_cpu", reason="ggx-cpu is not installed")
    _, path = tiny_qwen
    ids = _prompt(29, 268)
    want = load_model(path, devices=["ref"], warmup=False).forward(ids)
    got = load_model(path, devices=["CPU"], n_threads=2, fuse=fuse, warmup=False).forward(ids)
    # ggx-cpu quantizes activations to Q8 for the Q8_0 products, as ggml does (test_moe's criterion)
    nmse = float(((got - want) ** 2).sum() / (want**2).sum())
    assert nmse < 1e-2, nmse


def test_qwen3moe_experts_upload_through_the_copy_callback(tmp_path):
    """Experts in host memory, MUL_MAT_ID offloaded to the scheduler's test device: only the used
    experts travel, through the expert-upload copy callback, and the logits are ref's."""
    import sys
    from pathlib import Path

    from ggx.ops import Op
    from ggx.reference import RefDevice

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from sched_device import TestDevice

    path = write_tiny_qwen(tmp_path / "moe.gguf", "qwen3moe", **{**CONFIGS["qwen3moe"], "n_expert": 8})
    ids = _prompt(9, 268, seed=2)
    want = load_model(path, devices=["ref"], warmup=False)
    dev = TestDevice("moe-test", offload=lambda op: op.op is Op.MUL_MAT_ID)
    m = load_model(path, devices=[dev, RefDevice()], host_experts=True, tensor_split=[1, 0], warmup=False)
    assert all(w.data_buffer.is_host for n, w in m.weights.items() if n.endswith("_exps.weight"))
    np.testing.assert_allclose(m.forward(ids), want.forward(ids), atol=1e-4, rtol=1e-4)
    cb = m.runner.copy_callback
    assert m.runner.sched.stats.n_callback_copies > 0 and cb.runs
    m.reset()
    m.eval(ids[:4])
    got = m.eval([ids[4]])[-1]  # one token: at most n_expert_used experts per expert stack
    np.testing.assert_allclose(got, want.forward(ids[:5])[-1], atol=1e-4, rtol=1e-4)
    assert sum(last - first + 1 for first, last in cb.runs) <= 3 * m.hp.n_layer * m.hp.n_expert_used


# --- validation: every key and tensor these architectures read, named when wrong ---------------

def _refused(tmp_path, arch, match, **kw):
    path = write_tiny_qwen(tmp_path / f"bad-{arch}.gguf", arch, **{**CONFIGS[arch], **kw})
    with pytest.raises(GGXFormatError, match=match):
        read_hparams(GGUFFile(path))


@pytest.mark.parametrize("arch, tensor", [
    ("qwen2", "blk.1.attn_k.bias"), ("qwen2", "blk.0.attn_v.weight"), ("qwen3", "blk.0.attn_q_norm.weight"),
    ("qwen3", "blk.1.attn_k_norm.weight"), ("qwen3moe", "blk.0.ffn_gate_inp.weight"),
    ("qwen3moe", "blk.1.ffn_down_exps.weight"), ("qwen3", "output_norm.weight")])
def test_missing_tensor_is_named(tmp_path, arch, tensor):
    _refused(tmp_path, arch, tensor.replace(".", r"\."), drop=(tensor,))


@pytest.mark.parametrize("arch, tensor, ne, kind, what", [
    ("qwen2", "blk.0.attn_q.bias", (32,), "F32", r"ne \[32\]"),
    ("qwen2", "blk.0.attn_k.bias", (32,), "F16", "bias 'blk.0.attn_k.bias' is F16"),
    ("qwen3", "blk.0.attn_q_norm.weight", (16,), "norm", r"ne \[16\], the metadata implies \[32\]"),
    ("qwen3moe", "blk.0.ffn_up_exps.weight", (64, 64, 3), "Q8_0", r"ne \[64, 64, 3\]"),
    ("qwen3moe", "blk.1.ffn_gate_inp.weight", (64, 4), "F16", "router 'blk.1.ffn_gate_inp.weight' is F16"),
])
def test_wrong_tensor_is_named(tmp_path, arch, tensor, ne, kind, what):
    _refused(tmp_path, arch, what, replace={tensor: (ne, kind)})


@pytest.mark.parametrize("arch, metadata, what", [
    ("qwen3moe", {"expert_count": None}, "qwen3moe.expert_count"),
    ("qwen3moe", {"expert_used_count": 0}, r"qwen3moe.expert_used_count = 0 is not a sensible count \(at least 1\)"),
    ("qwen3moe", {"expert_used_count": 5}, "expert_used_count 5 is more than qwen3moe.expert_count 4"),
    ("qwen3", {"attention.value_length": 16}, "qwen3.attention.value_length 16 differs"),
    ("qwen2", {"attention.head_count_kv": 3}, "qwen2.attention.head_count 4 is not a multiple"),
    ("qwen2", {"feed_forward_length": 0}, r"qwen2.feed_forward_length = 0 is not a sensible count \(at least 1\)"),
])
def test_wrong_metadata_is_named(tmp_path, arch, metadata, what):
    _refused(tmp_path, arch, what, metadata=metadata)


@pytest.mark.parametrize("keys, what", [
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0},
     r"qwen2.rope.scaling.type = 'yarn' with qwen2.rope.scaling.factor = 4: RoPE context scaling is not supported"),
    ({"rope.scale_linear": 2.0}, "qwen2.rope.scale_linear = 2: RoPE context scaling"),
])
def test_rope_context_scaling_is_refused_by_name(tmp_path, keys, what):
    _refused(tmp_path, "qwen2", what, metadata=keys)
    # no scaling (type none, or a factor of 1) loads
    path = write_tiny_qwen(tmp_path / "plain.gguf", "qwen2",
                           metadata={"rope.scaling.type": "linear", "rope.scaling.factor": 1.0})
    assert read_hparams(GGUFFile(path))[0].name == "qwen2"


def test_qwen3moe_expert_width_defaults_as_llama_cpp(tmp_path):
    """Without expert_feed_forward_length the experts are feed_forward_length / expert_used_count wide."""
    path = write_tiny_qwen(tmp_path / "moe.gguf", "qwen3moe", **CONFIGS["qwen3moe"],
                           metadata={"expert_feed_forward_length": None, "feed_forward_length": 128})
    assert read_hparams(GGUFFile(path))[1].n_ff == 64


def test_qwen2_pre_tokenizer_splits_digits_one_by_one(smollm2_path):
    """Qwen 2 / 2.5 / 3 files name pre-tokenizer "qwen2": llama 3's split with single digits."""
    from ggx.models.tokenizer import Tokenizer

    f = GGUFFile(smollm2_path)
    vocab, merges = f.get("tokenizer.ggml.tokens", list), f.get("tokenizer.ggml.merges", list)
    text = "I'm 12345 cats\n\n  don't!"

    def pieces(pre):
        hf = Tokenizer(vocab, merges, pre=pre)._tok  # the `tokenizers` object, built at first use
        return [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)]

    qwen, llama3 = pieces("qwen2"), pieces("llama3")
    assert qwen[:7] == ["I", "'m", "Ġ", "1", "2", "3", "4"] and llama3[:4] == ["I", "'m", "Ġ", "123"]
    assert [p for p in qwen if not p.isdigit()] == [p for p in llama3 if not p.isdigit()]
