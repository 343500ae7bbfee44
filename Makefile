# Two commands on a fresh machine: `make serve` and `make test` (both run `make setup` first).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup serve test lint tiny clean

# Idempotent: creates .venv, installs torch 2.13.0 first (the local CPU wheel here; a bare
# `torch` would pull a multi-GB CUDA build), then the project with its serving and test extras.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip show torch >/dev/null 2>&1 || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[serve,test]'
	@bash scripts/ensure_system_deps.sh
	@touch $@

serve: setup
	$(VENV)/bin/volundr-serve $(SERVE_ARGS)

test: setup
	$(VPY) -m pytest -q -ra $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

tiny: setup
	$(VPY) -m volundr.converter tiny .cache/tiny

clean:
	rm -rf $(VENV) .cache build *.egg-info
