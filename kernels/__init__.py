"""Kernels for the worker's hot path, each with a torch reference of identical semantics.

Shipped inside the package as `dilaserve.kernels`. The dispatchers (plain names) run the
Triton kernel on CUDA tensors when triton is installed and the torch reference elsewhere;
the `*_reference` and `*_triton` variants are exported for tests and benchmarks.
"""

from .backend import KernelInputError, TritonUnavailableError, use_triton
from .kv_reuse import (
    scatter_kv,
    scatter_kv_reference,
    scatter_kv_triton,
)
from .unmask import (
    NO_TOKEN,
    PARTIAL_BYTES,
    CommitResult,
    argmax_confidence,
    argmax_confidence_reference,
    argmax_confidence_triton,
    combine_vocab_partials,
    confidence_commit,
    confidence_commit_reference,
    confidence_commit_triton,
    partial_ids,
    threshold_commit,
    threshold_commit_reference,
    threshold_commit_triton,
    vocab_partials,
    vocab_partials_reference,
    vocab_partials_triton,
)

__all__ = [
    "NO_TOKEN",
    "PARTIAL_BYTES",
    "CommitResult",
    "KernelInputError",
    "TritonUnavailableError",
    "argmax_confidence",
    "argmax_confidence_reference",
    "argmax_confidence_triton",
    "combine_vocab_partials",
    "confidence_commit",
    "confidence_commit_reference",
    "confidence_commit_triton",
    "scatter_kv",
    "scatter_kv_reference",
    "scatter_kv_triton",
    "partial_ids",
    "threshold_commit",
    "threshold_commit_reference",
    "threshold_commit_triton",
    "use_triton",
    "vocab_partials",
    "vocab_partials_reference",
    "vocab_partials_triton",
]
