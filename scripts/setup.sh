#!/usr/bin/env bash
# Installs what nodepulse needs on a fresh Debian machine, idempotently: apt packages,
# a Python venv with the project and its test tools, and the pinned control-plane
# binaries (built once with Go, cached in ~/.cache/nodepulse).
set -euo pipefail
cd "$(dirname "$0")/.."

# docker.io and debootstrap: the kind tests (e2e/kind) start a private dockerd and make
# their base images from Debian's packages; dbus-daemon: the e2e test of graceful node
# shutdown runs a private bus with a stand-in logind on it; libfuse3-3: the soak's slow
# disk (FUSE)
APT_PACKAGES=(containerd runc containernetworking-plugins busybox-static iptables iproute2
              gcc libc6-dev make curl docker.io debootstrap dbus-daemon libfuse3-3)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

command -v go >/dev/null || { echo "setup: the Go toolchain (go >= 1.25) is needed to build the control plane" >&2; exit 1; }

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.nodepulse-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing nodepulse with its test and benchmark tools into .venv"
  .venv/bin/pip install -q -e '.[test,bench]'
  echo "$want" > "$stamp"
fi

.venv/bin/nodepulse-dev build >/dev/null
