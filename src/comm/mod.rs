//! Communication: the rendezvous store and process groups with their collectives (CPU transport
//! over sockets and cross-memory reads; NCCL for CUDA buffers), each operation bounded by a timeout.

pub mod auth;
pub mod cma;
pub mod conn;
pub mod device_group;
pub mod flight_recorder;
pub mod frame;
pub mod group;
pub mod host_device;
pub mod mesh;
pub mod nccl;
pub mod peers;
pub mod queue;
pub mod quorum;
pub mod recorded_device;
pub mod shape_group;
pub mod store;
