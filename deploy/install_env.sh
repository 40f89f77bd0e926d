#!/usr/bin/env bash
# Idempotent: Docker (20.10, dockerd --experimental), CRIU 4.1.1 (built from Debian's orig
# tarball) and the sandbox base image `belayer-sandbox:1`.
# Every expensive product is cached under $BELAYER_CACHE (default /var/cache/belayer):
# a second run on a prepared machine takes a few seconds.
set -euo pipefail

CACHE="${BELAYER_CACHE:-/var/cache/belayer}"
IMAGE="${BELAYER_SANDBOX_IMAGE:-belayer-sandbox:1}"
CRIU_VERSION=4.1.1
CRIU_SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
DOCKERD_LOG="${BELAYER_DOCKERD_LOG:-/var/log/belayer-dockerd.log}"
# Plain system PATH: pyenv shims break asciidoc/the CRIU build, and /usr/local/bin/docker is a
# newer client than Debian's daemon; we call /usr/bin/docker explicitly below.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export DEBIAN_FRONTEND=noninteractive
DOCKER=/usr/bin/docker

say() { echo "install_env: $*"; }
die() { echo "install_env: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (installs packages, starts dockerd, builds CRIU)"
mkdir -p "$CACHE"

mirror() {
  # The Debian mirror already configured for apt (never a hard-coded host).
  local uri
  uri=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' \
    | grep -v security | head -n1 || true)
  if [ -z "$uri" ]; then
    uri=$(grep -h '^deb ' /etc/apt/sources.list 2>/dev/null | grep -v security | awk '{print $2}' | head -n1 || true)
  fi
  [ -n "$uri" ] || die "no Debian mirror found in the apt sources"
  echo "${uri%/}"
}

APT_UPDATED=0
apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ $APT_UPDATED = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  say "apt-get install ${missing[*]}"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# --- 1. Docker ------------------------------------------------------------------------------
apt_install docker.io iptables iproute2 ca-certificates xz-utils curl
# A real Prometheus for the metrics test (belayer up --metrics-port); the package's service
# is not started (no systemd here): tests run their own server.
apt_install prometheus
# tmux drives `belayer top` in a real terminal in its test.
apt_install tmux
# Node.js + npm: the reward-service test runs a service written in Node.js (nats.js).
command -v node >/dev/null && command -v npm >/dev/null || apt_install nodejs npm

# --- 2. CRIU 4.1.1 (before dockerd starts, so dockerd's PATH sees it) -------------------------
criu_ok() { command -v criu >/dev/null && criu --version 2>/dev/null | grep -q "Version: 4\.1"; }
if ! criu_ok; then
  DEB=$(ls "$CACHE"/criu/criu_${CRIU_VERSION}-*_amd64.deb 2>/dev/null | head -n1 || true)
  if [ -z "$DEB" ]; then
    say "building CRIU $CRIU_VERSION (about 3 minutes)"
    apt_install build-essential dpkg-dev debhelper libbsd-dev libcap-dev libgnutls28-dev \
      libnet1-dev libnftables-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev pkgconf \
      protobuf-c-compiler protobuf-compiler uuid-dev python3
    mkdir -p "$CACHE/criu"
    TARBALL="$CACHE/criu/criu_${CRIU_VERSION}.orig.tar.xz"
    if [ ! -f "$TARBALL" ] || ! echo "$CRIU_SHA256  $TARBALL" | sha256sum -c --quiet - 2>/dev/null; then
      curl -fsSL -o "$TARBALL.part" "$(mirror)/pool/main/c/criu/criu_${CRIU_VERSION}.orig.tar.xz"
      mv "$TARBALL.part" "$TARBALL"
    fi
    echo "$CRIU_SHA256  $TARBALL" | sha256sum -c --quiet - || die "CRIU tarball sha256 mismatch"
    BUILD=$(mktemp -d /tmp/belayer-criu.XXXXXX)
    tar -C "$BUILD" -xJf "$TARBALL"
    SRC=$(find "$BUILD" -mindepth 1 -maxdepth 1 -type d | head -n1)
    mkdir -p "$SRC/debian/source"
    echo "3.0 (quilt)" > "$SRC/debian/source/format"
    cat > "$SRC/debian/control" <<'EOF'
Source: criu
Section: admin
Priority: optional
Maintainer: Belayer <belayer@localhost>
Build-Depends: debhelper-compat (= 13)
Standards-Version: 4.6.2

Package: criu
Architecture: amd64
Depends: ${shlibs:Depends}, ${misc:Depends}, iproute2, iptables
Description: checkpoint/restore in userspace (Belayer's build of 4.1.1 for bookworm)
 Only the criu binary; no crit/pycriu, no man pages.
EOF
    cat > "$SRC/debian/changelog" <<EOF
criu (${CRIU_VERSION}-0belayer1) bookworm; urgency=medium

  * Local build for Belayer (bookworm's 3.17 fails on this kernel's vDSO).

 -- Belayer <belayer@localhost>  Mon, 01 Jan 2024 00:00:00 +0000
EOF
    # CRIU's parasite code is built with its own flags: drop dpkg's hardening flags.
    cat > "$SRC/debian/rules" <<'EOF'
#!/usr/bin/make -f
export DEB_BUILD_MAINT_OPTIONS = hardening=-all
%:
	dh $@
override_dh_auto_build:
	env -u CFLAGS -u CPPFLAGS -u LDFLAGS -u CXXFLAGS $(MAKE) -j$(shell nproc) criu
override_dh_auto_install:
	install -D -m 0755 criu/criu debian/criu/usr/sbin/criu
override_dh_auto_test:
override_dh_auto_clean:
override_dh_dwz:
EOF
    chmod +x "$SRC/debian/rules"
    (cd "$SRC" && dpkg-buildpackage -b -uc -us -d >"$BUILD/build.log" 2>&1) \
      || { tail -n 40 "$BUILD/build.log" >&2; die "CRIU build failed (log: $BUILD/build.log)"; }
    cp "$BUILD"/criu_${CRIU_VERSION}-*_amd64.deb "$CACHE/criu/"
    rm -rf "$BUILD"
    DEB=$(ls "$CACHE"/criu/criu_${CRIU_VERSION}-*_amd64.deb | head -n1)
  fi
  say "installing $DEB"
  if [ $APT_UPDATED = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  apt-get install -y -qq --no-install-recommends "$DEB" >/dev/null
  criu_ok || die "criu $CRIU_VERSION not installed correctly"
fi
criu check >/dev/null 2>&1 || { criu check >&2 || true; die "'criu check' failed"; }
say "criu $(criu --version | awk '/Version/{print $2}') ok"

# --- 3. dockerd --experimental -----------------------------------------------------------------
if ! $DOCKER info >/dev/null 2>&1; then
  if ! pgrep -x dockerd >/dev/null; then
    say "starting dockerd --experimental (log: $DOCKERD_LOG)"
    mkdir -p "$(dirname "$DOCKERD_LOG")"
    nohup setsid env PATH="$PATH" dockerd --experimental >>"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  for _ in $(seq 1 150); do
    $DOCKER info >/dev/null 2>&1 && break
    sleep 0.2
  done
  $DOCKER info >/dev/null 2>&1 || { tail -n 20 "$DOCKERD_LOG" >&2 || true; die "dockerd did not come up"; }
fi
[ "$($DOCKER info --format '{{.ExperimentalBuild}}')" = true ] \
  || die "dockerd runs without --experimental (checkpoints need it): stop it and rerun"
DPID=$(pgrep -xo dockerd || true)
dockerd_sees_criu() {
  local path d
  path=$(tr '\0' '\n' </proc/"$1"/environ | sed -n 's/^PATH=//p')
  [ -n "$path" ] || path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  for d in ${path//:/ }; do [ -x "$d/criu" ] && return 0; done
  return 1
}
if [ -n "$DPID" ] && ! dockerd_sees_criu "$DPID"; then
  die "dockerd (pid $DPID) does not have criu on its PATH: restart it with PATH containing /usr/sbin"
fi
say "dockerd $($DOCKER version --format '{{.Server.Version}}') ok"

# --- 3b. the `belayer` OCI runtime (fast full_restore, docs/environment.md) --------------------
# runc, except that `create` of a container with a restore marker is `runc restore`: restores
# skip Docker's checkpoint import. Registered in /etc/docker/daemon.json ("runtimes" is
# reloaded on SIGHUP: running containers are not touched).
RUNTIME_SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/services/environment/belayer-runc"
RUNTIME_BIN=/usr/local/bin/belayer-runc
cmp -s "$RUNTIME_SRC" "$RUNTIME_BIN" || install -m 0755 "$RUNTIME_SRC" "$RUNTIME_BIN"
mkdir -p /run/belayer-restore
if /usr/bin/python3 - "$RUNTIME_BIN" <<'EOF'
import json, os, sys
path, binary = "/etc/docker/daemon.json", sys.argv[1]
config = json.load(open(path)) if os.path.exists(path) else {}
if config.get("runtimes", {}).get("belayer", {}).get("path") == binary:
    sys.exit(1)  # already registered
config.setdefault("runtimes", {})["belayer"] = {"path": binary}
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path + ".tmp", "w") as f:
    json.dump(config, f, indent=2)
os.replace(path + ".tmp", path)
EOF
then
  say "registered the belayer runtime in /etc/docker/daemon.json; reloading dockerd"
  kill -HUP "$(pgrep -xo dockerd)"
fi
for _ in $(seq 1 50); do
  $DOCKER info --format '{{json .Runtimes}}' | grep -q '"belayer"' && break
  sleep 0.2
done
$DOCKER info --format '{{json .Runtimes}}' | grep -q '"belayer"' \
  || die "dockerd did not register the belayer runtime (see /etc/docker/daemon.json)"
say "belayer runtime ok ($RUNTIME_BIN)"

# --- 4. sandbox base image ---------------------------------------------------------------------
if ! $DOCKER image inspect "$IMAGE" >/dev/null 2>&1; then
  ROOTFS_TAR="$CACHE/sandbox-rootfs-bookworm-python3-procps.tar"
  if [ ! -f "$ROOTFS_TAR" ]; then
    say "building the sandbox root file system with debootstrap (about 1-2 minutes)"
    apt_install debootstrap
    ROOT=$(mktemp -d /tmp/belayer-rootfs.XXXXXX)
    debootstrap --variant=minbase --include=python3,procps bookworm "$ROOT" "$(mirror)" \
      >"$CACHE/debootstrap.log" 2>&1 || { tail -n 20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed"; }
    rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* \
      "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/locale/*
    tar -C "$ROOT" --numeric-owner -cf "$ROOTFS_TAR.part" .
    mv "$ROOTFS_TAR.part" "$ROOTFS_TAR"
    rm -rf "$ROOT"
  fi
  say "importing $IMAGE"
  $DOCKER import -c 'CMD ["/bin/sh"]' -c 'WORKDIR /root' -c 'LABEL belayer.image=sandbox' \
    "$ROOTFS_TAR" "$IMAGE" >/dev/null
fi
$DOCKER run --rm --network none "$IMAGE" python3 -c 'print("ok")' | grep -q ok \
  || die "sandbox image $IMAGE does not run python3"
say "sandbox image $IMAGE ok"

# --- 5. SWE workload image: the base image + pytest (workloads/swe.py) -------------------------
# Pure-python wheels are downloaded here on the host (cached) and unpacked into the image's
# site-packages by a `docker build --network none`: no registry, no network inside the build.
# Rebuilt only when the base image or the pinned wheels change (label belayer.swe.key).
SWE_IMAGE="${BELAYER_SWE_IMAGE:-belayer-swe:1}"
SWE_WHEELS="pytest==8.3.5 pluggy==1.5.0 iniconfig==2.0.0 packaging==24.2"
SWE_KEY="$($DOCKER image inspect -f '{{.Id}}' "$IMAGE") $SWE_WHEELS"
if [ "$($DOCKER image inspect -f '{{index .Config.Labels "belayer.swe.key"}}' "$SWE_IMAGE" 2>/dev/null || true)" != "$SWE_KEY" ]; then
  WHEEL_DIR="$CACHE/swe-wheels/$(echo "$SWE_WHEELS" | sha256sum | cut -c1-12)"
  if [ ! -f "$WHEEL_DIR/.complete" ]; then
    say "downloading pytest wheels for $SWE_IMAGE"
    PIP_PY="$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/python"
    [ -x "$PIP_PY" ] || PIP_PY=python3
    mkdir -p "$WHEEL_DIR"
    # shellcheck disable=SC2086  # the pins are separate words on purpose
    "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --dest "$WHEEL_DIR" $SWE_WHEELS \
      || die "pip download of $SWE_WHEELS failed"
    touch "$WHEEL_DIR/.complete"
  fi
  CTX=$(mktemp -d /tmp/belayer-swe-image.XXXXXX)
  mkdir "$CTX/wheels"
  cp "$WHEEL_DIR"/*.whl "$CTX/wheels/"
  cat > "$CTX/Dockerfile" <<EOF
FROM $IMAGE
COPY wheels/ /tmp/belayer-wheels/
RUN python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('/usr/local/lib/python3.11/dist-packages') for w in sorted(glob.glob('/tmp/belayer-wheels/*.whl'))]" \\
 && rm -rf /tmp/belayer-wheels \\
 && python3 -m compileall -q /usr/local/lib/python3.11/dist-packages \\
 && printf '#!/bin/sh\\nexec python3 -m pytest "\$@"\\n' > /usr/local/bin/pytest && chmod 755 /usr/local/bin/pytest
LABEL belayer.image=swe belayer.swe.key="$SWE_KEY"
EOF
  say "building $SWE_IMAGE"
  DOCKER_BUILDKIT=0 $DOCKER build --network none -q -t "$SWE_IMAGE" "$CTX" >/dev/null \
    || { rm -rf "$CTX"; die "docker build of $SWE_IMAGE failed"; }
  rm -rf "$CTX"
fi
$DOCKER run --rm --network none "$SWE_IMAGE" python3 -m pytest --version 2>&1 | grep -q "pytest 8" \
  || die "swe image $SWE_IMAGE does not run pytest"
say "swe image $SWE_IMAGE ok"
