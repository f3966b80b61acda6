"""Tandem: an asynchronous continuous-batching LLM engine (public API)."""
from backend.config import EngineConfig
from backend.engine import Engine, EngineDead, EngineOverloaded
from backend.outputs.processor import coalesce_outputs
from backend.request import RequestOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineDead", "EngineOverloaded", "RequestOutput", "SamplingParams",
           "coalesce_outputs"]
