#!/usr/bin/env bash
# build_image.sh ROLE [BOM] (ROLE: head | compute): install exactly what the bill of materials lists for a node of ROLE,
# fail naming the package if what got installed differs from it, and write the image manifest as the very last step.
# BOM: the bom.json `gpucluster render` writes (gpucluster/spec/bom.py); by default where the image component puts it
# (IMAGE_BOM). The one build script: EC2 Image Builder runs it while baking the node image (components/image.py), and a
# node booted on a stock AMI runs it first (bootstrap.py, when the manifest is missing). Exit 0: the manifest lists
# what was installed. Any other exit: there is no manifest.
set -euo pipefail

# --- what the steps take from the bill of materials, by name ---------------------------------------------------------
# read_bom fails naming any the role's lists lack for the steps that run, and any source the BOM gives the role that no
# step of the role installs: nothing in a role goes unbuilt. The sources each step builds or fetches
# (gpucluster/spec/bom.py's SOURCES):
declare -A STEP_SOURCES=([slurm]=slurm [pyxis]=pyxis [enroot]=enroot [gpu]=dcgm-exporter [nccl_tests]=nccl-tests
  [python_venv]=pip)
# The apt packages each step needs from the role's list (whole names, as extended regular expressions): Slurm's
# configure for the plugins SLURM_PLUGINS names (gcc and make from build-essential, pkg-config from pkgconf, munge,
# PMIx, dbus for cgroup v2, and a Lua: configure asks pkg-config for lua 5.4 down to 5.1); enroot's build (git, patch,
# setcap); nccl-tests' (g++, make, git); AWS's agent. On the head also MariaDB's client library (SLURM_HEAD_PLUGINS)
# and Grafana, which its repository's pin holds.
declare -A STEP_APT=([slurm]='build-essential pkgconf libmunge-dev libpmix-dev libdbus-1-dev liblua5\.[1-4]-dev'
  [enroot]='git patch libcap2-bin' [nccl_tests]='build-essential git' [cloudwatch_agent]=amazon-cloudwatch-agent)
declare -A HEAD_STEP_APT=([slurm]=libmariadb-dev [repositories]=grafana)
# Pinned packages no apt repository serves: AWS's signed .deb (cloudwatch_agent installs it at the BOM's version).
SIGNED_DEBS=(amazon-cloudwatch-agent)

# --- what the bill of materials does not hold: signing keys ----------------------------------------------------------
CWAGENT_KEY_FINGERPRINT=937616F3450B7D806CBD9725D58167303B789C72  # AWS's CloudWatch agent signing key
GRAFANA_KEY_FINGERPRINT=B53AE77BADB630A683046005963FA27710458545  # what Grafana publishes since its 2023 rotation
# NVIDIA images: dcgm-exporter (the BOM's source: its image and linux/amd64 digest), pulled into the image so that a
# boot needs no registry. Its DCGM is its own, embedded; it talks to the parent image's host engine (nvidia-dcgm).
DCGM_EXPORTER_LOCAL=gpucluster/dcgm-exporter:image  # DCGM_EXPORTER_IMAGE in gpucluster/contract/settings.py

# --- where things come from and go ---------------------------------------------------------------------------------
CWAGENT_URL=https://amazoncloudwatch-agent.s3.amazonaws.com
# AWS's signed apt repository for the FSx Lustre client (FSx for Lustre user guide, Ubuntu): apt checks every package
# against this key, which AWS publishes unversioned.
LUSTRE_KEY_URL=https://fsx-lustre-client-repo-public-keys.s3.amazonaws.com/fsx-ubuntu-public-key.asc
LUSTRE_REPO=https://fsx-lustre-client-repo.s3.amazonaws.com/ubuntu
GRAFANA_REPO=https://apt.grafana.com
NEURON_BIN=/opt/aws/neuron/bin  # the Neuron Deep Learning AMI's tools
PYPI=https://pypi.org/simple
MANIFEST=/opt/gpucluster-image/manifest.json  # IMAGE_MANIFEST in gpucluster/contract/settings.py
IMAGE_BOM=/opt/gpucluster-image/bom.json      # IMAGE_BOM in gpucluster/contract/settings.py
VENV=/opt/gpucluster-image/venv
# APT::Snapshot (apt.conf(5)) for the whole build: every apt call resolves Ubuntu's pockets from the dated snapshot.
SNAPSHOT_CONF=/etc/apt/apt.conf.d/50gpucluster-snapshot
# Ubuntu's libpmix-dev (openpmix): headers and libpmix.so here, as Debian's own Slurm is configured against it. Slurm's
# mpi/pmix plugin loads libpmix.so from this directory at run time: `srun --mpi=pmix` needs it on every node.
PMIX_DIR=/usr/lib/x86_64-linux-gnu/pmix2
# Slurm's configure as ParallelCluster runs it (PMIx, then make and make install), with the layout bootstrap.py and the
# rendered files expect: daemons in /usr/sbin, slurm.conf and plugstack.conf in /etc/slurm, plugins in /usr/lib/slurm
# (slurm.conf names no PluginDir), the units Slurm generates in systemd's directory. A named feature whose library is
# missing stops configure (--with-pmix=DIR, --enable-cgroupv2: task/cgroup on Ubuntu's cgroup v2 needs dbus); lua
# (JobSubmitPlugins=lua) it skips silently, so the plugins are checked after the install.
SLURM_CONFIGURE=(--prefix=/usr --sysconfdir=/etc/slurm --localstatedir=/var "--with-pmix=$PMIX_DIR" --with-lua
  --enable-cgroupv2 --with-systemdsystemunitdir=/usr/lib/systemd/system)
