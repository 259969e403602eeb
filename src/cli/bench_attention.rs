//! `titan bench attention`: causal (or block-causal, `--doc-len`) grouped-query attention alone, forward and backward, on the CPU
//! or GPU 0, timed per call after warm-up (medians), with TFLOP/s counted the way FlashAttention
//! reports them (forward 4·b·h·s²·d/2 for the causal half, backward 2.5 times that), so the figures
//! compare with `scripts/torch_attention_gpu.py` (PyTorch's SDPA) on the same shapes. titan's times
//! are of the whole op as training calls it, rounding its f32 inputs to bf16 included; PyTorch's
//! inputs are bf16 already.

use std::time::Instant;

use anyhow::{bail, ensure, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{CudaBackend, GemmPrecision};
use crate::backend::{AttnGrads, AttnInputs, AttnMask, AttnSaved, AttnShape, Backend};
use crate::train::threads::init_threads;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchAttentionArgs {
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 2048)]
    pub seq: usize,
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// Timed calls of each direction (after warm-up).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// cpu or cuda (GPU 0).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// bfloat16 (tensor-core attention on CUDA for head_dim 64 and 128) or float32. Default:
    /// bfloat16 on CUDA, float32 on the CPU.
    #[arg(long)]
    pub precision: Option<String>,
    /// CPU threads (0: every core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Documents of this many tokens packed in each sequence, attended block-causally (each
    /// query sees only its own document: `[model] attn_mask_type = "block_causal"`; on CUDA by
    /// the one-warp-per-row kernels, the tensor-core ones taking causal attention only).
    /// 0: one document per sequence (plain causal attention).
    #[arg(long, default_value_t = 0)]
    pub doc_len: usize,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
}

impl BenchAttentionArgs {
    /// The documents' lengths in one sequence.
    fn documents(&self) -> Vec<usize> {
        let len = if self.doc_len == 0 {
            self.seq
        } else {
            self.doc_len
        };
        let mut docs = vec![len; self.seq / len];
        if !self.seq.is_multiple_of(len) {
            docs.push(self.seq % len);
        }
        docs
    }

    /// Each query's position in its document, for every sequence (None: one document each).
    fn positions(&self) -> Option<Vec<u32>> {
        (self.doc_len > 0).then(|| {
            let row: Vec<u32> = self.documents().iter().flat_map(|&n| 0..n as u32).collect();
            row.repeat(self.batch)
        })
    }
}

pub fn run_attention(a: &BenchAttentionArgs) -> Result<()> {
    ensure!(
        a.heads > 0 && a.kv_heads > 0 && a.heads.is_multiple_of(a.kv_heads),
        "--heads {} must be a positive multiple of --kv-heads {}",
        a.heads,
        a.kv_heads
    );
    ensure!(
        a.batch > 0 && a.seq > 0 && a.head_dim > 0 && a.iters > 0,
        "--batch, --seq, --head-dim and --iters must be positive"
    );
    init_threads(a.threads);
    let precision = a.precision.clone().unwrap_or_else(|| {
        if a.device == "cuda" {
            "bfloat16"
        } else {
            "float32"
        }
        .to_string()
    });
    match a.device.as_str() {
        "cpu" => report(a, &precision, &CpuBackend::new()),
        "cuda" => {
            let be = CudaBackend::new(0, GemmPrecision::from_config(&precision)?)?;
            report(a, &precision, &be)
        }
        other => bail!("--device `{other}` is not known (accepted: cpu, cuda)"),
    }
}

fn report<B: Backend>(a: &BenchAttentionArgs, precision: &str, be: &B) -> Result<()> {
    let (forward_s, backward_s) = time_attention(be, a);
    // FlashAttention's count: 4·b·h·s²·d for the forward's two products, halved by the causal
    // mask; with documents, the sum of their squares in place of s².
    let squares: f64 = a.documents().iter().map(|&n| (n as f64).powi(2)).sum();
    let forward_flops = 4.0 * (a.batch * a.heads * a.head_dim) as f64 * squares / 2.0;
    let backward_flops = 2.5 * forward_flops;
    let (fwd_tflops, bwd_tflops) = (
        forward_flops / forward_s / 1e12,
        backward_flops / backward_s / 1e12,
    );
    if a.json {
        outln!(
            "{}",
            serde_json::json!({
                "device": a.device, "backend": be.name(), "precision": precision,
                "batch": a.batch, "seq": a.seq, "heads": a.heads, "kv_heads": a.kv_heads,
                "head_dim": a.head_dim, "doc_len": a.doc_len,
                "forward_ms": forward_s * 1e3, "backward_ms": backward_s * 1e3,
                "forward_tflops": fwd_tflops, "backward_tflops": bwd_tflops,
            })
        );
    } else {
        let documents = match a.doc_len {
            0 => String::new(),
            n => format!(" in documents of {n}"),
        };
        outln!(
            "attention {}×{}{documents} heads {}/{} head_dim {} ({}, {precision}): forward {:.3} \
             ms ({:.2} TFLOP/s), backward {:.3} ms ({:.2} TFLOP/s); medians of {} calls",
            a.batch,
            a.seq,
            a.heads,
            a.kv_heads,
            a.head_dim,
            be.name(),
            forward_s * 1e3,
            fwd_tflops,
            backward_s * 1e3,
            bwd_tflops,
            a.iters
        );
    }
    Ok(())
}

/// Median seconds of one forward and of one backward call (each waited for on a device).
fn time_attention<B: Backend>(be: &B, a: &BenchAttentionArgs) -> (f64, f64) {
    let shape = AttnShape::causal(a.batch, a.seq, a.heads, a.kv_heads, a.head_dim);
    let q_len = a.batch * a.seq * a.heads * a.head_dim;
    let kv_len = a.batch * a.seq * a.kv_heads * a.head_dim;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect() };
    let (q, k, v, dout) = (
        be.upload(&random(q_len)),
        be.upload(&random(kv_len)),
        be.upload(&random(kv_len)),
        be.upload(&random(q_len)),
    );
    let mut out = be.zeros(q_len);
    let mut lse = be.zeros(a.batch * a.heads * a.seq);
    let (mut dq, mut dk, mut dv) = (be.zeros(q_len), be.zeros(kv_len), be.zeros(kv_len));
    let timed = |f: &mut dyn FnMut()| -> f64 {
        for _ in 0..a.warmup {
            f();
        }
        be.synchronize();
        let mut times: Vec<f64> = (0..a.iters)
            .map(|_| {
                let t0 = Instant::now();
                f();
                be.synchronize();
                t0.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    let positions = a.positions();
    let x = AttnInputs {
        mask: AttnMask {
            positions: positions.as_deref(),
            window: None,
        },
        ..AttnInputs::causal(&q, &k, &v, shape)
    };
    let forward = timed(&mut || be.attention_forward(&mut out, &mut lse, x));
    let backward = timed(&mut || {
        let grads = AttnGrads {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
        };
        let saved = AttnSaved {
            out: &out,
            lse: &lse,
        };
        be.attention_backward(grads, &dout, x, saved)
    });
    (forward, backward)
}
