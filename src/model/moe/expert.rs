//! One routed expert's computation on the rows routed to it, forward and backward: `y = w2 ·
//! f(w1·x + b1, w3·x + b3) + b2` (`f` the experts' activation, `activation.rs`; the biases
//! gpt-oss's), each GEMM in float8 where a converter chose it, and how the experts of a layer
//! share the CPU's threads (`each_expert`).

use anyhow::Result;
use rayon::prelude::*;

use super::MoeShapes;
use crate::backend::float8::LinearGemm;
use crate::backend::Backend;
use crate::model::bias;
use crate::model::float8_linear::{Float8Casts, OnOneRank, SharedInput};

/// One routed expert's parameters (or their gradients): `[w1, w2, w3]` and their biases when it
/// has them.
pub(super) struct ExpertParams<T> {
    pub(super) w: [T; 3],
    pub(super) b: Option<[T; 3]>,
}

/// `y = w2 · f(w1 · x + b1, w3 · x + b3) + b2` over `rows` rows (`f` the experts' activation;
/// no biases but gpt-oss's), keeping gate, up and the activation's output.
pub(super) fn swiglu_ffn<B: Backend>(
    be: &B,
    m: &MoeShapes,
    x: &B::Buf,
    p: ExpertParams<&B::Buf>,
    rows: usize,
    y: &mut B::Buf,
) -> Result<[B::Buf; 3]> {
    let (up_proj, down) = m.expert_linears();
    let casts = expert_casts();
    let hidden = m.hidden;
    let [w1, w2, w3] = p.w;
    let (mut gate, mut up, mut act) = (
        be.uninit(rows * hidden),
        be.uninit(rows * hidden),
        be.uninit(rows * hidden),
    );
    let mut x_cast = SharedInput::new(x, LinearGemm::Output);
    for (out, w) in [(&mut gate, w1), (&mut up, w3)] {
        let wq = casts.operand(be, (up_proj, LinearGemm::Output, 1), w, rows)?;
        up_proj.forward(
            be,
            out,
            x_cast.for_linear(&casts, be, up_proj, rows)?,
            wq.buf(),
            rows,
        );
    }
    if let Some([b1, _, b3]) = p.b {
        bias::add(be, &mut gate, b1);
        bias::add(be, &mut up, b3);
    }
    m.round(be, &mut gate);
    m.round(be, &mut up);
    m.activation.forward(be, &mut act, &gate, &up);
    m.round(be, &mut act);
    let [aq, w2q] = casts.operands(be, down, LinearGemm::Output, (&act, w2), rows)?;
    down.forward(be, y, aq.buf(), w2q.buf(), rows);
    if let Some([_, b2, _]) = p.b {
        bias::add(be, y, b2);
    }
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

/// The backward of `swiglu_ffn`: adds the parameters' gradients into `g` and `dx +=` the
/// input's.
#[allow(clippy::too_many_arguments)]
pub(super) fn swiglu_ffn_backward<B: Backend>(
    be: &B,
    m: &MoeShapes,
    x: &B::Buf,
    [gate, up, act]: [&B::Buf; 3],
    p: ExpertParams<&B::Buf>,
    g: ExpertParams<&mut B::Buf>,
    dy: &B::Buf,
    (rows, dx): (usize, &mut B::Buf),
) -> Result<()> {
    let (up_proj, down) = m.expert_linears();
    let casts = expert_casts();
    let hidden = m.hidden;
    let ([w1, w2, w3], [g1, g2, g3]) = (p.w, g.w);
    let mut dact = be.uninit(rows * hidden);
    let [dyq, w2q] = casts.operands(be, down, LinearGemm::InputGrad, (dy, w2), rows)?;
    down.input_grad(be, &mut dact, dyq.buf(), w2q.buf(), rows);
    let [dyq, aq] = casts.operands(be, down, LinearGemm::WeightGrad, (dy, act), rows)?;
    down.add_weight_grad(be, g2, dyq.buf(), aq.buf(), rows);
    let (mut dgate, mut dup) = (be.uninit(rows * hidden), be.uninit(rows * hidden));
    m.activation
        .backward(be, (&mut dgate, &mut dup), &dact, gate, up);
    if let Some([db1, db2, db3]) = g.b {
        bias::add_grad(be, db1, &dgate);
        bias::add_grad(be, db2, dy);
        bias::add_grad(be, db3, &dup);
    }
    let mut x_cast = SharedInput::new(x, LinearGemm::WeightGrad);
    for ((d, w), g) in [(&dgate, w1), (&dup, w3)].into_iter().zip([g1, g3]) {
        let [dq, wq] = casts.operands(be, up_proj, LinearGemm::InputGrad, (d, w), rows)?;
        up_proj.add_input_grad(be, dx, dq.buf(), wq.buf(), rows);
        let dq = casts.operand(be, (up_proj, LinearGemm::WeightGrad, 0), d, rows)?;
        let xq = x_cast.for_linear(&casts, be, up_proj, rows)?;
        up_proj.add_weight_grad(be, g, dq.buf(), xq, rows);
    }
    Ok(())
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
