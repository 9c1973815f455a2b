"""The OpenAI-compatible HTTP API of the GPU service."""

from gpu_service.api.app import create_app
from gpu_service.api.context import ApiContext
from gpu_service.api.tokenizer import ServedTokenizer, TokenizerError, load_tokenizer

__all__ = ["ApiContext", "ServedTokenizer", "TokenizerError", "create_app", "load_tokenizer"]
