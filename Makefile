# Set-up and entry points. `make demo` and `make test` each create .venv on a fresh machine.
SHELL := /bin/bash
VENV := .venv
# jax 0.11.2 needs Python 3.12 (pyenv installs are found without activating them).
PY312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-all bench venv clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	@test -n "$(PY312)" || { echo "error: Python 3.12 not found (needed for jax==0.11.2)"; exit 1; }
	test -x $(VENV)/bin/python || $(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m experiments.aps_digits

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.quantize_bench

clean:
	rm -rf $(VENV) build *.egg-info
