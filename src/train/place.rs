//! What a rank's composition knows of its place in the mesh: the groups its layout crosses, the
//! data-parallel degree, FSDP's shard degree and its rank. A running job takes them from its
//! joined groups (`MeshPlace::of`); `titan plan` from the degrees alone (`MeshPlace::planned`,
//! shape-only groups), so the planner and the trainer size a rank with one function.

use std::sync::Arc;

use crate::comm::group::ProcessGroup;
use crate::comm::mesh::DeviceMesh;
use crate::comm::shape_group::ShapeGroup;
use crate::launch::Distributed;
use crate::parallel::parallelize::MeshGroups;

/// A rank's place, as its composition needs it.
pub struct MeshPlace {
    pub groups: MeshGroups,
    /// Ranks splitting the batch (`dp_replicate × dp_shard`).
    pub dp_size: usize,
    /// FSDP's shard degree (`dp_shard × cp`), None when parameters stay whole.
    pub fsdp_shard: Option<usize>,
    pub rank: usize,
}

impl MeshPlace {
    /// One process: no groups.
    pub fn single() -> Self {
        MeshPlace {
            groups: MeshGroups::default(),
            dp_size: 1,
            fsdp_shard: None,
            rank: 0,
        }
    }

    /// A running rank's place, from the groups it joined.
    pub fn of(dist: Option<&Distributed>) -> Self {
        let Some(d) = dist else {
            return Self::single();
        };
        MeshPlace {
            groups: MeshGroups {
                tp: d.tp.clone(),
                cp: d.cp.clone(),
                ep: d.ep.clone(),
                pp: d.pp.clone(),
                loss: Some(d.loss.clone()),
            },
            dp_size: d.dp.size(),
            fsdp_shard: d.mesh.fsdp_shard_degree(),
            rank: d.rank,
        }
    }

    /// The place of `rank` in `mesh` with `expert_parallel_degree`, as `launch::groups` would
    /// join it (the same groups exist, of the same sizes, with this rank at the same place).
    pub fn planned(mesh: &DeviceMesh, rank: usize, expert_parallel_degree: usize) -> Self {
        if mesh.world == 1 {
            return Self::single();
        }
        let group = |name: &str, ranks: Vec<usize>| -> Arc<dyn ProcessGroup> {
            let at = ranks.iter().position(|&r| r == rank).expect("own group");
            Arc::new(ShapeGroup::new(name, at, ranks.len()))
        };
        let dim = |name: &str| {
            (mesh.degree(name) > 1).then(|| group(name, mesh.group_ranks(rank, &[name])))
        };
        let ep = (expert_parallel_degree > 1)
            .then(|| group("ep", mesh.expert_groups(rank, expert_parallel_degree).0));
        let loss = group(
            "loss",
            mesh.group_ranks(rank, &["dp_replicate", "dp_shard", "cp"]),
        );
        MeshPlace {
            groups: MeshGroups {
                tp: dim("tp"),
                cp: dim("cp"),
                ep,
                pp: dim("pp"),
                loss: Some(loss),
            },
            dp_size: mesh.degree("dp_replicate") * mesh.degree("dp_shard"),
            fsdp_shard: mesh.fsdp_shard_degree(),
            rank,
        }
    }
}
