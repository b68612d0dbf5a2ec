//! SLO-aware threshold choice (DESIGN §4, Alg. 1): the highest allowed threshold whose
//! predicted remaining time fits the request's remaining SLO budget.

use super::predictor::StepsLeft;

/// Seconds one step of each shape is expected to take on an instance.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepPrices {
    /// A block-only (cache) step; equals `full` when caching is off.
    pub cache: f64,
    /// A full-sequence (recompute or no-cache) step.
    pub full: f64,
}

/// Predicted seconds left for a request with `steps` remaining at the given prices.
pub fn remaining_seconds(steps: StepsLeft, prices: StepPrices) -> f64 {
    steps.cache * prices.cache + steps.recompute * prices.full
}

/// Index of the chosen threshold among the candidates.
///
/// `allowed` is a non-empty bitmask over candidate indices (ascending thresholds); `steps[k]`
/// is the prediction at candidate `k`. Walks allowed thresholds from highest to lowest and
/// returns the first whose estimate fits `slo_left`, else the lowest allowed one.
pub fn choose_threshold(
    allowed: u32,
    steps: &[StepsLeft],
    prices: StepPrices,
    slo_left: f64,
) -> usize {
    debug_assert!(allowed != 0, "allowed threshold set must not be empty");
    let lowest = allowed.trailing_zeros() as usize;
    let mut rest = allowed;
    while rest != 0 {
        let k = 31 - rest.leading_zeros() as usize;
        if k == lowest || remaining_seconds(steps[k], prices) <= slo_left {
            return k;
        }
        rest &= !(1u32 << k);
    }
    lowest
}

/// `allowed` restricted to candidates at or below index `cap`.
pub fn capped(allowed: u32, cap: usize) -> u32 {
    let below = if cap >= 31 {
        u32::MAX
    } else {
        (1u32 << (cap + 1)) - 1
    };
    allowed & below
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn steps(totals: &[f64]) -> Vec<StepsLeft> {
        totals
            .iter()
            .map(|&t| StepsLeft {
                cache: t - 1.0,
                recompute: 1.0,
            })
            .collect()
    }

    const PRICES: StepPrices = StepPrices {
        cache: 0.01,
        full: 0.05,
    };

    #[test]
    fn picks_highest_fitting_threshold() {
        // Estimates: 0.14, 0.24, 0.54 s for candidates 0, 1, 2.
        let s = steps(&[10.0, 20.0, 50.0]);
        assert_eq!(choose_threshold(0b111, &s, PRICES, 1.0), 2);
        assert_eq!(choose_threshold(0b111, &s, PRICES, 0.3), 1);
        assert_eq!(choose_threshold(0b111, &s, PRICES, 0.1), 0);
        assert_eq!(choose_threshold(0b110, &s, PRICES, 0.1), 1);
        assert_eq!(choose_threshold(0b101, &s, PRICES, 0.3), 0);
        assert_eq!(choose_threshold(capped(0b111, 1), &s, PRICES, 1.0), 1);
    }

    #[test]
    fn capped_keeps_bits_at_or_below() {
        assert_eq!(capped(0b1011, 1), 0b11);
        assert_eq!(capped(0b1011, 0), 0b1);
        assert_eq!(capped(u32::MAX, 31), u32::MAX);
    }

    proptest! {
        /// The chosen threshold never decreases when the remaining budget grows.
        #[test]
        fn choice_is_monotone_in_budget(
            totals in prop::collection::vec(1.0f64..500.0, 1..8),
            mask_bits in 1u32..255,
            b1 in 0.0f64..10.0,
            extra in 0.0f64..10.0,
            cache_price in 0.0001f64..0.1,
            full_price in 0.0001f64..0.5,
        ) {
            let s = steps(&totals);
            let allowed = mask_bits & ((1u32 << totals.len()) - 1);
            prop_assume!(allowed != 0);
            let prices = StepPrices { cache: cache_price, full: full_price };
            let low = choose_threshold(allowed, &s, prices, b1);
            let high = choose_threshold(allowed, &s, prices, b1 + extra);
            prop_assert!(low <= high);
            prop_assert!(allowed & (1 << low) != 0 && allowed & (1 << high) != 0);
        }
    }
}
