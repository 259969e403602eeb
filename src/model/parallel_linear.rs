//! Megatron's column- and row-parallel linear layers under sequence parallelism, forward and
//! backward: each layer's GEMMs together with the collective that feeds or follows them, because
//! async tensor parallelism overlaps the two.
//!
//! Between layers a rank holds its `1/tp` of the token rows (`local`, rows `[rank·n/tp, …)` of
//! the `n` tokens). A column-parallel layer needs every row: the rows are all-gathered, then each
//! rank multiplies them by its slice of the weight. A row-parallel layer's products are partial
//! sums over the group: they are reduce-scattered back to row shards. The backward mirrors both.
//!
//! Plain TP runs one collective and then the GEMMs (or the GEMMs and then one collective).
//! Async TP (`TensorParallelOps::overlap_chunks` > 1) cuts the local rows into chunks: chunk `c`
//! of every rank's rows is one collective, queued on the group's communication thread, and the
//! GEMMs of chunk `c` run while chunk `c + 1` travels (all-gather then GEMM), or chunk `c`'s
//! reduce-scatter travels while chunk `c + 1` multiplies (GEMM then reduce-scatter). A chunk's
//! rows are `rows_per_chunk` consecutive rows of each rank, so they are picked from and put back
//! into full row order with one strided copy (`Backend::copy_rows`). The products are the same
//! row by row, so async TP equals plain TP within fp32 rounding.
//!
//! With one rank every layer is its local GEMMs, in the same order as before tensor parallelism.
//!
//! A float8 linear's GEMMs read operands cast first, whole (`float8_linear`), and a cast may agree
//! its scales over the group, which cannot run between queued collectives. So a row-parallel
//! forward casts before cutting chunks, and the other three (whose input arrives in gathered
//! chunks, or whose weight gradients run while reduce-scatters are queued) run as plain TP.

use anyhow::Result;

use super::crossings::context::ContextParallelOps;
use super::crossings::tensor::TensorParallelOps;
use super::float8_linear::{AmaxGroups, Float8Casts, GemmDim, Operand, SharedInput};
use super::linear::Linear;
use super::lora::{Adapter, AdapterGrads, LoraIds, OwnedAdapter};
use super::params::ParamSet;
use crate::backend::float8::LinearGemm;
use crate::backend::Backend;

/// One projection of a column-parallel layer's forward: `y = x · Wᵀ (+ b)`, plus its LoRA
/// adapter's `scale · (x·Aᵀ)·Bᵀ` when it has one.
pub struct Projection<'a, B: Backend> {
    pub linear: Linear,
    pub w: &'a B::Buf,
    pub y: &'a mut B::Buf,
    pub lora: Option<Adapter<'a, B>>,
    /// Its bias (gpt-oss's attention): split with the output features of a column-parallel
    /// layer, whole on every rank of a row-parallel one, added once the products are summed.
    pub bias: Option<&'a B::Buf>,
}

impl<'a, B: Backend> Projection<'a, B> {
    pub fn new(linear: Linear, w: &'a B::Buf, y: &'a mut B::Buf) -> Self {
        Projection {
            linear,
            w,
            y,
            lora: None,
            bias: None,
        }
    }

    /// This projection with its LoRA adapter (None: none).
    pub fn with_lora(self, lora: Option<Adapter<'a, B>>) -> Self {
        Projection { lora, ..self }
    }

    /// This projection with its bias (None: none).
    pub fn with_bias(self, bias: Option<&'a B::Buf>) -> Self {
        Projection { bias, ..self }
    }
}

/// A LoRA adapter in a backward: its factors, where their gradients go, and their parameters
/// (for a weight gradient left for later).
pub struct AdapterGrad<'a, B: Backend> {
    pub adapter: Adapter<'a, B>,
    pub grads: AdapterGrads<'a, B>,
    pub ids: LoraIds,
}

/// One projection's backward: its output gradient `dy`, its weight `w` and where that weight's
/// gradient is added (`dw`, parameter `param`; an empty `dw` is a frozen weight, whose gradient
/// is not computed), its LoRA adapter's, and its bias's (`db`).
pub struct ProjectionGrad<'a, B: Backend> {
    pub linear: Linear,
    pub dy: &'a B::Buf,
    pub w: &'a B::Buf,
    pub dw: &'a mut B::Buf,
    pub param: usize,
    pub lora: Option<AdapterGrad<'a, B>>,
    pub db: Option<&'a mut B::Buf>,
}

