//! Pipeline parallelism: the model cut into stages of whole blocks over the `pp` ranks (`stage`),
//! the schedules that order each rank's forwards and backwards over the microbatches
//! (`schedule`), the transfers of activations and gradients between ranks (`transfer`), and a
//! rank running its schedule (`runtime`).

pub mod plan;
pub mod runtime;
pub mod schedule;
pub mod stage;
pub mod transfer;
