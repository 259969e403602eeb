//! How many copies between host memory and a backend's buffers a run makes, and how many bytes
//! they move: the measure of a device-resident step (a GPU stalls on every such copy that waits
//! for its result). `titan bench train --json` reports it per step (`host_device_copies_per_step`,
//! `host_device_bytes_per_step`).
//!
//! What counts: every `Backend::upload`, `download`, `upload_owned` and `download_owned`, on
//! every backend, so the CPU's count is the count of the same calls on a GPU (on the CPU they
//! are plain copies, or moves). CUDA also counts the copies its ops make of their own (the loss's
//! per-row values, the partial sums of norms and float8 amaxes, the ids an op uploads, the
//! pointer tables of multi-tensor kernels), which have no CPU counterpart; a GPU's count is
//! therefore at least the CPU's.

use std::sync::atomic::{AtomicU64, Ordering};

/// Copies and bytes so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transfers {
    pub copies: u64,
    pub bytes: u64,
}

impl Transfers {
    /// What happened after `earlier`.
    pub fn since(self, earlier: Transfers) -> Transfers {
        Transfers {
            copies: self.copies - earlier.copies,
            bytes: self.bytes - earlier.bytes,
        }
    }
}

/// A backend's running count (any thread may record).
#[derive(Debug, Default)]
pub struct TransferCounter {
    copies: AtomicU64,
    bytes: AtomicU64,
}

impl TransferCounter {
    /// One copy of `values` f32 values.
    pub fn record(&self, values: usize) {
        self.record_bytes(4 * values as u64);
    }

    /// One copy of `bytes` bytes.
    pub fn record_bytes(&self, bytes: u64) {
        self.copies.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn read(&self) -> Transfers {
        Transfers {
            copies: self.copies.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}