impl<'a, B: Backend> ProjectionGrad<'a, B> {
    pub fn new(
        linear: Linear,
        dy: &'a B::Buf,
        w: &'a B::Buf,
        dw: &'a mut B::Buf,
        param: usize,
    ) -> Self {
        ProjectionGrad {
            linear,
            dy,
            w,
            dw,
            param,
            lora: None,
            db: None,
        }
    }

    /// This projection's backward with its LoRA adapter's (None: none).
    pub fn with_lora(self, lora: Option<AdapterGrad<'a, B>>) -> Self {
        ProjectionGrad { lora, ..self }
    }

    /// This projection's backward with its bias's gradient (None: no bias).
    pub fn with_bias(self, db: Option<&'a mut B::Buf>) -> Self {
        ProjectionGrad { db, ..self }
    }

    /// `db += Σ_rows dy` over the rows of `dy` this rank holds (a column-parallel layer's every
    /// token, a row-parallel one's own rows, whose sums the group's replicated-gradient sum adds).
    fn add_bias_grad(&mut self, be: &B) {
        if let Some(db) = self.db.as_deref_mut() {
            super::bias::add_grad(be, db, self.dy);
        }
    }

    /// `dx += scale · (dy·B)·A` over `rows` rows of `dy` (the adapter's input-gradient share).
    fn add_adapter_input_grad(&self, be: &B, dx: &mut B::Buf, dy: &B::Buf, rows: usize) {
        if let Some(l) = &self.lora {
            l.adapter.add_input_grad(be, self.linear, dx, dy, rows);
        }
    }
}

/// A weight gradient `dW += dyᵀ · x` left for later (zero-bubble pipeline schedules run the
/// weight-gradient GEMMs as their own `W` action): copies of its operands, the parameter, and
/// the LoRA adapter's factors and parameters when it has one.
pub struct DeferredWeightGrad<B: Backend> {
    pub param: usize,
    pub linear: Linear,
    pub dy: B::Buf,
    pub x: B::Buf,
    pub rows: usize,
    pub lora: Option<(OwnedAdapter<B>, LoraIds)>,
}

impl<B: Backend> DeferredWeightGrad<B> {
    /// Adds the gradients into `grads` (a frozen weight's, empty, gets none).
    pub fn apply(&self, be: &B, grads: &mut ParamSet<B>) {
        let dw = &mut grads.bufs[self.param];
        if be.len(dw) > 0 {
            self.linear
                .add_weight_grad(be, dw, &self.dy, &self.x, self.rows);
        }
        if let Some((adapter, ids)) = &self.lora {
            let [da, db] = grads
                .bufs
                .get_disjoint_mut([ids.a, ids.b])
                .expect("an adapter's factors are distinct");
            let mut g = AdapterGrads { da, db };
            adapter
                .view()
                .add_weight_grads(be, self.linear, &mut g, &self.dy, &self.x, self.rows);
        }
    }
}

/// The linear layers of a tensor-parallel group over `tokens` token rows. With `deferred`, the
/// backward leaves the weight gradients there instead of computing them.
/// Which of a linear's features its tensor-parallel group splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureSplit {
    /// Column-parallel: each rank holds a slice of the output features (`N`).
    Outputs,
    /// Row-parallel: each rank holds a slice of the input features (`K`).
    Inputs,
}

/// The groups that split a layer's GEMM dimensions: tensor parallelism its features (as
/// `split` says), context parallelism each sequence's token rows.
pub struct SplitGroups<'a, B: Backend> {
    tp: &'a dyn TensorParallelOps<B>,
    cp: &'a dyn ContextParallelOps<B>,
    split: FeatureSplit,
}

impl<B: Backend> SplitGroups<'_, B> {
    /// The float8 casts agreeing their scales over these groups.
    fn float8(&self) -> Float8Casts<'_> {
        Float8Casts {
            groups: self,
            partial_row_blocks: false,
        }
    }
}

