#!/usr/bin/env bash
# Puts what `make e2e` runs besides the envtest binaries into $1, building only what is
# missing: kubelet, kube-scheduler and kube-proxy from the Kubernetes Go module the envtest
# binaries come from (operator/hack/envtest/go.mod, so every component has one version);
# containerd 2, its runc shim, ctr and runc from ./runtime/go.mod (Debian's containerd 1.6
# is older than the kubelet accepts; Debian's runc 1.1.5 works too, but runc 1.5 is what
# containerd 2 is released with, and it names the call that fails); and the pod sandbox image
# (./pause.c, static) as an OCI archive. $1 is keyed by these inputs' hash by the Makefile.
set -euo pipefail
dest=$1
here=$(cd "$(dirname "$0")" && pwd)
envtest=$here/../../operator/hack/envtest
mkdir -p "$dest/bin"
ver=$(sed -n 's/^require k8s.io\/kubernetes v//p' "$envtest/go.mod")
if ! [[ -x $dest/bin/kubelet && -x $dest/bin/kube-scheduler && -x $dest/bin/kube-proxy ]]; then
  echo "building kubelet, kube-scheduler and kube-proxy v$ver into $dest/bin"
  v=k8s.io/component-base/version
  ldflags="-X $v.gitVersion=v$ver -X $v.gitMajor=${ver%%.*} -X $v.gitMinor=$(cut -d. -f2 <<<"$ver") -X $v.gitTreeState=clean"
  (cd "$envtest" && GOFLAGS=-mod=mod go build -trimpath -ldflags "$ldflags" -o "$dest/bin/" \
      k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kube-proxy)
fi
# (no `| head` under pipefail: a writer that outlives head dies of SIGPIPE and fails the script)
mod() { sed -n "s#^\s*$1 v\([^ ]*\).*#\1#p" "$here/runtime/go.mod" | sed -n 1p; }
if ! [[ -x $dest/bin/containerd && -x $dest/bin/containerd-shim-runc-v2 && -x $dest/bin/ctr ]]; then
  cver=$(mod github.com/containerd/containerd/v2)
  echo "building containerd v$cver into $dest/bin"
  # no btrfs snapshotter (it needs cgo and btrfs headers); overlayfs is what the CRI uses here
  (cd "$here/runtime" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -tags "no_btrfs urfave_cli_no_docs" \
      -ldflags "-X github.com/containerd/containerd/v2/version.Version=v$cver" -o "$dest/bin/" \
      github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
      github.com/containerd/containerd/v2/cmd/ctr)
fi
if [[ ! -x $dest/bin/runc ]]; then
  rver=$(mod github.com/opencontainers/runc)
  echo "building runc v$rver into $dest/bin"
  # cgo: runc's nsenter is C, and its seccomp filters come from libseccomp
  (cd "$here/runtime" && CGO_ENABLED=1 GOFLAGS=-mod=mod go build -trimpath -tags "seccomp urfave_cli_no_docs" \
      -ldflags "-X main.version=$rver" -o "$dest/bin/" github.com/opencontainers/runc)
fi
if [[ ! -s $dest/pause.oci.tar ]]; then
  echo "building the pod sandbox image localhost/cpuserve-pause:3.10"
  gcc -O2 -static -Wall -Werror -o "$dest/bin/pause" "$here/pause.c"
  ctr=$(buildah from scratch)
  trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
  buildah copy -q --chmod 0755 "$ctr" "$dest/bin/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 --label org.opencontainers.image.title=cpuserve-pause "$ctr"
  buildah commit -q "$ctr" localhost/cpuserve-pause:3.10 >/dev/null
  buildah push -q localhost/cpuserve-pause:3.10 "oci-archive:$dest/pause.oci.tar.tmp:localhost/cpuserve-pause:3.10"
  mv "$dest/pause.oci.tar.tmp" "$dest/pause.oci.tar"
fi
"$dest/bin/kubelet" --version
"$dest/bin/containerd" --version
"$dest/bin/runc" --version | sed -n 1p
