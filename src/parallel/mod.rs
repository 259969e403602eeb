//! Parallelisms that wrap or cross the model: data parallel (DDP, FSDP/HSDP), tensor parallel with
//! sequence parallel (`tp`), context parallel (`cp`), expert parallel (`ep`), pipelines, the one walk over the blocks every layout runs (`walk`), and the composition of a rank's
//! layout from the mesh (`plan`).

pub mod cp;
pub mod ddp;
pub mod ep;
pub mod fsdp;
pub mod parallelize;
pub mod param_state;
pub mod pipeline;
pub mod plan;
pub mod tp;
pub mod walk;
