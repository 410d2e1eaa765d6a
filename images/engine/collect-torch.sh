#!/bin/sh
# Run in the image's `torch` stage after `apt-get install python3-torch`: copies what
# `import torch` loads into /out, leaving the rest of Debian's libtorch1.13 dependency
# tree behind (it pulls OpenCV, FFmpeg, GDAL, Qt and LLVM, about 1.2 GB, for
# caffe2 operators the engine never calls). Libraries owned by packages the runtime
# stage installs itself (listed in $1, one package per line) are not copied.
set -eu
keep=$1
site=/usr/lib/python3/dist-packages
mkdir -p /out$site /out/usr/lib/cpuserve-torch
cp -a $site/torch /out$site/
# only what torch's import and cpuserve use: no test binaries or headers
rm -rf /out$site/torch/test /out$site/torch/include /out$site/torch/share
find /out$site/torch -name __pycache__ -prune -exec rm -rf {} +
# torch/__init__ loads libtorch_global_deps itself; the rest through the extension modules
{ echo "$(readlink -f $site/torch/lib/libtorch_global_deps.so)"
  find $site/torch -name '*.so*' -exec ldd {} + 2>/dev/null | awk '/=> \//{print $3}'; } | sort -u | while read -r lib; do
  pkg=$(dpkg -S "$(readlink -f "$lib")" 2>/dev/null | head -n1 | cut -d: -f1) || pkg=
  if [ -n "$pkg" ] && grep -qx "$pkg" "$keep"; then continue; fi
  cp -L "$lib" /out/usr/lib/cpuserve-torch/
done
# torch/lib holds symlinks into the system library directory: point them at the copies
for link in /out$site/torch/lib/*; do
  [ -L "$link" ] || continue
  name=$(basename "$(readlink -f "$site/torch/lib/$(basename "$link")")")
  if [ -e "/out/usr/lib/cpuserve-torch/$name" ]; then ln -sf "/usr/lib/cpuserve-torch/$name" "$link"; else rm "$link"; fi
done
mkdir -p /out/etc/ld.so.conf.d
echo /usr/lib/cpuserve-torch > /out/etc/ld.so.conf.d/cpuserve-torch.conf
echo "torch closure: $(ls /out/usr/lib/cpuserve-torch | wc -l) libraries, $(du -sh /out/usr/lib/cpuserve-torch | cut -f1)"