SLURM_PLUGIN_DIR=/usr/lib/slurm
SLURM_PLUGINS=(auth_munge.so mpi_pmix.so job_submit_lua.so cgroup_v2.so proctrack_cgroup.so task_cgroup.so)
SLURM_HEAD_PLUGINS=(accounting_storage_mysql.so)  # slurmdbd's store: MariaDB on the head
SLURM_UNITS=(slurmctld.service slurmd.service slurmdbd.service)
# SlurmUser must have the same uid on every node, and the head and compute images are baked from different parents.
SLURM_UID=401
# aws-ofi-nccl, NCCL's EFA plugin, as the Deep Learning AMIs install it: which of the two directories is not settled
# (the EFA installer's layout, or Ubuntu's multiarch one below it), so the loader gets whichever holds the plugin.
OFI_NCCL_DIRS=(/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu /opt/amazon/ofi-nccl/lib)
OFI_NCCL_CONF=/etc/ld.so.conf.d/gpucluster-ofi-nccl.conf
# nccl-tests on NVIDIA images (`gpucluster verify` runs its all_reduce_perf), built as awsome-distributed-training's
# nccl-tests.Dockerfile builds it (make MPI=1 MPI_HOME CUDA_HOME NCCL_HOME) into its own tree's build/: against the EFA
# installer's Open MPI, whose PMIx support `srun --mpi=pmix` launches it with, and the parent image's CUDA and NCCL.
NCCL_TESTS_DIR=/opt/nccl-tests
ALL_REDUCE_PERF=$NCCL_TESTS_DIR/build/all_reduce_perf  # ALL_REDUCE_PERF in gpucluster/contract/settings.py
MPI_HOME=/opt/amazon/openmpi
CUDA_HOME=/usr/local/cuda
# Where NCCL's header and library may be: the Deep Learning AMI's, in CUDA's tree (awsome-distributed-training's
# nccl-tests-ami.sbatch loads NCCL from /usr/local/cuda-<version>/lib), else Ubuntu's libnccl-dev layout.
NCCL_HOMES=("$CUDA_HOME" /usr)

ROLE=${1:-}
BOM=${2:-$IMAGE_BOM}
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

