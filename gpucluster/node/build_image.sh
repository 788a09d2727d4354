#!/usr/bin/env bash
# build_image.sh ROLE (head | compute): install what a gpucluster node of ROLE runs, at pinned versions, and write
# the image manifest as the very last step. The one build script: EC2 Image Builder runs it while baking the node
# image (components/image.py), and a node booted on a stock AMI runs it first (bootstrap.py, when the manifest is
# missing). Exit 0: the manifest lists what was installed. Any other exit: there is no manifest.
set -euo pipefail

# --- pinned versions -------------------------------------------------------------------------------------------------
# Ubuntu 24.04 (noble) amd64 archive, as packages.ubuntu.com listed them when pinned (slurm-wlm, python-boto3 and
# pyyaml have nothing beyond the release pocket). Ubuntu drops a superseded version from its index: the install
# then fails here, and the variable takes the new version.
SLURM_VERSION=23.11.4-1.2ubuntu5             # src:slurm-wlm, noble/universe: one version on head and compute
MUNGE_VERSION=0.5.15-4ubuntu0.1              # noble-security
MARIADB_VERSION=1:10.11.14-0ubuntu0.24.04.1  # noble-updates
BOTO3_VERSION=1.34.46+dfsg-1ubuntu1
PYTHON3_VENV_VERSION=3.12.3-0ubuntu2.1       # noble-updates; depends on exactly this python3
PYYAML_VERSION=6.0.1-2build2
ENROOT_VERSION=3.5.0
ENROOT_TAG=v$ENROOT_VERSION
ENROOT_COMMIT=c7dc4a6b66e817af5ceb7d5315850696067b3f80  # what the tag named when pinned; it fixes the submodules too
PYXIS_TAG=v0.20.1                                     # the pyxis line paired with enroot 3.5.0
PYXIS_COMMIT=d3ff5b87de45e0cb23dfe626c5edba1238e980e0  # what the tag named when pinned
CWAGENT_VERSION=1.300072.0b1766
CWAGENT_KEY_FINGERPRINT=937616F3450B7D806CBD9725D58167303B789C72  # AWS's CloudWatch agent signing key
# Monitoring: Ubuntu's Prometheus packages (noble-updates, as packages.ubuntu.com listed them when pinned); Grafana OSS
# from Grafana's signed repository, its key checked against the fingerprint Grafana publishes (since its 2023 rotation).
PROMETHEUS_VERSION=2.45.3+ds-2ubuntu0.3
ALERTMANAGER_VERSION=0.26.0+ds-1ubuntu0.3
NODE_EXPORTER_VERSION=1.7.0-1ubuntu0.3
GRAFANA_VERSION=11.6.14
GRAFANA_KEY_FINGERPRINT=B53AE77BADB630A683046005963FA27710458545
GRAFANA_SDK_VERSION=1769699379!11.6.0  # grafana-foundation-sdk (`gpucluster render`'s dashboards): no dependencies
# NVIDIA images: dcgm-exporter, pulled into the image so that a boot needs no registry; by its linux/amd64 digest, as a
# tag can move. Its DCGM (4.5) is its own, embedded: not the parent image's dcgmi and nv-hostengine.
DCGM_EXPORTER_IMAGE=nvcr.io/nvidia/k8s/dcgm-exporter:4.5.2-4.8.1-ubuntu22.04
DCGM_EXPORTER_DIGEST=sha256:a7ad6547d4546eaf4dd5d6b4c0b4db4101e63ef7dc3cdff7f42b767d2c60b706
DCGM_EXPORTER_LOCAL=gpucluster/dcgm-exporter:image  # DCGM_EXPORTER_IMAGE in gpucluster/contract/settings.py
TORCH_VERSION=2.13.0     # the examples' version (requirements-dev.txt)
PYDANTIC_VERSION=2.14.4  # for the head's `gpucluster` command (requirements.txt: pydantic 2)
# Every other distribution pip installs; torch pins its own CUDA wheels and triton exactly.
PIP_CONSTRAINTS=(filelock==4.3.1 fsspec==2026.9.0 jinja2==3.1.6 markupsafe==3.0.4 mpmath==1.3.0 networkx==3.6.1
  setuptools==84.2.1 sympy==1.14.0 typing-extensions==4.16.0 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5)

