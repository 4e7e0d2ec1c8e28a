#!/usr/bin/env bash
# Build the ARL-Tangram container images without pulling any image.
#
#   images/build.sh [TARGET...]        # default: operator scheduler node-agent
#
# 1. Two base images are made from Debian root file systems instead of being pulled:
#      arl-tangram/base:bookworm      debootstrap --variant=minbase bookworm
#                                     + python3 python3-venv ca-certificates,
#                                     the user nonroot (65532), security updates
#      arl-tangram/builder:bookworm   the same + gcc libc6-dev (build stages only)
#    Each root file system is cached as a tarball under $CACHE_DIR, so a second run only
#    re-imports (or finds) the images; REFRESH=1 rebuilds the tarballs (new updates).
# 2. `docker build --network host --target T` of the repository's Dockerfile for each
#    target, tagged $PREFIX/T:$VERSION; pip installs the dependencies from PyPI during
#    the build (hence the host network: dockerd may run with --bridge=none).
#
# Needs root and debootstrap the first time (and Debian's mirror), a Docker Engine
# always. Environment:
#   PREFIX=arl-tangram        image name prefix (e.g. registry.example.com/arl-tangram)
#   VERSION=<pyproject>       image tag (the project's version, which the chart's
#                             appVersion follows)
#   CACHE_DIR=/var/cache/tangram/images
#   MIRROR=http://deb.debian.org/debian   SECURITY_MIRROR=http://deb.debian.org/debian-security
#   REFRESH=1                 rebuild the cached root file systems
#   EXTRA_CA=FILE             a PEM bundle pip must trust during the build (a TLS-
#                             intercepting proxy); default: the certificates in
#                             /usr/local/share/ca-certificates, if any. Only the build
#                             stage sees it; the images do not carry it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

SUITE=bookworm
PREFIX=${PREFIX:-arl-tangram}
VERSION=${VERSION:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)}
CACHE_DIR=${CACHE_DIR:-/var/cache/tangram/images}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
BASE_PACKAGES=python3,python3-venv,ca-certificates
BUILDER_PACKAGES="gcc libc6-dev"
# Names the cached tarballs: change it whenever the recipe below changes.
RECIPE=1
BASE_IMAGE=$PREFIX/base:$SUITE
BUILDER_IMAGE=$PREFIX/builder:$SUITE
NONROOT=65532
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(operator scheduler node-agent)

say() { printf '[images] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

for t in "${TARGETS[@]}"; do
  case $t in operator | scheduler | node-agent) ;; *) die "unknown target $t (operator, scheduler, node-agent)" ;; esac
done
[ -n "$VERSION" ] || die "cannot read the version from pyproject.toml; set VERSION"
docker info >/dev/null 2>&1 || die "no Docker Engine (as root: dockerd --bridge=none --iptables=false &)"

base_tar=$CACHE_DIR/base-$SUITE-minbase-$RECIPE.tar
builder_tar=$CACHE_DIR/builder-$SUITE-minbase-$RECIPE.tar

# --- root file systems ----------------------------------------------------------------------

