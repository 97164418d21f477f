"""Shape and dtype rules shared by the fake kernels."""
import torch


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are kept in float32 for half/bfloat16 inputs, else in the input dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def stats_like(input: torch.Tensor) -> torch.Tensor:
    torch._check(input.dim() == 4, lambda: f"fxfuse: expected a 4-D (N, C, H, W) input, got {input.dim()}-D")
    return input.new_empty((input.shape[1],), dtype=stats_dtype(input.dtype))
