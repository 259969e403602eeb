//! Communication: the rendezvous store and process groups with their collectives (CPU transport
//! over TCP; NCCL later), each operation bounded by a timeout.

pub mod cma;
pub mod conn;
pub mod group;
pub mod mesh;
pub mod store;
