//! The routed experts' computation on the rows routed to them, forward and backward: `y = w2 ·
//! f(w1·x + b1, w3·x + b3) + b2` per expert (`f` the experts' activation, `activation.rs`; the
//! biases gpt-oss's), written once over every local row: each projection one grouped GEMM over
//! the experts' blocks of rows (`LocalExperts`), or, for float8 experts, one GEMM per expert with
//! its own casts, the experts sharing the CPU's threads (`each_expert`).

use anyhow::Result;
use rayon::prelude::*;

use super::MoeShapes;
use crate::backend::float8::LinearGemm;
use crate::backend::grouped_gemm::{rows_of, GroupedGemm};
use crate::backend::{Backend, GemmOutput, GemmShape};
use crate::model::bias;
use crate::model::float8_linear::{Float8Casts, OnOneRank};
use crate::model::linear::Linear;

/// One routed expert's parameters (or their gradients): `[w1, w2, w3]` and their biases when it
/// has them.
pub(super) struct ExpertParams<T> {
    pub(super) w: [T; 3],
    pub(super) b: Option<[T; 3]>,
}

/// Each local expert's block of rows on the host: (first row, count).
pub(super) type ExpertBlocks = Vec<(usize, usize)>;

/// Which of an expert's three projections (its place in `[w1, w2, w3]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proj {
    Gate = 0,
    Down = 1,
    Up = 2,
}

/// This rank's experts over their rows (`[local rows, _]`, expert-major): each projection of every
/// expert at once. Plain experts run one grouped GEMM per projection reading the offsets where
/// the backend keeps them (`Backend::grouped_matmul`; biases as grouped GEMMs of depth one); float8
/// experts (each expert's operands cast with its own scales) run one expert at a time on the
/// host's blocks.
pub(super) struct LocalExperts<'a, B: Backend> {
    pub(super) params: Vec<ExpertParams<&'a B::Buf>>,
    /// Local expert `x`'s rows are `offsets[x]..offsets[x + 1]` (`u32` bits, on the backend).
    pub(super) offsets: &'a B::Buf,
    /// The same as (first row, count) on the host, where the experts run one at a time.
    pub(super) blocks: Option<ExpertBlocks>,
}

impl<'a, B: Backend> LocalExperts<'a, B> {
    /// Whether experts of these shapes run one at a time (float8 casts).
    pub(super) fn one_at_a_time(m: &MoeShapes) -> bool {
        m.experts_float8.is_some()
    }

