//! titan: Llama pretraining in Rust. Modules follow the layers of DESIGN.md, bottom to top:
//! tensor/backend → model → train → checkpoint → data → config/cli/launch/plan.

#[macro_use]
pub mod console;

pub mod backend;
pub mod checkpoint;
pub mod cli;
pub mod comm;
pub mod config;
pub mod data;
pub mod launch;
pub mod memory_timeline;
pub mod model;
pub mod parallel;
pub mod plan;
pub mod tensor;
pub mod trace;
pub mod train;
