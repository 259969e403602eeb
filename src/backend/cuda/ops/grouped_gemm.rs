//! A mixture of experts' grouped GEMMs on the GPU (`Backend::grouped_matmul`,
//! `grouped_weight_grad`; kernels in `kernels/grouped_gemm.cu`): each expert's rows found from the
//! offsets on the device, its weight's address passed by value in the launch (`ExpertAddresses`),
//! so neither the counts come down nor a table goes up. More than 256 experts on one rank go
//! through the host defaults (one `matmul` per expert after the offsets come down).

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::CudaBackend;
use crate::backend::grouped_gemm::GroupedGemm;
use crate::backend::GemmOutput;

/// The most experts one launch addresses (`TITAN_GG_MAX_EXPERTS`).
pub(super) const MAX_EXPERTS: usize = 256;
/// Output tile side and threads per block (`TITAN_GG_TILE`, `TITAN_GG_THREADS`).
const TILE: usize = 64;
const THREADS: u32 = 256;

/// The experts' buffer addresses, passed to the kernel by value (`GgAddresses`); 0: skipped.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct ExpertAddresses {
    at: [u64; MAX_EXPERTS],
}

// SAFETY: plain old data of the kernel's `GgAddresses` layout (256 `unsigned long long`).
unsafe impl DeviceRepr for ExpertAddresses {}

impl KernelArg for &ExpertAddresses {
    type Arg = Self;
    fn kernel_arg(self) -> Self {
        self
    }
}

impl ExpertAddresses {
    fn of(addresses: impl Iterator<Item = u64>) -> Self {
        let mut table = ExpertAddresses {
            at: [0; MAX_EXPERTS],
        };
        for (slot, a) in table.at.iter_mut().zip(addresses) {
            *slot = a;
        }
        table
    }
}

impl CudaBackend {
    pub(super) fn grouped_matmul_untimed(
        &self,
        out: &mut Buf,
        a: &Buf,
        (weights, offsets): (&[&Buf], &Buf),
        g: GroupedGemm,
    ) {
        let experts = weights.len();
        assert!(experts <= MAX_EXPERTS, "grouped_matmul: {experts} experts");
        check_len("grouped_matmul", "offsets", offsets.len(), experts + 1);
        let rows = a.len() / g.k.max(1);
        check_len("grouped_matmul", "a", a.len(), rows * g.k);
        check_len("grouped_matmul", "out", out.len(), rows * g.n);
        for w in weights {
            check_len("grouped_matmul", "weight", w.len(), g.k * g.n);
        }
        if rows == 0 || g.n == 0 || experts == 0 {
            return;
        }
        let table = ExpertAddresses::of(weights.iter().map(|w| w.device_address(&self.stream)));
        // Each expert's rows in whole tiles: at most `rows / TILE` rounded up, plus one per expert.
        let cfg = LaunchConfig {
            grid_dim: (
                g.n.div_ceil(TILE) as u32,
                (rows.div_ceil(TILE) + experts) as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (e, k, n) = (experts as i32, g.k as i32, g.n as i32);
        let trans_b = g.trans_b as i32;
        let accumulate = (g.output == GemmOutput::Accumulate) as i32;
        launch!(
            self,
            "grouped_gemm",
            cfg,
            out,
            a,
            &table,
            offsets,
            &e,
            &k,
            &n,
            &trans_b,
            &accumulate
        );
    }

    pub(super) fn grouped_weight_grad_untimed(
        &self,
        grads: &mut [&mut Buf],
        (dy, x): (&Buf, &Buf),
        offsets: &Buf,
        (n_out, k_in): (usize, usize),
    ) {
        let experts = grads.len();
        assert!(
            experts <= MAX_EXPERTS,
            "grouped_weight_grad: {experts} experts"
        );
        check_len("grouped_weight_grad", "offsets", offsets.len(), experts + 1);
        let rows = x.len() / k_in.max(1);
        check_len("grouped_weight_grad", "dy", dy.len(), rows * n_out);
        if rows == 0 || experts == 0 || n_out == 0 || k_in == 0 {
            return;
        }
        let table = ExpertAddresses::of(grads.iter_mut().map(|g| match g.len() {
            0 => 0,
            len => {
                check_len("grouped_weight_grad", "gradient", len, n_out * k_in);
                g.device_address_mut(&self.stream)
            }
        }));
        let cfg = LaunchConfig {
            grid_dim: (
                k_in.div_ceil(TILE) as u32,
                n_out.div_ceil(TILE) as u32,
                experts as u32,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_out, k_in) = (n_out as i32, k_in as i32);
        launch!(
            self,
            "grouped_weight_grad",
            cfg,
            &table,
            dy,
            x,
            offsets,
            &n_out,
            &k_in
        );
    }
}