    fn weights(&self, p: Proj) -> Vec<&'a B::Buf> {
        self.params.iter().map(|e| e.w[p as usize]).collect()
    }

    /// Each expert's bias of projection `p`, when the experts have biases.
    fn biases(&self, p: Proj) -> Option<Vec<&'a B::Buf>> {
        self.params
            .iter()
            .map(|e| e.b.map(|b| b[p as usize]))
            .collect()
    }

    /// The linear of projection `p` (its shape and float8 recipe).
    fn linear(m: &MoeShapes, p: Proj) -> Linear {
        let (up_proj, down) = m.expert_linears();
        match p {
            Proj::Down => down,
            _ => up_proj,
        }
    }

    /// `f(e, first row, count)` for every local expert with rows (concurrently on the CPU).
    fn each<T: Send>(
        &self,
        be: &B,
        f: impl Fn(usize, usize, usize) -> Result<T> + Sync + Send,
    ) -> Result<Vec<(usize, usize, T)>> {
        let blocks = self.blocks.as_ref().expect("experts run one at a time");
        let work: Vec<_> = blocks.iter().enumerate().filter(|(_, b)| b.1 > 0).collect();
        each_expert(be, work, |(e, &(from, count))| {
            f(e, from, count).map(|t| (from, count, t))
        })
        .into_iter()
        .collect()
    }

    /// `out = x · Wᵀ + b` for each expert's rows.
    fn forward(&self, be: &B, m: &MoeShapes, p: Proj, out: &mut B::Buf, x: &B::Buf) -> Result<()> {
        let linear = Self::linear(m, p);
        let (d_in, d_out) = (linear.d_in, linear.d_out);
        if self.blocks.is_none() {
            let g = GroupedGemm {
                k: d_in,
                n: d_out,
                trans_b: true,
                output: GemmOutput::Overwrite,
            };
            be.grouped_matmul(out, x, (&self.weights(p), self.offsets), g);
            if let Some(biases) = self.biases(p) {
                // Each expert's bias: a GEMM of depth one, its rows' ones times `bᵀ` (`bias`).
                let ones = bias::ones(be, be.len(x) / d_in);
                let g = GroupedGemm {
                    k: 1,
                    n: d_out,
                    trans_b: true,
                    output: GemmOutput::Accumulate,
                };
                be.grouped_matmul(out, &ones, (&biases, self.offsets), g);
            }
            return Ok(());
        }
        let outputs = self.each(be, |e, from, count| {
            let casts = expert_casts();
            let xe = rows_of(be, x, (from, count), d_in);
            let w = self.params[e].w[p as usize];
            let [xq, wq] = casts.operands(be, linear, LinearGemm::Output, (&xe, w), count)?;
            let mut ye = be.uninit(count * d_out);
            linear.forward(be, &mut ye, xq.buf(), wq.buf(), count);
            if let Some(b) = self.params[e].b {
                bias::add(be, &mut ye, b[p as usize]);
            }
            Ok(ye)
        })?;
        for (from, count, ye) in outputs {
            be.copy_range(out, from * d_out, &ye, 0, count * d_out);
        }
        Ok(())
    }

    /// `dx (+)= dy · W` for each expert's rows.
    fn input_grad(
        &self,
        be: &B,
        m: &MoeShapes,
        p: Proj,
        (dx, output): (&mut B::Buf, GemmOutput),
        dy: &B::Buf,
    ) -> Result<()> {
        let linear = Self::linear(m, p);
        let (d_in, d_out) = (linear.d_in, linear.d_out);
        if self.blocks.is_none() {
            let g = GroupedGemm {
                k: d_out,
                n: d_in,
                trans_b: false,
                output,
            };
            be.grouped_matmul(dx, dy, (&self.weights(p), self.offsets), g);
            return Ok(());
        }
        let grads = self.each(be, |e, from, count| {
            let casts = expert_casts();
            let dye = rows_of(be, dy, (from, count), d_out);
            let w = self.params[e].w[p as usize];
            let [dq, wq] = casts.operands(be, linear, LinearGemm::InputGrad, (&dye, w), count)?;
            let mut dxe = match output {
                GemmOutput::Accumulate => rows_of(be, dx, (from, count), d_in),
                GemmOutput::Overwrite => be.uninit(count * d_in),
            };
            be.matmul(
                &mut dxe,
                dq.buf(),
                wq.buf(),
                GemmShape::new(count, d_out, d_in),
                output,
            );
            Ok(dxe)
        })?;
        for (from, count, dxe) in grads {
            be.copy_range(dx, from * d_in, &dxe, 0, count * d_in);
        }
        Ok(())
    }

    /// Each expert's `dW += dyᵀ · x` (and `db += Σ dy`) over its rows.
    fn weight_grad(
        &self,
        be: &B,
        m: &MoeShapes,
        p: Proj,
        grads: &mut [ExpertParams<&mut B::Buf>],
        (dy, x): (&B::Buf, &B::Buf),
    ) -> Result<()> {
        let linear = Self::linear(m, p);
        let (d_in, d_out) = (linear.d_in, linear.d_out);
        let i = p as usize;
        if self.blocks.is_none() {
            let mut dws: Vec<&mut B::Buf> = grads.iter_mut().map(|g| &mut *g.w[i]).collect();
            be.grouped_weight_grad(&mut dws, (dy, x), self.offsets, (d_out, d_in));
            let dbs: Option<Vec<&mut B::Buf>> = grads
                .iter_mut()
                .map(|g| g.b.as_mut().map(|b| &mut *b[i]))
                .collect();
            if let Some(mut dbs) = dbs {
                let ones = bias::ones(be, be.len(x) / d_in);
                be.grouped_weight_grad(&mut dbs, (dy, &ones), self.offsets, (d_out, 1));
            }
            return Ok(());
        }
        let blocks = self.blocks.as_ref().expect("experts run one at a time");
        let work: Vec<_> = blocks
            .iter()
            .zip(grads.iter_mut())
            .filter(|(b, _)| b.1 > 0)
            .map(|(b, g)| (b, (&mut *g.w[i], g.b.as_mut().map(|b| &mut *b[i]))))
            .collect();
        let done = each_expert(be, work, |(&(from, count), (dw, db))| {
            let casts = expert_casts();
            let (dye, xe) = (
                rows_of(be, dy, (from, count), d_out),
                rows_of(be, x, (from, count), d_in),
            );
            let [dq, xq] =
                casts.operands(be, linear, LinearGemm::WeightGrad, (&dye, &xe), count)?;
            linear.add_weight_grad(be, dw, dq.buf(), xq.buf(), count);
            if let Some(db) = db {
                bias::add_grad(be, db, &dye);
            }
            Ok(())
        });
        done.into_iter().collect()
    }
}

