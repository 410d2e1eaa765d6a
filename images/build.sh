#!/usr/bin/env bash
# `make images`: the engine for linux/amd64, arm64 and s390x and the operator for amd64 and
# arm64, with buildah (chroot isolation) on Debian bases made by debootstrap, each assembled
# into one multi-arch index and written as an OCI archive under $CPUSERVE_IMAGE_CACHE:
#   cpuserve-engine-<version>.oci.tar, cpuserve-operator-<version>.oci.tar
# An architecture's image is rebuilt only when what goes into it changed: its inputs are
# hashed, and an image whose io.cpuserve.inputs label carries that hash is kept. Unchanged
# steps of a rebuild come from buildah's layer cache (container storage, outside the clone).
#
# Environment: ENGINE_ARCHES, OPERATOR_ARCHES (space-separated subsets), CPUSERVE_IMAGE_CACHE,
# BASE_IMAGE_<arch> (start from a registry image instead of the debootstrap base).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${CPUSERVE_IMAGE_CACHE:-$HOME/.cache/cpuserve-images}
ENGINE_ARCHES=${ENGINE_ARCHES:-amd64 arm64 s390x}
OPERATOR_ARCHES=${OPERATOR_ARCHES:-amd64 arm64}
VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/cpuserve/Chart.yaml)
BUILD_ARCH=$(dpkg --print-architecture)
mkdir -p "$CACHE/oci" "$CACHE/logs"

ENGINE_INPUTS=(images/engine images/base/mkbase.sh engine/CMakeLists.txt engine/cmake engine/csrc engine/cpuserve
               topology/cpuserve_topology)
OPERATOR_INPUTS=(images/operator images/base/mkbase.sh operator/cpuserve_operator topology/cpuserve_topology)
declare -A ISA_PATHS=([amd64]=amx,avx512_bf16,avx512_vnni,avx512,avx2,scalar [arm64]=neon_dotprod,neon,scalar [s390x]=vxe,scalar)

inputs_hash() {  # content of every input file (not its timestamp), plus the architecture
  { echo "$1"; find "${@:2}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z \
      | xargs -0 sha256sum; } | sha256sum | cut -c1-16
}

revision() {  # the last commit that changed these inputs, marked -dirty when they differ from it
  local rev
  rev=$(git log -1 --format=%H -- "$@" 2>/dev/null || true)
  [ -n "$rev" ] || { echo unknown; return; }
  git diff --quiet HEAD -- "$@" 2>/dev/null && echo "$rev" || echo "$rev-dirty"
}

build_one() {  # name arch containerfile inputs...
  local name=$1 arch=$2 file=$3; shift 3
  local tag=localhost/cpuserve-$name:$VERSION-$arch key base
  key=$(inputs_hash "$arch" "$@")
  if [ "$(buildah inspect --type image --format '{{index .OCIv1.Config.Labels "io.cpuserve.inputs"}}' "$tag" \
          2>/dev/null)" = "$key" ]; then
    echo "$name $arch: up to date ($key)"; return
  fi
  local basevar="BASE_IMAGE_$arch"; base=${!basevar:-localhost/cpuserve-base:bookworm-$arch}
  if [[ $base == localhost/cpuserve-base:* ]]; then images/base/mkbase.sh "$arch"; fi
  images/base/mkbase.sh "$BUILD_ARCH"
  local start=$SECONDS log=$CACHE/logs/$name-$arch.log
  echo "$name $arch: building (log: $log)"
  local attempt
  for attempt in 1 2; do
    # BUILDPLATFORM given explicitly: buildah 1.28 (Debian bookworm) sets it to the target platform
    buildah build --isolation chroot --layers --pull=never --platform "linux/$arch" \
        --build-arg "BUILDPLATFORM=linux/$BUILD_ARCH" \
        --build-arg "BASE_IMAGE=$base" --build-arg "BUILD_IMAGE=localhost/cpuserve-base:bookworm-$BUILD_ARCH" \
        --build-arg "VERSION=$VERSION" --build-arg "REVISION=$(revision "$@")" \
        --build-arg "ISA_PATHS=${ISA_PATHS[$arch]}" --label "io.cpuserve.inputs=$key" \
        --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt \
        -f "$file" -t "$tag" . >"$log" 2>&1 && break
    # A RUN step now and then fails before it starts: "Close_Fd sealing memfd copy: Device or
    # resource busy" (the sealed in-memory copy of its own binary that buildah's runtime makes,
    # seen once in a 2026-11-28 build here; the same step passed when run again). The steps
    # before it are cached layers, so the second try resumes at that step.
    if [ "$attempt" = 1 ] && grep -q "sealing memfd copy" "$log"; then
      echo "$name $arch: transient runtime error (sealing memfd copy), building again"; continue
    fi
    tail -40 "$log"; echo "$name $arch: build FAILED (log: $log)"; return 1
  done
  echo "$name $arch: built in $((SECONDS - start)) s, $(podman image inspect --format '{{.Size}}' "$tag" | numfmt --to=iec) ($key)"
}

assemble() {  # name arches...: one multi-arch index, written as an OCI archive
  local name=$1; shift
  local list=localhost/cpuserve-$name:$VERSION archive=$CACHE/oci/cpuserve-$name-$VERSION.oci.tar ids
  ids=$(for arch in "$@"; do podman image inspect --format '{{.Id}}' "$list-$arch"; done)
  if [ -s "$archive" ] && [ "$(cat "$archive.ids" 2>/dev/null)" = "$ids" ]; then
    echo "$list: $archive is up to date"; return
  fi
  buildah manifest rm "$list" >/dev/null 2>&1 || true
  buildah manifest create "$list" >/dev/null
  for arch in "$@"; do
    buildah manifest add --arch "$arch" --os linux "$list" "containers-storage:$list-$arch" >/dev/null
  done
  rm -f "$archive.tmp"
  buildah manifest push --quiet --all "$list" "oci-archive:$archive.tmp:$list" >/dev/null
  mv "$archive.tmp" "$archive"
  echo "$ids" > "$archive.ids"
  echo "$list: index of $* -> $archive ($(du -h "$archive" | cut -f1))"
}

hack/host-deps.sh images
for arch in $ENGINE_ARCHES; do build_one engine "$arch" images/engine/Containerfile "${ENGINE_INPUTS[@]}"; done
for arch in $OPERATOR_ARCHES; do build_one operator "$arch" images/operator/Containerfile "${OPERATOR_INPUTS[@]}"; done
# shellcheck disable=SC2086
assemble engine $ENGINE_ARCHES
# shellcheck disable=SC2086
assemble operator $OPERATOR_ARCHES