# iptables: every boot's lockdown (gpucluster/contract/lockdown.py) keeps instance metadata from users with it; Ubuntu's
# images carry it, named here so that no parent image can lack it. Unversioned, from the noble archive, like the tools.
HEAD_PACKAGES=("munge=$MUNGE_VERSION" "slurmctld=$SLURM_VERSION" "slurmdbd=$SLURM_VERSION"
  "slurm-client=$SLURM_VERSION" "mariadb-server=$MARIADB_VERSION" "python3-boto3=$BOTO3_VERSION"
  "python3-venv=$PYTHON3_VENV_VERSION" "python3-yaml=$PYYAML_VERSION" iptables "prometheus=$PROMETHEUS_VERSION"
  "prometheus-alertmanager=$ALERTMANAGER_VERSION" "prometheus-node-exporter=$NODE_EXPORTER_VERSION"
  "grafana=$GRAFANA_VERSION")
# libslurm-dev: pyxis compiles against this Slurm; python3-venv: the torch venv.
COMPUTE_PACKAGES=("munge=$MUNGE_VERSION" "slurmd=$SLURM_VERSION" "slurm-client=$SLURM_VERSION"
  "libslurm-dev=$SLURM_VERSION" "python3-boto3=$BOTO3_VERSION" "python3-venv=$PYTHON3_VENV_VERSION" iptables
  "prometheus-node-exporter=$NODE_EXPORTER_VERSION")
# enroot from source (its doc/installation.md): git, gcc, make, setcap (libcap2-bin) and patch (for musl) build it;
# the doc's libtool, automake and libmd-dev served a libbsd that 3.5.0 vendors and builds without them. At run time
# it needs what its .deb depended on. Unversioned, from the noble archive: the tools only build a source pinned by
# commit, and the .deb left these dependencies to the archive too.
ENROOT_BUILD_PACKAGES=(git gcc make libcap2-bin patch)
ENROOT_RUNTIME_PACKAGES=(curl gawk jq parallel squashfs-tools zstd bsdmainutils)
# The boot configures and starts these (bootstrap.py); the image leaves them off.
HEAD_SERVICES=(munge slurmctld slurmdbd mariadb prometheus prometheus-alertmanager prometheus-node-exporter
  grafana-server)
COMPUTE_SERVICES=(munge slurmd prometheus-node-exporter)

# --- where things come from and go ---------------------------------------------------------------------------------
ENROOT_REPO=https://github.com/NVIDIA/enroot.git
PYXIS_REPO=https://github.com/NVIDIA/pyxis.git
CWAGENT_URL=https://amazoncloudwatch-agent.s3.amazonaws.com
CWAGENT_CTL=/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl
# AWS's signed apt repository for the FSx Lustre client (FSx for Lustre user guide, Ubuntu): apt checks every package
# against this key, which AWS publishes unversioned.
LUSTRE_KEY_URL=https://fsx-lustre-client-repo-public-keys.s3.amazonaws.com/fsx-ubuntu-public-key.asc
LUSTRE_REPO=https://fsx-lustre-client-repo.s3.amazonaws.com/ubuntu
GRAFANA_REPO=https://apt.grafana.com
NEURON_BIN=/opt/aws/neuron/bin  # the Neuron Deep Learning AMI's tools
PYPI=https://pypi.org/simple
MANIFEST=/opt/gpucluster-image/manifest.json  # IMAGE_MANIFEST in gpucluster/contract/settings.py
VENV=/opt/gpucluster-image/venv

ROLE=${1:-}
# For tests only: they run this script as root on a shared machine, so every file it writes goes under this prefix.
ROOT=${GPUCLUSTER_IMAGE_ROOT:-}
# For tests only: the first wait between two attempts in milliseconds; it doubles after each failure.
RETRY_BASE_MS=${GPUCLUSTER_RETRY_BASE_MS:-5000}
RETRY_ATTEMPTS=5
export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1

log() { printf '%s build_image %s: %s\n' "$(date -u +%FT%TZ)" "$ROLE" "$*" >&2; }
die() {
  log "FAILED: $*"
  exit 1
}

# retry CMD...: up to RETRY_ATTEMPTS attempts, waiting RETRY_BASE_MS, then twice as long after each failure.
# CMD runs as an `until` condition, where `set -e` is off: a function given here chains its steps with &&.
retry() {
  local attempt=1 wait_ms=$RETRY_BASE_MS seconds
  until "$@"; do
    ((attempt < RETRY_ATTEMPTS)) || { log "giving up after $attempt attempts: $*"; return 1; }
    seconds=$((wait_ms / 1000)).$(printf '%03d' $((wait_ms % 1000)))
    log "attempt $attempt of $RETRY_ATTEMPTS failed, next in ${seconds}s: $*"
    sleep "$seconds"
    attempt=$((attempt + 1)) wait_ms=$((wait_ms * 2))
  done
}

