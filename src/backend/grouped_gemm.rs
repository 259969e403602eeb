//! A mixture of experts' grouped GEMMs: one product per expert over that expert's block of rows,
//! the blocks given by offsets in a buffer (`offsets[e]..offsets[e + 1]`, `u32` bits as
//! `routing::ids_to_bits` writes them), so that a device can size each expert's GEMM without the
//! counts coming back to the host (`Backend::grouped_matmul`, `grouped_weight_grad`).
//!
//! Here the shape, the host defaults (the offsets downloaded, one `matmul` per expert on its rows,
//! which stay on the backend) and the CPU's versions (slices of the same buffers, the experts
//! concurrently: their GEMMs are small, and whole experts per thread scaled better than each split
//! over every thread, docs/performance.md).

use rayon::prelude::*;

use super::routing::ids_of_bits;
use super::{Backend, GemmOutput, GemmShape};

/// Each expert's product `out_e[rows_e, n] (+)= a_e[rows_e, k] · op(W_e)`, `W_e` stored `[n, k]`
/// and read transposed with `trans_b` (a linear layer's `x · Wᵀ`), else `[k, n]` (its input
/// gradient `dy · W`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupedGemm {
    pub k: usize,
    pub n: usize,
    pub trans_b: bool,
    pub output: GemmOutput,
}

impl GroupedGemm {
    /// One expert's GEMM over `rows` rows.
    pub fn expert(&self, rows: usize) -> GemmShape {
        let shape = GemmShape::new(rows, self.k, self.n);
        match self.trans_b {
            true => shape.b_transposed(),
            false => shape,
        }
    }
}

/// Expert `e`'s block of rows: (first row, row count).
fn block(offsets: &[u32], e: usize) -> (usize, usize) {
    let from = offsets[e] as usize;
    (from, offsets[e + 1] as usize - from)
}

/// Checks the offsets against the experts and the rows the operands hold.
fn checked_offsets(op: &str, bits: &[f32], experts: usize, rows: usize) -> Vec<u32> {
    let offsets = ids_of_bits(bits);
    assert_eq!(
        offsets.len(),
        experts + 1,
        "{op}: offsets for {experts} experts"
    );
    assert!(
        offsets.windows(2).all(|w| w[0] <= w[1]) && offsets[experts] as usize <= rows,
        "{op}: offsets {offsets:?} decrease or pass the {rows} rows"
    );
    offsets
}

/// Rows `from..from + rows` of a `[_, width]` buffer, as a buffer of their own.
pub fn rows_of<B: Backend + ?Sized>(
    be: &B,
    x: &B::Buf,
    (from, rows): (usize, usize),
    width: usize,
) -> B::Buf {
    let mut out = be.uninit(rows * width);
    be.copy_range(&mut out, 0, x, from * width, rows * width);
    out
}

/// `Backend::grouped_matmul`'s host default.
pub(super) fn matmul<B: Backend + ?Sized>(
    be: &B,
    out: &mut B::Buf,
    a: &B::Buf,
    (weights, offsets): (&[&B::Buf], &B::Buf),
    g: GroupedGemm,
) {
    let rows = be.len(a) / g.k.max(1);
    let offsets = checked_offsets("grouped_matmul", &be.download(offsets), weights.len(), rows);
    for (e, w) in weights.iter().enumerate() {
        let (from, count) = block(&offsets, e);
        if count == 0 {
            continue;
        }
        let ae = rows_of(be, a, (from, count), g.k);
        let mut oe = match g.output {
            GemmOutput::Accumulate => rows_of(be, out, (from, count), g.n),
            _ => be.uninit(count * g.n),
        };
        be.matmul(&mut oe, &ae, w, g.expert(count), g.output);
        be.copy_range(out, from * g.n, &oe, 0, count * g.n);
    }
}

