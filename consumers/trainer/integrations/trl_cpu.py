"""TRL 1.16's AsyncGRPOTrainer without CUDA: ``use_cpu_kernels()`` before building it.

As shipped, the trainer needs a CUDA device twice: its tree attention (``packing``) fetches
the FlashAttention-3 kernel from the Hugging Face Hub (``kernels``), and its constructor
reads the GPU's name to compute MFU. Here the kernel's ``flash_attn_varlen_func`` is
computed in PyTorch, segment by segment (``flash_attn_varlen_torch``: the same numbers, for
CPU runs, not for speed), and the MFU figure is off. torch and trl are imported here alone.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch


def flash_attn_varlen_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                            max_seqlen_q: int, max_seqlen_k: int,
                            softmax_scale: float | None = None, causal: bool = True,
                            window_size: tuple[int, int] = (-1, -1),
                            **kwargs: Any) -> torch.Tensor:
    """FlashAttention's ``flash_attn_varlen_func`` (what TRL's tree attention calls) in
    PyTorch: segment ``s``'s queries ``q[cu_q[s]:cu_q[s+1]]`` attend to its keys
    ``k[cu_k[s]:cu_k[s+1]]``, causally aligned to the end (FlashAttention's rule when there
    are more keys than queries); grouped-query heads as FlashAttention. ``q``: [tokens,
    heads, dim]; returns the same shape. Segment by segment: for CPU runs, not speed."""
    if window_size != (-1, -1) or kwargs.get("softcap"):
        raise NotImplementedError("flash_attn_varlen_torch: no sliding window, no softcap")
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)
        ks = k[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        vs = v[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        mask = None
        if causal:
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        out[cu_q[s]:cu_q[s + 1]] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale,
            enable_gqa=ks.shape[0] != qs.shape[0]).transpose(0, 1)
    return out


def use_cpu_kernels() -> None:
    """Let TRL 1.16's ``AsyncGRPOTrainer`` run without CUDA (module docstring); call it
    before building the trainer. Does nothing where CUDA is available."""
    if torch.cuda.is_available():
        return
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    kernel = SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_torch)
    # TRL's own module globals, looked up at call time: the two CUDA-only calls
    setattr(packing, "_flash_attn", lambda: kernel)  # noqa: B010
    setattr(async_grpo_trainer, "get_peak_flops_per_device",  # noqa: B010
            lambda accelerator, dtype: None)
