//! A rank's process groups from the device mesh: which groups a layout has, over which ranks,
//! decided once here for the trainer and the planner alike. A running job joins them over the
//! TCP transport (`TcpGroups`), in the one order every rank follows (a rank that joined its groups
//! in another order would wait on a peer waiting on it): the data groups (`dp`, the loss group,
//! FSDP's shard and HSDP's replica groups), then `tp`, `cp`, `pp`, the expert groups, the
//! checkpoint writers and the whole job. `titan plan` makes the same groups as shapes alone
//! (`ShapeGroups`). Each group is named by its mesh dims and the restart generation, so a
//! restarted run never meets an earlier one's keys. Device communicators are attached to these
//! groups afterwards (`device_groups`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;

use crate::comm::flight_recorder;
use crate::comm::group::{ProcessGroup, TcpGroup};
use crate::comm::mesh::DeviceMesh;
use crate::comm::shape_group::ShapeGroup;
use crate::comm::store::StoreClient;

type Group = Arc<dyn ProcessGroup>;

/// How a group over some ranks comes to be.
pub trait GroupMaker {
    /// The group of the global `ranks`, this rank at `local`, named `name`.
    fn group(&self, ranks: &[usize], local: usize, name: &str) -> Result<Group>;
}

/// A running job's groups: joined over the TCP transport through the rendezvous store, each
/// recorded by the flight recorder when it is on.
pub struct TcpGroups<'a> {
    pub store: &'a StoreClient,
    /// This rank's address peers connect to.
    pub host: &'a str,
    pub init: Duration,
    pub op: Duration,
}

impl GroupMaker for TcpGroups<'_> {
    fn group(&self, ranks: &[usize], local: usize, name: &str) -> Result<Group> {
        let group = TcpGroup::connect(
            self.store,
            name,
            local,
            ranks.len(),
            self.host,
            self.init,
            self.op,
        )?;
        Ok(Arc::new(
            group.with_record(flight_recorder::for_group(name, ranks)),
        ))
    }
}

/// The planner's groups: their shapes alone (`titan plan` sizes a rank without running it).
pub struct ShapeGroups;

impl GroupMaker for ShapeGroups {
    fn group(&self, ranks: &[usize], local: usize, name: &str) -> Result<Group> {
        Ok(Arc::new(ShapeGroup::new(name, local, ranks.len())))
    }
}

/// What a rank makes its groups with.
pub struct GroupJoiner<'a> {
    pub maker: &'a dyn GroupMaker,
    pub mesh: &'a DeviceMesh,
    pub rank: usize,
    pub world: usize,
    pub generation: u64,
}

/// Every group of a rank, with the store names of those a layer above forms more groups beside
/// (device communicators, checkpoint barriers). A group of a dimension of degree 1 is None.
pub struct RankGroups {
    /// The ranks that split the batch (`dp_replicate × dp_shard`): each reads its own data.
    pub dp: Group,
    pub dp_name: String,
    /// The ranks whose losses and target counts add up to the step's (`dp_replicate × dp_shard ×
    /// cp`: context parallelism splits each sequence's targets too); `dp` without it.
    pub loss: Group,
    /// FSDP's shard group (`dp_shard`, `× cp` with context parallelism, TorchTitan's folding) and,
    /// for HSDP, the replica group (`dp_replicate`).
    pub shard: Option<Group>,
    pub shard_name: Option<String>,
    pub replicate: Option<Group>,
    pub replicate_name: Option<String>,
    /// The tensor-parallel group (`tp`).
    pub tp: Option<Group>,
    pub tp_name: Option<String>,
    /// The context-parallel group (`cp`: the ranks splitting each sequence).
    pub cp: Option<Group>,
    pub cp_name: Option<String>,
    /// The pipeline group (`pp`: the ranks holding the stages of one model copy).
    pub pp: Option<Group>,
    pub pp_name: Option<String>,
    /// Expert parallelism (`[parallelism] expert_parallel_degree` above 1): the ranks splitting
    /// the experts, and the ranks holding the same experts, which FSDP-shard them
    /// (`DeviceMesh::expert_groups`); under HSDP, a replica group of the experts' own (the
    /// `dp_replicate` ranks again: its collectives run on another queue than `replicate`'s).
    pub ep: Option<Group>,
    pub ep_name: Option<String>,
    pub expert_shard: Option<Group>,
    pub expert_shard_name: Option<String>,
    pub expert_replicate: Option<Group>,
    pub expert_replicate_name: Option<String>,
    /// The ranks that write a sharded checkpoint together (`pp × dp_shard × tp`, tp fastest, of
    /// the dims in use; under HSDP or DDP each replica has one and replica 0's writes). None when
    /// checkpoints are written whole by rank 0 (one process or DDP, without TP or PP).
    pub writers: Option<Group>,
    pub writers_name: Option<String>,
    /// Every rank of the job (the data-parallel group itself when the job is data parallel
    /// only): job-wide figures such as the largest rank's peak memory.
    pub all: Group,
    pub all_name: String,
}