apt_get() { apt-get -o DPkg::Lock::Timeout=120 -q -y "$@"; }
apt_install() { retry apt_get install --no-install-recommends "$@"; }
fetch() { curl -fsSL -o "$2" "$1"; }  # fetch URL FILE

packages() {  # packages PACKAGE=VERSION...
  install -d "$ROOT/etc/apt/preferences.d" "$ROOT/etc/apt/sources.list.d" "$ROOT/usr/share/keyrings"
  # Every binary of Slurm's source follows the pin, also as a dependency and on a later apt upgrade.
  printf 'Package: src:slurm-wlm\nPin: version %s\nPin-Priority: 1001\n' "$SLURM_VERSION" \
    >"$ROOT/etc/apt/preferences.d/gpucluster-slurm"
  retry fetch "$LUSTRE_KEY_URL" "$WORK/fsx-ubuntu-public-key.asc"
  gpg --batch --yes --dearmor -o "$ROOT/usr/share/keyrings/fsx-ubuntu-public-key.gpg" "$WORK/fsx-ubuntu-public-key.asc"
  echo "deb [signed-by=/usr/share/keyrings/fsx-ubuntu-public-key.gpg] $LUSTRE_REPO noble main" \
    >"$ROOT/etc/apt/sources.list.d/fsxlustreclientrepo.list"
  [[ $ROLE == compute ]] || grafana_repository
  retry apt_get update --error-on=any  # the one index refresh of this run: Ubuntu's, Lustre's and (head) Grafana's
  apt_install "$@"
  # Built for the running kernel, so not versioned apart from it. Not the lustre-client-modules-aws meta package the
  # FSx guide adds for kernel upgrades: it may pull a newer kernel into the image, one the parent AMI's NVIDIA and EFA
  # modules were not built for. A baked image keeps its kernel; a new parent AMI is a new bake.
  apt_install "lustre-client-modules-$(uname -r)"
}

grafana_repository() {
  local key=$WORK/grafana.asc fingerprints
  retry fetch "$GRAFANA_REPO/gpg.key" "$key"
  # Every primary key in the file: apt would trust any of them for this repository.
  fingerprints=$(gpg --batch --homedir "$WORK" --with-colons --show-keys "$key" |
    awk -F: '$1 == "pub" {p = 1} $1 == "sub" {p = 0} $1 == "fpr" && p {print $10; p = 0}')
  [[ $fingerprints == "$GRAFANA_KEY_FINGERPRINT" ]] ||
    die "Grafana's apt key is ${fingerprints:-none}, not the pinned one"
  gpg --batch --yes --dearmor -o "$ROOT/usr/share/keyrings/grafana.gpg" "$key"
  echo "deb [signed-by=/usr/share/keyrings/grafana.gpg] $GRAFANA_REPO stable main" \
    >"$ROOT/etc/apt/sources.list.d/grafana.list"
  # A later apt upgrade keeps this Grafana: the repository carries every newer major.
  printf 'Package: grafana\nPin: version %s\nPin-Priority: 1001\n' "$GRAFANA_VERSION" \
    >"$ROOT/etc/apt/preferences.d/gpucluster-grafana"
}

clone_pyxis() { rm -rf "$1" && git clone -q --depth 1 --branch "$PYXIS_TAG" "$PYXIS_REPO" "$1"; }
# The submodules (makeself, musl, linux-headers) at the commits the pinned tree names, cloned whole: a shallow fetch of
# a commit no branch points at needs a server that hands out commits by id. musl's is git://git.musl-libc.org (port
# 9418, unencrypted): what it sends must still hash to the commit named.
clone_enroot() {
  rm -rf "$1" && git clone -q --depth 1 --branch "$ENROOT_TAG" --recurse-submodules "$ENROOT_REPO" "$1"
}
# The layout of enroot's .deb (/usr/bin, /usr/lib/enroot, /etc/enroot: the boot adds to /etc/enroot/enroot.conf.d) and
# its standard flavour, which NVIDIA builds with these flags (pkg/debbuild), in the environment: on make's command
# line they would replace the Makefile's own CPPFLAGS.
enroot_make() { CPPFLAGS="-DALLOW_SPECULATION -DINHERIT_FDS" make -C "$WORK/enroot" prefix=/usr sysconfdir=/etc "$@"; }

