# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# The project's own environment has every extra, the peers the report compares with included.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-slow test-busy test-gpu test-install install lock clean gpu-wheels gpu-check

# constraints.txt pins every package of this repository's own environment (reproducible tests and
# figures, and pip has nothing to resolve); the package itself asks only for ranges, so
# `pip install torchspeed` keeps a user's torch. `make lock` rewrites it from the current .venv.
# torchspeed/data/_crops.c is compiled by the install (an editable install builds it in place).
# uv (pinned, installed into .venv first) fetches and unpacks the wheels in parallel: the whole install took
# 28 s with empty caches where pip took 3-4 minutes. Where uv cannot be had or fails (an index only pip's
# configuration knows, no uv wheel for the platform), pip installs the same pins.
EXTRAS := .[all,turbojpeg,peers,dev]
$(STAMP): pyproject.toml constraints.txt torchspeed/data/_crops.c
	@echo "installing torchspeed with every extra into $(VENV) (under a minute with uv; pip: 3-4 minutes), once"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	{ $(PY) -m pip install --quiet --disable-pip-version-check "$$(grep '^uv==' constraints.txt)" && \
	  $(VENV)/bin/uv pip install --quiet --python $(PY) -c constraints.txt -e '$(EXTRAS)'; } || \
	{ echo "uv could not install; pip installs instead"; \
	  $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '$(EXTRAS)'; }
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchspeed bench --quick

# PYTHONFAULTHANDLER: a native crash prints every thread's Python stack, in the pytest workers and the
# processes they start too, even if a library replaced pytest's own handler. One pytest worker a core this
# process may use (nproc: affinity and CPU sets; at most 4), each taking whole test files: much of the suite
# waits on the processes it starts (torchrun launches, fresh interpreters), so on a quiet 2-core AMD EPYC
# (2026-11-28) the suite took 6.3-7.6 minutes where one process took 10.1. `make test PARALLEL=`: one process.
WORKERS := $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 4 ] && n=4; echo $$n)
PARALLEL := -n $(WORKERS) --dist loadfile
test: $(STAMP)
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q $(PARALLEL)

# The slow tests, then the whole suite again on a busy machine (test-busy).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow
	@$(MAKE) --no-print-directory test-busy

# `make test` beside two CPU-bound processes, as on a CI runner or a laptop that shares its cores: no test
# may depend on the machine being quiet or fast (tests/conftest.py reads other processes' load as none
# unless a test measures it; tests that judge which timed choice wins time fakes on tests/helpers.py's
# FakeClock). The spinners end with the run, whatever its result.
test-busy: $(STAMP)
	@$(PY) -c 'while True: pass' & a=$$!; $(PY) -c 'while True: pass' & b=$$!; \
	trap 'kill $$a $$b' EXIT; echo "two CPU-bound processes spinning beside the suite (pids $$a $$b)"; \
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q $(PARALLEL)

# The CUDA suite. It fails (one line naming why) where no CUDA device can run a kernel, instead of passing
# with every test skipped; it prints the driver, CUDA, cuDNN, ONNX Runtime and TensorRT versions it runs on.
# ONNX Runtime's GPU build (pinned in constraints-gpu.txt for the CUDA of the pinned torch) replaces the
# CPU one in .venv (both install the same module; `make clean` goes back); TensorRT is optional:
# `$(PY) -m pip install -c constraints-gpu.txt tensorrt-cu13` adds the TensorRT rows.
GPU_STAMP := $(VENV)/.installed-gpu-stamp
$(GPU_STAMP): $(STAMP) constraints-gpu.txt
	$(PY) -m pip uninstall --quiet --disable-pip-version-check -y onnxruntime
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints-gpu.txt onnxruntime-gpu
	touch $(GPU_STAMP)

test-gpu: $(STAMP)
	@$(PY) tests/gpu_suite.py
	@$(MAKE) --no-print-directory $(GPU_STAMP)
	$(PY) -X faulthandler -m pytest -q -m gpu

# The built wheel (with its compiled crop renderer) installed with every extra ([all], and turbojpeg) into a fresh
# environment that already has torch:
# torch must stay, and doctor, optimize (torch + ONNX Runtime) and fast_loader must run there.
test-install: $(STAMP)
	$(PY) -m pytest -q -m install tests/test_packaging.py tests/test_gpu_check.py

# The GPU check on a machine that has its own torch and reaches no package index (the lent GPU machine, a
# cluster node): `make gpu-wheels` where an index is reachable (the few missing wheels into .whl/, for
# Python 3.12 and this one), carry .whl/ there, then `make gpu-check PYTHON=python3` (no .venv: that
# interpreter's torch is used). Logs, `torchspeed info`, the CUDA tests and a quick report go to gpu-check/.
gpu-wheels:
	scripts/gpu-wheels.sh

gpu-check:
	scripts/gpu-check.sh $(PYTHON)

lock: $(STAMP)
	{ sed -n '1,2p' constraints.txt; $(PY) -m pip freeze --exclude-editable --disable-pip-version-check | grep -v '^torchspeed'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) torchspeed-report .pytest_cache .gpu-site gpu-check
