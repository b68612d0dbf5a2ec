//! Errors of loading a LightGBM model and of the learned predictor.

#[derive(Debug, thiserror::Error)]
pub enum GbmError {
    #[error("cannot read LightGBM model {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// The text is not a well-formed LightGBM text model.
    #[error("malformed LightGBM model (line {line}): {reason}")]
    Parse { line: usize, reason: String },
    /// A well-formed model that uses something native inference does not evaluate.
    #[error("unsupported LightGBM model: {0}")]
    Unsupported(String),
    /// The model's features are not the predictor's (see `features::FEATURE_NAMES`).
    #[error("LightGBM model features do not fit the step predictor: {0}")]
    Features(String),
    /// A row of the wrong width was given for evaluation.
    #[error("expected rows of {expected} features, got {got} values")]
    RowWidth { expected: usize, got: usize },
}
