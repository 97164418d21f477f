"""Loads the FXFUSE_CUDA=1 build made by `make cuda-build` (build/cuda-build-lib) in a fresh
process and checks that it registered the CUDA and AutocastCUDA kernels. Needs no GPU:
torch's CUDA libraries load without one. Catches what compiling alone does not (undefined
symbols, a registration that never runs)."""

import glob
import importlib.util
import sys

import torch

paths = glob.glob("build/cuda-build-lib/fxfuse/_C*.so")
if len(paths) != 1:
    sys.exit(f"check_cuda_build: expected one build/cuda-build-lib/fxfuse/_C*.so, found {paths}")
spec = importlib.util.spec_from_file_location("_C", paths[0])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
expected = [
    ("bn_act", "CUDA"),
    ("bn_act_backward", "CUDA"),
    ("bn_act_", "CUDA"),
    ("bn_act_backward_", "CUDA"),
    ("bn_act_backward_into_grad_", "CUDA"),
    ("bn_stats", "CUDA"),
    ("conv_bn_act", "AutocastCUDA"),
    ("conv_act", "AutocastCUDA"),
    ("linear_act", "AutocastCUDA"),
]
missing = [
    f"fxfuse::{op} for {key}"
    for op, key in expected
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fxfuse::{op}", key)
]
if missing:
    sys.exit("check_cuda_build: no kernel registered: " + ", ".join(missing))
print(f"check_cuda_build: {paths[0]} loads; CUDA and AutocastCUDA kernels registered")
