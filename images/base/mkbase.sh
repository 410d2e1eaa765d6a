#!/usr/bin/env bash
# A Debian bookworm base image for one architecture, made with debootstrap (no registry
# is needed) and imported into local container storage as
#   localhost/cpuserve-base:bookworm-<arch>
# The root filesystem is cached as a tarball under $CACHE keyed by the content hash of
# this script, so a second run (or a second image) costs seconds. Foreign architectures
# run their second stage under qemu-user through binfmt_misc (images/host-setup.sh).
set -euo pipefail
arch=${1:?usage: mkbase.sh amd64|arm64|s390x}
CACHE=${CPUSERVE_IMAGE_CACHE:-$HOME/.cache/cpuserve-images}
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
image=localhost/cpuserve-base:$SUITE-$arch
key=$(sha256sum "$0" | cut -c1-16)

if [ "$(buildah inspect --type image --format '{{index .ImageAnnotations "io.cpuserve.base-key"}}' "$image" 2>/dev/null)" = "$key" ]; then
  echo "base $image is current ($key)"; exit 0
fi
tarball=$CACHE/rootfs/$SUITE-$arch-$key.tar
if [ ! -s "$tarball" ]; then
  mkdir -p "$CACHE/rootfs"
  root=$(mktemp -d "$CACHE/rootfs/.debootstrap-$arch-XXXX")
  trap 'rm -rf "$root"' EXIT
  echo "debootstrap $SUITE $arch (minbase) from $MIRROR"
  debootstrap --variant=minbase --arch="$arch" "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 \
    || { tail -30 "$root.log" "$root/debootstrap/debootstrap.log" 2>/dev/null; exit 1; }
  rm -f "$root.log"
  # the image's own sources: the suite, its updates and security
  cat >"$root/etc/apt/sources.list" <<SRC
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
SRC
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
  tar --numeric-owner --xattrs -C "$root" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$root"; trap - EXIT
fi
ctr=$(buildah from --arch "$arch" scratch)
trap 'buildah rm "$ctr" >/dev/null' EXIT
mnt=$(buildah mount "$ctr")
tar --numeric-owner --xattrs -C "$mnt" -xf "$tarball"
buildah umount "$ctr" >/dev/null
buildah config --arch "$arch" --os linux --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --annotation "io.cpuserve.base-key=$key" --label "io.cpuserve.base=debian-$SUITE-debootstrap-minbase" "$ctr"
buildah commit --quiet --rm "$ctr" "$image" >/dev/null
trap - EXIT
echo "base $image imported ($key, $(du -h "$tarball" | cut -f1) rootfs)"
