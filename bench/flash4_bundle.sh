#!/usr/bin/env bash
# Packs flash-attn-4 (the `flash4` attention backend) for a CUDA 13 GPU machine that reaches no package index:
# its wheels and its CuTe DSL's (cp312, x86-64) unpacked into fa4site/, xz-compressed and split into parts
# small enough to carry beside the working tree, with sha256 sums and assemble.sh, all in .fa4/ (git ignores it).
# On the GPU machine, with the parts copied to /tmp/fa4:   source .fa4/assemble.sh
# (unpacks to /tmp/fa4site once and puts it on PYTHONPATH). Usage here: bash bench/flash4_bundle.sh [PART_MB]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out=$root/.fa4
part_mb=${1:-26}
grep -qx '/.fa4/' "$root/.git/info/exclude" 2>/dev/null || echo '/.fa4/' >> "$root/.git/info/exclude"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
dsl=4.8.1
# flash-attn-4's requirements with the cu13 extra, torch (on the GPU machine already) left out.
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/wheels" "flash-attn-4==4.0.0b36" \
  "nvidia-cutlass-dsl==$dsl" "nvidia-cutlass-dsl-libs-base==$dsl" "nvidia-cutlass-dsl-libs-core==$dsl" \
  "nvidia-cutlass-dsl-libs-cu13==$dsl" "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext "quack-kernels>=0.5.3" einops
# The DSL's own requirements, used only where the machine's Python lacks them (assemble.sh checks).
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/fallback" "cuda-bindings>=13.0,<13.1" \
  cuda-pathfinder protobuf
mkdir -p "$work/fa4site/fallback"
for w in "$work"/wheels/*.whl; do unzip -q -o "$w" -d "$work/fa4site"; done
for w in "$work"/fallback/*.whl; do unzip -q -o "$w" -d "$work/fa4site/fallback"; done
rm -rf "$work/fa4site/nvidia_cutlass_dsl/cu13/lib/stubs"  # other platforms' stubs
rm -rf "$out" && mkdir -p "$out"
tar cf - -C "$work" fa4site | xz -T0 -6 | split -b "${part_mb}M" -d -a 2 - "$out/part"
(cd "$out" && sha256sum part* > sha256)
cat > "$out/assemble.sh" <<'EOF'
# Sourced on the GPU machine once /tmp/fa4 holds every part: unpacks flash-attn-4 under /tmp/fa4site (once)
# and puts it on PYTHONPATH (a PYTHONPATH folder's .pth files are not read, so the DSL's folder is added too).
_d=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -d /tmp/fa4site/flash_attn ]; then
  (cd /tmp/fa4 && cp "$_d/sha256" . && sha256sum -c --quiet sha256) && cat /tmp/fa4/part* | xz -d | tar x -C /tmp &&
    python3 -m compileall -q -j 0 /tmp/fa4site > /dev/null  # .pyc files, as pip install writes them
fi
export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import cuda.bindings, google.protobuf" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:/tmp/fa4site/fallback
EOF
ls -l "$out"
