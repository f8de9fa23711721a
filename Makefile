# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# The project's own environment has every extra, the peers the report compares with included.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-slow test-gpu test-install install lock clean

# constraints.txt pins every package of this repository's own environment (reproducible tests and
# figures, and pip has nothing to resolve); the package itself asks only for ranges, so
# `pip install torchspeed` keeps a user's torch. `make lock` rewrites it from the current .venv.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[all,peers,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchspeed bench --quick

# -X faulthandler: a native crash prints every thread's Python stack, even if a library replaced
# pytest's own handler.
test: $(STAMP)
	$(PY) -X faulthandler -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# The built wheel installed with every extra ([all]) into a fresh environment that already has torch:
# torch must stay, and doctor, optimize (torch + ONNX Runtime) and fast_loader must run there.
test-install: $(STAMP)
	$(PY) -m pytest -q -m install tests/test_packaging.py

lock: $(STAMP)
	{ sed -n '1,2p' constraints.txt; $(PY) -m pip freeze --exclude-editable --disable-pip-version-check | grep -v '^torchspeed'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) torchspeed-report .pytest_cache
