"""`ggx serve`: an OpenAI-compatible HTTP server over continuous batching (ggx.models.batched).

`schema.py` (the request bodies), `engine.py` (the thread stepping the Batcher), `app.py` (the
routes, errors and limits). Needs the `serve` extra (FastAPI, uvicorn): `pip install ggx[serve]`.
"""
from __future__ import annotations
