"""Shared test settings: GPU-marked tests skip where CUDA is absent; kernel tests run there under Triton's
interpreter instead.

Without CUDA, TRITON_INTERPRET=1 is set here, before any test module imports a Triton-language kernel (Triton
reads it when a kernel is defined), and the interpreter gets a GPU's bf16 numerics (tests/triton_interpreter.py).
So `pytest tests` on a CPU machine also runs tests/kernels and the engine on the Triton path, interpreted.

One OpenMP thread per process unless OMP_NUM_THREADS says otherwise: `make test` runs two workers on two cores, and
each starts tritonservers, stubs and tools (which inherit the variable). With torch's default of one thread per core
in every one of them, threads spin-waiting at the end of each parallel region took the cores from the processes that
had work: a transformers decode step took three times as long as with one thread."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch (and numpy's BLAS) read it

import pytest
import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:  # triton is a test requirement (requirements.txt): kernel tests fail, not skip, without it
    from tests import triton_interpreter

    triton_interpreter.install()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: make test-gpu)")
    skip_slow = pytest.mark.skip(reason="one of the slowest cases under Triton's interpreter: the GPU runs it "
                                        "(make test-gpu); TANDEM_ALL_KERNEL_CASES=1 runs it here")
    all_cases = os.environ.get("TANDEM_ALL_KERNEL_CASES") == "1"
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip_gpu)
        if "interpreter_slow" in item.keywords and INTERPRET and not all_cases:
            item.add_marker(skip_slow)
