"""`ggx chat [MODEL | -m MODEL] [--system TEXT] [-n N] [--temp T] ...` (also `ggx run -i`).

A multi-turn conversation with a GGUF model in one KV cache: each line read from stdin is a user
turn; the whole conversation is rendered with the model's chat template (ggx.models.chat: the
file's own, else ChatML or Gemma's) and generated from with `reuse_prefix=True`, so the turns
already in the cache are not evaluated again, only what the template added since (the last
answer's end, the new turn). Empty lines are skipped; end with EOF (Ctrl-D) or `/exit`. The
answers stream to stdout; the summary on stderr says how many prompt tokens each turn evaluated
and how many came from the cache.
"""
from __future__ import annotations

import argparse
import sys
from typing import TextIO

from .argtypes import finite_float, int_at_least, utf8_text
from .run import add_model_argument, chosen_model

EXIT_WORDS = ("/exit", "/quit")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="talk with a GGUF model, turn by turn, in its chat format",
                              description="A multi-turn conversation with a GGUF model: one line of stdin per "
                                          "user turn, answers on stdout; end with EOF or /exit.")
    add_model_argument(p)
    add_chat_arguments(p)
    p.add_argument("-n", "--n-predict", type=int_at_least(1), default=256,
                   help="most tokens per answer (default 256)")
    p.add_argument("--temp", type=finite_float(0.0), default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-k", type=int_at_least(0, "0 keeps every token"), default=40)
    p.add_argument("--top-p", type=finite_float(0.0, 1.0), default=0.95)
    p.add_argument("--seed", type=int_at_least(0), default=None, help="random seed for sampling")
    p.add_argument("-t", "--threads", type=int_at_least(1), default=None, help="CPU threads (default: the backend's)")
    p.add_argument("--device", action="append", default=None, metavar="D", help="device to run on (repeatable)")
    p.add_argument("-c", "--ctx-size", type=int_at_least(1), default=None,
                   help="context length in tokens (default 4096, at most the model's training context)")
    p.set_defaults(func=chat)


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """The option `ggx chat` and `ggx run` share."""
    p.add_argument("--system", type=utf8_text, default=None, metavar="TEXT",
                   help="a system message opening the conversation (with `ggx run`: implies --chat)")


def chat(args: argparse.Namespace) -> int:
    from ..models import load_model

    model = load_model(chosen_model(args), args.device, args.threads, n_ctx=args.ctx_size,
                       progress=sys.stderr.isatty())
    return converse(model, sys.stdin, sys.stdout, sys.stderr, args.system, args.n_predict,
                    temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def converse(model, inp: TextIO, out: TextIO, err: TextIO, system: str | None, n_predict: int,
             **sampling) -> int:
    """The conversation loop over `inp`'s lines; returns the exit status."""
    from ..errors import GGXContextOverflow

    messages = [{"role": "system", "content": system}] if system else []
    prompt_note = "> " if inp.isatty() else ""
    evaluated = cached = turns = 0
    while True:
        if prompt_note:
            out.write(prompt_note)
            out.flush()
        line = inp.readline()
        if not line:
            break
        text = line.rstrip("\r\n")
        if text.strip() in EXIT_WORDS:
            break
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            ids = model.encode_prompt(model.chat_template.render(messages))
        except GGXContextOverflow as e:
            err.write(f"the conversation no longer fits the context: {e}\n")
            return 1
        reply = []
        for tok in model.generate(ids, n_predict, reuse_prefix=True, **sampling):
            out.write(tok.text)
            out.flush()
            reply.append(tok.text)
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})
        st = model.stats
        turns += 1
        evaluated += st.prompt_tokens
        cached += st.prompt_cached
        err.write(f"[turn {turns}: {st.prompt_tokens} prompt tokens evaluated, {st.prompt_cached} from the cache; "
                  f"{st.generated} generated, {st.gen_tps:.1f} tokens/s]\n")
    err.write(f"{turns} turns; prompt tokens evaluated {evaluated}, reused from the KV cache {cached}\n")
    return 0
