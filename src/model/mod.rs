//! Models: the one decoder with explicit forward and backward (`decoder`), the model families over
//! it, each a folder with its flavors and Hugging Face adapter (`families`), model shapes
//! (`args`), canonical parameter names, initialization; one rank's shapes (`local_shapes`) and the
//! interfaces through which the block crosses ranks (`crossings`).

pub mod activation_checkpoint;
pub mod args;
pub mod bias;
pub mod crossings;
pub mod decoder;
pub mod families;
pub mod float8_convert;
pub mod float8_linear;
pub mod init;
pub mod linear;
pub mod local_shapes;
pub mod lora;
pub mod lora_args;
pub mod moe;
pub mod parallel_linear;
pub mod params;
pub mod projection;
pub mod token_marks;

pub use args::ModelArgs;
pub use decoder::{Decoder, KvCache, Workspace};
pub use local_shapes::LocalShapes;
pub use params::{ParamDtype, ParamSet, ReduceDtype};

use crate::backend::Backend;

/// Freshly initialised parameters for `args` (see `init`).
pub fn init_params<B: Backend>(be: &B, args: &ModelArgs, seed: u64) -> ParamSet<B> {
    use rayon::prelude::*;
    let specs = params::param_specs(args);
    // Each parameter has its own random stream, so drawing them in parallel changes no value.
    ParamSet {
        names: specs.iter().map(|(n, _)| n.clone()).collect(),
        shapes: specs.iter().map(|(_, s)| s.clone()).collect(),
        bufs: specs
            .par_iter()
            .map(|(name, shape)| {
                be.upload(&init::init_param(args, name, shape.iter().product(), seed))
            })
            .collect(),
    }
}
