#!/usr/bin/env bash
# FlashAttention 4 for the GPU machines, which lack it and cannot download. Its CUDA 13 library wheel is 92 MB, over
# the 64 MiB a device call carries, so it travels in two calls to one warm machine:
#   bash benchmarks/fa4_wheels.sh split          here: download flash-attn-4 and what it needs into .fa4/a and .fa4/b
#                                                (git-ignored, 48 and 52 MB: with the ~9 MB tree each fits a call)
#   bash benchmarks/fa4_wheels.sh stash DIR      device call 1 (carry [".fa4/a"]): keep part a in DIR (e.g. /tmp/fa4)
#   bash benchmarks/fa4_wheels.sh install DIR    device call 2 (carry [".fa4/b"]): join the pieces, unpack them into
#                                                DIR/site; then export PYTHONPATH=$(cat DIR/pythonpath):$PYTHONPATH
# Since 4.4 the CuTe DSL is split: nvidia-cutlass-dsl is a metadata shim, the `cutlass` Python package is in
# nvidia-cutlass-dsl-libs-core and its compiled parts in -libs-base / -libs-cu13, all under one folder
# (nvidia_cutlass_dsl/dsl_packages/cutlass). pip --target keeps only the first wheel's copy of a shared folder, and a
# .pth file on PYTHONPATH is never read, so the wheels are unpacked (merged) and dsl_packages goes on the path.
# (On 2026-11-28 the install without libs-core failed on the H200: "No module named 'cutlass.cute'".)
# Versions: flash-attn-4 4.0.0b36 (its Hopper forward and backward: flash_fwd_sm90 / flash_bwd_sm90, head size up
# to 256), nvidia-cutlass-dsl 4.8.1 with the cu13 libraries (the machines run torch 2.11+cu130).
set -euo pipefail
mode=${1:?usage: fa4_wheels.sh split|stash DIR|install DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
case $mode in
  split)
    cd "$root"
    tmp=$(mktemp -d)
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python3 -m pip download -q --no-deps --pre "${plat[@]}" -d "$tmp" flash-attn-4==4.0.0b36 \
      nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
      "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext quack-kernels
    rm -rf .fa4 && mkdir -p .fa4/a .fa4/b
    big=$(ls "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl)
    split -b 46M -d "$big" ".fa4/a/$(basename "$big").part"
    mv ".fa4/a/$(basename "$big").part01" .fa4/b/
    find "$tmp" -name '*.whl' ! -name 'nvidia_cutlass_dsl_libs_cu13-*' -exec mv {} .fa4/b/ \;
    (cd "$tmp" && sha256sum "$(basename "$big")") > .fa4/b/SHA256SUMS
    rm -rf "$tmp"
    du -sh .fa4/a .fa4/b ;;
  stash)
    dir=${2:?usage: fa4_wheels.sh stash DIR}
    mkdir -p "$dir" && cp "$root"/.fa4/a/* "$dir"/ && ls "$dir" ;;
  install)
    dir=${2:?usage: fa4_wheels.sh install DIR}
    cp "$root"/.fa4/b/* "$dir"/
    cd "$dir"
    big=$(ls nvidia_cutlass_dsl_libs_cu13-*.whl.part00); big=${big%.part00}
    cat "$big".part* > "$big" && sha256sum -c SHA256SUMS
    rm -rf "$dir/site" && mkdir -p "$dir/site"
    # glob order unpacks libs-cu13 after libs-base: where both ship a file, the CUDA 13 build must win
    for wheel in ./*.whl; do python3 -m zipfile -e "$wheel" "$dir/site/"; done
    echo "$dir/site:$dir/site/nvidia_cutlass_dsl/dsl_packages" > "$dir/pythonpath"
    PYTHONPATH="$(cat "$dir/pythonpath"):${PYTHONPATH:-}" python3 -c \
      "import cutlass.cute, flash_attn.cute as f; print('flash_attn.cute from', f.__file__)" ;;
  *) echo "unknown mode $mode (split|stash DIR|install DIR)" >&2; exit 2 ;;
esac
