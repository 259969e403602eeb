//! Float8 amaxes agreed over a group (TP's split features, CP's split sequences): the collective
//! behind `TensorParallelOps::all_reduce_max` and `ContextParallelOps::max_amax_over_group`.

use anyhow::Result;

use crate::comm::group::{ProcessGroup, ReduceOp};

/// Float8 amaxes (`|x|` maxima, NaN when a value was NaN) the largest over `group`, in place.
/// `ReduceOp::Max` keeps the larger number and so would drop a NaN: it travels as +inf and comes
/// back as NaN. (An infinite amax dequantises every value to NaN as well: scale 0, inverse ∞.)
pub fn all_reduce_amax(group: &dyn ProcessGroup, amaxes: &mut [f32]) -> Result<()> {
    nan_as_infinity(amaxes);
    group.all_reduce(amaxes, ReduceOp::Max)?;
    infinity_as_nan(amaxes);
    Ok(())
}

/// Amaxes about to travel through a maximum, which would drop a NaN: each NaN as +inf.
pub fn nan_as_infinity(amaxes: &mut [f32]) {
    amaxes
        .iter_mut()
        .filter(|a| a.is_nan())
        .for_each(|a| *a = f32::INFINITY);
}

/// Amaxes back from a maximum: each +inf (a NaN's, or an infinite value's) as NaN.
pub fn infinity_as_nan(amaxes: &mut [f32]) {
    amaxes
        .iter_mut()
        .filter(|a| a.is_infinite())
        .for_each(|a| *a = f32::NAN);
}
