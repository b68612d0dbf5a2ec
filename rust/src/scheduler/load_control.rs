//! Adaptive load control (DESIGN §5, Alg. 2): caps each request's allowed thresholds so the
//! cluster's worst-case load over one SLO window fits its capacity — as written
//! ([`LoadControl::run`]: earliest requests keep the highest thresholds) and *(ours)* with
//! the expected arrivals counted and one level shared by all ([`LoadControl::uniform`]).

use super::predictor::StepsLeft;

/// Load, in tokens processed, of finishing a request with `steps` remaining.
///
/// With caching a cache step processes the block (`block` tokens) and a recompute step
/// `full_tokens` ([`super::request::Request::full_step_tokens`]: the whole sequence, two
/// blocks under the exact cache); without caching every step the whole sequence.
pub fn request_load(steps: StepsLeft, full_tokens: f64, block: f64, caching: bool) -> f64 {
    if caching {
        steps.cache * block + steps.recompute * full_tokens
    } else {
        (steps.cache + steps.recompute) * full_tokens
    }
}

/// Reusable scratch for the prefix/suffix pass, so a round does not allocate.
#[derive(Clone, Debug, Default)]
pub struct LoadControl {
    suffix: Vec<f64>,
    totals: Vec<f64>,
}

/// Highest candidate in `mask` at or below `level`, or the lowest in `mask`.
fn at_most(mask: u32, level: usize) -> usize {
    let below = super::threshold::capped(mask, level);
    if below == 0 {
        mask.trailing_zeros() as usize
    } else {
        31 - below.leading_zeros() as usize
    }
}

impl LoadControl {
    /// Walks `n` requests in order and calls `set_cap(i, k)` with the highest candidate `k`
    /// kept for request `i`.
    ///
    /// `allowed(i)` is request `i`'s non-empty threshold bitmask and `load(i, k)` its load at
    /// candidate `k`. Request `i` keeps the highest allowed `k` with
    /// `committed + load(i, k) + Σ_{j>i} load(j, lowest_j) <= capacity`, or its lowest one;
    /// `committed` sums the loads at the caps already kept. O(n × thresholds).
    ///
    /// Returns whether the load at every request's lowest threshold alone exceeds
    /// `capacity` (overload: no cap can make the load fit).
    pub fn run(
        &mut self,
        n: usize,
        capacity: f64,
        allowed: impl Fn(usize) -> u32,
        load: impl Fn(usize, usize) -> f64,
        mut set_cap: impl FnMut(usize, usize),
    ) -> bool {
        self.suffix.clear();
        self.suffix.resize(n + 1, 0.0);
        for i in (0..n).rev() {
            let lowest = allowed(i).trailing_zeros() as usize;
            self.suffix[i] = self.suffix[i + 1] + load(i, lowest);
        }
        let mut committed = 0.0;
        for i in 0..n {
            let mask = allowed(i);
            let lowest = mask.trailing_zeros() as usize;
            let rest = self.suffix[i + 1];
            let mut chosen = lowest;
            let mut higher = mask & !(1u32 << lowest);
            while higher != 0 {
                let k = 31 - higher.leading_zeros() as usize;
                if committed + load(i, k) + rest <= capacity {
                    chosen = k;
                    break;
                }
                higher &= !(1u32 << k);
            }
            committed += load(i, chosen);
            set_cap(i, chosen);
        }
        self.suffix[0] > capacity
    }

