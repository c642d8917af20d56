#!/usr/bin/env bash
# One prepared check of rlgate's GPU-only paths, for a Linux machine with one
# CUDA GPU and network access to PyPI:
#   - CUDA vLLM installs from the `gpu` extra and serves tiny-random and SmolLM2
#   - the CUDA-IPC weight push is exact (check-parity --weight-sync ipc)
#   - a LoRA adapter push is exact on vLLM's CUDA LoRA kernels (check-parity --lora)
#   - the GPU tests pass (FSDP over NCCL needs two GPUs), and the engine benchmark runs
# Writes everything it prints to ${OUT:-gpu-check}/gpu_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
make install ENGINE=gpu
.venv/bin/rlgate check-parity --model tiny-random --weight-sync ipc
.venv/bin/rlgate check-parity --model smollm2-135m-instruct --weight-sync ipc
.venv/bin/rlgate check-parity --model smollm2-135m-instruct --weight-sync file --no-fresh-engine
.venv/bin/rlgate check-parity --model smollm2-135m-instruct --lora 8
.venv/bin/python -m pytest -m gpu -v
.venv/bin/python bench/engine.py --json "$out/bench_engine_gpu.json"
