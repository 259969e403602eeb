//! GEMM through the `gemm` crate (AVX-512 micro-kernels picked at run time, rayon threads).
//!
//! `gemm` takes arbitrary row/column strides, so transposed operands are read in place.

use crate::backend::{GemmOutput, GemmShape};
use gemm::Parallelism;

/// Below this many multiply-adds threading costs more than it saves.
const PARALLEL_MIN_FLOPS: usize = 48 * 48 * 48;

pub fn matmul(out: &mut [f32], a: &[f32], b: &[f32], shape: GemmShape, output: GemmOutput) {
    matmul_threads(out, a, b, shape, output, true)
}

/// `matmul`, split over the threads (when large enough) only if `threaded`: a GEMM that is one
/// task of a parallel loop already (a mixture of experts' experts) may run on its own thread.
/// Either way every output is the same sum in the same order.
pub fn matmul_threads(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    shape: GemmShape,
    output: GemmOutput,
    threaded: bool,
) {
    let GemmShape {
        m,
        k,
        n,
        trans_a,
        trans_b,
    } = shape;
    let accumulate = output.accumulates();
    assert!(
        out.len() >= m * n,
        "matmul: out holds {} < {m}x{n}",
        out.len()
    );
    assert!(a.len() >= m * k, "matmul: a holds {} < {m}x{k}", a.len());
    assert!(b.len() >= k * n, "matmul: b holds {} < {k}x{n}", b.len());
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            out[..m * n].fill(0.0);
        }
        return;
    }
    // (row stride, column stride) of each operand as it is stored.
    let (a_rs, a_cs) = if trans_a {
        (1, m as isize)
    } else {
        (k as isize, 1)
    };
    let (b_rs, b_cs) = if trans_b {
        (1, k as isize)
    } else {
        (n as isize, 1)
    };
    let parallelism =
        if threaded && m * n * k >= PARALLEL_MIN_FLOPS && rayon::current_num_threads() > 1 {
            Parallelism::Rayon(0)
        } else {
            Parallelism::None
        };
    // SAFETY: the asserts above bound every index the strides can reach; `out` does not alias `a`/`b`
    // (distinct borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Strides of one matrix operand: element `(i, j)` is at `ptr + i·row + j·col`.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    pub row: isize,
    pub col: isize,
}

impl Strided {
    pub const fn rows(stride: usize) -> Self {
        Strided {
            row: stride as isize,
            col: 1,
        }
    }
    pub const fn transposed(stride: usize) -> Self {
        Strided {
            row: 1,
            col: stride as isize,
        }
    }
}

/// Single-threaded `out[m,n] (+)= a[m,k] · b[k,n]` on strided views, for small blocks inside
/// tasks that are already parallel (attention tiles).
///
/// # Safety
/// Every element the strides reach must be inside its allocation, and `out` must not overlap `a`/`b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_block(
    out: *mut f32,
    out_s: Strided,
    a: *const f32,
    a_s: Strided,
    b: *const f32,
    b_s: Strided,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    gemm::gemm(
        m,
        n,
        k,
        out,
        out_s.col,
        out_s.row,
        accumulate,
        a,
        a_s.col,
        a_s.row,
        b,
        b_s.col,
        b_s.row,
        1.0f32,
        1.0f32,
        false,
        false,
        false,
        Parallelism::None,
    );
}
