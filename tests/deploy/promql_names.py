"""The metric names a PromQL expression reads (the selectors' names), for checking dashboards and adapter rules.

Not a PromQL parser: strings, label matchers {...}, ranges [...], groupings such as `by (...)`, numbers and
durations are removed, and what remains as an identifier not followed by "(" (a function or aggregation) and not a
keyword is a metric name. Good for the queries of deploy/kubernetes; a `__name__` matcher is refused."""
from __future__ import annotations

import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-zA-Z_$]+")
_NUMBER = re.compile(r"(?<![A-Za-z_:0-9])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)")
_TOKEN = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
             "atan2", "inf", "nan", "Inf", "NaN"}
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<selector>.*?)\s*,\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$")


def metric_names(expr: str) -> set[str]:
    """The metric names expr selects; ValueError where it uses a form this reader does not handle."""
    if "__name__" in expr:
        raise ValueError(f"a __name__ matcher is not handled: {expr}")
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    if "{" in text or "}" in text:
        raise ValueError(f"unbalanced or nested braces: {expr}")
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _TOKEN.finditer(text):
        word = match.group(0).rstrip("( \t\n")
        if match.group(1) or word in _KEYWORDS:
            continue
        names.add(word)
    return names


def template_query_names(query: str) -> set[str]:
    """The metric names of a Grafana template variable's query: label_values(selector, label) or a PromQL query."""
    match = _LABEL_VALUES.match(query)
    return metric_names(match.group("selector")) if match else metric_names(query)
