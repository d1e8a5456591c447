"""The model runtime: a Llama-family decoder in plain torch plus its loaders."""

from service.model.chat_template import ChatTemplate, ChatTemplateError
from service.model.decoder import DecoderModel
from service.model.load_error import ModelLoadError
from service.model.loader import LoadedModel, ModelFile, load_model, open_model
from service.model.model_config import ModelConfig, RopeScaling
from service.model.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "DecoderModel",
    "LoadedModel",
    "ModelConfig",
    "ModelFile",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "load_model",
    "open_model",
]
