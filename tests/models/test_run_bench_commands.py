"""`ggx run` and `ggx bench` on a tiny synthetic model (reference backend)."""
from __future__ import annotations

from ggx.cli import main


def test_run_streams_text_and_summary(tiny_llama, capsys):
    assert main(["run", str(tiny_llama), "--device", "ref", "-p", "the cat", "-n", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("the cat") and len(out) > len("the cat")
    for field in ("load time", "prompt:", "generation:", "tokens/s", "devices:         ref", "weights in:",
                  "splits/token:"):
        assert field in err
    assert "4 tokens" in err  # 5 generated: the first from the prompt's logits, 4 decode steps


def test_run_sampling_is_seeded(tiny_llama, capsys):
    args = ["run", str(tiny_llama), "--device", "ref", "-n", "8", "--temp", "0.8", "--seed", "3", "-p", "a"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


def test_bench_table(tiny_llama, capsys):
    assert main(["bench", str(tiny_llama), "--device", "ref", "-p", "16", "-n", "4", "-r", "2", "--profile"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| model") and len(lines) == 4
    assert "pp16" in lines[2] and "tg4" in lines[3] and "±" in lines[2]
    assert "decode step" in out and "scheduler" in out and "model Python" in out


def test_bad_arguments(tiny_llama, tmp_path, capsys):
    assert main(["bench", str(tiny_llama), "-t", "x"]) == 2
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert main(["run", str(bad), "--device", "ref"]) == 2
    assert "truncated" in capsys.readouterr().err


def test_graph_of_a_model_decode_step(tiny_llama, tmp_path, capsys):
    out = tmp_path / "m.dot"
    assert main(["graph", str(tiny_llama), "-d", "ref", "--layers", "1", "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("digraph") and "decode step, layers 0-0 of 2" in text
    assert "cluster" in text and "blk.0.attn_norm.weight" in text
    assert "blk.1." not in text  # cut to the first layer
    assert "FLASH_ATTN_EXT" in text and "SET_ROWS" in text  # the real attention, not the demo's
    one_layer = int(capsys.readouterr().out.split("(")[1].split()[0])
    assert main(["graph", str(tiny_llama), "-d", "ref", "--layers", "2", "-o", str(out)]) == 0
    two_layers = int(capsys.readouterr().out.split("(")[1].split()[0])
    assert "blk.1.ffn_norm.weight" in out.read_text() and two_layers > one_layer
    assert main(["graph", str(tiny_llama), "--layers", "0", "-o", str(out)]) == 2
    assert main(["graph", str(tiny_llama), "--weights-on", "ref", "-o", str(out)]) == 2


def test_graph_of_the_default_model(tmp_path):
    out = tmp_path / "smollm2.dot"
    assert main(["graph", "default", "--layers", "1", "-o", str(out)]) == 0
    assert "decode step, layers 0-0 of 30" in out.read_text()
