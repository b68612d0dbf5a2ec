//! *(ours)* Load shedding for deadline admission: under sustained overload, refuse the share
//! of arrivals the cluster cannot carry even at the lowest thresholds, spread evenly over
//! arrivals, instead of refusing every arrival while a burst lasts.
//!
//! The share comes from the *offered* load (every arrival, admitted or not, over the last
//! few windows) against the capacity load control plans with, so it settles where the
//! admitted load fits: shedding by the admitted load alone would stop as soon as it worked.

use super::forecast::ArrivalForecast;

#[derive(Clone, Debug, Default)]
pub(super) struct LoadShedder {
    offered: ArrivalForecast,
    /// Share of arrivals to refuse, from the last round.
    fraction: f64,
    /// Error diffusion: refusals owed; an arrival is refused when it reaches one.
    owed: f64,
    expected: Vec<f64>,
}

impl LoadShedder {
    /// Counts an arrival's load at each threshold, before admission decides on it.
    pub fn offer(&mut self, time: f64, loads: &[f64]) {
        self.offered.record(time, loads);
    }

    /// Sets the share to refuse: the part of the offered load at the lowest threshold
    /// expected within `window` that exceeds `capacity` (load per window).
    pub fn update(&mut self, now: f64, window: f64, horizon: f64, capacity: f64) {
        self.offered
            .expected(now, window, horizon, &mut self.expected);
        let offered = self.expected.first().copied().unwrap_or(0.0);
        self.fraction = if offered > capacity && offered > 0.0 {
            1.0 - capacity / offered
        } else {
            0.0
        };
    }

    /// Whether to refuse the next arrival.
    pub fn refuse_next(&mut self) -> bool {
        self.owed += self.fraction;
        if self.owed >= 1.0 {
            self.owed -= 1.0;
            return true;
        }
        false
    }

    pub fn fraction(&self) -> f64 {
        self.fraction
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_the_excess_share_evenly() {
        let mut s = LoadShedder::default();
        for i in 0..400 {
            s.offer(f64::from(i) * 0.025, &[1.0, 2.0]); // 40 per second at load 1
        }
        s.update(10.0, 1.0, 10.0, 30.0);
        assert!((s.fraction() - 0.25).abs() < 1e-9);
        let refused: Vec<bool> = (0..8).map(|_| s.refuse_next()).collect();
        assert_eq!(refused.iter().filter(|&&r| r).count(), 2);
        assert!(!refused[0] && refused[3] && refused[7], "{refused:?}");
    }

    #[test]
    fn refuses_nothing_within_capacity_or_before_any_arrival() {
        let mut s = LoadShedder::default();
        s.update(0.0, 1.0, 10.0, 30.0);
        assert!(!s.refuse_next());
        for i in 0..100 {
            s.offer(f64::from(i) * 0.1, &[1.0]);
        }
        s.update(10.0, 1.0, 10.0, 30.0);
        assert_eq!(s.fraction(), 0.0);
        assert!((0..100).all(|_| !s.refuse_next()));
    }
}
