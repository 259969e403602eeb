//! Pipeline parallelism: the model cut into stages of whole blocks over the `pp` ranks (`stage`),
//! the schedules that order each rank's forwards and backwards over the microbatches
//! (`schedule`), the transfers of activations and gradients between ranks (`transfer`), and what a
//! rank holds (`rank`); the one walk (`parallel::walk`) runs its schedule.

mod actions;
mod dual_pipe_v;
mod interleaved;
mod list_schedule;
pub mod plan;
pub mod rank;
mod rank_actions;
pub mod schedule;
pub mod stage;
pub mod transfer;
