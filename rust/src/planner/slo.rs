//! The SLO convention of the evaluation (DESIGN §9): a multiple of the mean latency of a
//! request served alone on a TP-1 instance at the highest candidate threshold, with its
//! output padded to whole blocks and its cache steps attending to its whole sequence (under
//! block diffusion's exact cache: up to the end of their block).

use super::classes::Arrival;
use super::error::PlannerError;
use super::inputs::ThresholdOption;
use crate::profile::{LatencyProfile, StepKind};

/// Mean seconds a request of `arrivals` takes alone on a TP-1 instance when each step
/// commits `tokens_per_step` tokens. With caching, each block opens with a recompute
/// step over the whole sequence; under the `exact` cache only the first step prefills
/// (its prompt and first block), and cache steps attend up to their block's end.
pub fn mean_isolated_latency(
    profile: &LatencyProfile,
    arrivals: &[Arrival],
    top: ThresholdOption,
    caching: bool,
    exact: bool,
    block_length: u32,
) -> Result<f64, PlannerError> {
    if arrivals.is_empty() {
        return Err(PlannerError::BadSetting {
            name: "arrivals",
            value: 0.0,
            reason: "at least one arrival is needed",
        });
    }
    if !(top.tokens_per_step.is_finite() && top.tokens_per_step > 0.0) || block_length == 0 {
        return Err(PlannerError::BadThreshold {
            index: 0,
            reason: "tokens per step and block length must be positive".into(),
        });
    }
    let block = block_length as f64;
    let mut total = 0.0;
    for a in arrivals {
        // The worker decodes whole blocks, so the output it runs is padded to them.
        let blocks = (a.output_tokens as f64 / block).ceil();
        let output = blocks * block;
        let sequence = a.prompt_tokens as f64 + output;
        let steps = output / top.tokens_per_step;
        let prompt = a.prompt_tokens as f64;
        total += if caching && exact {
            // Cache steps attend to the prefix up to their block's end: on average
            // halfway through the output, plus half a block.
            let context = prompt + (output + block) / 2.0;
            profile.step_time(1, StepKind::Recompute, prompt + block, prompt + block)?
                + (steps - 1.0).max(0.0) * profile.step_time(1, StepKind::Cache, block, context)?
        } else if caching {
            blocks * profile.step_time(1, StepKind::Recompute, sequence, sequence)?
                + (steps - blocks).max(0.0)
                    * profile.step_time(1, StepKind::Cache, block, sequence)?
        } else {
            steps * profile.latency(1, StepKind::NoCache, sequence)?
        };
    }
    Ok(total / arrivals.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_of_steps_times_step_latency() {
        let profile =
            LatencyProfile::from_tables([(1, StepKind::NoCache, vec![(100, 0.01), (200, 0.02)])])
                .unwrap();
        let arrivals = [
            Arrival {
                time: 0.0,
                prompt_tokens: 50,
                output_tokens: 50,
            },
            Arrival {
                time: 1.0,
                prompt_tokens: 100,
                output_tokens: 100,
            },
        ];
        let top = ThresholdOption {
            threshold: 0.9,
            tokens_per_step: 2.0,
        };
        let t = mean_isolated_latency(&profile, &arrivals, top, false, false, 25).unwrap();
        // 25 steps × 0.01 s and 50 steps × 0.02 s.
        assert!((t - (0.25 + 1.0) / 2.0).abs() < 1e-12);
        assert!(mean_isolated_latency(&profile, &arrivals, top, true, false, 25).is_err());
    }

    #[test]
    fn outputs_pad_to_whole_blocks_and_cache_steps_see_the_context() {
        let profile = LatencyProfile::from_context_tables([
            (1, StepKind::NoCache, None, vec![(100, 0.01), (200, 0.02)]),
            (1, StepKind::Recompute, None, vec![(100, 0.01), (200, 0.02)]),
            (1, StepKind::Cache, Some(100), vec![(32, 0.001)]),
            (1, StepKind::Cache, Some(200), vec![(32, 0.003)]),
        ])
        .unwrap();
        // 40 output tokens run as 64: 32 steps over a 124-token sequence.
        let one = [Arrival {
            time: 0.0,
            prompt_tokens: 60,
            output_tokens: 40,
        }];
        let top = ThresholdOption {
            threshold: 0.9,
            tokens_per_step: 2.0,
        };
        let t = mean_isolated_latency(&profile, &one, top, false, false, 32).unwrap();
        assert!((t - 32.0 * 0.0124).abs() < 1e-12);
        // Caching: 2 recompute steps and 30 cache steps attending to 124 tokens.
        let t = mean_isolated_latency(&profile, &one, top, true, false, 32).unwrap();
        assert!((t - (2.0 * 0.0124 + 30.0 * 0.00148)).abs() < 1e-12);
    }
}
