"""DiLaServe: SLO-aware serving of diffusion language models."""

from dilaserve._core import LatencyProfile, LatencyProfileError

__all__ = ["LatencyProfile", "LatencyProfileError", "__version__"]
__version__ = "0.1.0"
