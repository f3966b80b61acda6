"""The serving stub's NumPy-1 shim: which installed packages it hides, and that hiding makes them absent."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MODULE = REPO / "model_repository" / "llm" / "1" / "numpy_compat.py"


def _load():
    spec = importlib.util.spec_from_file_location("numpy_compat_under_test", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dist(site: Path, name: str, *requires: str) -> None:
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0"] + [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_needs_numpy2_directly_or_through_a_dependency(tmp_path):
    _dist(tmp_path, "numpy")
    _dist(tmp_path, "needs-two", "numpy<2.8,>=2.0.0")
    _dist(tmp_path, "Through_Dep", "needs_two>=1.0", "numpy>=1.24")
    _dist(tmp_path, "through-through", "through-dep")
    _dist(tmp_path, "fine", "numpy>=1.21")
    _dist(tmp_path, "extra-only", 'numpy>=2; extra == "fast"', 'needs-two; extra == "fast"')
    _dist(tmp_path, "other-python", 'numpy>=2; python_version < "3.0"')
    _dist(tmp_path, "no-bound", "numpy")
    compat = _load()
    assert compat.distributions_needing_other_numpy("1.26.4", [str(tmp_path)]) == \
        {"needs-two", "through-dep", "through-through"}
    assert compat.distributions_needing_other_numpy("2.5.2", [str(tmp_path)]) == set()
    assert compat.distributions_needing_other_numpy("2.8.0", [str(tmp_path)]) == \
        {"needs-two", "through-dep", "through-through"}


def test_hidden_package_is_absent_to_find_spec_and_import(tmp_path):
    """A fake numpy 1 and a package that needs numpy 2, in a fresh interpreter: the package disappears."""
    site = tmp_path / "site"
    (site / "numpy").mkdir(parents=True)
    (site / "numpy" / "__init__.py").write_text("__version__ = '1.26.4'\n")
    _dist(site, "numpy")
    (site / "needstwo").mkdir()
    (site / "needstwo" / "__init__.py").write_text("raise RuntimeError('imported under numpy 1')\n")
    _dist(site, "needs-two", "numpy>=2")
    info = site / "needs_two-1.0.dist-info"
    (info / "RECORD").write_text("needstwo/__init__.py,,\n")
    (info / "top_level.txt").write_text("needstwo\n")
    (site / "fine").mkdir()
    (site / "fine" / "__init__.py").write_text("")
    _dist(site, "fine", "numpy>=1.21")
    (site / "fine-1.0.dist-info" / "top_level.txt").write_text("fine\n")
    script = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        f"sys.path.insert(0, {str(MODULE.parent)!r})\n"
        "import numpy_compat\n"
        "hidden = numpy_compat.hide_packages_needing_numpy2()\n"
        "print(hidden, importlib.util.find_spec('needstwo'), importlib.util.find_spec('fine') is not None)\n"
        "try:\n    import needstwo\nexcept ImportError:\n    print('ImportError')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['needstwo'] None True", "ImportError"]
