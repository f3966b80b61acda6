"""Run under NumPy 1 beside packages built for NumPy 2: hide those packages from optional imports.

The Python-backend stubs of nvidia-pytriton 0.7.0 need NumPy 1 (see model.stub_numpy_problem), so a server on a
machine whose Python has NumPy 2 puts a folder with numpy 1.26 first on PYTHONPATH. That machine's other packages
may require NumPy 2 (SciPy 1.18, scikit-learn, ...). transformers imports some of them only because they are
installed (`is_sklearn_available()` → `from sklearn.metrics import roc_curve` when `transformers.generation` loads),
and they then fail under NumPy 1 (`module 'numpy' has no attribute 'long'`), which breaks
`from transformers import AutoTokenizer`. Marking such a package as absent in sys.modules makes
`importlib.util.find_spec` answer None, so transformers skips it, and a direct import raises ImportError.
"""
from __future__ import annotations

import importlib.metadata
import sys

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def distributions_needing_other_numpy(numpy_version: str, path: list[str] | None = None) -> set[str]:
    """Canonical names of installed distributions that require, directly or through an installed dependency,
    a numpy that excludes this one (only unconditional requirements count, not extras)."""
    version = Version(numpy_version)
    excluded: set[str] = set()
    depends_on: dict[str, set[str]] = {}
    found = importlib.metadata.distributions(path=path) if path is not None else importlib.metadata.distributions()
    for dist in found:
        name = canonicalize_name(dist.metadata["Name"] or "")
        if not name or name == "numpy":
            continue
        needs = depends_on.setdefault(name, set())
        for line in dist.requires or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an optional extra's requirement, or one for another platform
            dep = canonicalize_name(req.name)
            if dep != "numpy":
                needs.add(dep)
            elif req.specifier and not req.specifier.contains(version, prereleases=True):
                excluded.add(name)
    changed = True
    while changed:  # scikit-learn accepts numpy 1 but imports SciPy, which does not
        changed = False
        for name, needs in depends_on.items():
            if name not in excluded and needs & excluded:
                excluded.add(name)
                changed = True
    return excluded


def hide_packages_needing_numpy2() -> list[str]:
    """Under NumPy < 2, mark the top-level modules of packages that require NumPy >= 2 as absent; return them."""
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        return []
    excluded = distributions_needing_other_numpy(numpy.__version__)
    if not excluded:
        return []
    hidden = []
    for module, dists in importlib.metadata.packages_distributions().items():
        if module in sys.modules:
            continue  # already imported: it works, leave it
        if any(canonicalize_name(d) in excluded for d in dists):
            sys.modules[module] = None  # find_spec → None; import → ImportError
            hidden.append(module)
    return sorted(hidden)
