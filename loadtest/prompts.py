"""Load the prompt dataset (JSONL, one {"prompt": ...} object per line)."""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")


def load_prompts(path: str | Path = DEFAULT_PROMPTS) -> list[str]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(json.loads(line)["prompt"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: expected a JSON object with a 'prompt' field") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
