"""Model code and model loading."""
from workbench.models.llama import LlamaArgs, LlamaModel
from workbench.models.loader import load_model, load_tokenizer, make_random_checkpoint, resolve_checkpoint

__all__ = ["LlamaArgs", "LlamaModel", "load_model", "load_tokenizer", "make_random_checkpoint",
           "resolve_checkpoint"]