/// `Backend::grouped_weight_grad`'s host default.
pub(super) fn weight_grad<B: Backend + ?Sized>(
    be: &B,
    grads: &mut [&mut B::Buf],
    (dy, x): (&B::Buf, &B::Buf),
    offsets: &B::Buf,
    (n_out, k_in): (usize, usize),
) {
    let rows = be.len(x) / k_in.max(1);
    let offsets = checked_offsets(
        "grouped_weight_grad",
        &be.download(offsets),
        grads.len(),
        rows,
    );
    for (e, g) in grads.iter_mut().enumerate() {
        let (from, count) = block(&offsets, e);
        if count == 0 || be.len(g) == 0 {
            continue;
        }
        let (dye, xe) = (
            rows_of(be, dy, (from, count), n_out),
            rows_of(be, x, (from, count), k_in),
        );
        let shape = GemmShape::new(n_out, count, k_in).a_transposed();
        be.matmul(g, &dye, &xe, shape, GemmOutput::Accumulate);
    }
}

/// The CPU's `grouped_matmul`: each expert's GEMM on its slices, the experts concurrently.
pub(super) fn cpu_matmul(
    out: &mut [f32],
    a: &[f32],
    (weights, offsets): (&[&Vec<f32>], &[f32]),
    g: GroupedGemm,
    gemm: impl Fn(&mut [f32], &[f32], &[f32], GemmShape, GemmOutput, bool) + Sync,
) {
    let rows = a.len() / g.k.max(1);
    let offsets = checked_offsets("grouped_matmul", offsets, weights.len(), rows);
    let mut blocks = Vec::with_capacity(weights.len());
    let mut rest = &mut out[offsets[0] as usize * g.n..];
    for (e, w) in weights.iter().enumerate() {
        let (from, count) = block(&offsets, e);
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(count * g.n);
        if count > 0 {
            blocks.push((from, count, mine, w));
        }
        rest = tail;
    }
    largest_first(&mut blocks, |b| b.1);
    let threaded = each_threaded(blocks.len());
    blocks
        .into_par_iter()
        .with_max_len(1)
        .for_each(|(from, count, mine, w)| {
            let ae = &a[from * g.k..(from + count) * g.k];
            gemm(mine, ae, w, g.expert(count), g.output, threaded);
        });
}

/// Whether each of `experts` concurrent GEMMs should itself be split over the threads: not when
/// there are experts enough to keep every thread busy (twice as many), where splitting each
/// one only added work (Qwen3-MoE debug model, 8 experts on 2 threads: 4% more tokens/s
/// without); yes when there are few (each expert's GEMM then uses the idle threads).
fn each_threaded(experts: usize) -> bool {
    experts < 2 * rayon::current_num_threads()
}

/// The experts' work ordered largest first, each its own task: the threads that finish the small
/// ones take the rest, instead of waiting on one thread's share of several large ones.
fn largest_first<T>(work: &mut [T], rows: impl Fn(&T) -> usize) {
    work.sort_by_key(|w| std::cmp::Reverse(rows(w)));
}

