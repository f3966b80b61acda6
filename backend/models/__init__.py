"""Llama-family models: load_model (safetensors folder -> fused model), resolve_model_path, ModelSpec."""
from backend.models.default_model import DEFAULT_ALIAS, resolve_model_path
from backend.models.loader import SUPPORTED_MODEL_TYPES, load_model
from backend.models.spec import ModelSpec
from backend.models.standin import STAND_IN, stand_in_model

# model settings that name a model built in code rather than a checkpoint: name → (device → (model, tokenizer))
BUILT_IN_MODELS = {STAND_IN: stand_in_model}

__all__ = ["BUILT_IN_MODELS", "DEFAULT_ALIAS", "ModelSpec", "STAND_IN", "SUPPORTED_MODEL_TYPES", "load_model",
           "resolve_model_path"]
