"""Kernels for the worker's hot path, each with a torch reference of identical semantics.

Shipped inside the package as `dilaserve.kernels`. The dispatchers below run the Triton
kernel on CUDA tensors and the torch reference elsewhere.
"""

from .kv_reuse import gather_kv, scatter_kv

__all__ = ["gather_kv", "scatter_kv"]
