//! Whole tensors from a tensor-parallel run, for a checkpoint written in the layout-free format:
//! every rank's tensor-parallel parts (under FSDP, first its shards gathered over the shard group)
//! are gathered over the tensor-parallel group and joined by each tensor's split
//! (`TpSharding::join`). Every rank takes part; rank 0 then writes the whole checkpoint.
//!
//! This holds the whole model and both AdamW moments in host memory on every rank while it
//! saves: fine for the models a CPU trains, not for 70B. Writing tensor-parallel parts as shards
//! of the sharded format (as FSDP alone does) is the way past it, and not built yet.

use anyhow::Result;

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::comm::group::ProcessGroup;
use crate::model::params::{param_specs, TpSharding};
use crate::model::ParamSet;
use crate::parallel::plan::{ParamState, RankLayout};
use crate::train::optimizer::AdamW;

/// The whole weights and AdamW moments of a tensor-parallel run, as host sets on the CPU backend.
pub struct WholeState {
    pub params: ParamSet<CpuBackend>,
    pub exp_avg: ParamSet<CpuBackend>,
    pub exp_avg_sq: ParamSet<CpuBackend>,
}

/// Gathers the whole state (every rank of the job calls this together).
pub fn whole_state<B: Backend>(
    be: &B,
    layout: &RankLayout<B>,
    opt: &AdamW<B>,
) -> Result<WholeState> {
    let tp = layout
        .tp_group()
        .expect("whole_state gathers tensor-parallel parts (a titan bug)");
    let specs = param_specs(&layout.model.args);
    let (weights, shard_group): (&ParamSet<B>, Option<&dyn ProcessGroup>) = match &layout.state {
        ParamState::Whole { params, .. } => (params, None),
        ParamState::Sharded { fsdp, .. } => (&fsdp.shards, Some(fsdp.shard_group())),
    };
    let local_specs = layout.model.param_specs();
    let gather = |set: &ParamSet<B>| -> Result<ParamSet<CpuBackend>> {
        let mut bufs = Vec::with_capacity(set.len());
        for (i, (name, shape)) in specs.iter().enumerate() {
            let mut part = be.download(&set.bufs[i]);
            if let Some(g) = shard_group {
                let mut all = vec![0.0f32; part.len() * g.size()];
                g.all_gather(&part, &mut all)?;
                all.truncate(local_specs[i].1.iter().product());
                part = all;
            }
            let mut all = vec![0.0f32; part.len() * tp.size()];
            tp.all_gather(&part, &mut all)?;
            let parts: Vec<Vec<f32>> = all.chunks(part.len()).map(<[f32]>::to_vec).collect();
            bufs.push(TpSharding::of(name).join(&parts, shape));
        }
        Ok(ParamSet {
            names: specs.iter().map(|(n, _)| n.clone()).collect(),
            shapes: specs.iter().map(|(_, s)| s.clone()).collect(),
            bufs,
        })
    };
    Ok(WholeState {
        params: gather(weights)?,
        exp_avg: gather(&opt.exp_avg)?,
        exp_avg_sq: gather(&opt.exp_avg_sq)?,
    })
}
