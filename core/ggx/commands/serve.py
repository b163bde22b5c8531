"""`ggx serve [MODEL] [--host H] [--port P] [--parallel N] [-c CTX] [--api-key KEY] ...`.

Loads a model as `ggx run` does and serves OpenAI's chat and completion API over HTTP
(ggx.serve): `--parallel` slots share one KV cache of `--ctx-size` tokens, and every step
evaluates one prompt chunk and one decode batch of all generating slots (ggx.models.batched).
Binds to 127.0.0.1 unless --host says otherwise; --api-key (or GGX_API_KEY) makes every route
but /health require `Authorization: Bearer KEY`. Prints the address once it is listening
(`--port 0` picks a free port).
"""
from __future__ import annotations

import argparse
import os
import sys

from .argtypes import int_at_least
from .run import add_model_argument, add_tensor_split, chosen_model

API_KEY_ENV = "GGX_API_KEY"
DEFAULT_PARALLEL = 4
DEFAULT_CTX_PER_SLOT = 2048


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a GGUF model over an OpenAI-compatible HTTP API",
                              description="Serve a GGUF model over OpenAI's chat and completion API "
                                          "(default model: SmolLM2-135M Q4_1).")
    add_model_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_at_least(0, "0 picks a free port"), default=8080,
                   help="port to listen on (default 8080; 0: a free one, printed at start)")
    p.add_argument("-np", "--parallel", type=int_at_least(1), default=DEFAULT_PARALLEL,
                   help=f"requests generated at once (slots), sharing one KV cache (default {DEFAULT_PARALLEL})")
    p.add_argument("-c", "--ctx-size", type=int_at_least(1), default=None,
                   help=f"KV cache size in tokens, split evenly among the slots "
                        f"(default {DEFAULT_CTX_PER_SLOT} per slot, at most the model's training context each)")
    p.add_argument("--chunk", type=int_at_least(1), default=128,
                   help="prompt tokens evaluated per step: a longer prompt takes several steps, between "
                        "which the other slots keep generating (default 128)")
    p.add_argument("--queue", type=int_at_least(0), default=16,
                   help="requests that may wait for a slot; past that a request is answered 503 (default 16)")
    p.add_argument("--api-key", default=None,
                   help=f"require Authorization: Bearer KEY on every route but /health (also: {API_KEY_ENV})")
    p.add_argument("--max-body", type=int_at_least(1), default=1 << 20,
                   help="largest request body in bytes; larger ones are answered 413 (default 1 MiB)")
    p.add_argument("--no-pad-decode", action="store_true",
                   help="decode only the generating slots' rows (faster with few clients; a slot's logits may "
                        "then differ in the last bits with the number of neighbours)")
    p.add_argument("--alias", default=None, help="the model's name in the API (default: the file's name)")
    p.add_argument("-t", "--threads", type=int_at_least(1), default=None, help="CPU threads (default: the backend's)")
    p.add_argument("--device", action="append", default=None, metavar="D",
                   help="device to run on (repeatable; default: the accelerators, then the CPU)")
    add_tensor_split(p)
    p.add_argument("--no-flash-attn", action="store_true", help="use mul_mat + soft_max attention")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import socket
    from pathlib import Path

    from ..errors import GGXUnsupported, GGXValueError

    try:
        import uvicorn

        from ..serve.app import ServeConfig, create_app
        from ..serve.engine import Engine
    except ImportError as e:
        raise GGXUnsupported(f"ggx serve needs FastAPI and uvicorn ({e.name} is missing): "
                             "pip install 'ggx[serve]'") from None
    from ..models import load_model
    from ..models.batched import Batcher

    n_seq = args.parallel
    ctx = args.ctx_size or DEFAULT_CTX_PER_SLOT * n_seq
    if ctx < n_seq:
        raise GGXValueError(f"--ctx-size {ctx} cannot be split among {n_seq} slots")
    # bind first: a port in use is an error before the model loads
    try:
        sock = socket.create_server((args.host, args.port), family=socket.AF_INET6 if ":" in args.host
                                    else socket.AF_INET)
    except OSError as e:
        raise GGXValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    model = load_model(chosen_model(args), args.device, args.threads, n_ctx=ctx // n_seq,
                       flash_attn=not args.no_flash_attn, progress=sys.stderr.isatty(),
                       tensor_split=args.tensor_split)
    batcher = Batcher(model, n_seq, min(ctx, model.hp.n_ctx_train * n_seq), n_chunk=min(args.chunk, model.n_batch),
                      decode_rows=None if args.no_pad_decode else n_seq)
    batcher.warmup()
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config = ServeConfig(args.alias or Path(model.path).stem, api_key, args.max_body)
    app = create_app(model, Engine(batcher, args.queue), config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"ggx serve: {config.model_id} on http://{shown}:{port} ({n_seq} slots of {batcher.n_ctx_seq} tokens"
          f"{', API key required' if api_key else ''})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