remove_tree() { # rm -rf that never follows a mount into the host: unmount below first
  local m
  for m in $(awk -v w="$1" 'index($5, w) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  rm -rf --one-file-system "$1"
}
work=
ca_tmp=
cleanup() {
  if [ -n "$work" ] && [ -d "$work" ]; then remove_tree "$work"; fi
  if [ -n "$ca_tmp" ]; then rm -f "$ca_tmp"; fi
}
trap cleanup EXIT

in_root() { chroot "$work/rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 "$@"; }

clean_rootfs() {
  local r=$work/rootfs
  in_root apt-get clean
  rm -rf "$r"/var/lib/apt/lists/*_* "$r"/var/cache/apt/*.bin "$r"/usr/share/doc/* \
    "$r"/usr/share/man/* "$r"/usr/share/info/* "$r"/var/log/*.log "$r"/var/log/apt/* \
    "$r"/tmp/* "$r"/var/tmp/*
  find "$r"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
  find "$r" -xdev -name '__pycache__' -type d -prune -exec rm -rf {} +
  : >"$r"/etc/resolv.conf # Docker provides its own
}

pack() { # pack DEST: tar the root file system; the cache file appears whole or not at all
  local partial=$work/partial.tar
  tar --numeric-owner --xattrs --one-file-system --exclude=./dev/* --exclude=./proc/* \
    --exclude=./sys/* -C "$work/rootfs" -cf "$partial" .
  sync "$partial"
  mv "$partial" "$1"
  say "cached $1 ($(($(stat -c %s "$1") >> 20)) MiB)"
}

build_rootfs() {
  [ "$(id -u)" = 0 ] || die "building the root file systems needs root (or cached $base_tar)"
  command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] ||
    die "debootstrap is missing (apt-get install debootstrap)"
  PATH=$PATH:/usr/sbin:/sbin
  mkdir -p "$CACHE_DIR/debs"
  for stale in "$CACHE_DIR"/.build-*; do
    [ -e "$stale" ] || continue
    say "removing $stale, left by an interrupted build"
    remove_tree "$stale"
  done
  work=$(mktemp -d "$CACHE_DIR/.build-XXXXXX")
  local r=$work/rootfs t0=$SECONDS
  say "debootstrap --variant=minbase --include=$BASE_PACKAGES $SUITE (takes minutes)"
  if ! debootstrap --variant=minbase --include="$BASE_PACKAGES" --cache-dir="$CACHE_DIR/debs" \
    "$SUITE" "$r" "$MIRROR" >"$work/debootstrap.log" 2>&1; then
    tail -n 20 "$work/debootstrap.log" >&2
    die "debootstrap failed (log above)"
  fi
  say "debootstrap finished in $((SECONDS - t0))s; applying updates"
  mount -t proc proc "$r/proc"
  mount --bind /dev "$r/dev"
  cp /etc/resolv.conf "$r/etc/resolv.conf"
  cat >"$r/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
  in_root apt-get -qq update
  in_root apt-get -qq -y -o Dpkg::Options::=--force-confold upgrade >/dev/null
  # The user the operator and the scheduler run as (any uid works; 65532 is distroless's).
  in_root groupadd --system --gid "$NONROOT" nonroot
  in_root useradd --system --uid "$NONROOT" --gid "$NONROOT" --home-dir /home/nonroot \
    --create-home --shell /usr/sbin/nologin nonroot
  clean_rootfs
  pack "$base_tar"
  say "adding $BUILDER_PACKAGES for the builder"
  cp /etc/resolv.conf "$r/etc/resolv.conf"
  in_root apt-get -qq update
  # shellcheck disable=SC2086
  in_root apt-get -qq -y --no-install-recommends install $BUILDER_PACKAGES >/dev/null
  clean_rootfs
  pack "$builder_tar"
  cleanup
  say "root file systems built in $((SECONDS - t0))s"
}

mkdir -p "$CACHE_DIR"
exec 9>"$CACHE_DIR/.build.lock"
flock 9 # two builds at once would share the work directory
if [ "${REFRESH:-}" = 1 ] || [ ! -f "$base_tar" ] || [ ! -f "$builder_tar" ]; then
  build_rootfs
fi

import_image() { # import_image TARBALL IMAGE: docker import, unless the image came from this tarball
  local tarball=$1 image=$2 stamp
  stamp="$(basename "$tarball") $(stat -c %Y "$tarball")"
  if [ "$(docker image inspect -f '{{index .Config.Labels "dev.tangram.rootfs"}}' "$image" 2>/dev/null)" = "$stamp" ]; then
    say "$image is current ($stamp)"
    return
  fi
  say "docker import $tarball as $image"
  docker import \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LANG=C.UTF-8" \
    --change "LABEL dev.tangram.rootfs=\"$stamp\"" \
    --change 'CMD ["/bin/bash"]' \
    "$tarball" "$image" >/dev/null
}
import_image "$base_tar" "$BASE_IMAGE"
import_image "$builder_tar" "$BUILDER_IMAGE"

# --- the images -----------------------------------------------------------------------------

ca_args=()
extra_ca=${EXTRA_CA:-}
if [ -z "$extra_ca" ] && compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  ca_tmp=$(mktemp)
  extra_ca=$ca_tmp
  cat /usr/local/share/ca-certificates/*.crt >"$extra_ca"
fi
if [ -n "$extra_ca" ]; then
  ca_args=(--build-arg "EXTRA_CA_PEM=$(cat "$extra_ca")")
  say "pip trusts the extra certificates of ${EXTRA_CA:-/usr/local/share/ca-certificates} during the build"
fi

for t in "${TARGETS[@]}"; do
  t0=$SECONDS
  say "docker build --target $t -t $PREFIX/$t:$VERSION"
  docker build --network host --target "$t" \
    --build-arg "BASE=$BASE_IMAGE" --build-arg "BUILDER=$BUILDER_IMAGE" \
    --build-arg "VERSION=$VERSION" "${ca_args[@]}" \
    -t "$PREFIX/$t:$VERSION" .
  say "built $PREFIX/$t:$VERSION in $((SECONDS - t0))s" \
    "($(($(docker image inspect -f '{{.Size}}' "$PREFIX/$t:$VERSION") >> 20)) MiB)"
  # smoke test: the command starts with no network, as the image's user, on a read-only
  # root; the prebuilt exec server is where TANGRAM_EXECD says
  docker run --rm --network none --read-only --tmpfs /tmp "$PREFIX/$t:$VERSION" \
    sh -c 'tangram --help >/dev/null && test -x "$TANGRAM_EXECD"' ||
    die "$PREFIX/$t:$VERSION does not run \`tangram --help\` or lacks \$TANGRAM_EXECD"
done
