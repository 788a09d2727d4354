# The two commands of the README. Each sets up what it needs on a fresh machine first.
#   make plan [STACK=dev]   offline plan of a stack and its cost (no AWS account, no Pulumi CLI)
#   make test               the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STACK ?= dev

# What the tests run for real: Slurm's daemons with munge and MariaDB, cloud-init's schema checker, shellcheck for
# build_image.sh, PyYAML for /usr/bin/python3 (the boot rehearsal's cloud-init stand-in; cloud-init brings it too),
# iptables, iproute2 and sudo for the nodes' lockdown (tests/test_lockdown.py); Prometheus, its node exporter and
# Alertmanager, which the head and nodes run and whose promtool and amtool check what we render.
SYSTEM_PACKAGES := slurmctld slurmd slurm-client slurmdbd munge mariadb-server mariadb-client cloud-init \
  shellcheck python3-yaml systemd util-linux mount e2fsprogs iptables iproute2 sudo \
  prometheus prometheus-node-exporter prometheus-alertmanager
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: plan test bench system-packages

$(VENV)/.installed: requirements.txt requirements-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

plan: $(VENV)/.installed
	$(PY) -m gpucluster plan $(STACK)

system-packages:
	@dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1 || { $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $(SYSTEM_PACKAGES); }

test: lint $(VENV)/.installed system-packages docs
	$(PY) -m pytest -q

# ruff and mypy as pyproject.toml configures them.
.PHONY: lint
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml): --strict fails on a broken link or anchor and on a page left out of the nav.
.PHONY: docs
docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict --quiet

bench: $(VENV)/.installed system-packages
	$(PY) benchmarks/plan_speed.py
	$(PY) benchmarks/resume_scale.py
	$(PY) benchmarks/interruption.py
	$(PY) benchmarks/submit_to_running.py
	$(PY) benchmarks/boot.py
