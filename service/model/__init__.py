"""The model runtime: a Llama-family decoder in plain torch plus its loaders."""

from service.model.chat_template import ChatTemplate, ChatTemplateError
from service.model.config import ModelConfig, RopeScaling
from service.model.errors import ModelLoadError
from service.model.llama import LlamaModel
from service.model.loader import LoadedModel, load_model
from service.model.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "load_model",
]
