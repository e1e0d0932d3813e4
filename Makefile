# Everything a fresh machine needs: `make demo`, `make test`, `make bench`, `make docs`,
# `make lint`.
# torch is installed first, pinned to the CPU wheel; every later install runs under
# constraints.txt so that nothing can swap it for a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip --disable-pip-version-check -q
STAMP   = $(VENV)/.installed

.PHONY: demo test docs lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test,docs]'
	# DeepSpeed is an sdist whose build imports torch: build it against the torch above.
	DS_BUILD_OPS=0 $(PIP) install -c constraints.txt --no-build-isolation 'deepspeed>=0.15'
	touch $@

demo: $(STAMP)
	$(PY) -m distgrad.demo --check
	launch/torchrun.sh ddp

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html

# ruff keeps the form (pyproject.toml's [tool.ruff]): formatted, and the lint rules pass
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: docs lint
	$(PY) -m pytest -n auto -q

bench: $(STAMP)
	$(PIP) install -c constraints.txt -e '.[bench]'
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) docs/_build .pytest_cache
