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
