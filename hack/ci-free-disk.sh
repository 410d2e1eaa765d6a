#!/usr/bin/env bash
# Makes room on a CI machine that earlier runs have filled: a run needs about 25 GiB (the
# virtualenv with PyPI's CUDA build of torch is 6 GiB; the images, their build stages and the
# OCI archives about 12 GiB; the e2e node a few more). When less is free, removes what only
# earlier runs used: buildah's leftover working containers, untagged images (earlier builds'
# stages and layers; the current images, the base root filesystems and the caches outside the
# clone stay), then pip's download cache. Usage: hack/ci-free-disk.sh [GiB needed, default 25]
set -euo pipefail
need=${1:-25}
# the least free space of the filesystems a run writes to: the clone, the caches, container storage
free_gib() {
  local dirs=(. "$HOME")
  [ -d /var/lib/containers ] && dirs+=(/var/lib/containers)
  df -Pk "${dirs[@]}" | awk 'NR > 1 { g = int($4 / 1048576); if (m == "" || g < m) m = g } END { print m }'
}
[ "$(free_gib)" -ge "$need" ] && exit 0
echo "ci-free-disk: $(free_gib) GiB free, $need wanted: removing what earlier runs left behind"
if command -v buildah >/dev/null; then buildah rm --all >/dev/null 2>&1 || true; fi
if command -v podman >/dev/null; then podman image prune -f >/dev/null 2>&1 || true; fi
if [ "$(free_gib)" -lt "$need" ]; then
  for py in python3 .venv/bin/python; do "$py" -m pip cache purge >/dev/null 2>&1 && break || true; done
fi
echo "ci-free-disk: $(free_gib) GiB free now"
