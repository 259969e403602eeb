//! Training: AdamW and clipping, the lr schedule, memory accounting, metrics, and the loop itself.

pub mod banner;
pub mod compose;
pub mod fit;
pub mod lr;
pub mod memory;
pub mod metrics;
pub mod muon;
pub mod optimizer;
pub mod place;
pub mod profiler;
pub mod replicas;
pub mod save;
pub mod semi_sync;
pub mod start;
pub mod step;
pub mod tensorboard;
pub mod threads;
pub mod trainer;
pub mod validate;

pub use trainer::{train, RunOptions, TrainSummary};
