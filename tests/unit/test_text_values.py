"""backend.text_values: the one yes/no parser of settings, adapter parameters and request fields."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from backend.config import EngineConfig
from backend.text_values import bool_word, parse_bool


@pytest.mark.parametrize("text", ["1", "true", "TRUE", " yes ", "On"])
def test_true_words(text):
    assert parse_bool("flag", text) is True


@pytest.mark.parametrize("text", ["0", "false", "False", " no", "OFF"])
def test_false_words(text):
    assert parse_bool("flag", text) is False


@pytest.mark.parametrize("text", ["ture", "", "2", "enabled"])
def test_a_typo_is_an_error_naming_the_field(text):
    with pytest.raises(ValueError, match=r"^log_prompts must be true or false, got"):
        parse_bool("log_prompts", text)


def test_bool_word_leaves_other_values_to_the_caller():
    assert bool_word(True) is True and bool_word(3) is None and bool_word("maybe") is None


def test_engine_settings_read_through_it():
    assert EngineConfig.from_dict({"gc_freeze": "off"}).gc_freeze is False
    with pytest.raises(ValueError, match="gc_freeze must be true or false"):
        EngineConfig.from_dict({"gc_freeze": "flase"})


def _adapter_flags():
    model_dir = Path(__file__).resolve().parents[2] / "model_repository" / "llm" / "1"
    spec = importlib.util.spec_from_file_location("adapter_flags", model_dir / "adapter_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.adapter_flags


def test_the_adapters_flags_read_through_it():
    flags = _adapter_flags()
    assert flags({}) == {"log_prompts": False, "REPORT_CUSTOM_METRICS": False, "unload_on_engine_failure": True}
    assert flags({"unload_on_engine_failure": "true", "ENABLE_VLLM_HEALTH_CHECK": "false"})["unload_on_engine_failure"] \
        is False  # the vLLM backend's key wins
    with pytest.raises(ValueError, match=r"config.pbtxt parameters: log_prompts must be true or false, got 'ture'"):
        flags({"log_prompts": "ture"})
