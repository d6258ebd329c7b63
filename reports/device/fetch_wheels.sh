#!/usr/bin/env bash
# Run HERE (the CPU machine, which reaches PyPI), in the repo root, before the device calls of
# bench_batch_cuda.sh. The device machine reaches no registry and a call carries at most 64 MiB,
# while the CUDA 13 build of MLX is one ~90 MB wheel: this downloads the wheels the device image
# lacks into .whl/ (git-ignored) and splits that wheel into two parts, one per call:
#   .whl/part1/  first 48 MiB of mlx-cuda-13          (call 1: carry [".whl/part1"])
#   .whl/part2/  the rest + mlx, mlx-lm wheels         (call 2: carry [".whl/part2"])
# The device image (see the device tool's KINDS.md) already holds CUDA 13's nvidia-* libraries,
# numpy, transformers, tokenizers, safetensors and tqdm, which these wheels need.
set -euo pipefail
MLX_VERSION=${MLX_VERSION:-0.32.4}
MLX_LM_VERSION=${MLX_LM_VERSION:-0.32.2}
PY=${PY:-python3}
rm -rf .whl && mkdir -p .whl/dl .whl/part1 .whl/part2
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/dl \
    "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION"
cuda=$(ls .whl/dl/mlx_cuda_13-*.whl)
name=$(basename "$cuda")
split -b 48M -d "$cuda" ".whl/part1/$name.part"
mv .whl/part1/"$name".part0[1-9] .whl/part2/
(cd .whl/dl && sha256sum "$name") > .whl/part2/SHA256
mv .whl/dl/mlx-*.whl .whl/dl/mlx_lm-*.whl .whl/part2/
rm -rf .whl/dl
du -sh .whl/part1 .whl/part2
