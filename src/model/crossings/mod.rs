//! The crossings: the interfaces through which the block crosses ranks. The model is written once
//! in one rank's shapes (`LocalShapes`); the few points where its data meets other ranks' go
//! through these traits, so the block never knows the layout:
//!
//! - `tensor`: `TensorParallelOps`, the tensor/sequence-parallel group (row gathers and
//!   reduce-scatters around the column- and row-parallel linears, the vocabulary-parallel loss);
//! - `context`: `ContextParallelOps`, attention over a sequence split across the context-parallel
//!   group, and `SequenceShard`, which positions a rank holds;
//! - `expert`: `ExpertParallelOps`, the all-to-alls of a mixture of experts' rows;
//! - `single_rank`: `SingleRank`, degree 1 in all three, for one process (each operation is the
//!   local one).
//!
//! Their implementations over process groups, with the collectives, live above the model under
//! `parallel/` (`tp.rs`, `cp.rs`, `ep.rs`); the model defines the interface and never imports
//! `parallel/`.

pub mod context;
pub mod expert;
pub mod single_rank;
pub mod tensor;
