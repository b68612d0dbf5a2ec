//! The learned step predictor (DESIGN §3): LightGBM regressors trained offline in Python
//! (`dilaserve predictor train`), evaluated here natively.
//!
//! Why a hand-written reader rather than a crate: the crates that run LightGBM models
//! either bind its C library (they download prebuilt binaries at build time, which a
//! machine without that network access cannot do, and their boosters are not `Sync`), or
//! are single young releases that do not document LightGBM's missing-value rules. The text
//! format is small and stable, prediction is a sum of tree walks, and the scheduler needs
//! one thing no general reader offers: a request evaluated at every candidate threshold in
//! one walk per tree ([`Forest::predict_varying`]).

mod error;
mod features;
mod forest;
mod gbm;
mod specialized;
mod text_format;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_gbm;

pub use error::GbmError;
pub use features::{known_features, FeatureMap, FEATURE_NAMES, KNOWN_FEATURES};
pub use forest::{Forest, OutputTransform};
pub use gbm::{GbmPredictor, RECOMPUTE_SUFFIX};
