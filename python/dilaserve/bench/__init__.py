"""`dilaserve bench`: a load generator that replays arrivals against the server and
reports SLO attainment, latency, throughput, accuracy and τ per policy and rate."""

from .report import Summary, plot, summarize
from .sweep import SweepSpec, run_sweep

__all__ = ["Summary", "SweepSpec", "plot", "run_sweep", "summarize"]
