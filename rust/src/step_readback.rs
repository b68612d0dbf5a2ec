//! A worker's step read-back, turned into its report's columns in one pass: the commit's
//! host copy (per row: committed flags, new ids, confidences, Dream grid steps) becomes the
//! committed block positions and tokens of every row and the confidence statistics the
//! step predictor reads (DESIGN §3). A step's host time then no longer grows by a dozen
//! array operations per row.

use crate::step_report::CONFIDENCE_STATS as STATS;

/// Quantile levels of the statistics other than the mean, in `STATS` order.
const LEVELS: [f64; 4] = [0.0, 0.25, 0.5, 0.75];

/// One step's read-back as report columns.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReadBack {
    /// Committed positions per row.
    pub counts: Vec<u32>,
    /// Committed block positions (offsets in the row's block), row after row, ascending.
    pub positions: Vec<u32>,
    /// Their tokens.
    pub tokens: Vec<u32>,
    /// `CONFIDENCE_STATS` per row (min, q25, median, mean, q75); NaN for a row without
    /// candidates.
    pub stats: Vec<f64>,
    /// Steps of Dream's grid each row passed.
    pub timesteps: Vec<u32>,
}

/// Reads `host` (`rows` × `3 * width + 1`, row-major: committed flags, ids, confidences,
/// grid steps) where row `i`'s first `candidates[i]` columns are its candidates and
/// `columns[i * width + j]` is the block position of its column `j`.
pub fn read_back(
    host: &[f64],
    rows: usize,
    width: usize,
    candidates: &[u32],
    columns: &[i64],
) -> Result<ReadBack, String> {
    let stride = 3 * width + 1;
    if host.len() != rows * stride || candidates.len() != rows || columns.len() != rows * width {
        return Err(format!(
            "a read-back of {rows} rows of width {width} needs {} values, {rows} candidate \
             counts and {} columns; got {}, {} and {}",
            rows * stride,
            rows * width,
            host.len(),
            candidates.len(),
            columns.len()
        ));
    }
    let mut out = ReadBack {
        counts: Vec::with_capacity(rows),
        stats: Vec::with_capacity(rows * STATS),
        timesteps: Vec::with_capacity(rows),
        ..ReadBack::default()
    };
    let mut ordered = Vec::with_capacity(width);
    for (i, row) in host.chunks_exact(stride).enumerate() {
        let n = (candidates[i] as usize).min(width);
        let (committed, rest) = row.split_at(width);
        let (ids, rest) = rest.split_at(width);
        let (confidence, passed) = rest.split_at(width);
        let before = out.positions.len();
        for j in (0..n).filter(|&j| committed[j] != 0.0) {
            out.positions.push(columns[i * width + j] as u32);
            out.tokens.push(ids[j] as u32);
        }
        out.counts.push((out.positions.len() - before) as u32);
        out.timesteps.push(passed[0] as u32);
        ordered.clear();
        ordered.extend_from_slice(&confidence[..n]);
        out.stats.extend(statistics(&mut ordered));
    }
    Ok(out)
}

/// min, q25, median, mean, q75 of `values` (reordered), the quantiles interpolated
/// linearly between order statistics as `torch.quantile` does; NaN when empty.
fn statistics(values: &mut [f64]) -> [f64; STATS] {
    if values.is_empty() {
        return [f64::NAN; STATS];
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    values.sort_by(f64::total_cmp);
    let last = (values.len() - 1) as f64;
    let [low, q25, median, q75] = LEVELS.map(|level| {
        let rank = last * level;
        let (below, above) = (values[rank.floor() as usize], values[rank.ceil() as usize]);
        below + (above - below) * (rank - rank.floor())
    });
    [low, q25, median, mean, q75]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_read_back_as_report_columns() {
        // Two rows of width 3: row 0 has 3 candidates (columns 0 and 2 committed), row 1
        // has one candidate, committed.
        let host = [
            1.0, 0.0, 1.0, 11.0, 12.0, 13.0, 0.9, 0.1, 0.5, 1.0, //
            1.0, 0.0, 0.0, 21.0, 99.0, 99.0, 0.8, -1.0, -1.0, 2.0,
        ];
        let columns = [0, 2, 3, 1, 1, 1];
        let out = read_back(&host, 2, 3, &[3, 1], &columns).unwrap();
        assert_eq!(out.counts, vec![2, 1]);
        assert_eq!(out.positions, vec![0, 3, 1]);
        assert_eq!(out.tokens, vec![11, 13, 21]);
        assert_eq!(out.timesteps, vec![1, 2]);
        let expected = [0.1, 0.3, 0.5, 0.5, 0.7];
        for (got, want) in out.stats[..5].iter().zip(expected) {
            assert!((got - want).abs() < 1e-12, "{got} != {want}");
        }
        assert_eq!(out.stats[5..], [0.8; 5]);
    }

    #[test]
    fn a_row_without_candidates_has_nan_statistics() {
        let host = [0.0, 5.0, -1.0, 1.0];
        let out = read_back(&host, 1, 1, &[0], &[0]).unwrap();
        assert_eq!((out.counts, out.positions), (vec![0], vec![]));
        assert!(out.stats.iter().all(|s| s.is_nan()));
    }

    #[test]
    fn a_mis_shaped_read_back_is_refused() {
        assert!(read_back(&[0.0; 4], 2, 1, &[1, 1], &[0, 0]).is_err());
    }
}
