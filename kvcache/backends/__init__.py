"""Paged-attention backends: pure torch (CPU and GPU) and FlashInfer (CUDA only)."""

from kvcache.backends.base import AttentionBackend, StepKernel
from kvcache.backends.torch_backend import TorchBackend

__all__ = ["AttentionBackend", "StepKernel", "TorchBackend"]
