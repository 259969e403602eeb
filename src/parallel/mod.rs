//! Parallelisms that wrap or cross the model: data parallel (DDP, FSDP/HSDP), tensor parallel with
//! sequence parallel (`tp`), context parallel (`cp`), expert parallel (`ep`), pipelines; the
//! composition of a rank's layout from its mesh groups (`parallelize`), the layout itself with
//! the operations a step needs of it (`layout`), where its weights live (`param_state`), and the
//! one walk over the blocks every layout runs (`walk`).

pub mod amax;
pub mod cp;
pub mod ddp;
pub mod ep;
pub mod fsdp;
pub mod layout;
pub mod muon_exchange;
pub mod parallelize;
pub mod param_state;
pub mod pipeline;
pub mod tp;
pub mod walk;
