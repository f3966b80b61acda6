"""Find a tritonserver, prepare its Python backend and environment, start it, wait for it, stop it."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STUB_NAME = "triton_python_backend_stub"
_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")


@dataclass(slots=True)
class TritonInstall:
    """Where a tritonserver binary lives and what it needs to run Python models."""

    binary: Path
    backend_dir: Path | None  # None: the server's own default backends folder
    lib_dirs: list[Path]  # extra LD_LIBRARY_PATH entries


def _pytriton_server_dir() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return path if (path / "bin" / "tritonserver").exists() else None


def find_triton(cache_dir: Path | None = None) -> TritonInstall:
    """A tritonserver on PATH wins; otherwise the one inside the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), None, [])
    server_dir = _pytriton_server_dir()
    if server_dir is None:
        raise FileNotFoundError(
            "no tritonserver found: put one on PATH or `pip install nvidia-pytriton==0.7.0` into this venv"
        )
    libs = server_dir.parent.parent / "nvidia_pytriton.libs"  # the wheel's bundled shared libraries
    backend_dir = prepare_backend_dir(server_dir, cache_dir or REPO_ROOT / ".cache" / "triton")
    return TritonInstall(server_dir / "bin" / "tritonserver", backend_dir, [libs])


def prepare_backend_dir(server_dir: Path, cache_dir: Path) -> Path:
    """Build `<cache>/backends/python` = the wheel's python backend + the stub for this Python."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_dir / "python_backend_stubs" / version / STUB_NAME
    if not stub.exists():
        raise FileNotFoundError(f"nvidia-pytriton ships no Python backend stub for Python {version} ({stub})")
    # A copy outside site-packages: the wheel may be read-only, and the stub must sit next to the backend.
    target = cache_dir / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    sources = [server_dir / "backends" / "python" / name for name in _BACKEND_FILES] + [stub]
    for src in sources:
        dst = target / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size or dst.stat().st_mtime < src.stat().st_mtime:
            shutil.copy2(src, dst)
    return target.parent


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python stubs: libraries, this venv's packages, the repo."""
    env = dict(os.environ if base is None else base)
    # The stub embeds libpython: prefer this interpreter's, so stdlib and site-packages match the venv.
    libpython_dir = sysconfig.get_config_var("LIBDIR")
    lib_dirs = [str(p) for p in install.lib_dirs] + ([libpython_dir] if libpython_dir else [])
    env["LD_LIBRARY_PATH"] = _join(lib_dirs, env.get("LD_LIBRARY_PATH"))
    site_packages = sysconfig.get_paths()["purelib"]
    # The stub's interpreter knows nothing of this venv: give it the repo and the venv's packages
    # (after any PYTHONPATH the caller set on purpose).
    caller = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(caller + [str(REPO_ROOT), site_packages]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _join(first: list[str], rest: str | None) -> str:
    parts = first + ([p for p in rest.split(os.pathsep) if p] if rest else [])
    return os.pathsep.join(dict.fromkeys(parts))  # keep order, drop duplicates


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_ports_free(*ports: int) -> None:
    """Fail early with a clear message: Triton loads models before it binds, and a health check on a busy
    port would be answered by whichever server holds it."""
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                raise RuntimeError(f"port {port} is already in use; choose other ports (--http-port/--grpc-port/"
                                   "--metrics-port or TANDEM_*_PORT)") from None


def start_server(
    model_repository: str | Path,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    extra_args: list[str] | None = None,
    log_path: str | Path | None = None,
    install: TritonInstall | None = None,
) -> subprocess.Popen:
    """Start tritonserver in its own process group (so stop_server can end its stubs too)."""
    install = install or find_triton()
    check_ports_free(http_port, grpc_port, metrics_port)
    cmd = [
        str(install.binary),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
    ]
    if install.backend_dir is not None:
        cmd.append(f"--backend-directory={install.backend_dir}")
    cmd += list(extra_args or [])
    out = open(log_path, "ab") if log_path else None
    try:
        return subprocess.Popen(
            cmd, env=server_env(install), stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
    finally:
        if out:
            out.close()  # the child keeps its own descriptor


def wait_until_ready(
    proc: subprocess.Popen, http_port: int, timeout: float = 180.0, model_name: str | None = None
) -> None:
    """Poll the HTTP health (and model) endpoint; raise RuntimeError if the server exits or times out."""
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    if model_name:
        url = f"http://127.0.0.1:{http_port}/v2/models/{model_name}/ready"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"tritonserver was not ready within {timeout:.0f} s ({url})")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """SIGTERM (Triton unloads models and ends stubs), then SIGKILL the whole group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of this group only (stubs left behind)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)
    return proc.returncode


def stub_pids(marker: str) -> list[int]:
    """Pids of live python-backend stubs whose command line mentions `marker` (e.g. a model repository)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if STUB_NAME in cmdline and marker in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def set_parameters(config_text: str, values: dict[str, str]) -> str:
    """Replace (or add) `parameters` entries of a config.pbtxt."""
    for key, value in values.items():
        entry = f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
        pattern = re.compile(r'parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'"[^\n]*')
        config_text, n = pattern.subn(entry, config_text)
        if n == 0:
            config_text += "\n" + entry + "\n"
    return config_text


def make_model_repository(target: Path, parameters: dict[str, str], model_name: str = "llm") -> Path:
    """A copy of our model repository under target with some engine parameters changed."""
    repo = target / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    config = repo / model_name / "config.pbtxt"
    config.write_text(set_parameters(config.read_text(), parameters))
    return repo