impl<B: Backend> AmaxGroups for SplitGroups<'_, B> {
    fn agree(&self, amaxes: &mut [f32], spans: &[GemmDim]) -> anyhow::Result<()> {
        let split = match self.split {
            FeatureSplit::Outputs => GemmDim::N,
            FeatureSplit::Inputs => GemmDim::K,
        };
        if self.tp.degree() > 1 && spans.contains(&split) {
            self.tp.all_reduce_max(amaxes)?;
        }
        if self.cp.degree() > 1 && spans.contains(&GemmDim::M) {
            self.cp.max_amax_over_group(amaxes)?;
        }
        Ok(())
    }
}

pub struct SequenceParallel<'a, B: Backend> {
    pub tp: &'a dyn TensorParallelOps<B>,
    /// The context-parallel group, whose ranks hold the other rows of the same sequences: a float8
    /// amax over token rows is agreed over it.
    pub cp: &'a dyn ContextParallelOps<B>,
    pub tokens: usize,
    pub deferred: Option<&'a std::cell::RefCell<Vec<DeferredWeightGrad<B>>>>,
    /// Every rank holds every token row (MLA's latents, computed whole on each rank): column
    /// layers neither gather their input nor reduce-scatter its gradient, which stays this rank's
    /// share. Float8 scales still agree over the group, whose ranks hold the other features.
    pub rows_replicated: bool,
}

/// Where chunk `c` of the local rows lies: its first local row and its number of rows.
struct Chunk {
    first: usize,
    rows: usize,
}

impl<'a, B: Backend> SequenceParallel<'a, B> {
    fn degree(&self) -> usize {
        match self.rows_replicated {
            true => 1,
            false => self.tp.degree(),
        }
    }

