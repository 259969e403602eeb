//! Parallelisms that wrap the model: data parallel (DDP today; FSDP/HSDP, TP, PP, CP to come).

pub mod ddp;
pub mod fsdp;