# --- the bill of materials -------------------------------------------------------------------------------------------
# The role's part of bom.json as bash declarations, read with the system python3's json module: every problem with the
# file at once. APT_PINS: name=version; PIP_PINS: name==version (and a --require-hashes requirements file);
# PACKAGES: every pinned package; SOURCE_URL, SOURCE_SHA256, SOURCE_COMMIT, SOURCE_VERSION: the role's sources by name.
read_bom() {  # read_bom STEP...: the steps that will run
  [[ -f $BOM ]] || die "no bill of materials at $BOM (build_image.sh ROLE [BOM])"
  local step installed='' sources='' apt='' all=("${COMPUTE_STEPS[@]}")
  if [[ $ROLE == head ]]; then all=("${HEAD_STEPS[@]}"); fi
  for step in "${all[@]}"; do installed+=" ${STEP_SOURCES[$step]:-}"; done
  for step in "$@"; do
    sources+=" ${STEP_SOURCES[$step]:-}" apt+=" ${STEP_APT[$step]:-}"
    if [[ $ROLE == head ]]; then apt+=" ${HEAD_STEP_APT[$step]:-}"; fi
  done
  python3 - "$BOM" "$ROLE" "$WORK/requirements.txt" "$installed" "$sources" "$apt" >"$WORK/bom.sh" <<'PYTHON' ||
import json, re, shlex, sys

path, role, requirements, installed, needed_sources, needed_apt = sys.argv[1:]
bom = json.load(open(path))
problems = []
def get(where, key, kind, prefix=""):
    value = where.get(key) if isinstance(where, dict) else None
    if not isinstance(value, kind):
        problems.append(f"{prefix}{key}: missing or not a {kind.__name__}")
        return kind()
    return value
snapshot, slurm = get(bom, "ubuntu_snapshot", str), get(bom, "slurm_version", str)
if snapshot and not re.fullmatch(r"\d{8}T\d{6}Z", snapshot):
    problems.append(f"ubuntu_snapshot: {snapshot!r} is not YYYYMMDDTHHMMSSZ")
packages, sources, hashes = get(bom, "packages", dict), get(bom, "sources", dict), bom.get("pip_hashes", {})
mine = get(get(bom, "roles", dict), role, dict, "roles.")
apt, pip, wanted = mine.get("apt", []), mine.get("pip", []), mine.get("sources", [])
problems += [f"roles.{role}: {name} is not in packages" for name in apt + pip if name not in packages]
problems += [f"roles.{role}.sources: no {name}, which build_image.sh installs" for name in needed_sources.split()
             if name not in wanted]
problems += [f"roles.{role}.sources: {name} is not a source build_image.sh installs" for name in wanted
             if name not in installed.split()]
problems += [f"roles.{role}.apt: no package named {pattern}, which build_image.sh needs" for pattern in needed_apt.split()
             if not any(re.fullmatch(pattern, name) for name in apt)]
problems += [f"pip_hashes: no sha256 hash for {name}" for name in pip
             if not hashes.get(name) or not all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes[name])]
for name in wanted:  # pinned by the sha256 of the url's bytes, or a git repository's by its commit
    source = sources.get(name, {})
    if not isinstance(source.get("url"), str) or not isinstance(source.get("version"), str):
        problems.append(f"sources.{name}: no url and version")
    elif "commit" in source and not re.fullmatch(r"[0-9a-f]{40}", str(source["commit"])):
        problems.append(f"sources.{name}: commit {source['commit']!r} is not a 40-hex commit")
    elif "commit" not in source and not re.fullmatch(r"[0-9a-f]{64}", str(source.get("sha256"))):
        problems.append(f"sources.{name}: no url and sha256")
if problems:
    sys.exit("\n".join(problems))
def array(name, values):
    print(f"declare -ga {name}=({' '.join(map(shlex.quote, values))})")
def table(name, pairs):
    print(f"declare -gA {name}=({' '.join(f'[{shlex.quote(k)}]={shlex.quote(str(v))}' for k, v in pairs)})")
print(f"SNAPSHOT={shlex.quote(snapshot)} SLURM_VERSION={shlex.quote(slurm)}")
array("APT_PINS", [f"{name}={packages[name]}" for name in apt])
array("PIP_PINS", [f"{name}=={packages[name]}" for name in pip])
table("PACKAGES", packages.items())
for field in ("url", "sha256", "commit", "version"):
    table(f"SOURCE_{field.upper()}", ((name, sources[name].get(field) or "") for name in wanted))
with open(requirements, "w") as out:
    out.writelines(f"{name}=={packages[name]} {' '.join('--hash=' + h for h in hashes[name])}\n" for name in pip)
PYTHON
    die "bill of materials $BOM (above)"
  # shellcheck source=/dev/null
  source "$WORK/bom.sh"
}

# source_file NAME FILE: the BOM's source NAME, downloaded and checked against its sha256.
source_file() {
  [[ -n ${SOURCE_URL[$1]:-} ]] || die "the bill of materials lists no source $1 for the $ROLE image"
  retry fetch "${SOURCE_URL[$1]}" "$2"
  local sum
  sum=$(sha256sum "$2")
  [[ ${sum%% *} == "${SOURCE_SHA256[$1]}" ]] ||
    die "$1 from ${SOURCE_URL[$1]} has sha256 ${sum%% *}, not ${SOURCE_SHA256[$1]}"
}

# source_tree NAME DIR: a source archive (a GitHub tag archive: one top directory) unpacked into DIR.
source_tree() {
  source_file "$1" "$WORK/$1.tar.gz"
  install -d "$2"
  tar -xzf "$WORK/$1.tar.gz" -C "$2" --strip-components=1
}

# --- the steps, in the order main runs them ------------------------------------------------------------------------

snapshot() {  # Ubuntu's pockets as they were at the BOM's date (apt.conf(5): APT::Snapshot), for every apt call
  install -d "$ROOT${SNAPSHOT_CONF%/*}"
  printf 'APT::Snapshot "%s";\n' "$SNAPSHOT" >"$ROOT$SNAPSHOT_CONF"
}

