//! Request classes from a window of recent arrivals: bin by prompt and output length at
//! the window's own quantiles, so each bin holds a similar share of requests whatever the
//! length distribution, and rate = arrivals per second plus a safety margin.

use serde::{Deserialize, Serialize};

use super::error::PlannerError;
use super::inputs::RequestClass;

/// One observed request.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Arrival {
    /// Seconds on any clock shared by the window bounds.
    pub time: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
}

/// How to bin a window into classes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct BinSpec {
    pub prompt_bins: usize,
    pub output_bins: usize,
    /// Rates are scaled by `1 + rate_margin`, headroom for the next window's growth.
    pub rate_margin: f64,
}

impl Default for BinSpec {
    /// 2 × 4 bins (8 classes) with a 10 % rate margin.
    fn default() -> Self {
        Self {
            prompt_bins: 2,
            output_bins: 4,
            rate_margin: 0.10,
        }
    }
}

/// Arrivals in `[start, end)`, after checking every arrival and the window.
pub fn window(arrivals: &[Arrival], start: f64, end: f64) -> Result<Vec<Arrival>, PlannerError> {
    if !(start.is_finite() && end.is_finite() && start < end) {
        return Err(PlannerError::BadSetting {
            name: "window",
            value: end - start,
            reason: "the window end must be finite and after its start",
        });
    }
    for (index, a) in arrivals.iter().enumerate() {
        if !a.time.is_finite() {
            return Err(PlannerError::BadArrival {
                index,
                reason: "arrival time is not finite",
            });
        }
        if a.output_tokens == 0 {
            return Err(PlannerError::BadArrival {
                index,
                reason: "output tokens must be positive",
            });
        }
    }
    let inside: Vec<Arrival> = arrivals
        .iter()
        .copied()
        .filter(|a| a.time >= start && a.time < end)
        .collect();
    if inside.is_empty() {
        return Err(PlannerError::EmptyWindow { start, end });
    }
    Ok(inside)
}

/// Upper edges splitting `values` into `bins` groups of similar size (duplicates merged).
fn quantile_edges(values: &mut [u64], bins: usize) -> Vec<u64> {
    values.sort_unstable();
    let mut edges: Vec<u64> = (1..bins).map(|i| values[i * values.len() / bins]).collect();
    edges.dedup();
    edges
}

/// Bins the arrivals of `[start, end)` into classes with mean lengths and margin-scaled
/// rates; empty bins are dropped, classes come in (prompt bin, output bin) order.
pub fn classes_from_arrivals(
    arrivals: &[Arrival],
    start: f64,
    end: f64,
    spec: &BinSpec,
) -> Result<Vec<RequestClass>, PlannerError> {
    if spec.prompt_bins == 0 || spec.output_bins == 0 {
        return Err(PlannerError::BadSetting {
            name: "bins",
            value: spec.prompt_bins.min(spec.output_bins) as f64,
            reason: "prompt and output bins must be at least 1",
        });
    }
    if !(spec.rate_margin.is_finite() && spec.rate_margin >= 0.0) {
        return Err(PlannerError::BadSetting {
            name: "rate_margin",
            value: spec.rate_margin,
            reason: "must be non-negative",
        });
    }
    let inside = window(arrivals, start, end)?;
    let mut prompts: Vec<u64> = inside.iter().map(|a| a.prompt_tokens).collect();
    let mut outputs: Vec<u64> = inside.iter().map(|a| a.output_tokens).collect();
    let p_edges = quantile_edges(&mut prompts, spec.prompt_bins);
    let o_edges = quantile_edges(&mut outputs, spec.output_bins);
    let cells = (p_edges.len() + 1) * (o_edges.len() + 1);
    // Per cell: count, prompt sum, output sum.
    let mut sums = vec![(0usize, 0.0f64, 0.0f64); cells];
    for a in &inside {
        let p = p_edges.partition_point(|&e| e <= a.prompt_tokens);
        let o = o_edges.partition_point(|&e| e <= a.output_tokens);
        let cell = &mut sums[p * (o_edges.len() + 1) + o];
        cell.0 += 1;
        cell.1 += a.prompt_tokens as f64;
        cell.2 += a.output_tokens as f64;
    }
    let scale = (1.0 + spec.rate_margin) / (end - start);
    Ok(sums
        .into_iter()
        .filter(|c| c.0 > 0)
        .map(|(n, p, o)| RequestClass {
            prompt_tokens: p / n as f64,
            output_tokens: o / n as f64,
            rate: n as f64 * scale,
            slo_seconds: None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrival(time: f64, p: u64, o: u64) -> Arrival {
        Arrival {
            time,
            prompt_tokens: p,
            output_tokens: o,
        }
    }

    #[test]
    fn bins_at_quantiles_with_margin() {
        let arrivals: Vec<Arrival> = (0..100)
            .map(|i| {
                arrival(
                    i as f64 * 0.1,
                    if i % 2 == 0 { 100 } else { 1000 },
                    10 + i as u64,
                )
            })
            .collect();
        let spec = BinSpec {
            prompt_bins: 2,
            output_bins: 2,
            rate_margin: 0.5,
        };
        let classes = classes_from_arrivals(&arrivals, 0.0, 10.0, &spec).unwrap();
        assert_eq!(classes.len(), 4);
        let total: f64 = classes.iter().map(|c| c.rate).sum();
        assert!((total - 100.0 / 10.0 * 1.5).abs() < 1e-9);
        assert_eq!(classes[0].prompt_tokens, 100.0);
        assert_eq!(classes[3].prompt_tokens, 1000.0);
        assert!(classes[0].output_tokens < classes[1].output_tokens);
    }

    #[test]
    fn window_bounds_and_bad_input() {
        let arrivals = vec![arrival(0.0, 5, 5), arrival(5.0, 5, 5), arrival(10.0, 5, 5)];
        let spec = BinSpec::default();
        let classes = classes_from_arrivals(&arrivals, 0.0, 10.0, &spec).unwrap();
        assert_eq!(classes.len(), 1);
        assert!((classes[0].rate - 2.0 / 10.0 * 1.1).abs() < 1e-12);
        assert!(matches!(
            classes_from_arrivals(&arrivals, 20.0, 30.0, &spec),
            Err(PlannerError::EmptyWindow { .. })
        ));
        assert!(classes_from_arrivals(&arrivals, 5.0, 5.0, &spec).is_err());
        let bad = vec![arrival(1.0, 5, 0)];
        assert!(matches!(
            classes_from_arrivals(&bad, 0.0, 10.0, &spec),
            Err(PlannerError::BadArrival { index: 0, .. })
        ));
    }
}
