"""Constraints the structured-output tests share (engine and tritonserver): a bounded tool-call schema, so a 135M
model's outputs end well within max_tokens, and a regex, a choice and a Lark grammar with its language as a regex."""
from __future__ import annotations

PROMPT = "Call the weather tool for a city as JSON."
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "days", "units", "alerts"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,6}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"\n'
GRAMMAR_LANGUAGE = r"The answer is (yes|no)\."  # the grammar's language, as a regex