    /// These layers over input rows every rank holds whole (`rows_replicated`).
    pub fn replicated_rows(&self) -> SequenceParallel<'a, B> {
        SequenceParallel {
            tp: self.tp,
            cp: self.cp,
            tokens: self.tokens,
            deferred: self.deferred,
            rows_replicated: true,
        }
    }

    /// The groups of a layer whose features the tensor-parallel group splits as `split`.
    fn groups(&self, split: FeatureSplit) -> SplitGroups<'_, B> {
        SplitGroups {
            tp: self.tp,
            cp: self.cp,
            split,
        }
    }

    /// `g`'s weight gradient `dW += dyᵀ · x` now, or its operands kept for later (`deferred`):
    /// copies, or the float8 casts themselves; none for a frozen weight. Then its LoRA adapter's
    /// factor gradients, from the high-precision `dy` and `x`.
    fn weight_grad(
        &self,
        be: &B,
        g: &mut ProjectionGrad<'_, B>,
        split: FeatureSplit,
        dy: &B::Buf,
        x: &mut SharedInput<'_, B>,
        rows: usize,
    ) -> Result<()> {
        let linear = g.linear;
        if be.len(g.dw) > 0 {
            let groups = self.groups(split);
            let casts = groups.float8();
            let gq = casts.operand(be, (linear, LinearGemm::WeightGrad, 0), dy, rows)?;
            let xq = x.for_linear(&casts, be, linear, rows)?;
            match self.deferred {
                None => linear.add_weight_grad(be, g.dw, gq.buf(), xq, rows),
                Some(later) => later.borrow_mut().push(DeferredWeightGrad {
                    param: g.param,
                    linear,
                    dy: gq.into_owned(be, rows * linear.d_out),
                    x: Operand::HighPrecision(xq).into_owned(be, rows * linear.d_in),
                    rows,
                    lora: None,
                }),
            }
        }
        let Some(l) = g.lora.as_mut() else {
            return Ok(());
        };
        let xh = x.high_precision();
        match self.deferred {
            None => l
                .adapter
                .add_weight_grads(be, linear, &mut l.grads, dy, xh, rows),
            Some(later) => later.borrow_mut().push(DeferredWeightGrad {
                param: g.param,
                linear,
                dy: Operand::HighPrecision(dy).into_owned(be, rows * linear.d_out),
                x: Operand::HighPrecision(xh).into_owned(be, rows * linear.d_in),
                rows,
                lora: Some((l.adapter.to_owned(be), l.ids)),
            }),
        }
        Ok(())
    }

    fn local_rows(&self) -> usize {
        self.tokens / self.degree()
    }

    /// The chunks async TP cuts the local rows into (empty for plain TP, and for a float8 layer
    /// that casts while the chunks would be in flight).
    fn chunks(&self, float8_casts_between: bool) -> Vec<Chunk> {
        let parts = self.tp.overlap_chunks().min(self.local_rows());
        if self.degree() == 1 || parts <= 1 || float8_casts_between {
            return Vec::new();
        }
        let per = self.local_rows().div_ceil(parts);
        (0..self.local_rows())
            .step_by(per)
            .map(|first| Chunk {
                first,
                rows: per.min(self.local_rows() - first),
            })
            .collect()
    }

    /// Chunk `c`'s rows of every rank from `full` (`[tokens, width]`), as `[degree · rows, width]`.
    fn pick(&self, be: &B, full: &B::Buf, width: usize, c: &Chunk) -> B::Buf {
        let mut out = be.uninit(self.degree() * c.rows * width);
        let (piece, stride) = (c.rows * width, self.local_rows() * width);
        be.copy_rows(
            &mut out,
            0,
            piece,
            full,
            c.first * width,
            stride,
            self.degree(),
            piece,
        );
        out
    }

    /// The inverse of `pick`: chunk rows back to their places in `full`.
    fn place(&self, be: &B, full: &mut B::Buf, chunk: &B::Buf, width: usize, c: &Chunk) {
        let (piece, stride) = (c.rows * width, self.local_rows() * width);
        be.copy_rows(
            full,
            c.first * width,
            stride,
            chunk,
            0,
            piece,
            self.degree(),
            piece,
        );
    }

    /// This rank's chunk `c` of `local` (`[local rows, width]`).
    fn local_chunk(&self, be: &B, local: &B::Buf, width: usize, c: &Chunk) -> B::Buf {
        let mut out = be.uninit(c.rows * width);
        be.copy_range(&mut out, 0, local, c.first * width, c.rows * width);
        out
    }

    /// Column-parallel forward: `y = x · Wᵀ` for each projection over every token, `x` being the
    /// `local` rows (`[tokens/tp, width]`) gathered over the group into `full`, which the backward
    /// reads (with one rank `full` is not used).
    pub fn column_forward(
        &self,
        be: &B,
        local: &B::Buf,
        full: &mut B::Buf,
        width: usize,
        projections: &mut [Projection<'_, B>],
    ) -> Result<()> {
        let float8 = projections.iter().any(|p| p.linear.float8.is_some());
        let chunks = self.chunks(float8);
        if chunks.is_empty() {
            let x = if self.degree() == 1 {
                local
            } else {
                self.tp.gather_rows(be, local, full)?;
                &*full
            };
            let groups = self.groups(FeatureSplit::Outputs);
            let casts = groups.float8();
            let mut xs = SharedInput::new(x, LinearGemm::Output);
            for p in projections.iter_mut() {
                let w = casts.operand(be, (p.linear, LinearGemm::Output, 1), p.w, self.tokens)?;
                let xq = xs.for_linear(&casts, be, p.linear, self.tokens)?;
                p.linear.forward(be, p.y, xq, w.buf(), self.tokens);
                if let Some(l) = &p.lora {
                    l.add_forward(be, p.linear, p.y, x, self.tokens);
                }
                if let Some(b) = p.bias {
                    super::bias::add(be, p.y, b);
                }
            }
            return Ok(());
        }
        for c in &chunks {
            self.tp
                .start_gather_rows(be, self.local_chunk(be, local, width, c))?;
        }
        for c in &chunks {
            let x = self.tp.finish_oldest(be)?;
            self.place(be, full, &x, width, c);
            let rows = self.degree() * c.rows;
            for p in projections.iter_mut() {
                let mut y = be.uninit(rows * p.linear.d_out);
                p.linear.forward(be, &mut y, &x, p.w, rows);
                if let Some(l) = &p.lora {
                    l.add_forward(be, p.linear, &mut y, &x, rows);
                }
                if let Some(b) = p.bias {
                    super::bias::add(be, &mut y, b);
                }
                self.place(be, p.y, &y, p.linear.d_out, c);
            }
        }
        Ok(())
    }

    /// Row-parallel forward into the residual stream: `out = residual + x · Wᵀ` (and the
    /// adapter's share) on this rank's rows, `proj.y` being `out` and `x` (`[tokens, d_in]`)
    /// holding this rank's slice of the input features, so that the products are partial sums
    /// over the group, reduce-scattered (through `partial`, `[tokens, d_out]`).
    pub fn row_forward_residual(
        &self,
        be: &B,
        proj: Projection<'_, B>,
        x: &B::Buf,
        residual: &B::Buf,
        partial: &mut B::Buf,
    ) -> Result<()> {
        let Projection {
            linear,
            w,
            y: out,
            lora,
            bias,
        } = proj;
        let add_bias = |out: &mut B::Buf| {
            if let Some(b) = bias {
                super::bias::add(be, out, b);
            }
        };
        let x_hp = x;
        let [x, w] = self.groups(FeatureSplit::Inputs).float8().operands(
            be,
            linear,
            LinearGemm::Output,
            (x, w),
            self.tokens,
        )?;
        let (x, w) = (x.buf(), w.buf());
        let add_adapter = |y: &mut B::Buf, x: &B::Buf, rows: usize| {
            if let Some(l) = &lora {
                l.add_forward(be, linear, y, x, rows);
            }
        };
        if self.degree() == 1 {
            linear.forward_residual(be, out, residual, x, w, self.tokens);
            add_adapter(out, x_hp, self.tokens);
            add_bias(out);
            return Ok(());
        }
        let chunks = self.chunks(false);
        if chunks.is_empty() {
            linear.forward(be, partial, x, w, self.tokens);
            add_adapter(partial, x_hp, self.tokens);
            self.tp.reduce_scatter_rows(be, partial, out)?;
            be.add_assign(out, residual);
            add_bias(out);
            return Ok(());
        }
        for c in &chunks {
            let xc = self.pick(be, x, linear.d_in, c);
            let rows = self.degree() * c.rows;
            let mut pc = be.uninit(rows * linear.d_out);
            linear.forward(be, &mut pc, &xc, w, rows);
            if lora.is_some() {
                add_adapter(&mut pc, &self.pick(be, x_hp, linear.d_in, c), rows);
            }
            self.tp.start_reduce_scatter_rows(be, pc)?;
        }
        let d = linear.d_out;
        for c in &chunks {
            let sum = self.tp.finish_oldest(be)?;
            be.copy_range(out, c.first * d, &sum, 0, c.rows * d);
        }
        be.add_assign(out, residual);
        add_bias(out);
        Ok(())
    }

    /// Row-parallel backward: `dx = dy · W` (and the adapter's share) and the weight gradients,
    /// `dy` being the output gradient's local rows (`g.dy`) gathered over the group (into `full`,
    /// `[tokens, d_out]`).
    pub fn row_backward(
        &self,
        be: &B,
        mut g: ProjectionGrad<'_, B>,
        full: &mut B::Buf,
        x: &B::Buf,
        dx: &mut B::Buf,
    ) -> Result<()> {
        g.add_bias_grad(be);
        let (n, linear, dy_local, w) = (self.tokens, g.linear, g.dy, g.w);
        let chunks = self.chunks(linear.float8.is_some());
        if chunks.is_empty() {
            let dy = if self.degree() == 1 {
                dy_local
            } else {
                self.tp.gather_rows(be, dy_local, full)?;
                &*full
            };
            let [gq, wq] = self.groups(FeatureSplit::Inputs).float8().operands(
                be,
                linear,
                LinearGemm::InputGrad,
                (dy, w),
                n,
            )?;
            linear.input_grad(be, dx, gq.buf(), wq.buf(), n);
            g.add_adapter_input_grad(be, dx, dy, n);
            let mut x = SharedInput::new(x, LinearGemm::WeightGrad);
            return self.weight_grad(be, &mut g, FeatureSplit::Inputs, dy, &mut x, n);
        }
        for c in &chunks {
            self.tp
                .start_gather_rows(be, self.local_chunk(be, dy_local, linear.d_out, c))?;
        }
        for c in &chunks {
            let dyc = self.tp.finish_oldest(be)?;
            self.place(be, full, &dyc, linear.d_out, c);
            let rows = self.degree() * c.rows;
            let mut dxc = be.uninit(rows * linear.d_in);
            linear.input_grad(be, &mut dxc, &dyc, w, rows);
            g.add_adapter_input_grad(be, &mut dxc, &dyc, rows);
            self.place(be, dx, &dxc, linear.d_in, c);
        }
        let mut x = SharedInput::new(x, LinearGemm::WeightGrad);
        self.weight_grad(be, &mut g, FeatureSplit::Inputs, full, &mut x, n)
    }

    /// Column-parallel backward: `dW_i += dy_iᵀ · x` for each projection, and this rank's rows of
    /// the input gradient `Σ_i dy_i · W_i`, summed over the group (reduce-scattered through
    /// `full`, `[tokens, width]`) into `dlocal`. `x` is the input the forward read.
    pub fn column_backward(
        &self,
        be: &B,
        grads: &mut [ProjectionGrad<'_, B>],
        x: &B::Buf,
        full: &mut B::Buf,
        dlocal: &mut B::Buf,
    ) -> Result<()> {
        let n = self.tokens;
        grads.iter_mut().for_each(|g| g.add_bias_grad(be));
        let groups = self.groups(FeatureSplit::Outputs);
        let casts = groups.float8();
        let mut x = SharedInput::new(x, LinearGemm::WeightGrad);
        // A float8 weight gradient may agree its scales over the group, which cannot run while
        // the chunks' reduce-scatters are queued on it.
        let chunks = self.chunks(grads.iter().any(|g| g.linear.float8.is_some()));
        if chunks.is_empty() {
            // Each projection's two GEMMs back to back, so a device converts its `dy` once.
            let target = if self.degree() == 1 {
                &mut *dlocal
            } else {
                &mut *full
            };
            for (i, g) in grads.iter_mut().enumerate() {
                let [dy, w] =
                    casts.operands(be, g.linear, LinearGemm::InputGrad, (g.dy, g.w), n)?;
                if i == 0 {
                    g.linear.input_grad(be, target, dy.buf(), w.buf(), n);
                } else {
                    g.linear.add_input_grad(be, target, dy.buf(), w.buf(), n);
                }
                g.add_adapter_input_grad(be, target, g.dy, n);
                let dy = g.dy;
                self.weight_grad(be, g, FeatureSplit::Outputs, dy, &mut x, n)?;
            }
            if self.degree() > 1 {
                self.tp.reduce_scatter_rows(be, full, dlocal)?;
            }
            return Ok(());
        }
        let width = grads[0].linear.d_in;
        let mut cast = Vec::with_capacity(grads.len());
        for g in grads.iter() {
            cast.push(casts.operands(be, g.linear, LinearGemm::InputGrad, (g.dy, g.w), n)?);
        }
        for c in &chunks {
            let rows = self.degree() * c.rows;
            let mut dxc = be.uninit(rows * width);
            for (i, (g, [dy, w])) in grads.iter().zip(&cast).enumerate() {
                let dyc = self.pick(be, dy.buf(), g.linear.d_out, c);
                if i == 0 {
                    g.linear.input_grad(be, &mut dxc, &dyc, w.buf(), rows);
                } else {
                    g.linear.add_input_grad(be, &mut dxc, &dyc, w.buf(), rows);
                }
                g.add_adapter_input_grad(be, &mut dxc, &dyc, rows);
            }
            self.tp.start_reduce_scatter_rows(be, dxc)?;
        }
        drop(cast);
        // The weight gradients need no communication: they hide the last reduce-scatters.
        for g in grads.iter_mut() {
            let dy = g.dy;
            self.weight_grad(be, g, FeatureSplit::Outputs, dy, &mut x, n)?;
        }
        for c in &chunks {
            let sum = self.tp.finish_oldest(be)?;
            be.copy_range(dlocal, c.first * width, &sum, 0, c.rows * width);
        }
        Ok(())
    }
}