containers() {  # enroot and pyxis: `srun --container-image=...`
  apt_install "${ENROOT_BUILD_PACKAGES[@]}" "${ENROOT_RUNTIME_PACKAGES[@]}"
  retry clone_enroot "$WORK/enroot"
  [[ $(git -C "$WORK/enroot" rev-parse HEAD) == "$ENROOT_COMMIT" ]] || die "enroot $ENROOT_TAG is not $ENROOT_COMMIT"
  enroot_make all  # before the install: one that builds writes its DESTDIR into bin/enroot and enroot.conf
  enroot_make install DESTDIR="$ROOT"
  [[ -x $ROOT/usr/bin/enroot && -f $ROOT/etc/enroot/enroot.conf ]] || die "enroot is not in /usr/bin and /etc/enroot"
  enroot_make setcap DESTDIR="$ROOT"  # as the enroot+caps package: unprivileged users import images
  # As the .deb: Ubuntu 24.04 lets a program create user namespaces only under an AppArmor profile that allows it.
  install -D -m 644 "$ROOT/usr/share/enroot/apparmor.profile" "$ROOT/etc/apparmor.d/enroot"
  if aa-enabled --quiet 2>/dev/null; then apparmor_parser -r -T -W "$ROOT/etc/apparmor.d/enroot"; fi
  retry clone_pyxis "$WORK/pyxis"
  [[ $(git -C "$WORK/pyxis" rev-parse HEAD) == "$PYXIS_COMMIT" ]] || die "pyxis $PYXIS_TAG is not $PYXIS_COMMIT"
  # Against /usr/include/slurm from libslurm-dev; installs /usr/local/lib/slurm/spank_pyxis.so (plugstack.conf).
  make -C "$WORK/pyxis" install DESTDIR="$ROOT"
  [[ -f $ROOT/usr/local/lib/slurm/spank_pyxis.so ]] || die "pyxis installed no spank_pyxis.so"
}

cloudwatch_agent() {  # the idle-GPU alarms read its metrics; the Deep Learning AMIs usually carry it
  if [[ -x $ROOT$CWAGENT_CTL ]]; then
    log "CloudWatch agent already in the image"
    return
  fi
  local deb=$WORK/amazon-cloudwatch-agent.deb home=$WORK/gnupg fingerprint
  retry fetch "$CWAGENT_URL/assets/amazon-cloudwatch-agent.gpg" "$WORK/cwagent.gpg"
  retry fetch "$CWAGENT_URL/ubuntu/amd64/$CWAGENT_VERSION/amazon-cloudwatch-agent.deb" "$deb"
  retry fetch "$CWAGENT_URL/ubuntu/amd64/$CWAGENT_VERSION/amazon-cloudwatch-agent.deb.sig" "$deb.sig"
  install -d -m 700 "$home"
  gpg --batch --homedir "$home" --import "$WORK/cwagent.gpg"
  fingerprint=$(gpg --batch --homedir "$home" --with-colons --fingerprint | awk -F: '$1 == "fpr" {print $10; exit}')
  [[ $fingerprint == "$CWAGENT_KEY_FINGERPRINT" ]] || die "CloudWatch agent key is $fingerprint, not the pinned one"
  gpg --batch --homedir "$home" --verify "$deb.sig" "$deb" || die "CloudWatch agent package signature does not verify"
  apt_install "$deb"
}

dcgm() {  # on the NVIDIA Deep Learning AMIs: check, never install (docker and nvidia-ctk run dcgm-exporter)
  if ! command -v nvidia-smi >/dev/null; then
    echo "none (no NVIDIA driver)"
  elif ! command -v dcgmi >/dev/null; then
    die "an NVIDIA image without DCGM (dcgmi): the Deep Learning AMI should carry it"
  elif ! command -v docker >/dev/null || ! command -v nvidia-ctk >/dev/null; then
    die "an NVIDIA image without docker or the NVIDIA container toolkit: the Deep Learning AMI should carry them"
  else
    echo "from the parent image"
  fi
}

