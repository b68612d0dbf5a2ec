"""Shared fixtures. Triton kernels run in the numpy interpreter when no GPU is present; the
switch must be set before any kernel module is imported, hence here. Test tensors are tiny,
so one intra-op thread is fastest and keeps results independent of the machine's load."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)


def _tiny_checkpoint(tmp_path_factory, family: str):
    from dilaserve.models.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{family}"), family)


@pytest.fixture(scope="session")
def tiny_llada_dir(tmp_path_factory):
    """A random LLaDA-format checkpoint directory (config, safetensors, tokenizer)."""
    return _tiny_checkpoint(tmp_path_factory, "llada")


@pytest.fixture(scope="session")
def tiny_dream_dir(tmp_path_factory):
    """A random Dream-format checkpoint directory (config, safetensors, tokenizer)."""
    return _tiny_checkpoint(tmp_path_factory, "dream")
