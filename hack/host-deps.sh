#!/usr/bin/env bash
# What `make test` needs from the host beyond Python, Go and a C++ compiler, installed
# from Debian's packages when missing (root, or sudo):
#   kernels: cmake, ninja, GoogleTest, the arm64/s390x cross compilers and qemu-user
#   images:  buildah, podman, runc, debootstrap, qemu-user, and qemu registered with
#            binfmt_misc (with the F flag, so chroots of another architecture run)
#   envtest: openssl (the control plane's service-account keys; the server's HTTPS tests' certificates)
#   e2e:     the node's CNI plugins, iptables, iproute2, curl, and libseccomp-dev + pkg-config
#            (runc is built with cgo against libseccomp)
set -euo pipefail
want=()
need() { command -v "$1" >/dev/null 2>&1 || want+=("$2"); }
for part in "${@:-kernels images envtest e2e}"; do for p in $part; do case $p in
  kernels) need ninja ninja-build; need cmake cmake; [ -d /usr/src/googletest ] || want+=(googletest)
           need aarch64-linux-gnu-g++ g++-aarch64-linux-gnu; need s390x-linux-gnu-g++ g++-s390x-linux-gnu
           need qemu-aarch64-static qemu-user-static ;;
  images)  need buildah buildah; need podman podman; need runc runc; need debootstrap debootstrap
           need qemu-aarch64-static qemu-user-static; need numfmt coreutils ;;
  envtest) need openssl openssl ;;
  e2e)     [ -x /usr/lib/cni/bridge ] || want+=(containernetworking-plugins); need iptables iptables
           need ip iproute2; need curl curl; need pkg-config pkg-config; need openssl openssl
           [ -e /usr/include/seccomp.h ] || want+=(libseccomp-dev) ;;
  *) echo "host-deps.sh: unknown part $p (kernels, images, envtest, e2e)" >&2; exit 2 ;;
esac; done; done
sudo=; [ "$(id -u)" = 0 ] || sudo=sudo
if [ ${#want[@]} -gt 0 ]; then
  mapfile -t want < <(printf '%s\n' "${want[@]}" | sort -u)
  echo "installing from Debian: ${want[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
fi
case " ${*:-images} " in *images*)
  bf=/proc/sys/fs/binfmt_misc
  [ -e $bf/register ] || $sudo mount -t binfmt_misc binfmt_misc $bf
  for arch in aarch64 s390x; do
    [ -e $bf/qemu-$arch ] || $sudo sh -c "cat /usr/lib/binfmt.d/qemu-$arch.conf > $bf/register"
  done ;;
esac
