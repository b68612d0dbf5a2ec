"""Per policy and rate: SLO attainment, latency, throughput, accuracy and mean τ, as JSON
lines and a PNG plot against rate."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .client import Outcome


@dataclass(frozen=True)
class Summary:
    policy: str
    rate: float
    requests: int
    attainment: float  # share of all requests answered within their SLO
    mean_latency_s: float
    p50_latency_s: float
    p99_latency_s: float
    throughput_rps: float  # answers per second of the run
    goodput_rps: float  # answers within SLO per second
    accuracy: float  # right answers among those answered
    mean_tau: float
    rejected: int

    def to_dict(self) -> dict:
        return asdict(self)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(policy: str, rate: float, outcomes: Sequence[Outcome], duration: float) -> Summary:
    answered = [o for o in outcomes if o.latency_s is not None]
    latencies = [o.latency_s for o in answered]  # type: ignore[misc]
    taus = [o.mean_tau for o in answered if o.mean_tau is not None]
    met = sum(o.slo_met for o in outcomes)
    nan = float("nan")
    return Summary(
        policy=policy,
        rate=rate,
        requests=len(outcomes),
        attainment=met / len(outcomes) if outcomes else nan,
        mean_latency_s=statistics.mean(latencies) if latencies else nan,
        p50_latency_s=_quantile(latencies, 0.5) if latencies else nan,
        p99_latency_s=_quantile(latencies, 0.99) if latencies else nan,
        throughput_rps=len(answered) / duration,
        goodput_rps=met / duration,
        accuracy=sum(o.correct for o in answered) / len(answered) if answered else nan,
        mean_tau=statistics.mean(taus) if taus else nan,
        rejected=sum(o.status == 429 for o in outcomes),
    )


def plot(
    summaries: Sequence[Summary], path: str | Path, x_label: str = "request rate (req/s)"
) -> Path:
    """Attainment and mean latency against rate (or what `rate` holds: `x_label`), one
    line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (att, lat) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(s.policy for s in summaries):
        mine = sorted((s for s in summaries if s.policy == policy), key=lambda s: s.rate)
        rates = [s.rate for s in mine]
        att.plot(rates, [100 * s.attainment for s in mine], marker="o", label=policy)
        lat.plot(rates, [s.mean_latency_s for s in mine], marker="o", label=policy)
    att.set(xlabel=x_label, ylabel="SLO attainment (%)", title="attainment")
    lat.set(xlabel=x_label, ylabel="mean latency (s)", title="latency")
    for ax in (att, lat):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