    /// *(ours)* Lowers every request a little rather than the latest a lot: finds the
    /// highest level `L` whose load — each request at its highest allowed candidate at or
    /// below `L`, plus `expected[L]` from arrivals to come — fits `capacity`, caps everyone
    /// at `L`, then raises requests one candidate further, in order, while the spare
    /// capacity lasts. Request `i` has the non-empty threshold bitmask `allowed[i]` and
    /// the loads `loads[i * k..(i + 1) * k]` at the `k` candidates (1 to 32); its cap goes
    /// to `caps[i]`. `expected` holds `k` loads (or none).
    ///
    /// Returns the load of every request at its lowest candidate with the expected
    /// arrivals at the lowest: beyond `capacity`, no cap can make the load fit.
    pub fn uniform(
        &mut self,
        k: usize,
        capacity: f64,
        expected: &[f64],
        allowed: &[u32],
        loads: &[f64],
        caps: &mut [u8],
    ) -> f64 {
        let coming = |level: usize| expected.get(level).copied().unwrap_or(0.0);
        self.totals.clear();
        self.totals.extend((0..k).map(coming));
        // Most requests allow every candidate: their level-`l` load is simply column `l`.
        let every = u32::MAX >> (32 - k);
        for (&mask, row) in allowed.iter().zip(loads.chunks_exact(k)) {
            if mask == every {
                for (total, load) in self.totals.iter_mut().zip(row) {
                    *total += load;
                }
            } else {
                for (level, total) in self.totals.iter_mut().enumerate() {
                    *total += row[at_most(mask, level)];
                }
            }
        }
        let level = (0..k).rev().find(|&l| self.totals[l] <= capacity);
        // Nothing fits: everyone stays at the lowest.
        let mut spare = level.map_or(f64::NEG_INFINITY, |l| capacity - self.totals[l]);
        let level = level.unwrap_or(0);
        for ((&mask, row), cap_out) in allowed.iter().zip(loads.chunks_exact(k)).zip(caps) {
            let (mut cap, next) = if mask == every {
                (level, (level + 1 < k).then_some(level + 1))
            } else {
                let cap = at_most(mask, level);
                let above = mask & !super::threshold::capped(mask, cap);
                (cap, (above != 0).then(|| above.trailing_zeros() as usize))
            };
            if let Some(next) = next {
                let extra = row[next] - row[cap];
                if extra <= spare {
                    spare -= extra;
                    cap = next;
                }
            }
            *cap_out = cap as u8;
        }
        self.totals.first().copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(loads: &[Vec<f64>], masks: &[u32], capacity: f64) -> Vec<usize> {
        let mut caps = vec![usize::MAX; loads.len()];
        let _ = LoadControl::default().run(
            loads.len(),
            capacity,
            |i| masks[i],
            |i, k| loads[i][k],
            |i, k| caps[i] = k,
        );
        caps
    }

    #[test]
    fn early_requests_keep_high_thresholds_first() {
        let loads = vec![vec![10.0, 20.0, 40.0]; 3];
        let masks = [0b111; 3];
        assert_eq!(run(&loads, &masks, 1000.0), vec![2, 2, 2]);
        // 40 + 10 + 10 fits 60; then 40 + 40 + 10 > 60 but 40 + 10 + 10 fits.
        assert_eq!(run(&loads, &masks, 60.0), vec![2, 0, 0]);
        assert_eq!(run(&loads, &masks, 70.0), vec![2, 1, 0]);
        assert_eq!(run(&loads, &masks, 5.0), vec![0, 0, 0]);
        let mut control = LoadControl::default();
        let overloaded = |control: &mut LoadControl, capacity| {
            control.run(3, capacity, |_| 0b111, |i, k| loads[i][k], |_, _| {})
        };
        assert!(
            overloaded(&mut control, 29.0),
            "3 x 10 at the lowest exceeds 29"
        );
        assert!(!overloaded(&mut control, 30.0));
        // A request's own allowed set is respected.
        assert_eq!(run(&loads, &[0b110, 0b111, 0b011], 1000.0), vec![2, 2, 1]);
    }

    #[test]
    fn load_units_follow_step_shapes() {
        let s = StepsLeft {
            cache: 10.0,
            recompute: 2.0,
        };
        assert_eq!(
            request_load(s, 400.0, 32.0, true),
            10.0 * 32.0 + 2.0 * 400.0
        );
        assert_eq!(request_load(s, 400.0, 32.0, false), 12.0 * 400.0);
    }

    fn uniform(loads: &[Vec<f64>], masks: &[u32], capacity: f64, expected: &[f64]) -> Vec<usize> {
        let mut caps = vec![u8::MAX; loads.len()];
        let _ = LoadControl::default().uniform(
            loads[0].len(),
            capacity,
            expected,
            masks,
            &loads.concat(),
            &mut caps,
        );
        caps.into_iter().map(usize::from).collect()
    }

    #[test]
    fn uniform_lowers_everyone_a_little_and_counts_arrivals_to_come() {
        let loads = vec![vec![10.0, 20.0, 40.0]; 3];
        let masks = [0b111; 3];
        assert_eq!(uniform(&loads, &masks, 1000.0, &[]), vec![2, 2, 2]);
        // 3 x 20 fits 70 and leaves 10: not enough to raise anyone to 40 (extra 20).
        assert_eq!(uniform(&loads, &masks, 70.0, &[]), vec![1, 1, 1]);
        // The paper's walk keeps the first request at the top and drops the last instead.
        assert_eq!(run(&loads, &masks, 70.0), vec![2, 1, 0]);
        // Spare capacity raises the earliest first.
        assert_eq!(uniform(&loads, &masks, 80.0, &[]), vec![2, 1, 1]);
        // Expected arrivals take their share: 30 + 3 x 20 > 80, so the level drops to 10
        // (45 in all) and the spare 35 raises everyone one step.
        assert_eq!(
            uniform(&loads, &masks, 80.0, &[15.0, 30.0, 60.0]),
            vec![1, 1, 1]
        );
        assert_eq!(
            uniform(&loads, &masks, 60.0, &[15.0, 30.0, 60.0]),
            vec![1, 0, 0]
        );
        // Allowed sets are respected.
        assert_eq!(
            uniform(&loads, &[0b100, 0b011, 0b111], 1000.0, &[]),
            vec![2, 1, 2]
        );
        assert_eq!(
            uniform(&loads, &[0b100, 0b011, 0b111], 5.0, &[]),
            vec![2, 0, 0]
        );
        let lowest_load = |capacity: f64, expected: &[f64]| {
            LoadControl::default().uniform(
                3,
                capacity,
                expected,
                &[0b111; 3],
                &loads.concat(),
                &mut [0; 3],
            )
        };
        assert_eq!(lowest_load(30.0, &[]), 30.0);
        assert_eq!(lowest_load(30.0, &[1.0, 1.0, 1.0]), 31.0);
    }

    fn case() -> impl Strategy<Value = (Vec<Vec<f64>>, Vec<u32>, f64)> {
        (1usize..6).prop_flat_map(|k| {
            let row = prop::collection::vec(0.0f64..1000.0, k);
            let mask = 1u32..(1u32 << k);
            (prop::collection::vec((row, mask), 1..40), 0.0f64..20_000.0).prop_map(|(rows, cap)| {
                let (loads, masks) = rows.into_iter().unzip();
                (loads, masks, cap)
            })
        })
    }

    proptest! {
        /// After load control the worst-case load at every request's highest kept threshold
        /// fits capacity, unless every request is already at its lowest allowed threshold.
        #[test]
        fn worst_case_load_fits_capacity((loads, masks, capacity) in case()) {
            let caps = run(&loads, &masks, capacity);
            let mut total = 0.0;
            let mut all_lowest = true;
            for (i, &k) in caps.iter().enumerate() {
                prop_assert!(masks[i] & (1 << k) != 0, "cap outside the allowed set");
                all_lowest &= k == masks[i].trailing_zeros() as usize;
                total += loads[i][k];
            }
            prop_assert!(all_lowest || total <= capacity * (1.0 + 1e-9) + 1e-9,
                "total {total} > capacity {capacity}");
        }

        /// Uniform caps fit capacity unless everyone is at their lowest, and stay in the
        /// allowed set.
        #[test]
        fn uniform_caps_fit_capacity((loads, masks, capacity) in case()) {
            let caps = uniform(&loads, &masks, capacity, &[]);
            let mut total = 0.0;
            let mut all_lowest = true;
            for (i, &k) in caps.iter().enumerate() {
                prop_assert!(masks[i] & (1 << k) != 0, "cap outside the allowed set");
                all_lowest &= k == masks[i].trailing_zeros() as usize;
                total += loads[i][k];
            }
            prop_assert!(all_lowest || total <= capacity * (1.0 + 1e-9) + 1e-9);
        }

        /// The caps are the definition's: each request's highest allowed candidate at or
        /// below the highest level that fits, raised one candidate in order while the spare
        /// lasts (checks the shortcuts for requests that allow every candidate).
        #[test]
        fn uniform_matches_its_definition(
            (loads, masks, capacity) in case(),
            full in prop::collection::vec(any::<bool>(), 40),
            expected in prop::collection::vec(0.0f64..2000.0, 5),
        ) {
            let k = loads[0].len();
            let every = u32::MAX >> (32 - k);
            let masks: Vec<u32> =
                masks.iter().zip(&full).map(|(&m, &f)| if f { every } else { m }).collect();
            let expected = &expected[..k];
            let total = |level: usize| {
                loads.iter().zip(&masks).fold(expected[level], |t, (row, &m)| t + row[at_most(m, level)])
            };
            let level = (0..k).rev().find(|&l| total(l) <= capacity);
            let mut spare = level.map_or(f64::NEG_INFINITY, |l| capacity - total(l));
            let level = level.unwrap_or(0);
            let mut want = Vec::new();
            for (row, &m) in loads.iter().zip(&masks) {
                let mut cap = at_most(m, level);
                let above = m & !super::super::threshold::capped(m, cap);
                if above != 0 {
                    let next = above.trailing_zeros() as usize;
                    if row[next] - row[cap] <= spare {
                        spare -= row[next] - row[cap];
                        cap = next;
                    }
                }
                want.push(cap);
            }
            prop_assert_eq!(uniform(&loads, &masks, capacity, expected), want);
        }

        /// More capacity never lowers the first request's cap.
        #[test]
        fn more_capacity_never_hurts_the_first((loads, masks, capacity) in case(), extra in 0.0f64..5000.0) {
            let a = run(&loads, &masks, capacity);
            let b = run(&loads, &masks, capacity + extra);
            prop_assert!(a[0] <= b[0]);
        }
    }
}
