"""Shared fixtures. Triton kernels run in the numpy interpreter when no GPU is present; the
switch must be set before any kernel module is imported, hence here."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
