# Set-up and entry points. `make demo` and `make test` each create .venv on a fresh machine.
SHELL := /bin/bash
VENV := .venv
# jax 0.11.2 needs Python 3.12 (pyenv installs are found without activating them).
PY312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
# test-latest: Python 3.13 with the newest releases setup.cfg's ranges admit (no constraints file).
VENV_LATEST := .venv-latest
PY313 := $(shell for p in python3.13 $$HOME/.pyenv/versions/3.13*/bin/python3.13 /usr/local/bin/python3.13 /usr/bin/python3.13; do \
	  $$p -c 'import sys; assert sys.version_info[:2] == (3, 13)' >/dev/null 2>&1 && { echo $$p; break; }; done)

.PHONY: demo test test-latest test-slow test-all bench venv docs clean

# The allocator the tests run under. XLA:CPU spends most of this suite compiling, and compiles
# about 15 % faster under tcmalloc (Debian's libtcmalloc-minimal4) than under glibc's malloc; it
# is preloaded when installed (CI installs it). Without it, glibc's thresholds are raised: by
# default it maps and unmaps each buffer above its mmap threshold, which cost a training step on 8
# emulated devices about a third of its speed (docs/setup.md, "Faster CPU runs").
TCMALLOC := $(shell /sbin/ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $$NF; exit}')
ALLOCATOR := $(if $(TCMALLOC),LD_PRELOAD=$(TCMALLOC) TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=68719476736,MALLOC_MMAP_THRESHOLD_=134217728 MALLOC_TRIM_THRESHOLD_=1073741824)

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	@test -n "$(PY312)" || { echo "error: Python 3.12 not found (needed for jax==0.11.2)"; exit 1; }
	test -x $(VENV)/bin/python || $(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m experiments.aps_digits

# The tests start about 110 Python processes (entry points, cluster hosts, notebook kernels, data
# workers). Where the environment sets PYTHONDONTWRITEBYTECODE (this machine's does), none
# of them writes bytecode, and each compiles jlp's sources again (0.25 s of its start-up); writing
# it once here, as an install would, spares them that.
BYTECODE := $(VENV)/bin/python -m compileall -q -j 0 jlp pallas_kernels experiments configs tests

test: $(STAMP)
	$(BYTECODE)
	$(ALLOCATOR) $(VENV)/bin/python -m pytest -n 2 --dist worksteal -q

# Re-resolves on every run (--upgrade, eager), so it tracks new releases; prints what it tested.
test-latest:
	@test -n "$(PY313)" || { echo "error: Python 3.13 not found (needed for test-latest)"; exit 1; }
	test -x $(VENV_LATEST)/bin/python || $(PY313) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/pip install -q --upgrade pip
	$(VENV_LATEST)/bin/pip install -q --upgrade --upgrade-strategy eager -e '.[dev]'
	@$(VENV_LATEST)/bin/python -c 'import sys; print("Python", sys.version.split()[0])'
	@$(VENV_LATEST)/bin/pip freeze --exclude-editable | grep -iE '^(jax|jaxlib|flax|optax|chex|ml.collections|ml.dtypes|orbax.checkpoint|tensorboardx|numpy|scipy|absl.py|tqdm|matplotlib|scikit.learn|pillow|pytest|pytest.xdist|hypothesis)=='
	$(ALLOCATOR) $(VENV_LATEST)/bin/python -m pytest -n 2 -q

test-slow: $(STAMP)
	$(BYTECODE)
	$(ALLOCATOR) $(VENV)/bin/python -m pytest -q -m slow

# The documentation site: docs/ (MyST pages, the notebooks from their stored outputs, the API
# reference from the docstrings) into docs/_build/html; every warning is an error. -E: read every
# page afresh, so that a page's warnings are reported on every run.
docs: $(DOCS_STAMP)
	$(VENV)/bin/python -m sphinx -E -W --keep-going -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

$(DOCS_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[dev,docs]'
	touch $(DOCS_STAMP)

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.quantize_bench

clean:
	rm -rf $(VENV) $(VENV_LATEST) build *.egg-info docs/_build
