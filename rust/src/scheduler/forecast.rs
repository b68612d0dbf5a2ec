//! *(ours)* Arrivals expected soon: the recent arrival rate and the mean load an arrival
//! brings at each candidate threshold, so load control can count work that has not
//! arrived yet (DESIGN §5's note: checking only the active requests binds too late).

use std::collections::VecDeque;

/// Sliding record of admitted arrivals: `(time, load at each candidate threshold)`.
#[derive(Clone, Debug, Default)]
pub struct ArrivalForecast {
    times: VecDeque<f64>,
    /// Loads of the arrivals in `times`, `k` per arrival.
    loads: VecDeque<f64>,
    sums: Vec<f64>,
    first: Option<f64>,
}

impl ArrivalForecast {
    /// Records an arrival at `time` with `loads[k]` at candidate `k`.
    pub fn record(&mut self, time: f64, loads: &[f64]) {
        if self.sums.len() != loads.len() {
            self.sums = vec![0.0; loads.len()];
            self.times.clear();
            self.loads.clear();
        }
        self.first.get_or_insert(time);
        self.times.push_back(time);
        self.loads.extend(loads);
        for (s, l) in self.sums.iter_mut().zip(loads) {
            *s += l;
        }
    }

    /// Load expected to arrive within the next `window` seconds at each candidate, from the
    /// arrivals of the last `horizon` seconds before `now`, written to `out`.
    ///
    /// The rate is measured over the horizon, or since the first arrival if that is
    /// shorter, but never over less than one window (a burst of the first few requests is
    /// not a rate).
    pub fn expected(&mut self, now: f64, window: f64, horizon: f64, out: &mut Vec<f64>) {
        while self.times.front().is_some_and(|&t| t < now - horizon) {
            self.times.pop_front();
            for s in &mut self.sums {
                *s -= self.loads.pop_front().unwrap_or(0.0);
            }
        }
        out.clear();
        let Some(first) = self.first else {
            return;
        };
        let span = (now - first).min(horizon).max(window);
        out.extend(self.sums.iter().map(|s| s.max(0.0) * window / span));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_load_is_rate_times_window_times_mean_load() {
        let mut f = ArrivalForecast::default();
        let mut out = vec![];
        f.expected(0.0, 1.0, 10.0, &mut out);
        assert!(out.is_empty(), "nothing known before the first arrival");
        // 2 arrivals per second for 10 s, loads 10 and 20 at two thresholds.
        for i in 0..20 {
            f.record(f64::from(i) * 0.5, &[10.0, 20.0]);
        }
        f.expected(10.0, 2.0, 10.0, &mut out);
        assert_eq!(out, vec![2.0 * 2.0 * 10.0, 2.0 * 2.0 * 20.0]);
        // Old arrivals leave the horizon.
        f.expected(25.0, 2.0, 10.0, &mut out);
        assert_eq!(out, vec![0.0, 0.0]);
    }

    #[test]
    fn a_first_burst_is_spread_over_at_least_one_window() {
        let mut f = ArrivalForecast::default();
        let mut out = vec![];
        for _ in 0..4 {
            f.record(0.0, &[1.0]);
        }
        f.expected(0.001, 2.0, 60.0, &mut out);
        assert_eq!(out, vec![4.0]);
    }
}
