"""Chat prompts: render a model's own chat template (from a local folder or GGUF), or a ChatML fallback."""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
CHATML = "chatml"  # the name that asks for FALLBACK_TEMPLATE itself
# ChatML: what SmolLM2, Qwen and many small instruct models use; the fallback when no template is found.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplate:
    """A Jinja chat template rendered the way transformers' apply_chat_template renders it."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "fallback"):
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # same sandbox transformers uses

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self.bos_token, self.eos_token, self.origin = bos_token, eos_token, origin

    def render(self, user: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self._template.render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
        )

    @classmethod
    def fallback(cls) -> "ChatTemplate":
        return cls(FALLBACK_TEMPLATE, origin=CHATML)


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


def _token_text(value) -> str:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        return value.get("content", "")
    return value or ""


def from_folder(folder: Path) -> ChatTemplate | None:
    """transformers layout: chat_template.jinja and/or tokenizer_config.json."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: take "default"
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if (folder / "chat_template.jinja").exists():
        source = (folder / "chat_template.jinja").read_text()
    if not source:
        ggufs = sorted(folder.glob("*.gguf"))
        return from_gguf(ggufs[0]) if ggufs else None
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    return ChatTemplate(source, bos, eos, origin=str(folder))


def from_gguf(path: Path) -> ChatTemplate | None:
    """The template and bos/eos token texts stored in a GGUF file's metadata."""
    from gguf import GGUFReader  # local: only needed for GGUF models

    reader = GGUFReader(str(path))

    def field(name):
        f = reader.fields.get(name)
        return None if f is None else f.parts[f.data[0]]

    source = field("tokenizer.chat_template")
    if source is None:
        return None
    tokens = reader.fields.get("tokenizer.ggml.tokens")

    def token(id_field):
        ids = field(id_field)
        if ids is None or tokens is None:
            return ""
        return bytes(tokens.parts[tokens.data[int(ids[0])]]).decode("utf-8", errors="replace")

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    return ChatTemplate(bytes(source).decode("utf-8"), bos, eos, origin=str(path))


def default_model_path() -> Path | None:
    """The engine's built-in default model folder, when the backend package is importable."""
    try:
        from backend.models.default_model import resolve_model_path

        return Path(resolve_model_path(DEFAULT_MODEL))
    except Exception:  # not installed, not converted yet, or any other reason: the caller falls back
        return None


def load_template(path: str | Path | None = None) -> tuple[ChatTemplate, str | None]:
    """The template for `path` (or the default model; "chatml": ChatML itself); falls back to ChatML with a note."""
    if str(path).lower() == CHATML:
        return ChatTemplate.fallback(), None
    target = Path(path) if path else default_model_path()
    if target is None:
        return ChatTemplate.fallback(), "no --tokenizer and no default model folder: using a ChatML template"
    try:
        template = from_gguf(target) if target.suffix == ".gguf" else from_folder(target)
    except (OSError, ValueError) as err:
        return ChatTemplate.fallback(), f"cannot read a chat template from {target} ({err}): using ChatML"
    if template is None:
        return ChatTemplate.fallback(), f"no chat template in {target}: using ChatML"
    return template, None
