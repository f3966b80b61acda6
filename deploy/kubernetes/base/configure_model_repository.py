"""Copy the image's model repository into a writable folder and apply this deployment's settings to the llm model.

    python3 configure_model_repository.py SOURCE_REPOSITORY TARGET_REPOSITORY SETTINGS_FOLDER

Each file of SETTINGS_FOLDER (a mounted ConfigMap) is one setting: its name a config.pbtxt parameter key, its
content the value, as `make serve SERVE_ARGS="--param KEY=VALUE"` sets it; `instance_group` instead replaces the
model's instance_group line. Unknown parameter keys are added, and then fail the model's load with a message that
names them, as with --param. Runs as the pod's init container, with the image's python3 and the standard library.
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

MODEL_NAME = "llm"
INSTANCE_GROUP = "instance_group"
_INSTANCE_GROUP_LINE = re.compile(r"^instance_group\s*\[.*\]\s*$", re.MULTILINE)


def set_parameter(config_text: str, key: str, value: str) -> str:
    """config.pbtxt text with parameter `key` set to `value` (replaced where it is, else added at the end)."""
    if '"' in value or "\\" in value or "\n" in value:
        raise ValueError(f"setting {key}: a value with quotes, backslashes or line breaks is not supported: {value!r}")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise ValueError(f"setting {key!r}: not a parameter name")
    entry = f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
    pattern = re.compile(r'^parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'"[^\n]*', re.MULTILINE)
    config_text, count = pattern.subn(lambda _match: entry, config_text)
    if count == 0:
        config_text = config_text.rstrip("\n") + "\n" + entry + "\n"
    return config_text


def set_instance_group(config_text: str, value: str) -> str:
    """config.pbtxt text whose one instance_group line is replaced by `instance_group <value>`."""
    value = value.strip()
    if not (value.startswith("[") and value.endswith("]")) or "\n" in value:
        raise ValueError(f"setting instance_group: expected one line '[ {{ kind: ... }} ]', got {value!r}")
    config_text, count = _INSTANCE_GROUP_LINE.subn(lambda _match: f"instance_group {value}", config_text)
    if count != 1:
        raise ValueError(f"config.pbtxt has {count} instance_group lines; expected exactly one to replace")
    return config_text


def read_settings(folder: Path) -> dict[str, str]:
    """The settings of a mounted ConfigMap folder: one per regular file, its trailing line break dropped."""
    return {path.name: path.read_text().rstrip("\n") for path in sorted(folder.iterdir())
            if path.is_file() and not path.name.startswith(".")}


def apply_settings(config_text: str, settings: dict[str, str]) -> str:
    for key, value in settings.items():
        if key == INSTANCE_GROUP:
            config_text = set_instance_group(config_text, value)
        else:
            config_text = set_parameter(config_text, key, value)
    return config_text


def configure(source: Path, target: Path, settings: dict[str, str]) -> Path:
    """Copy source into target (emptied first) and apply settings to its llm/config.pbtxt; returns that file."""
    if target.exists():
        for child in target.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / MODEL_NAME / "config.pbtxt"
    config.write_text(apply_settings(config.read_text(), settings))
    return config


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    source, target, folder = (Path(arg) for arg in argv)
    settings = read_settings(folder)
    try:
        config = configure(source, target, settings)
    except ValueError as err:
        print(f"model-config: {err}", file=sys.stderr)
        return 1
    for key, value in settings.items():
        print(f"model-config: {key} = {value}")
    print(f"model-config: wrote {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
