"""Tandem: an asynchronous continuous-batching LLM engine (public API)."""
from .config import EngineConfig
from .engine import Engine, EngineDead, EngineOverloaded
from .request import RequestOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineDead", "EngineOverloaded", "RequestOutput", "SamplingParams"]
