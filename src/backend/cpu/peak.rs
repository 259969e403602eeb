//! The CPU's peak fp32 FLOP rate, measured: MFU's denominator on the CPU.
//!
//! A datasheet figure needs each core's FMA width and its sustained clock, and a virtual machine
//! reports neither reliably (its `cpu MHz` is the nominal clock, not the boost the cores run at).
//! So every thread runs a short loop of independent fused multiply-adds on the widest vectors the
//! CPU has, all threads at once (shared cores and turbo limits count), and the best of a few
//! rounds is the peak: what these cores can do at most, which no training step exceeds.

use std::sync::OnceLock;
use std::time::Instant;

/// Independent accumulator chains: enough to cover the FMA latency on two pipes.
const CHAINS: usize = 12;
/// Loop iterations per round (about 2–5 ms per thread on a recent core).
const ITERATIONS: usize = 200_000;
const ROUNDS: usize = 3;

/// Peak fp32 TFLOP/s of `threads` threads running at once: the per-thread rate measured the first
/// time (all of them at once, about 20 ms), times `threads`.
pub fn peak_tflops(threads: usize) -> f64 {
    static PER_THREAD: OnceLock<f64> = OnceLock::new();
    *PER_THREAD.get_or_init(|| measure(threads)) * threads.max(1) as f64
}

/// TFLOP/s per thread with `threads` threads running at once, each the best of `ROUNDS`.
fn measure(threads: usize) -> f64 {
    let threads = threads.max(1);
    let total: f64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| (0..ROUNDS).map(|_| one_round()).fold(0.0, f64::max)))
            .collect();
        workers.into_iter().map(|w| w.join().unwrap_or(0.0)).sum()
    });
    total / threads as f64
}

/// One thread's FLOP rate over one round, in TFLOP/s.
fn one_round() -> f64 {
    let start = Instant::now();
    let (flops, checksum) = fma_loop(ITERATIONS);
    let seconds = start.elapsed().as_secs_f64();
    // The checksum keeps the loop from being optimised away.
    std::hint::black_box(checksum);
    flops / seconds.max(1e-9) / 1e12
}

/// Runs `iterations` rounds of `CHAINS` vector FMAs; returns the FLOPs done and a checksum.
fn fma_loop(iterations: usize) -> (f64, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::simd::avx512() {
            // SAFETY: the CPU reported AVX-512F.
            return unsafe { fma_loop_avx512(iterations) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU reported AVX2 and FMA.
            return unsafe { fma_loop_avx2(iterations) };
        }
    }
    fma_loop_scalar(iterations)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop_avx512(iterations: usize) -> (f64, f32) {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iterations {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let sum = acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum();
    ((iterations * CHAINS * 16 * 2) as f64, sum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(iterations: usize) -> (f64, f32) {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..iterations {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut lanes = [0.0f32; 8];
    let mut sum = 0.0;
    for x in acc {
        _mm256_storeu_ps(lanes.as_mut_ptr(), x);
        sum += lanes.iter().sum::<f32>();
    }
    ((iterations * CHAINS * 8 * 2) as f64, sum)
}

/// Elsewhere: four-wide arrays, which the compiler vectorises for the target's SIMD.
fn fma_loop_scalar(iterations: usize) -> (f64, f32) {
    let mut acc = [[1.0f32; 4]; CHAINS];
    for _ in 0..iterations {
        for chain in acc.iter_mut() {
            for x in chain.iter_mut() {
                *x = x.mul_add(0.999_999, 1e-7);
            }
        }
    }
    let sum = acc.iter().flatten().sum();
    ((iterations * CHAINS * 4 * 2) as f64, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fma_loop_counts_its_flops_and_stays_finite() {
        let (flops, checksum) = fma_loop(1000);
        assert!(flops >= (1000 * CHAINS * 4 * 2) as f64);
        assert!(checksum.is_finite() && checksum > 0.0);
        assert!(one_round() > 0.0);
    }
}
