"""Find a tritonserver, prepare its Python backend and environment, start it, wait for it, stop it."""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from scripts.server_stop import STUB_NAME, wait_for_exit

REPO_ROOT = Path(__file__).resolve().parent.parent
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
    # TANDEM_SERVER_PYTHONPATH: folders for the server's stubs only, first of all (e.g. numpy<2 for a stub built
    # for NumPy 1 on a machine whose Python has NumPy 2), leaving this process's own imports alone.
    server_only = [p for p in env.get("TANDEM_SERVER_PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(server_only + caller + [str(REPO_ROOT), site_packages]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ---- NumPy 2 vs the Python-backend stub ------------------------------------------------------------------
# The stub moves every tensor between shared memory and numpy in C++, through pybind11. The stubs inside
# nvidia-pytriton 0.7.0 (Triton 24.10's python backend, every Python version) are built with a pybind11 older
# than 2.12, which reads a dtype's item size at NumPy 1.x's offset in PyArray_Descr. NumPy 2 changed that struct;
# there the old offset holds the low word of the new `flags` field, 0 for plain types, so the stub sees an item
# size of 0 (= stride 0) and every tensor is mangled, whatever the Python version:
#   - each numeric input arrives as its first element repeated (input_ids [11, 22, 33] -> [11, 11, 11]);
#   - a BYTES input arrives as its first byte repeated: sampling_parameters '{"max_tokens": 8, ...}' (57 bytes
#     after its length prefix 57 = b"9\0\0\0") becomes b"9999..." (61 bytes), deserialize_bytes_tensor reads
#     a length of 960051513 and the stub dies (std::terminate on pybind11::error_already_set) before execute();
#   - every output tensor leaves with 0 bytes.
# Nothing in model.py can undo that (the BYTES crash comes before our code runs), so refuse to start instead.
# A stub built with pybind11 >= 2.12 names "numpy._core" (it picks numpy.core or numpy._core by NumPy's major
# version); the old ones only "numpy.core.multiarray". model.py makes the same check from inside the stub.
DEFAULT_STUB = Path("/opt/tritonserver/backends/python") / STUB_NAME  # NVIDIA's container


def stub_handles_numpy2(stub: Path) -> bool | None:
    """True: the stub's pybind11 knows NumPy 2; False: NumPy 1.x only; None: cannot tell."""
    try:
        data = stub.read_bytes()
    except OSError:
        return None
    if b"numpy._core" in data:
        return True
    return False if b"numpy.core.multiarray" in data else None


def stub_numpy(env: dict[str, str]) -> tuple[str, str] | None:
    """(version, folder) of the numpy the stub will import: model.py puts PYTHONPATH first, then comes the
    base interpreter's own site-packages (the stub embeds that interpreter, not the venv)."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + site.getsitepackages([sys.base_prefix])
    for dist in importlib.metadata.distributions(name="numpy", path=paths):
        return dist.version, str(dist.locate_file(""))
    return None


def numpy_abi_problem(stub: Path, numpy_version: str, numpy_where: str = "") -> str | None:
    """Why `stub` with this numpy would corrupt every tensor, or None when the pair works (or we cannot tell)."""
    try:
        major = int(numpy_version.split(".")[0])
    except ValueError:
        return None
    if major < 2 or stub_handles_numpy2(stub) is not False:
        return None
    where = f" from {numpy_where}" if numpy_where else ""
    return (f"the Python-backend stub {stub} was built for NumPy 1.x (its pybind11 predates NumPy 2) but would "
            f"import numpy {numpy_version}{where}: every tensor would be corrupted and the first request with a "
            "BYTES input would kill the stub ('unpack_from requires a buffer of at least ...'). Install numpy<2 "
            "there (requirements-serve.txt pins numpy==1.26.4), or put a folder with numpy<2 first on PYTHONPATH")


def check_stub_numpy(install: TritonInstall, env: dict[str, str]) -> None:
    """Raise RuntimeError if the server's stub and the numpy it would import do not fit (see above)."""
    found = stub_numpy(env)
    if found is None:
        return
    stub = (install.backend_dir / "python" / STUB_NAME) if install.backend_dir else DEFAULT_STUB
    problem = numpy_abi_problem(stub, *found)
    if problem:
        raise RuntimeError(problem)


def _join(first: list[str], rest: str | None) -> str:
    parts = first + ([p for p in rest.split(os.pathsep) if p] if rest else [])
    return os.pathsep.join(dict.fromkeys(parts))  # keep order, drop duplicates


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all bound at once before any is released (ports asked for one after another may
    repeat, and Triton refuses one port for two of its endpoints)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


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
    """Start tritonserver in its own process group (so stop_server can end its stubs too). Its stubs watch
    proc.drain_file (request_drain): once it exists they stop taking requests and end the ones still running after
    the model's drain_timeout_s."""
    install = install or find_triton()
    env = server_env(install)
    drain_file = Path(tempfile.gettempdir()) / f"tandem-drain-{os.getpid()}-{http_port}"
    drain_file.unlink(missing_ok=True)
    env[DRAIN_FILE_ENV] = str(drain_file)
    check_stub_numpy(install, env)  # fail here, not on the first request (see numpy_abi_problem)
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
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
        proc.drain_file = drain_file
        return proc
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


def request_drain(proc: subprocess.Popen) -> None:
    """Tell the server's stubs that a shutdown begins (see start_server), before Triton hears of it."""
    drain_file = getattr(proc, "drain_file", None)
    if drain_file is not None:
        Path(drain_file).touch()


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """Drain, SIGTERM (Triton waits for the requests in flight, unloads models and ends stubs; server_stop.py ends
    a server that cannot finish after the drain), then SIGKILL the whole group if it hangs."""
    code = proc.poll()
    if code is None:
        request_drain(proc)
        proc.send_signal(signal.SIGTERM)
        code = wait_for_exit(proc, timeout)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of this group only (stubs left behind)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)
    return proc.returncode if code is None else code


# the stub reads this variable (model_repository/llm/1/lifecycle.py)
DRAIN_FILE_ENV = "TANDEM_DRAIN_FILE"


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
