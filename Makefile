# The commands of the README. Each sets up what it needs on a fresh machine first.
#   make plan [STACK=dev]   offline plan of a stack and its cost (no AWS account, no Pulumi CLI); installs the runtime
#                           requirements only, and the `gpucluster` command in .venv/bin
#   make test               the whole test suite: its three lanes (tests/lanes.py) in parallel worker processes
#   make test-fast          the unit lane alone: no Slurm daemon, no local cluster
VENV ?= .venv
PY := $(VENV)/bin/python
STACK ?= dev

# What the tests run on this machine: cloud-init's schema checker, shellcheck for build_image.sh, systemd-analyze
# (tests/test_bootstrap.py), Slurm's scontrol (tests/test_bootstrap.py; it brings the slurm user), iptables, iproute2,
# util-linux and sudo for the nodes' lockdown (tests/test_lockdown.py, which needs the prometheus user too), promtool
# and amtool, which check what we render; mmdebstrap builds the rehearsal's node image; sshd (openssh-server) reads
# the head's sshd settings (tests/test_bootstrap.py). The Slurm daemons, munge, MariaDB and the exporters run only
# inside the rehearsal's nodes, from that image.
SYSTEM_PACKAGES := slurm-client cloud-init shellcheck systemd util-linux mount iptables iproute2 sudo \
  prometheus prometheus-alertmanager mmdebstrap openssh-server
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Test worker processes (pytest-xdist). The unit lane's tests are CPU-bound: one per core. A local cluster's test
# mostly waits on Slurm's timers: more of them than cores run side by side, each cluster in a network of its own.
FAST_WORKERS ?= $(shell nproc)
TEST_WORKERS ?= 6

.PHONY: plan test test-fast setup lanes bench system-packages rehearsal-rootfs

# Two stamps: the runtime (requirements.txt, what `make plan` needs: about a minute) and the development tools on top
# (requirements-dev.txt: tests, lint, docs; what `make test` needs). Debian's and Ubuntu's python3 makes a venv only
# with python3-venv: installed when the first try fails.
APT_INSTALL := DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get -o DPkg::Lock::Timeout=300 install -y -q
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check
# The runtime stamp installs this checkout too (editable, pyproject.toml), which puts the `gpucluster` command in
# $(VENV)/bin.
$(VENV)/.runtime: requirements.txt pyproject.toml
	python3 -m venv $(VENV) || { $(SUDO) apt-get update -q && $(APT_INSTALL) python3-venv && python3 -m venv $(VENV); }
	$(PIP_INSTALL) -r requirements.txt
	$(PIP_INSTALL) --no-deps -e .
	touch $@

$(VENV)/.installed: $(VENV)/.runtime requirements-dev.txt
	$(PIP_INSTALL) -r requirements-dev.txt
	touch $@

plan: $(VENV)/.runtime
	$(PY) -m gpucluster plan $(STACK)

system-packages:
	@dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1 || { $(SUDO) apt-get update -q && \
	  $(APT_INSTALL) $(SYSTEM_PACKAGES); }

# The boot rehearsal's node image (tests/rehearsal_image.py): Debian 13 with the node image's Slurm, from Debian's
# registry, rebuilt when the package list changed (it keeps a copy of the list it was built from); ~1.5 min, mostly
# download. Built beside the old one, which is swapped out only once the new one is complete.
REHEARSAL_ROOTFS ?= $(shell python3 tests/rehearsal_image.py)
export GPUCLUSTER_REHEARSAL_ROOTFS := $(REHEARSAL_ROOTFS)
REHEARSAL_LIST := tests/rehearsal/image-packages
rehearsal-rootfs: system-packages
	@cmp -s $(REHEARSAL_LIST) $(REHEARSAL_ROOTFS)/.gpucluster-image-packages || { \
	  $(SUDO) rm -rf $(REHEARSAL_ROOTFS).new && $(SUDO) mkdir -p $(dir $(REHEARSAL_ROOTFS)) && \
	  $(SUDO) mmdebstrap --quiet --variant=apt --include=$$(grep -v '^#' $(REHEARSAL_LIST) | paste -sd, -) \
	    trixie $(REHEARSAL_ROOTFS).new http://deb.debian.org/debian && \
	  $(SUDO) cp $(REHEARSAL_LIST) $(REHEARSAL_ROOTFS).new/.gpucluster-image-packages && \
	  $(SUDO) rm -rf $(REHEARSAL_ROOTFS) && $(SUDO) mv $(REHEARSAL_ROOTFS).new $(REHEARSAL_ROOTFS); }

# The venv beside the system packages and the rehearsal's image (after them: it needs mmdebstrap): pip, apt-get and
# mmdebstrap wait on nothing of each other's.
setup:
	@$(MAKE) --no-print-directory --jobs=2 $(VENV)/.installed rehearsal-rootfs

# Lint, the docs and the three lanes at once (the lanes mostly wait on Slurm's timers); each one's output in one piece,
# the tests' last.
test: setup
	@$(MAKE) --no-print-directory --jobs=3 --output-sync=target lint docs lanes

lanes:
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test-fast: setup
	$(PY) -m pytest -q -m unit -n $(FAST_WORKERS)

# ruff and mypy as pyproject.toml configures them.
.PHONY: lint
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml): --strict fails on a broken link or anchor and on a page left out of the nav.
# NO_MKDOCS_2_WARNING: Material's banner about a future MkDocs 2, not a finding of this site.
.PHONY: docs
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

bench: $(VENV)/.installed rehearsal-rootfs
	$(PY) benchmarks/plan_speed.py
	$(PY) benchmarks/resume_scale.py
	$(PY) benchmarks/interruption.py
	$(PY) benchmarks/submit_to_running.py
	$(PY) benchmarks/boot.py
