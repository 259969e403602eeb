//! A linear layer's bias (gpt-oss's attention projections, router and experts): `y[r, :] += b`
//! and its gradient `db += Σ_r dy[r, :]`.
//!
//! A bias is the weight of one more input feature that is always one, so both are GEMMs of depth
//! one through `Linear` (`[rows, 1]` ones times `bᵀ`, and `dyᵀ` times the ones): every backend
//! computes them with the GEMM it has, with no kernel of their own.

use super::linear::Linear;
use crate::backend::Backend;

/// The linear of a bias of `width` outputs: one input feature.
fn of_width(width: usize) -> Linear {
    Linear::new(1, width)
}

/// `rows` ones, the input feature a bias multiplies (filled where the backend keeps them: no
/// upload).
pub fn ones<B: Backend>(be: &B, rows: usize) -> B::Buf {
    let mut ones = be.uninit(rows);
    be.fill(&mut ones, 1.0);
    ones
}

/// `y[r, :] += b` for every row of `y` (`[rows, len(b)]`).
pub fn add<B: Backend>(be: &B, y: &mut B::Buf, b: &B::Buf) {
    let width = be.len(b);
    let rows = be.len(y) / width;
    of_width(width).add_forward(be, y, &ones(be, rows), b, rows);
}

/// `db += Σ_r dy[r, :]` over every row of `dy` (`[rows, len(db)]`); nothing for a frozen bias
/// (an empty `db`).
pub fn add_grad<B: Backend>(be: &B, db: &mut B::Buf, dy: &B::Buf) {
    let width = be.len(db);
    if width == 0 {
        return;
    }
    let rows = be.len(dy) / width;
    of_width(width).add_weight_grad(be, db, dy, &ones(be, rows), rows);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    #[test]
    fn a_bias_adds_to_every_row_and_its_gradient_sums_the_rows() {
        let be = CpuBackend::new();
        let mut y = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        add(&be, &mut y, &vec![10.0, 20.0, 30.0]);
        assert_eq!(y, [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
        let mut db = vec![1.0, 1.0, 1.0];
        add_grad(&be, &mut db, &vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(db, [6.0, 8.0, 10.0]);
        let mut frozen: Vec<f32> = vec![];
        add_grad(&be, &mut frozen, &vec![1.0, 2.0]);
        assert!(frozen.is_empty());
    }
}