neuron() {  # on the Neuron Deep Learning AMIs: neuron-monitor and its Prometheus output, checked
  local tool
  [[ -d $ROOT$NEURON_BIN ]] || { echo "none (no Neuron tools)"; return; }
  for tool in neuron-monitor neuron-monitor-prometheus.py; do
    [[ -x $ROOT$NEURON_BIN/$tool ]] || die "a Neuron image without $NEURON_BIN/$tool"
  done
  echo "from the parent image"
}

python_venv() {  # python_venv REQUIREMENT...: the one venv of the image, every distribution pinned
  printf '%s\n' "${PIP_CONSTRAINTS[@]}" >"$WORK/constraints.txt"
  python3 -m venv --system-site-packages "$ROOT$VENV"
  retry "$ROOT$VENV/bin/pip" install -q --no-cache-dir --only-binary=:all: --index-url "$PYPI" \
    --constraint "$WORK/constraints.txt" "$@"
}

write_manifest() {  # the last step: its presence means the image is complete
  local versions=("\"slurm\": \"$SLURM_VERSION\"" "\"munge\": \"$MUNGE_VERSION\"" "\"boto3\": \"$BOTO3_VERSION\"")
  if [[ $ROLE == head ]]; then
    versions+=("\"mariadb\": \"$MARIADB_VERSION\"" "\"pyyaml\": \"$PYYAML_VERSION\"" "\"pydantic\": \"$PYDANTIC_VERSION\""
      "\"prometheus\": \"$PROMETHEUS_VERSION\"" "\"alertmanager\": \"$ALERTMANAGER_VERSION\""
      "\"grafana\": \"$GRAFANA_VERSION\"" "\"grafana_foundation_sdk\": \"$GRAFANA_SDK_VERSION\"")
  else
    versions+=("\"enroot\": \"$ENROOT_VERSION $ENROOT_COMMIT\"" "\"pyxis\": \"$PYXIS_TAG $PYXIS_COMMIT\""
      "\"cloudwatch_agent\": \"$CWAGENT_VERSION\"" "\"torch\": \"$TORCH_VERSION\"" "\"dcgm\": \"$DCGM\""
      "\"dcgm_exporter\": \"$DCGM_EXPORTER\"" "\"neuron_monitor\": \"$NEURON\"")
  fi
  versions+=("\"node_exporter\": \"$NODE_EXPORTER_VERSION\"")
  local IFS=,
  printf '{"role": "%s", "built_at": "%s", "kernel": "%s", "versions": {%s}}\n' \
    "$ROLE" "$(date -u +%FT%TZ)" "$(uname -r)" "${versions[*]}" >"$ROOT$MANIFEST.tmp"
  mv "$ROOT$MANIFEST.tmp" "$ROOT$MANIFEST"
}

main() {
  [[ $ROLE == head || $ROLE == compute ]] || { echo "usage: build_image.sh head|compute" >&2; exit 2; }
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  install -d "$ROOT${MANIFEST%/*}" "$ROOT/usr/local/bin"
  rm -f "$ROOT$MANIFEST"  # a manifest from an earlier run must not vouch for this one
  log "building the $ROLE image"
  if [[ $ROLE == head ]]; then
    packages "${HEAD_PACKAGES[@]}"
    python_venv "pydantic==$PYDANTIC_VERSION" "grafana-foundation-sdk==$GRAFANA_SDK_VERSION"
    systemctl disable --now "${HEAD_SERVICES[@]}"
  else
    DCGM=$(dcgm)
    NEURON=$(neuron)
    DCGM_EXPORTER=none
    packages "${COMPUTE_PACKAGES[@]}"
    containers
    if [[ $DCGM != none* ]]; then
      DCGM_EXPORTER=$DCGM_EXPORTER_IMAGE@$DCGM_EXPORTER_DIGEST
      retry docker pull -q "$DCGM_EXPORTER"
      docker tag "$DCGM_EXPORTER" "$DCGM_EXPORTER_LOCAL"  # the name the boot's unit runs
    fi
    cloudwatch_agent
    python_venv "torch==$TORCH_VERSION"
    ln -sf "$VENV/bin/torchrun" "$ROOT/usr/local/bin/torchrun"
    systemctl disable --now "${COMPUTE_SERVICES[@]}"
  fi
  rm -f "$ROOT/etc/munge/munge.key"  # the package's own key: each cluster's comes from SSM at boot
  write_manifest
  log "done: $MANIFEST"
}

main
