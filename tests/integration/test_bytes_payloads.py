"""BYTES and numeric tensors through the real Python-backend stub, and the NumPy-2 guard.

The GPU machine's `serve_bench` killed the stub on its first (warm-up) request:
    unpack_from requires a buffer of at least 960051517 bytes for unpacking 960051513 bytes at offset 4
    (actual buffer size is 61)
61 bytes = the 4-byte length prefix + the 57-byte sampling_parameters '{"max_tokens": 8, "temperature": 0.0,
"ignore_eos": true}'; 960051513 = b"9999" read as a length, and chr(57) == "9". The nvidia-pytriton 0.7.0 stubs
(every Python version) are built with a pybind11 that predates NumPy 2 and read a dtype's item size as 0 under
numpy>=2, so every tensor comes out as its first element repeated (that prefix 57,0,0,0 became 57,57,57,57). It
reproduces on Python 3.11 and 3.12 alike with numpy 2.x in the stub, and never with numpy 1.26. See
scripts/tritonserver_env.py (numpy_abi_problem) and model.py (stub_numpy_problem).
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import site
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend import Engine, EngineConfig, SamplingParams
from scripts import tritonserver_env as tenv
from bench.serve_bench import make_requests

pytestmark = pytest.mark.integration

WARMUP_TOKENS = 8  # serve_bench's warm-up: 4 streams of 8 new tokens, the requests that crashed
SERVE_BENCH_SAMPLING = {"max_tokens": WARMUP_TOKENS, "temperature": 0.0, "ignore_eos": True}


def _numpy2_site() -> Path | None:
    """A site-packages of this interpreter's base with numpy>=2 in it (the machine's pyenv Python has one)."""
    import importlib.metadata

    for folder in site.getsitepackages([sys.base_prefix]):
        for dist in importlib.metadata.distributions(name="numpy", path=[folder]):
            if int(dist.version.split(".")[0]) >= 2:
                return Path(folder)
    return None


def _numpy2_only_path(tmp_path: Path) -> Path:
    """A folder holding only numpy>=2 (links), to put first on the stub's PYTHONPATH."""
    folder = _numpy2_site()
    if folder is None:
        pytest.skip("no numpy>=2 installed beside this Python to test the guard with")
    target = tmp_path / "numpy2"
    target.mkdir()
    for entry in folder.iterdir():
        if entry.name in ("numpy", "numpy.libs") or (entry.name.startswith("numpy-") and entry.name.endswith(".dist-info")):
            (target / entry.name).symlink_to(entry)
    return target


# ---- the guard, without a server -----------------------------------------------------------------------
def test_wheel_stubs_are_numpy1_only_and_the_guard_knows_it(tmp_path):
    stubs_dir = tenv._pytriton_server_dir() / "python_backend_stubs"
    stubs = sorted(stubs_dir.glob(f"*/{tenv.STUB_NAME}"))
    assert stubs, f"no stubs under {stubs_dir}"
    for stub in stubs:  # 0.7.0: pybind11 < 2.12 in all of them (3.8 ... 3.13)
        assert tenv.stub_handles_numpy2(stub) is False, stub
        assert tenv.numpy_abi_problem(stub, "1.26.4") is None
        problem = tenv.numpy_abi_problem(stub, "2.5.2", "/somewhere")
        assert problem and "numpy 2.5.2 from /somewhere" in problem and "numpy<2" in problem
    aware = tmp_path / "stub-numpy2"
    aware.write_bytes(b"\0numpy.core\0numpy._core\0multiarray\0")  # how pybind11 >= 2.12 names the module
    assert tenv.stub_handles_numpy2(aware) is True and tenv.numpy_abi_problem(aware, "2.5.2") is None
    unknown = tmp_path / "stub-unknown"
    unknown.write_bytes(b"\0")
    assert tenv.stub_handles_numpy2(unknown) is None and tenv.numpy_abi_problem(unknown, "2.5.2") is None


def test_this_environment_passes_the_guard():
    install = tenv.find_triton()
    env = tenv.server_env(install)
    version, _ = tenv.stub_numpy(env)
    tenv.check_stub_numpy(install, env)  # raises if this venv would break its own stub
    assert int(version.split(".")[0]) < 2 or tenv.stub_handles_numpy2(
        install.backend_dir / "python" / tenv.STUB_NAME) is not False


def test_start_server_refuses_numpy2_with_a_numpy1_stub(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(_numpy2_only_path(tmp_path)))
    with pytest.raises(RuntimeError, match=r"built for NumPy 1\.x .* would import numpy 2\."):
        tenv.start_server(tmp_path / "no-repository-needed", *tenv.free_ports(3))


def test_model_refuses_to_load_under_numpy2_instead_of_crashing_later(tmp_path, monkeypatch):
    """Past the start-up guard (e.g. another launcher), model.py itself fails the load with the reason."""
    monkeypatch.setenv("PYTHONPATH", str(_numpy2_only_path(tmp_path)))
    monkeypatch.setattr(tenv, "check_stub_numpy", lambda install, env: None)
    repo = tenv.make_model_repository(tmp_path, {"device": "cpu", "num_kv_blocks": "64", "max_num_seqs": "4"})
    log = tmp_path / "tritonserver.log"
    http, grpc, metrics = tenv.free_ports(3)
    proc = tenv.start_server(repo, http, grpc, metrics, ["--model-control-mode=explicit", "--load-model=llm",
                                                       "--exit-timeout-secs=10"], log_path=log)
    try:
        with pytest.raises(RuntimeError, match="exited"):
            tenv.wait_until_ready(proc, http, timeout=180, model_name="llm")
    finally:
        tenv.stop_server(proc, timeout=20)
    text = log.read_text(errors="replace")
    assert "failed to load 'llm'" in text and "built for NumPy 1.x" in text, text[-4000:]
    assert "terminate called" not in text
    assert not tenv.stub_pids(str(repo))


