"""`ggx run`, `ggx bench` and `ggx compile` on tiny synthetic models (reference backend), and how a
run ends: the summary's counts and stop reason, refusals before the prompt is echoed, Ctrl-C and
a closed pipe (real processes)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from gguf_synth import write_tiny_llama

from ggx import progress
from ggx.cli import main
from ggx.commands import bench
from ggx.models.runner import Runner


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """A tiny model trained (so it says) on 4096 tokens: `-n -1` keeps it generating for a while."""
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "long-llama.gguf", n_ctx_train=4096)


def _summary(err: str) -> dict[str, str]:
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in err.splitlines() if ":" in ln)}


def test_run_streams_text_and_summary(tiny_llama, capsys):
    assert main(["run", str(tiny_llama), "--device", "ref", "-p", "the cat", "-n", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("the cat") and len(out) > len("the cat")
    s = _summary(err)
    assert s["prompt"].split()[:3] == ["5", "tokens", "(prefill)"] and "tokens/s" in s["prompt"]
    # 5 generated: the first from the prompt's logits, then 4 decode steps
    assert s["generated"].startswith("5 tokens; 4 decode steps in") and "tokens/s" in s["generated"]
    assert s["stopped"] == "after -n 5 tokens"
    assert s["context"] == "512 tokens" and s["devices"].startswith("ref")
    assert "MiB" in s["weights in"] and s["splits/token"]
    split = dict(part.rsplit(" ", 2)[:2] for part in s["load split"].split(";")[0].split(", "))
    assert set(split) == {"file", "devices", "weights", "preparation"} and all(float(v) >= 0 for v in split.values())
    assert "kernels" in s["load split"]
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}  # a long test run's peak passes 1 GiB
    resident, peak = (float(x.split()[0]) * units[x.split()[1]] for x in s["memory"].split(",")[:2])
    assert 0 < resident <= peak and "resident" in s["memory"]


def test_run_says_how_much_of_the_weights_is_mapped(tiny_llama, capsys):
    assert main(["run", str(tiny_llama), "-p", "the cat", "-n", "2"]) == 0
    assert "of weights mapped from the file" in _summary(capsys.readouterr().err)["memory"]
    assert main(["run", str(tiny_llama), "-p", "the cat", "-n", "2", "--no-mmap"]) == 0
    assert "mapped" not in _summary(capsys.readouterr().err)["memory"]


def test_run_sampling_is_seeded(tiny_llama, capsys):
    args = ["run", str(tiny_llama), "--device", "ref", "-n", "8", "--temp", "0.8", "--seed", "3", "-p", "a"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


def test_a_full_context_stops_generation_and_says_so(tiny_llama, capsys):
    assert main(["run", str(tiny_llama), "--device", "ref", "-p", "the cat", "-c", "9", "-n", "50"]) == 0
    s = _summary(capsys.readouterr().err)
    assert s["stopped"].startswith("the context is full (9 tokens)") and "-c" in s["stopped"]
    assert s["generated"].startswith("5 tokens")  # 5 prompt tokens + 4 decoded = 9 slots, then one more token
    assert main(["run", str(tiny_llama), "--device", "ref", "-p", "the cat", "-c", "12", "-n", "-1"]) == 0
    assert _summary(capsys.readouterr().err)["stopped"].startswith("the context is full (12 tokens)")


def test_minus_c_above_the_training_context_is_explained(tiny_llama, capsys):
    assert main(["run", str(tiny_llama), "--device", "ref", "-n", "1", "-c", "100000"]) == 0
    assert _summary(capsys.readouterr().err)["context"] == \
        "512 tokens (-c 100000 is more than the model was trained for)"


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_echoed(tiny_llama, capsys):
    assert main(["run", str(tiny_llama), "--device", "ref", "-p", "the cat sat on the mat", "-c", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: the prompt has ")
    assert "more than the context of 4" in err and "with -c (up to 512" in err


def test_n_zero_prints_the_prompt_only(tiny_llama, capsys):
    assert main(["run", str(tiny_llama), "--device", "ref", "-p", "the cat", "-n", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "the cat\n"
    assert _summary(err)["generated"].startswith("0 tokens; 0 decode steps")


def test_compile_time_is_left_out_of_the_speeds(tiny_llama, capsys, monkeypatch):
    run = Runner.run
    calls = []

    def compiling_first(self, *args):
        calls.append(1)
        if len(calls) == 1:  # the prefill compiles (slowly) something
            with progress.compiling("test kernels"):
                time.sleep(0.7)
        return run(self, *args)

    monkeypatch.setattr(Runner, "run", compiling_first)
    assert main(["run", str(tiny_llama), "--device", "ref", "-p", "the cat", "-n", "3"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("compiling test kernels, first run only\n")  # the notice, before any text
    s = _summary(err)
    prefill_ms = float(s["prompt"].split(" in ")[1].split()[0])
    assert prefill_ms < 500, s["prompt"]
    assert float(s["kernels"].split()[0]) >= 700 and "left out of the times above" in s["kernels"]


def test_bench_table(tiny_llama, capsys):
    assert main(["bench", str(tiny_llama), "--device", "ref", "-p", "16", "-n", "4", "-r", "2", "--profile"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| model") and len(lines) == 4
    assert "pp16" in lines[2] and "tg4" in lines[3] and "±" in lines[2]
    assert "decode step" in out and "scheduler" in out and "model Python" in out


class _CountingModel:
    """What bench's repetitions touch of a model; the `compile_on` evals compile a kernel."""

    n_vocab = 10

    def __init__(self, compile_on: set[int]):
        self.evals = 0
        self.compile_on = compile_on

    def reset(self):
        pass

    def eval(self, tokens):
        self.evals += 1
        if self.evals in self.compile_on:
            with progress.compiling("test kernels"):
                pass


