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


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory) -> str:
    """A latency profile shaped like dilaserve-tiny's on a CPU, so serving tests measure
    nothing at start-up."""
    from dilaserve.scheduler import LatencyProfile

    profile = LatencyProfile.from_tables(
        [
            (1, "no_cache", [(32, 0.004), (512, 0.012), (8192, 0.15)]),
            (1, "recompute", [(32, 0.004), (512, 0.012), (8192, 0.15)]),
            (1, "cache", [(32, 0.003), (512, 0.008), (8192, 0.1)]),
        ]
    )
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    path.write_text(profile.to_json())
    return str(path)