/// The CPU's `grouped_weight_grad`: each expert's `dW_e += dy_eᵀ · x_e` on its slices.
pub(super) fn cpu_weight_grad(
    grads: &mut [&mut Vec<f32>],
    (dy, x): (&[f32], &[f32]),
    offsets: &[f32],
    (n_out, k_in): (usize, usize),
    gemm: impl Fn(&mut [f32], &[f32], &[f32], GemmShape, GemmOutput, bool) + Sync,
) {
    let rows = x.len() / k_in.max(1);
    let offsets = checked_offsets("grouped_weight_grad", offsets, grads.len(), rows);
    let mut work: Vec<_> = grads
        .iter_mut()
        .enumerate()
        .map(|(e, g)| (block(&offsets, e), g))
        .filter(|((_, count), g)| *count > 0 && !g.is_empty())
        .collect();
    largest_first(&mut work, |w| w.0 .1);
    let threaded = each_threaded(work.len());
    work.into_par_iter()
        .with_max_len(1)
        .for_each(|((from, count), g)| {
            let dye = &dy[from * n_out..(from + count) * n_out];
            let xe = &x[from * k_in..(from + count) * k_in];
            let shape = GemmShape::new(n_out, count, k_in).a_transposed();
            gemm(g, dye, xe, shape, GemmOutput::Accumulate, threaded);
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::routing::ids_to_bits;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// One `matmul` per expert on its rows copied out, as the MoE layer computed before.
    fn one_expert_at_a_time(
        out: &mut [f32],
        a: &[f32],
        w: &[Vec<f32>],
        offsets: &[u32],
        g: GroupedGemm,
    ) {
        let be = CpuBackend::new();
        for (e, w) in w.iter().enumerate() {
            let (from, count) = block(offsets, e);
            let ae = a[from * g.k..(from + count) * g.k].to_vec();
            let mut oe = out[from * g.n..(from + count) * g.n].to_vec();
            be.matmul(&mut oe, &ae, w, g.expert(count), g.output);
            out[from * g.n..(from + count) * g.n].copy_from_slice(&oe);
        }
    }

    #[test]
    fn grouped_gemms_equal_one_gemm_per_expert_bit_for_bit() {
        // Ten experts (on 2 threads each GEMM runs on its own thread), one without rows; and two
        // experts (each GEMM split over the threads).
        check_against_one_per_expert(&[70, 0, 130, 1, 64, 9, 33, 2, 40, 5]);
        check_against_one_per_expert(&[300, 170]);
    }

    /// Two rows past the last expert stay as they were; one gradient is frozen (empty).
    fn check_against_one_per_expert(counts: &[u32]) {
        let be = CpuBackend::new();
        let mut offsets = vec![0u32];
        for &c in counts {
            offsets.push(offsets.last().unwrap() + c);
        }
        let rows = *offsets.last().unwrap() as usize + 2;
        let (k, n) = (40, 72);
        let weights: Vec<Vec<f32>> = (0..counts.len()).map(|e| values(k * n, e)).collect();
        let refs: Vec<&Vec<f32>> = weights.iter().collect();
        let bits = ids_to_bits(&offsets);
        let a = values(rows * k, 99);
        for (trans_b, output) in [
            (true, GemmOutput::Overwrite),
            (false, GemmOutput::Accumulate),
        ] {
            let g = GroupedGemm {
                k,
                n,
                trans_b,
                output,
            };
            let start = values(rows * n, 7);
            let (mut grouped, mut each) = (start.clone(), start.clone());
            be.grouped_matmul(&mut grouped, &a, (&refs, &bits), g);
            one_expert_at_a_time(&mut each, &a, &weights, &offsets, g);
            assert_eq!(grouped, each, "trans_b {trans_b}");
            assert_eq!(grouped[(rows - 2) * n..], start[(rows - 2) * n..]);
        }
        // Weight gradients, one of them frozen (empty): dW_e += dy_eᵀ · x_e.
        let dy = values(rows * n, 5);
        let mut grads: Vec<Vec<f32>> = (0..counts.len()).map(|e| values(n * k, 50 + e)).collect();
        grads[1].clear();
        let mut want = grads.clone();
        for (e, w) in want.iter_mut().enumerate() {
            let (from, count) = block(&offsets, e);
            if count > 0 && !w.is_empty() {
                let (dye, xe) = (
                    &dy[from * n..(from + count) * n],
                    &a[from * k..(from + count) * k],
                );
                let shape = GemmShape::new(n, count, k).a_transposed();
                be.matmul(
                    w,
                    &dye.to_vec(),
                    &xe.to_vec(),
                    shape,
                    GemmOutput::Accumulate,
                );
            }
        }
        let mut slots: Vec<&mut Vec<f32>> = grads.iter_mut().collect();
        be.grouped_weight_grad(&mut slots, (&dy, &a), &bits, (n, k));
        assert_eq!(grads, want);
    }
}