def test_bench_json_has_llama_bench_fields_and_the_first_run(tiny_llama, capsys):
    import json

    assert main(["bench", str(tiny_llama), "--device", "ref", "-p", "12", "-n", "3", "-r", "2", "-o", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["n_prompt"], r["n_gen"]) for r in records] == [(12, 0), (0, 3)]
    for r in records:
        assert len(r["samples_ts"]) == 2 and r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 2)
        assert r["first_ts"] > 0
        assert 0 < r["load_s"] < r["start_s"] and r["peak_rss_bytes"] > 10**7
        assert set(r["load_split"]) == {"file", "devices", "weights", "preparation", "kernels"}


def test_bench_table_ends_with_start_and_peak_rss(tiny_llama, capsys):
    assert main(["bench", str(tiny_llama), "--device", "ref", "-p", "8", "-n", "0", "-r", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("start ") and "(process start to one token)" in last and "preparation" in last
    assert float(last.split("peak RSS ")[1].split()[0]) > 10


def test_bench_warms_up_and_replaces_repetitions_that_compiled():
    import numpy as np

    rng = np.random.default_rng(0)
    model = _CountingModel(compile_on={1, 3})  # the warm-up compiles, and so does the 2nd timed run
    assert len(bench.repetitions(model, "pp", 4, rng, 3)) == 3
    assert model.evals == 5  # warm-up + 3 timed + 1 replacing the one that compiled
    always = _CountingModel(compile_on=set(range(100)))
    assert len(bench.repetitions(always, "pp", 4, rng, 2)) == 2
    assert always.evals == 1 + 2 + bench.MAX_RETRIES  # retries are bounded


@pytest.mark.parametrize("tps, noted", [([100.0, 50.0, 150.0], True), ([100.0, 101.0, 99.0], False)])
def test_bench_says_why_repetitions_disagree(tiny_llama, capsys, monkeypatch, tps, noted):
    monkeypatch.setattr(bench, "repetitions", lambda *args, **kwargs: tps)
    assert main(["bench", str(tiny_llama), "--device", "ref", "-p", "8", "-n", "0"]) == 0
    out, err = capsys.readouterr()
    assert "100.00 ± " in out
    assert ("note: repetitions differ by up to 50% of their mean" in err) is noted


def test_bad_arguments(tiny_llama, tmp_path, capsys):
    assert main(["bench", str(tiny_llama), "-t", "x"]) == 2
    assert main(["bench", str(tiny_llama), "--device", "ref", "-p", "0", "-n", "0"]) == 2
    assert "nothing to run" in capsys.readouterr().err
    assert main(["bench", str(tiny_llama), "--device", "ref", "-p", "600", "-n", "0"]) == 2
    assert "does not fit the model's context of 512" in capsys.readouterr().err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert main(["run", str(bad), "--device", "ref"]) == 2
    assert "truncated" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["missing.gguf", "."])
def test_a_missing_model_or_a_directory_is_one_error_line(model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for cmd in ("run", "bench", "compile"):
        assert main([cmd, model, "--device", "ref"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err


def test_compile_runs_every_path_and_says_so_in_one_line(tiny_llama, capsys):
    assert main(["compile", str(tiny_llama), "-t", "1,2", "--no-tune"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kernels for ") and "compiled or loaded from the disk cache" in err[0]


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
    assert main(["graph", str(tiny_llama), "-o", str(tmp_path / "missing" / "m.dot")]) == 2


def test_graph_of_the_default_model(tmp_path):
    out = tmp_path / "smollm2.dot"
    assert main(["graph", "default", "--layers", "1", "-o", str(out)]) == 0
    assert "decode step, layers 0-0 of 30" in out.read_text()


# --- real processes: a closed pipe, Ctrl-C, argv bytes that are not UTF-8 -------------------------

def _ggx(*args, **kwargs) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "GGX_DEBUG"}
    return subprocess.Popen([sys.executable, "-m", "ggx.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, **kwargs)


def _long_run(model, **kwargs) -> subprocess.Popen:
    proc = _ggx("run", str(model), "--device", "ref", "-n", "-1", "-c", "4096", "-p", "the cat", **kwargs)
    assert proc.stdout.read(1) == b"t"  # the prompt is echoed: generation has begun
    return proc


def test_a_closed_pipe_stops_quietly(long_llama):
    proc = _long_run(long_llama)
    proc.stdout.close()  # `ggx run | head -c 1`
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert b"Traceback" not in err and b"Exception ignored" not in err and b"BrokenPipe" not in err


def _sigint_default() -> None:
    """In the child: SIGINT as a terminal delivers it, even when the tests were started from a
    shell's background job (which starts its children with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_with_a_short_message_and_status_130(long_llama):
    proc = _long_run(long_llama, preexec_fn=_sigint_default)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == b"interrupted" and b"Traceback" not in err
    assert out.endswith(b"\n")  # the text so far, its line ended


def test_a_prompt_that_is_not_utf8_is_a_usage_error(tiny_llama):
    proc = _ggx("run", str(tiny_llama), "--device", "ref", "-p", b"caf\xe9")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == b""
    assert err.splitlines()[-1] == b"ggx run: error: argument -p/--prompt: is not valid UTF-8 (byte 0xe9 at byte 3)"
