//! Models: Llama 3 shapes and flavors, canonical parameter names, initialization, and the decoder
//! itself with explicit forward and backward.

pub mod args;
pub mod init;
pub mod llama;
pub mod params;

pub use args::ModelArgs;
pub use llama::{KvCache, Llama, Workspace};
pub use params::{ParamDtype, ParamSet};

use crate::backend::Backend;

/// Freshly initialised parameters for `args` (see `init`).
pub fn init_params<B: Backend>(be: &B, args: &ModelArgs, seed: u64) -> ParamSet<B> {
    let specs = params::param_specs(args);
    let mut set = ParamSet::zeros(be, &specs);
    for (i, (name, shape)) in specs.iter().enumerate() {
        set.bufs[i] = be.upload(&init::init_param(args, name, shape.iter().product(), seed));
    }
    set
}
