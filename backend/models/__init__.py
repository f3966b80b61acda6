"""Llama-family models: load_model (safetensors folder -> fused model), resolve_model_path, ModelSpec."""
from backend.models.default_model import DEFAULT_ALIAS, resolve_model_path
from backend.models.loader import SUPPORTED_MODEL_TYPES, load_model
from backend.models.spec import ModelSpec

__all__ = ["DEFAULT_ALIAS", "ModelSpec", "SUPPORTED_MODEL_TYPES", "load_model", "resolve_model_path"]
