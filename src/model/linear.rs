//! The linear layer of every Llama projection, `y = x · Wᵀ` with `W` stored `[out, in]` as
//! PyTorch's `nn.Linear` keeps it, and its two backward products: the words the model is written
//! in, instead of GEMM calls with transposes and accumulate flags.
//!
//! A linear converted to float8 (`[model] converters = ["quantize.linear.float8"]`) carries its
//! recipe; its GEMMs are the same calls on operands cast beforehand (`float8_linear`), so these
//! methods never quantise. Under FSDP's float8 all-gather its weight arrives cast already.

use crate::backend::float8::Float8Recipe;
use crate::backend::Backend;
use crate::backend::{GemmOutput, GemmShape};

/// A projection from `d_in` to `d_out` features over a number of token rows.
#[derive(Debug, Clone, Copy)]
pub struct Linear {
    pub d_in: usize,
    pub d_out: usize,
    /// The float8 recipe its three GEMMs' operands are cast with (None: high precision).
    pub float8: Option<Float8Recipe>,
    /// Its weight arrives already cast: FSDP's float8 all-gather (tensorwise) sent it as float8
    /// codes with the scale of the whole weight and dequantised it, so its GEMMs read it as it is.
    pub weight_gathered_in_float8: bool,
}

impl Linear {
    pub fn new(d_in: usize, d_out: usize) -> Self {
        Linear {
            d_in,
            d_out,
            float8: None,
            weight_gathered_in_float8: false,
        }
    }

    /// This linear with its weight gathered in float8 by FSDP when `gathered` (its casts skip it).
    pub fn weight_gathered_in_float8(self, gathered: bool) -> Self {
        Linear {
            weight_gathered_in_float8: gathered && self.float8.is_some(),
            ..self
        }
    }

    /// This linear computing in float8 with `recipe` (None: high precision).
    pub fn in_float8(self, recipe: Option<Float8Recipe>) -> Self {
        Linear {
            float8: recipe,
            ..self
        }
    }

    /// `y = x · Wᵀ` (`x` `[rows, d_in]`, `y` `[rows, d_out]`).
    pub fn forward<B: Backend>(&self, be: &B, y: &mut B::Buf, x: &B::Buf, w: &B::Buf, rows: usize) {
        be.matmul(
            y,
            x,
            w,
            GemmShape::new(rows, self.d_in, self.d_out).b_transposed(),
            GemmOutput::Overwrite,
        );
    }

    /// `y += x · Wᵀ`: a projection added into the residual stream in place.
    pub fn add_forward<B: Backend>(
        &self,
        be: &B,
        y: &mut B::Buf,
        x: &B::Buf,
        w: &B::Buf,
        rows: usize,
    ) {
        be.matmul(
            y,
            x,
            w,
            GemmShape::new(rows, self.d_in, self.d_out).b_transposed(),
            GemmOutput::Accumulate,
        );
    }

    /// `y = residual + x · Wᵀ`: a projection back into the residual stream.
    pub fn forward_residual<B: Backend>(
        &self,
        be: &B,
        y: &mut B::Buf,
        residual: &B::Buf,
        x: &B::Buf,
        w: &B::Buf,
        rows: usize,
    ) {
        be.matmul_add(
            y,
            residual,
            x,
            w,
            GemmShape::new(rows, self.d_in, self.d_out).b_transposed(),
        );
    }

    /// `dx = dy · W`.
    pub fn input_grad<B: Backend>(
        &self,
        be: &B,
        dx: &mut B::Buf,
        dy: &B::Buf,
        w: &B::Buf,
        rows: usize,
    ) {
        be.matmul(
            dx,
            dy,
            w,
            GemmShape::new(rows, self.d_out, self.d_in),
            GemmOutput::Overwrite,
        );
    }

    /// `dx += dy · W` (a layer whose input feeds several projections).
    pub fn add_input_grad<B: Backend>(
        &self,
        be: &B,
        dx: &mut B::Buf,
        dy: &B::Buf,
        w: &B::Buf,
        rows: usize,
    ) {
        be.matmul(
            dx,
            dy,
            w,
            GemmShape::new(rows, self.d_out, self.d_in),
            GemmOutput::Accumulate,
        );
    }

    /// `dW += dyᵀ · x`; nothing for a frozen weight (an empty `dw`: LoRA's base).
    pub fn add_weight_grad<B: Backend>(
        &self,
        be: &B,
        dw: &mut B::Buf,
        dy: &B::Buf,
        x: &B::Buf,
        rows: usize,
    ) {
        if be.len(dw) == 0 {
            return;
        }
        be.matmul(
            dw,
            dy,
            x,
            GemmShape::new(self.d_out, rows, self.d_in).a_transposed(),
            GemmOutput::Accumulate,
        );
    }
}