impl RankGroups {
    /// The groups whose collectives may run on a device communicator, each with its name in the
    /// store, in the one order every rank attaches them (so no two ranks wait for each other's
    /// next): data parallelism's (FSDP's shard and HSDP's replica groups, or with whole
    /// parameters every data-parallel rank), tensor parallel, context parallel, expert
    /// parallelism's group and the experts' shard and replica groups, then, with `muon`, the
    /// group of every rank (Muon's exchange of whole matrices).
    pub fn device_capable(&self, muon: bool) -> Vec<(&Group, &str)> {
        let data = match &self.shard {
            Some(shard) => vec![
                (Some(shard), self.shard_name.as_ref()),
                (self.replicate.as_ref(), self.replicate_name.as_ref()),
            ],
            None if self.dp.size() > 1 => vec![(Some(&self.dp), Some(&self.dp_name))],
            None => Vec::new(),
        };
        let others = [
            (self.tp.as_ref(), self.tp_name.as_ref()),
            (self.cp.as_ref(), self.cp_name.as_ref()),
            (self.ep.as_ref(), self.ep_name.as_ref()),
            (self.expert_shard.as_ref(), self.expert_shard_name.as_ref()),
            (
                self.expert_replicate.as_ref(),
                self.expert_replicate_name.as_ref(),
            ),
        ];
        let mut groups: Vec<(&Group, &str)> = data
            .into_iter()
            .chain(others)
            .filter_map(|(group, name)| Some((group?, name?.as_str())))
            .collect();
        // The whole job (Muon's exchange), unless it is one of the groups above already.
        if muon && !groups.iter().any(|(g, _)| Arc::ptr_eq(g, &self.all)) {
            groups.push((&self.all, &self.all_name));
        }
        groups
    }

    /// The pipeline group with its name in the store, which carries point-to-point channels
    /// rather than collectives (attached after `device_capable`'s groups, by every rank).
    pub fn pipeline(&self) -> Option<(&Group, &str)> {
        Some((self.pp.as_ref()?, self.pp_name.as_deref()?))
    }
}

/// The data groups: `dp`, the loss group, and FSDP's shard and HSDP's replica groups.
struct DataGroups {
    dp: Group,
    dp_name: String,
    loss: Group,
    shard: Option<Group>,
    shard_name: Option<String>,
    replicate: Option<Group>,
    replicate_name: Option<String>,
}

/// Expert parallelism's groups, with their names (none without it).
#[derive(Default)]
struct ExpertGroups {
    ep: Option<Group>,
    ep_name: Option<String>,
    shard: Option<Group>,
    shard_name: Option<String>,
}

