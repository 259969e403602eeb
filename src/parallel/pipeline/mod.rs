//! Pipeline parallelism: the model cut into stages of whole blocks over the `pp` ranks, and the
//! schedules that order each rank's forwards and backwards over the microbatches
//! (`schedule`).

pub mod schedule;
