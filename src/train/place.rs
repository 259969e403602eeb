//! What a rank's composition knows of its place in the mesh: the groups its layout crosses, the
//! data-parallel degree, FSDP's shard degree and its rank. A running job takes them from its
//! joined groups (`MeshPlace::of`); `titan plan` from the same groups made as shapes
//! (`MeshPlace::planned`: `launch::groups` decides for both which groups exist), so the planner
//! and the trainer size a rank with one function.

use crate::comm::mesh::DeviceMesh;
use crate::launch::groups::{GroupJoiner, RankGroups, ShapeGroups};
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
        match dist {
            Some(d) => Self::in_groups(&d.groups, &d.mesh, d.rank),
            None => Self::single(),
        }
    }

    /// The place of `rank` in `mesh` with `expert_parallel_degree`: the groups `launch::groups`
    /// joins for it, made as shapes alone (the same groups, of the same sizes, with this rank at
    /// the same place).
    pub fn planned(mesh: &DeviceMesh, rank: usize, expert_parallel_degree: usize) -> Self {
        if mesh.world == 1 {
            return Self::single();
        }
        let joiner = GroupJoiner {
            maker: &ShapeGroups,
            mesh,
            rank,
            world: mesh.world,
            generation: 0,
        };
        let groups = joiner
            .join_all(expert_parallel_degree)
            .expect("shape groups are made without a transport");
        Self::in_groups(&groups, mesh, rank)
    }

    /// The place of `rank` with `groups` in `mesh`.
    fn in_groups(groups: &RankGroups, mesh: &DeviceMesh, rank: usize) -> Self {
        MeshPlace {
            groups: MeshGroups {
                tp: groups.tp.clone(),
                cp: groups.cp.clone(),
                ep: groups.ep.clone(),
                pp: groups.pp.clone(),
                loss: Some(groups.loss.clone()),
            },
            dp_size: groups.dp.size(),
            fsdp_shard: mesh.fsdp_shard_degree(),
            rank,
        }
    }
}