# ---- the payloads, through the served model ------------------------------------------------------------
def test_serve_bench_warmup_payloads(triton_server):
    """The exact requests that killed the stub: token-id prompts, 57-byte sampling_parameters, 4 streams."""
    from tandem_client import AsyncClient, GenerateRequest
    from tandem_client.request import tensors

    prompts = make_requests(4, (16, 200), WARMUP_TOKENS, seed=32)  # serve_bench's generator, CPU-sized lengths
    reqs = [GenerateRequest(input_ids=p, max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts]
    sampling = tensors(reqs[0])["sampling_parameters"][0][0]
    assert sampling == json.dumps(SERVE_BENCH_SAMPLING).encode() and len(sampling) == 57  # 57 == ord("9")

    async def drive():
        client = AsyncClient(triton_server.grpc_url, protocol="grpc", model=triton_server.model_name)
        try:
            async def one(req):
                return [chunk async for chunk in client.stream(req)]
            return await asyncio.gather(*(one(r) for r in reqs))
        finally:
            await client.close()

    stubs_before = triton_server.stub_pids()
    results = asyncio.run(drive())
    engine = Engine(EngineConfig(device="cpu", num_kv_blocks=128, max_num_seqs=4, max_model_len=1024))
    try:
        offline = engine.generate(prompts, SamplingParams(**SERVE_BENCH_SAMPLING))
    finally:
        engine.shutdown()
    for prompt, chunks, ref in zip(prompts, results, offline):
        assert sum(c.tokens() for c in chunks) == WARMUP_TOKENS
        assert chunks[-1].finish_reason == "length"
        # input_ids arrived whole (a NumPy-2 stub delivers [ids[0]] * len) and output_ids left whole
        assert [i for c in chunks for i in (c.output_ids or [])] == list(ref.token_ids)
        assert {c.num_input_tokens for c in chunks if c.num_input_tokens is not None} == {len(prompt)}
    assert triton_server.stub_pids() == stubs_before  # the stub lived through it


def _tensor(name: str, array: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _raw_bytes(value: bytes) -> np.ndarray:
    return np.array([value], dtype=np.object_)


def _ask(server, inputs: list, timeout: float = 120.0) -> tuple[list, list]:
    """One request on its own stream: (responses, errors)."""
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    responses, errors = [], []
    try:
        client.async_stream_infer(server.model_name, inputs, request_id="bytes", enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        while True:
            result, error = events.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                errors.append(error)
                break
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return responses, errors


def _text(responses: list) -> bytes:
    return b"".join(b"".join(r.as_numpy("text_output").reshape(-1).tolist())
                    for r in responses if r.as_numpy("text_output") is not None)


SMALL = json.dumps({"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}).encode()


@pytest.mark.parametrize("text_input, sampling, error", [
    (b"\xff\xfe not UTF-8", SMALL, "UTF-8"),
    (b"", SMALL, "non-empty"),
    ("\ufffd replacement".encode(), SMALL, None),
    (b"9999", SMALL, None),
    (b"x" * 3000, SMALL, None),
    (b"Hi", b"", None),  # empty sampling_parameters: defaults (16 tokens)
    (b"Hi", b"\xff\xfe", "sampling_parameters"),  # not JSON after replacement decoding
    (b"Hi", b"9999", "sampling_parameters"),  # JSON, but not an object
], ids=["invalid-utf8", "empty", "u+fffd", "9999", "long", "empty-sampling", "bad-sampling", "number-sampling"])
def test_bytes_inputs_are_answered_not_fatal(triton_server, text_input, sampling, error):
    stubs_before = triton_server.stub_pids()
    inputs = [_tensor("text_input", _raw_bytes(text_input), "BYTES"),
              _tensor("stream", np.array([True]), "BOOL"),
              _tensor("sampling_parameters", _raw_bytes(sampling), "BYTES"),
              _tensor("return_finish_reason", np.array([True]), "BOOL"),
              _tensor("return_output_ids", np.array([True]), "BOOL")]
    responses, errors = _ask(triton_server, inputs)
    if error:
        assert len(errors) == 1 and error in errors[0].message(), [str(e) for e in errors]
    else:
        assert not errors, [str(e) for e in errors]
        ids = [i for r in responses if r.as_numpy("output_ids") is not None for i in r.as_numpy("output_ids").tolist()]
        _text(responses).decode("utf-8")  # whole UTF-8 once joined; deltas may be empty while bytes are held
        reasons = [r.as_numpy("finish_reason")[0] for r in responses if r.as_numpy("finish_reason") is not None]
        assert all(r == b"None" for r in reasons[:-1])
        if sampling:  # greedy, EOS ignored: exactly max_tokens
            assert reasons[-1] == b"length" and len(ids) == 4
        else:  # defaults sample at temperature 1 and honour EOS: 16 tokens, or fewer ending on a stop token
            assert (reasons[-1], len(ids)) == (b"length", 16) or (reasons[-1] == b"stop" and 1 <= len(ids) <= 16), \
                (reasons[-1], ids)
    assert triton_server.stub_pids() == stubs_before, "the stub died (or was restarted)"