repositories() {  # third-party repositories: not in Ubuntu's snapshot, so the BOM pins each of their packages
  install -d "$ROOT/etc/apt/preferences.d" "$ROOT/etc/apt/sources.list.d" "$ROOT/usr/share/keyrings"
  retry fetch "$LUSTRE_KEY_URL" "$WORK/fsx-ubuntu-public-key.asc"
  gpg --batch --yes --dearmor -o "$ROOT/usr/share/keyrings/fsx-ubuntu-public-key.gpg" "$WORK/fsx-ubuntu-public-key.asc"
  echo "deb [signed-by=/usr/share/keyrings/fsx-ubuntu-public-key.gpg] $LUSTRE_REPO noble main" \
    >"$ROOT/etc/apt/sources.list.d/fsxlustreclientrepo.list"
  [[ $ROLE == compute ]] || grafana_repository
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
  # A later apt upgrade keeps the BOM's Grafana: the repository carries every newer major.
  printf 'Package: grafana\nPin: version %s\nPin-Priority: 1001\n' "${PACKAGES[grafana]}" \
    >"$ROOT/etc/apt/preferences.d/gpucluster-grafana"
}

apt_packages() {  # the role's apt packages at the BOM's versions, then checked one by one
  # Twice: apt finds a source's snapshot server in its built-in table (Ubuntu's archive and security hosts, the EC2
  # mirrors among them) or in the Snapshots: field of the Release file an earlier update fetched; a source it cannot
  # place stays live, silently (a mirror the parent image might name). The second update takes every source that
  # has a snapshot server from it.
  retry apt_get update --error-on=any
  retry apt_get update --error-on=any
  local pin listed missing=() from_archives=()
  for pin in "${APT_PINS[@]}"; do
    [[ " ${SIGNED_DEBS[*]} " == *" ${pin%%=*} "* ]] || from_archives+=("$pin")
  done
  # Every version apt's indexes list for these packages, as name=version lines (`apt-cache show NAME=VERSION` exits 0
  # for a version it does not know).
  listed=$(apt-cache madison "${from_archives[@]%%=*}" 2>/dev/null |
    awk -F' *[|] *' '{sub(/^ +/, "", $1); print $1 "=" $2}')
  for pin in "${from_archives[@]}"; do
    grep -qxF -- "$pin" <<<"$listed" || missing+=("$pin")
  done
  ((${#missing[@]} == 0)) ||
    die "not in Ubuntu's snapshot $SNAPSHOT nor in a pinned third-party repository: ${missing[*]}"
  apt_install "${from_archives[@]}"
  verify_apt "${from_archives[@]}"
}

verify_apt() {  # verify_apt NAME=VERSION...: each installed at that version, or the build fails naming it
  local pin name want status differ=()
  local -A got=()
  # shellcheck disable=SC2016  # dpkg-query's own ${field} syntax
  while IFS=$'\t' read -r name status; do got[$name]=$status; done < <(
    dpkg-query -W -f '${Package}\t${db:Status-Abbrev}${Version}\n' "${@%%=*}" 2>/dev/null || true)
  for pin in "$@"; do
    name=${pin%%=*} want=${pin#*=}
    status=${got[$name]:-not installed}
    [[ $status == "ii $want" ]] || differ+=("$name ${status#ii } (the BOM: $want)")
  done
  ((${#differ[@]} == 0)) || die "installed packages differ from the bill of materials: ${differ[*]}"
}

lustre() {  # the FSx Lustre client's kernel module, for the kernel this image boots and for no other
  local kernel module
  kernel=$(uname -r)
  module=lustre-client-modules-$kernel
  [[ -n $(apt-cache show "$module" 2>/dev/null) ]] ||
    die "AWS's FSx Lustre repository has no $module: no Lustre client for kernel $kernel (the parent image's)"
  # Not lustre-client-modules-aws, the meta package the FSx guide adds so that kernel upgrades bring their module: it
  # follows the linux-aws flavour, which on a parent with a newer (HWE) kernel would pull in a second kernel. The
  # kernel stays the parent image's instead (held below): a new kernel comes with a new parent image, a new bake.
  apt_install "$module${PACKAGES[$module]:+=${PACKAGES[$module]}}"
  hold_kernel
}

hold_kernel() {  # unattended-upgrades must never install a kernel this image has no Lustre module for
  local metas
  # Ubuntu's kernel meta packages (linux-aws, linux-image-aws, an HWE flavour's...) all come from linux-meta* sources;
  # held, no newer kernel package is ever pulled in. The kernel's own package, named by its version, never moves.
  # shellcheck disable=SC2016  # dpkg-query's own ${field} syntax
  metas=$(dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${source:Package}\n' 'linux-*' 2>/dev/null |
    awk '$1 == "ii" && $3 ~ /^linux-meta/ {print $2}') || true
  if [[ -z $metas ]]; then
    log "no kernel meta package installed: nothing to hold"
    return
  fi
  # shellcheck disable=SC2086  # one package name a line
  apt-mark hold $metas
}

slurm() {  # SchedMD's release, built here with PMIx and lua: the same Slurm on the head and on compute nodes
  local src=$WORK/slurm version plugin unit plugins=("${SLURM_PLUGINS[@]}")
  if [[ $ROLE == head ]]; then plugins+=("${SLURM_HEAD_PLUGINS[@]}"); fi
  [[ -e $ROOT$PMIX_DIR/lib/libpmix.so ]] || die "no $PMIX_DIR/lib/libpmix.so: the BOM's apt list lacks libpmix-dev"
  source_tree slurm "$src"
  (cd "$src" && ./configure "${SLURM_CONFIGURE[@]}")
  make -C "$src" -j "$(nproc)"
  make -C "$src" install DESTDIR="$ROOT"
  ldconfig
  version=$("$ROOT/usr/sbin/slurmd" -V)
  [[ $version == "slurm $SLURM_VERSION" ]] || die "the built Slurm says '$version', the BOM slurm $SLURM_VERSION"
  for plugin in "${plugins[@]}"; do
    [[ -f $ROOT$SLURM_PLUGIN_DIR/$plugin ]] || die "Slurm was built without $plugin (a build dependency missing)"
  done
  for unit in "${SLURM_UNITS[@]}"; do
    [[ -f $ROOT/usr/lib/systemd/system/$unit ]] || die "Slurm installed no $unit"
  done
  slurm_user
}

slurm_user() {
  if ! getent passwd slurm >/dev/null; then
    groupadd --system --gid "$SLURM_UID" slurm
    useradd --system --uid "$SLURM_UID" --gid slurm --home-dir /var/lib/slurm --no-create-home \
      --shell /usr/sbin/nologin slurm
  fi
  [[ $(id -u slurm) == "$SLURM_UID" ]] || die "the parent image's slurm user has uid $(id -u slurm), not $SLURM_UID"
}

pyxis() {  # `srun --container-image`: on compute nodes, and on the head for srun from a login shell
  source_tree pyxis "$WORK/pyxis"
  # Against /usr/include/slurm of the Slurm just installed; installs /usr/local/lib/slurm/spank_pyxis.so
  # (plugstack.conf).
  make -C "$WORK/pyxis" install DESTDIR="$ROOT"
  [[ -f $ROOT/usr/local/lib/slurm/spank_pyxis.so ]] || die "pyxis installed no spank_pyxis.so"
}

# clone_tag NAME DIR [GIT-OPTION...]: the BOM's source NAME at its release tag: a shallow fetch of a commit no branch
# points at needs a server that hands out commits by id.
clone_tag() {
  rm -rf "$2" && git clone -q --depth 1 --branch "v${SOURCE_VERSION[$1]}" "${@:3}" "${SOURCE_URL[$1]}" "$2"
}
# clone_source NAME DIR [GIT-OPTION...]: clone_tag, then the clone's HEAD checked against the BOM's commit before
# anything of it is built.
clone_source() {
  local commit
  retry clone_tag "$@"
  commit=$(git -C "$2" rev-parse HEAD)
  [[ $commit == "${SOURCE_COMMIT[$1]}" ]] || die "$1's tag v${SOURCE_VERSION[$1]} at ${SOURCE_URL[$1]} is commit \
$commit, not the BOM's ${SOURCE_COMMIT[$1]}"
}
# The layout of enroot's .deb (/usr/bin, /usr/lib/enroot, /etc/enroot: the boot adds to /etc/enroot/enroot.conf.d) and
# its standard flavour, which NVIDIA builds with these flags (pkg/debbuild), in the environment: on make's command
# line they would replace the Makefile's own CPPFLAGS.
enroot_make() { CPPFLAGS="-DALLOW_SPECULATION -DINHERIT_FDS" make -C "$WORK/enroot" prefix=/usr sysconfdir=/etc "$@"; }

enroot() {  # NVIDIA's enroot from its source at the BOM's commit (no digest of a release archive could be pinned)
  # With its submodules (makeself, musl, linux-headers) at the commits the tag's tree pins.
  clone_source enroot "$WORK/enroot" --recurse-submodules
  enroot_make all  # before the install: one that builds writes its DESTDIR into bin/enroot and enroot.conf
  enroot_make install DESTDIR="$ROOT"
  [[ -x $ROOT/usr/bin/enroot && -f $ROOT/etc/enroot/enroot.conf ]] || die "enroot is not in /usr/bin and /etc/enroot"
  enroot_make setcap DESTDIR="$ROOT"  # as the enroot+caps package: unprivileged users import images
  # Ubuntu 24.04 lets a program create user namespaces only under an AppArmor profile that allows it.
  local profile=$ROOT/etc/apparmor.d/enroot shipped=$ROOT/usr/share/enroot/apparmor.profile
  if [[ ! -f $profile && -f $shipped ]]; then install -D -m 644 "$shipped" "$profile"; fi
  [[ -f $profile ]] || die "enroot brought no AppArmor profile ($profile or $shipped)"
  if aa-enabled --quiet 2>/dev/null; then apparmor_parser -r -T -W "$profile"; fi
}

gpu() {  # NVIDIA images: the DCGM host engine, NCCL's EFA plugin on the loader's path, dcgm-exporter's image
  [[ $DCGM != none* ]] || return 0
  # The health check's dcgmi and dcgm-exporter use the parent image's host engine: on at every boot.
  if systemctl cat nvidia-dcgm.service >/dev/null 2>&1; then
    systemctl enable --now nvidia-dcgm.service
    DCGM_ENGINE=enabled
  else
    log "no nvidia-dcgm.service in the parent image: dcgmi starts an embedded host engine"
  fi
  local dir
  for dir in "${OFI_NCCL_DIRS[@]}"; do
    if compgen -G "$ROOT$dir/libnccl-net*.so" >/dev/null; then NCCL_PLUGIN_DIR=$dir; break; fi
  done
  [[ -n ${NCCL_PLUGIN_DIR:-} ]] || die "no libnccl-net*.so in ${OFI_NCCL_DIRS[*]}: the parent image lacks aws-ofi-nccl"
  install -d "$ROOT${OFI_NCCL_CONF%/*}"
  echo "$NCCL_PLUGIN_DIR" >"$ROOT$OFI_NCCL_CONF"
  ldconfig
  DCGM_EXPORTER=${SOURCE_URL[dcgm-exporter]}@sha256:${SOURCE_SHA256[dcgm-exporter]}
  retry docker pull -q "$DCGM_EXPORTER"
  docker tag "$DCGM_EXPORTER" "$DCGM_EXPORTER_LOCAL"  # the name the boot's unit runs
}

nccl_tests() {  # NVIDIA images: nccl-tests at the BOM's commit, its all_reduce_perf for `gpucluster verify`
  [[ $DCGM != none* ]] || return 0
  local dir nccl_home='' missing
  [[ -x $ROOT$CUDA_HOME/bin/nvcc ]] || die "no $CUDA_HOME/bin/nvcc: the parent image lacks CUDA's compiler"
  [[ -f $ROOT$MPI_HOME/include/mpi.h ]] || die "no $MPI_HOME/include/mpi.h: the parent image lacks the EFA \
installer's Open MPI"
  for dir in "${NCCL_HOMES[@]}"; do
    if [[ -f $ROOT$dir/include/nccl.h ]]; then nccl_home=$dir; break; fi
  done
  [[ -n $nccl_home ]] || die "no include/nccl.h in ${NCCL_HOMES[*]}: the parent image lacks NCCL's headers"
  clone_source nccl-tests "$ROOT$NCCL_TESTS_DIR"
  # LD_RUN_PATH (ld(1): the run path of an executable linked without -rpath, as nccl-tests links its tests): the
  # binary finds the Open MPI and NCCL it was built against without a job's LD_LIBRARY_PATH. Ubuntu's linker writes
  # it as DT_RUNPATH (--enable-new-dtags), which ld.so searches after LD_LIBRARY_PATH: a job that sets one wins.
  LD_RUN_PATH="$MPI_HOME/lib:$nccl_home/lib:$CUDA_HOME/lib64" make -C "$ROOT$NCCL_TESTS_DIR" -j "$(nproc)" MPI=1 \
    MPI_HOME="$ROOT$MPI_HOME" CUDA_HOME="$ROOT$CUDA_HOME" NCCL_HOME="$ROOT$nccl_home"
  [[ -x $ROOT$ALL_REDUCE_PERF ]] || die "nccl-tests built no $ALL_REDUCE_PERF"
  missing=$(ldd "$ROOT$ALL_REDUCE_PERF" | awk '/not found/ {print $1}' | paste -sd ' ')
  [[ -z $missing ]] || die "$ALL_REDUCE_PERF cannot load $missing"
  NCCL_TESTS="${SOURCE_VERSION[nccl-tests]} ${SOURCE_COMMIT[nccl-tests]}"
}

cloudwatch_agent() {  # the idle-GPU alarms read its metrics: AWS's signed .deb at the BOM's version
  local version=${PACKAGES[amazon-cloudwatch-agent]} deb=$WORK/amazon-cloudwatch-agent.deb home=$WORK/gnupg fingerprint
  # The Deep Learning AMIs usually carry an agent: kept when it is the BOM's, replaced (up or down) when it is not.
  # shellcheck disable=SC2016  # dpkg-query's own ${field} syntax
  if [[ $(dpkg-query -W -f '${Version}' amazon-cloudwatch-agent 2>/dev/null) == "$version" ]]; then
    log "CloudWatch agent $version already in the image"
    CWAGENT="$version from the parent image"
    return
  fi
  retry fetch "$CWAGENT_URL/assets/amazon-cloudwatch-agent.gpg" "$WORK/cwagent.gpg"
  retry fetch "$CWAGENT_URL/ubuntu/amd64/$version/amazon-cloudwatch-agent.deb" "$deb"
  retry fetch "$CWAGENT_URL/ubuntu/amd64/$version/amazon-cloudwatch-agent.deb.sig" "$deb.sig"
  install -d -m 700 "$home"
  gpg --batch --homedir "$home" --import "$WORK/cwagent.gpg"
  fingerprint=$(gpg --batch --homedir "$home" --with-colons --fingerprint | awk -F: '$1 == "fpr" {print $10; exit}')
  [[ $fingerprint == "$CWAGENT_KEY_FINGERPRINT" ]] || die "CloudWatch agent key is $fingerprint, not the pinned one"
  gpg --batch --homedir "$home" --verify "$deb.sig" "$deb" || die "CloudWatch agent package signature does not verify"
  apt_install --allow-downgrades "$deb"
  CWAGENT=$version
}

python_venv() {  # the one venv of the image: exactly the BOM's distributions, each checked against its hashes
  ((${#PIP_PINS[@]})) || return 0
  local wheel=$WORK/${SOURCE_URL[pip]##*/}
  # Without pip: Ubuntu's ensurepip is python3-venv, which depends on exactly one python3 and so breaks on a parent
  # with a newer one. pip comes from the BOM's wheel, run from the wheel itself to install itself (pip's bootstrap).
  source_file pip "$wheel"
  python3 -m venv --system-site-packages --without-pip "$ROOT$VENV"
  "$ROOT$VENV/bin/python" "$wheel/pip" install -q --no-index --no-cache-dir "$wheel"
  # --no-deps: the BOM lists every distribution; --require-hashes: each must hash to what it pins.
  retry "$ROOT$VENV/bin/pip" install -q --no-cache-dir --require-hashes --no-deps --only-binary=:all: \
    --index-url "$PYPI" -r "$WORK/requirements.txt"
  printf '%s\n' "${PIP_PINS[@]}" >"$WORK/pip-pins.txt"
  "$ROOT$VENV/bin/python" - "$WORK/pip-pins.txt" <<'PYTHON' || die "the venv differs from the bill of materials"
import importlib.metadata, re, sys, sysconfig

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

want = {norm(n): v for n, v in (line.split("==", 1) for line in open(sys.argv[1]).read().split())}
paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})  # the venv's, not the system's
have = {norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=paths)}
have.pop("pip", None)  # the BOM's wheel, by its sha256
wrong = [f"{n} {have.get(n, 'not installed')} (the BOM: {want[n]})" for n in sorted(want) if have.get(n) != want[n]]
wrong += [f"{n} {have[n]} (not in the BOM)" for n in sorted(set(have) - set(want))]
sys.exit("; ".join(wrong) or None)
PYTHON
  if [[ $ROLE == compute ]]; then ln -sf "$VENV/bin/torchrun" "$ROOT/usr/local/bin/torchrun"; fi
}

services() {  # the boot configures and starts them (bootstrap.py); the image leaves them off
  if [[ $ROLE == head ]]; then
    systemctl disable --now munge slurmctld slurmdbd mariadb prometheus prometheus-alertmanager \
      prometheus-node-exporter grafana-server
  else
    systemctl disable --now munge slurmd prometheus-node-exporter
  fi
  rm -f "$ROOT/etc/munge/munge.key"  # the package's own key: each cluster's comes from SSM at boot
}

manifest() {  # the last step: its presence means the image is complete; the BOM it was built from beside it
  # Again, the whole list: no later step's packages (the Lustre module, the agent) may have moved one of the BOM's.
  verify_apt "${APT_PINS[@]}"
  [[ $BOM -ef $ROOT$IMAGE_BOM ]] || install -m 644 "$BOM" "$ROOT$IMAGE_BOM"
  local bom_sum lustre_module
  bom_sum=$(sha256sum "$BOM")
  # shellcheck disable=SC2016  # dpkg-query's own ${field} syntax
  lustre_module=$(dpkg-query -W -f '${Version}' "lustre-client-modules-$(uname -r)")
  python3 - "$ROOT$MANIFEST.tmp" role="$ROLE" built_at="$(date -u +%FT%TZ)" kernel="$(uname -r)" \
    bom_sha256="${bom_sum%% *}" slurm="$SLURM_VERSION" pyxis="${SOURCE_VERSION[pyxis]:-}" \
    lustre_client_modules="$lustre_module" cloudwatch_agent="$CWAGENT" dcgm="$DCGM" dcgm_engine="$DCGM_ENGINE" \
    dcgm_exporter="$DCGM_EXPORTER" nccl_net_plugin="$NCCL_PLUGIN_DIR" nccl_tests="$NCCL_TESTS" \
    neuron_monitor="$NEURON" \
    enroot="${SOURCE_VERSION[enroot]:-none}${SOURCE_COMMIT[enroot]:+ ${SOURCE_COMMIT[enroot]}}" <<'PYTHON'
import json, sys

fields = dict(arg.split("=", 1) for arg in sys.argv[2:])
top = {key: fields.pop(key) for key in ("role", "built_at", "kernel", "bom_sha256")}
with open(sys.argv[1], "w") as out:
    json.dump({**top, "versions": fields}, out)
    out.write("\n")
PYTHON
  mv "$ROOT$MANIFEST.tmp" "$ROOT$MANIFEST"
}

# --- what the parent image must carry: checked before anything is installed ------------------------------------------

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

HEAD_STEPS=(snapshot repositories apt_packages lustre slurm pyxis python_venv services manifest)
COMPUTE_STEPS=(snapshot repositories apt_packages lustre slurm pyxis enroot gpu nccl_tests cloudwatch_agent python_venv
  services manifest)

main() {
  [[ $ROLE == head || $ROLE == compute ]] || { echo "usage: build_image.sh head|compute [BOM]" >&2; exit 2; }
  local steps step
  if [[ $ROLE == head ]]; then steps=("${HEAD_STEPS[@]}"); else steps=("${COMPUTE_STEPS[@]}"); fi
  # For tests only, a seam this machine forces: the bake rehearsal (tests/integration/test_bake_rehearsal.py) runs
  # the package steps for real, as root in a Debian chroot against a stand-in archive; the others need GitHub,
  # AWS's repositories, NVIDIA's registry or a Deep Learning AMI. A subset of the steps never writes the manifest.
  if [[ -n ${GPUCLUSTER_BUILD_STEPS:-} ]]; then
    read -r -a steps <<<"$GPUCLUSTER_BUILD_STEPS"
    for step in "${steps[@]}"; do
      [[ " ${HEAD_STEPS[*]} ${COMPUTE_STEPS[*]} " == *" $step "* && $step != manifest ]] ||
        die "GPUCLUSTER_BUILD_STEPS: $step is not a step of this script that a subset may run"
    done
  fi
  DCGM=$(if [[ $ROLE == compute ]]; then dcgm; else echo none; fi)
  NEURON=$(if [[ $ROLE == compute ]]; then neuron; else echo none; fi)
  DCGM_ENGINE=none DCGM_EXPORTER=none NCCL_PLUGIN_DIR='' NCCL_TESTS=none CWAGENT=none
  WORK=$(mktemp -d)
  # The snapshot is the build's: the image's own apt (unattended-upgrades' security fixes) reads the live archive.
  trap 'rm -rf "$WORK" "$ROOT$SNAPSHOT_CONF"' EXIT
  install -d "$ROOT${MANIFEST%/*}" "$ROOT/usr/local/bin"
  rm -f "$ROOT$MANIFEST"  # a manifest from an earlier run must not vouch for this one
  read_bom "${steps[@]}"
  log "building the $ROLE image: ${steps[*]}"
  for step in "${steps[@]}"; do
    log "step $step"
    "$step"
  done
  log "done${GPUCLUSTER_BUILD_STEPS:+ (steps $GPUCLUSTER_BUILD_STEPS only, no manifest)}"
}

main
