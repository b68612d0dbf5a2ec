"""Kernels for the worker's hot path, each with a torch reference of identical semantics.

Shipped inside the package as `dilaserve.kernels`. The dispatchers (plain names) run the
Triton kernel on CUDA tensors when triton is installed and the torch reference elsewhere;
the `*_reference` and `*_triton` variants are exported for tests and benchmarks.
"""

from .backend import KernelInputError, TritonUnavailableError
from .kv_reuse import (
    gather_kv,
    gather_kv_reference,
    gather_kv_triton,
    scatter_kv,
    scatter_kv_reference,
    scatter_kv_triton,
)
from .unmask import (
    CommitResult,
    confidence_commit,
    confidence_commit_reference,
    confidence_commit_triton,
    confidence_stats,
)

__all__ = [
    "CommitResult",
    "KernelInputError",
    "TritonUnavailableError",
    "confidence_commit",
    "confidence_commit_reference",
    "confidence_commit_triton",
    "confidence_stats",
    "gather_kv",
    "gather_kv_reference",
    "gather_kv_triton",
    "scatter_kv",
    "scatter_kv_reference",
    "scatter_kv_triton",
]