impl GroupJoiner<'_> {
    /// The group of these global ranks, named `name`.
    fn ranks(&self, ranks: &[usize], name: &str) -> Result<Group> {
        let local = ranks
            .iter()
            .position(|&r| r == self.rank)
            .expect("a rank is in its own group");
        self.maker.group(ranks, local, name)
    }

    /// The store name of this rank's group over mesh `dims`.
    fn name(&self, dims: &[&str]) -> String {
        format!(
            "{}-g{}",
            self.mesh.group_name(self.rank, dims),
            self.generation
        )
    }

    /// This rank's group over mesh `dims`.
    fn dims(&self, dims: &[&str]) -> Result<Group> {
        self.ranks(&self.mesh.group_ranks(self.rank, dims), &self.name(dims))
    }

    /// The group over one mesh dim, with its name, when that dim's degree is above 1.
    fn optional(&self, dim: &str) -> Result<(Option<Group>, Option<String>)> {
        if self.mesh.degree(dim) <= 1 {
            return Ok((None, None));
        }
        Ok((Some(self.dims(&[dim])?), Some(self.name(&[dim]))))
    }

    /// Every group of this rank, in the order every rank joins them.
    pub fn join_all(&self, expert_parallel_degree: usize) -> Result<RankGroups> {
        let data = self.data_groups()?;
        let (tp, tp_name) = self.optional("tp")?;
        let (cp, cp_name) = self.optional("cp")?;
        let (pp, pp_name) = self.optional("pp")?;
        let experts = self.expert_groups(expert_parallel_degree)?;
        let (expert_replicate, expert_replicate_name) = match &data.replicate {
            Some(_) if expert_parallel_degree > 1 => {
                let ranks = self.mesh.group_ranks(self.rank, &["dp_replicate"]);
                let name = format!("expert_replicate[{}]-g{}", ranks[0], self.generation);
                (Some(self.ranks(&ranks, &name)?), Some(name))
            }
            _ => (None, None),
        };
        let (writers, writers_name) = self.writers(&data, (&tp, &tp_name), &pp)?;
        let (all, all_name) = if data.dp.size() == self.world {
            (data.dp.clone(), data.dp_name.clone())
        } else {
            let dims = &crate::comm::mesh::DIMS;
            (self.dims(dims)?, self.name(dims))
        };
        Ok(RankGroups {
            dp: data.dp,
            dp_name: data.dp_name,
            loss: data.loss,
            shard: data.shard,
            shard_name: data.shard_name,
            replicate: data.replicate,
            replicate_name: data.replicate_name,
            tp,
            tp_name,
            cp,
            cp_name,
            pp,
            pp_name,
            ep: experts.ep,
            ep_name: experts.ep_name,
            expert_shard: experts.shard,
            expert_shard_name: experts.shard_name,
            expert_replicate,
            expert_replicate_name,
            writers,
            writers_name,
            all,
            all_name,
        })
    }

    /// `dp` (the ranks that split the batch), the loss group (`× cp`), and the parameter shard
    /// and replica groups: parameters are sharded over `dp_shard × cp`, so with context
    /// parallelism even a job without `dp_shard` shards them over its CP ranks.
    fn data_groups(&self) -> Result<DataGroups> {
        let mesh = self.mesh;
        let dp = self.dims(&["dp_replicate", "dp_shard"])?;
        let dp_name = self.name(&["dp_replicate", "dp_shard"]);
        let cp_degree = mesh.degree("cp");
        let loss = if cp_degree > 1 {
            self.dims(&["dp_replicate", "dp_shard", "cp"])?
        } else {
            dp.clone()
        };
        let shard_dims = mesh.shard_dims();
        let (shard, replicate, shard_name, replicate_name) =
            match (mesh.degree("dp_replicate"), mesh.fsdp_shard_degree()) {
                (_, None) => (None, None, None, None),
                (1, Some(_)) if cp_degree > 1 => {
                    (Some(loss.clone()), None, Some(self.name(shard_dims)), None)
                }
                (1, Some(_)) => (Some(dp.clone()), None, Some(dp_name.clone()), None),
                _ => (
                    Some(self.dims(shard_dims)?),
                    Some(self.dims(&["dp_replicate"])?),
                    Some(self.name(shard_dims)),
                    Some(self.name(&["dp_replicate"])),
                ),
            };
        Ok(DataGroups {
            dp,
            dp_name,
            loss,
            shard,
            shard_name,
            replicate,
            replicate_name,
        })
    }

    /// Expert parallelism's groups: the ranks splitting the experts and the ranks holding the
    /// same experts (which FSDP-shard them), with their names.
    fn expert_groups(&self, degree: usize) -> Result<ExpertGroups> {
        if degree <= 1 {
            return Ok(ExpertGroups::default());
        }
        let (ep_ranks, shard_ranks) = self.mesh.expert_groups(self.rank, degree);
        let ep_name = format!("ep[{}]-g{}", ep_ranks[0], self.generation);
        let shard_name = format!("expert_shard[{}]-g{}", shard_ranks[0], self.generation);
        Ok(ExpertGroups {
            ep: Some(self.ranks(&ep_ranks, &ep_name)?),
            ep_name: Some(ep_name),
            shard: Some(self.ranks(&shard_ranks, &shard_name)?),
            shard_name: Some(shard_name),
        })
    }

    /// The ranks that write a sharded checkpoint together (`pp × dp_shard × tp`, tp fastest, of
    /// the dims in use), reusing a group already joined when it is exactly that.
    fn writers(
        &self,
        data: &DataGroups,
        (tp, tp_name): (&Option<Group>, &Option<String>),
        pp: &Option<Group>,
    ) -> Result<(Option<Group>, Option<String>)> {
        let shard_dims = self.mesh.shard_dims();
        Ok(match (&data.shard, tp, pp) {
            (None, None, None) => (None, None),
            (Some(s), None, None) => (Some(s.clone()), data.shard_name.clone()),
            (None, Some(t), None) => (Some(t.clone()), tp_name.clone()),
            (None, None, Some(p)) => (Some(p.clone()), Some(self.name(&["pp"]))),
            // With a pipeline every stage's ranks write its own tensors: the writers span `pp`
            // too (outermost, so pipeline rank p's writers come p-th).
            (_, _, Some(_)) => {
                let mut dims = vec!["pp"];
                if data.shard.is_some() {
                    dims.extend(shard_dims);
                }
                if tp.is_some() {
                    dims.push("tp");
                }
                (Some(self.dims(&dims)?), Some(self.name(&dims)))
            }
            (Some(_), Some(_), None) => {
                let dims = [shard_dims, &["tp"]].concat();
                (Some(self.dims(&dims)?), Some(self.name(&dims)))
            }
        })
    }
}
