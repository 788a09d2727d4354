# The two commands of the README. Each sets up what it needs on a fresh machine first.
#   make plan [STACK=dev]   offline plan of a stack and its cost (no AWS account, no Pulumi CLI)
#   make test               the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STACK ?= dev

.PHONY: plan test bench

$(VENV)/.installed: requirements.txt requirements-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

plan: $(VENV)/.installed
	$(PY) -m gpucluster plan $(STACK)

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/plan_speed.py