/// `y = w2 · f(w1 · x + b1, w3 · x + b3) + b2` over every local expert's rows (`f` the experts'
/// activation; no biases but gpt-oss's), keeping gate, up and the activation's output.
pub(super) fn swiglu_ffn<B: Backend>(
    be: &B,
    m: &MoeShapes,
    experts: &LocalExperts<B>,
    x: &B::Buf,
    y: &mut B::Buf,
) -> Result<[B::Buf; 3]> {
    let rows = be.len(x) / m.dim;
    let [mut gate, mut up, mut act] = std::array::from_fn(|_| be.uninit(rows * m.hidden));
    experts.forward(be, m, Proj::Gate, &mut gate, x)?;
    experts.forward(be, m, Proj::Up, &mut up, x)?;
    m.round(be, &mut gate);
    m.round(be, &mut up);
    m.activation.forward(be, &mut act, &gate, &up);
    m.round(be, &mut act);
    experts.forward(be, m, Proj::Down, y, &act)?;
    m.round(be, y);
    Ok([gate, up, act])
}

/// The casts of an expert's GEMMs: an expert's rows and weights are all on this rank, so no
/// scale is agreed over a group (torchao's grouped GEMM scales per token row, per (expert,
/// feature), and per expert's group of rows for the weight gradient, as here).
fn expert_casts() -> Float8Casts<'static> {
    Float8Casts {
        groups: &OnOneRank,
        partial_row_blocks: true,
    }
}

/// The backward of `swiglu_ffn`: adds the parameters' gradients into `grads` (one per local
/// expert) and returns the input rows' gradient.
pub(super) fn swiglu_ffn_backward<B: Backend>(
    be: &B,
    m: &MoeShapes,
    experts: &LocalExperts<B>,
    [x, gate, up, act]: [&B::Buf; 4],
    grads: &mut [ExpertParams<&mut B::Buf>],
    dy: &B::Buf,
) -> Result<B::Buf> {
    let rows = be.len(x) / m.dim;
    let mut dact = be.uninit(rows * m.hidden);
    experts.input_grad(be, m, Proj::Down, (&mut dact, GemmOutput::Overwrite), dy)?;
    experts.weight_grad(be, m, Proj::Down, grads, (dy, act))?;
    let (mut dgate, mut dup) = (be.uninit(rows * m.hidden), be.uninit(rows * m.hidden));
    m.activation
        .backward(be, (&mut dgate, &mut dup), &dact, gate, up);
    let mut dx = be.zeros(rows * m.dim);
    for (d, p) in [(&dgate, Proj::Gate), (&dup, Proj::Up)] {
        experts.input_grad(be, m, p, (&mut dx, GemmOutput::Accumulate), d)?;
        experts.weight_grad(be, m, p, grads, (d, x))?;
    }
    Ok(dx)
}

/// `f` of every expert's work, in order: on the CPU the experts run concurrently, one per
/// thread, because their GEMMs are small (a few hundred rows) and split over every thread they
/// scaled worse than whole experts per thread (docs/performance.md); elsewhere one after another.
pub(super) fn each_expert<B: Backend, I: Send, T: Send>(
    be: &B,
    work: Vec<I>,
    f: impl Fn(I) -> T + Sync + Send,
) -> Vec<T> {
    if be.overlaps_host_calls() {
        work.into_par_iter().map(f).collect()
    } else {
        work.into_iter().map(f).collect()
    }
}
