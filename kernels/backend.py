"""What every kernel module shares: the optional Triton import, typed input errors, and the rule
that picks the Triton kernel or the torch reference.

Triton stays optional so that a CPU-only torch install (no triton wheel) still imports the
package and runs the references.
"""

import os
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed packages
    triton = None
    tl = None

__all__ = [
    "KernelInputError",
    "TritonUnavailableError",
    "require",
    "require_triton",
    "tl",
    "triton",
    "use_triton",
]


class KernelInputError(ValueError):
    """A kernel was given tensors of the wrong shape, dtype or device."""


class TritonUnavailableError(RuntimeError):
    """A Triton kernel was called where it cannot run."""


def require(condition: bool, message: str | Callable[[], str]) -> None:
    """Raises `KernelInputError(message)` unless `condition` holds. A message that names
    shapes is passed as a function and built only on failure: checks run several times a
    step, and formatting shapes costs more than the check."""
    if not condition:
        raise KernelInputError(message() if callable(message) else message)


def use_triton(tensor: torch.Tensor) -> bool:
    """The dispatch rule: Triton for CUDA tensors when triton imports, the reference otherwise."""
    return triton is not None and tensor.is_cuda


def require_triton(tensor: torch.Tensor) -> None:
    """Fails clearly where a Triton kernel cannot run: no triton, or a CPU tensor outside the
    interpreter (`TRITON_INTERPRET=1`, which runs kernels on CPU tensors for testing)."""
    if triton is None:
        raise TritonUnavailableError("triton is not installed; call the *_reference function")
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise TritonUnavailableError(
            f"Triton kernels need CUDA tensors (got {tensor.device}); "
            "set TRITON_INTERPRET=1 before importing triton to run them on CPU"
        )
