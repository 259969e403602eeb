//! Which road a job's collectives take: the device communicators attached to its mesh groups
//! (NCCL between GPUs), or host copies through the CPU transport (the default). Every rank
//! exchanges what it can do over the group of all ranks first, so all of them take the same road,
//! and a job that cannot use NCCL says why. The communicators are attached to the groups the
//! launcher joined (`comm::device_group::attach`), once, in the one order of
//! `groups::RankGroups::device_capable`; every layout then takes its collectives from the groups it
//! crosses.
//!
//! With the flight recorder on, each device communicator is attached wrapped in its recorder
//! (`comm::recorded_device`).
//!
//! `TITAN_DEVICE_COLLECTIVES=host` attaches the host-run device groups
//! (`comm::host_device::HostDeviceGroup`) to a CPU job's groups instead, so that the device road's
//! code runs and is tested on CPU ranks.

use std::collections::HashSet;
use std::sync::Arc;

use anyhow::{bail, Result};

use super::Distributed;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::libs::CudaLib;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::comm::device_group::{attach, attach_peers, DeviceGroup, DevicePeers};
use crate::comm::group::ProcessGroup;
use crate::comm::host_device::HostDeviceGroup;
use crate::comm::recorded_device::{recorded, recorded_peers};

/// The road a rank's collectives take, as the ranks agreed.
pub struct DeviceRoad {
    /// What carries the collectives of the groups that have a device communicator (None: every
    /// collective goes through the host).
    pub carrier: Option<&'static str>,
    /// Ranks (this one included) on this rank's GPU (1 on the CPU), for the memory check.
    pub ranks_on_my_gpu: usize,
}

impl DeviceRoad {
    fn host() -> Self {
        DeviceRoad {
            carrier: None,
            ranks_on_my_gpu: 1,
        }
    }
}

/// What the ranks agreed on.
struct Agreement {
    /// Every rank has a GPU of its own and NCCL.
    nccl: bool,
    /// Why not NCCL, for rank 0 to say (None when NCCL is used or no rank has a GPU).
    why_not_nccl: Option<String>,
    /// Ranks on this rank's GPU, itself included (1 on the CPU).
    ranks_on_my_gpu: usize,
}

/// This node's name as a number below 2^23 (exact in f32), to tell nodes apart.
fn node_key() -> f32 {
    use std::hash::{Hash, Hasher};
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_default();
    // SipHash with fixed keys: the same name gives the same number in every process.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.trim().hash(&mut h);
    (h.finish() & 0x7f_ffff) as f32
}

/// Exchanges every rank's facts over the CPU group of all ranks (all ranks call this, GPU or not):
/// its GPU's PCI location (`my_gpu`, None on the CPU) and whether it can use NCCL (`local_nccl`).
fn agree(
    d: &Distributed,
    my_gpu: Option<u32>,
    local_nccl: std::result::Result<(), String>,
) -> Result<Agreement> {
    let group = d.groups.all.as_ref();
    // A CPU rank gets a value no GPU has, distinct per rank.
    let gpu = my_gpu.map_or(-1.0 - group.rank() as f32, |pci| pci as f32);
    let mine = [local_nccl.is_ok() as u8 as f32, node_key(), gpu];
    let mut all = vec![0.0f32; mine.len() * group.size()];
    group.all_gather(&mine, &mut all)?;
    let ranks: Vec<&[f32]> = all.chunks(mine.len()).collect();
    let ranks_on_my_gpu = ranks
        .iter()
        .filter(|r| (r[1].to_bits(), r[2].to_bits()) == (mine[1].to_bits(), mine[2].to_bits()))
        .count();
    let mut gpus = HashSet::new();
    let shared = !ranks
        .iter()
        .filter(|r| r[0] == 1.0)
        .all(|r| gpus.insert((r[1].to_bits(), r[2].to_bits())));
    let all_ready = ranks.iter().all(|r| r[0] == 1.0);
    let why_not_nccl = match (&local_nccl, all_ready, shared) {
        (_, true, false) => None,
        (_, _, true) => Some("ranks share a GPU, which NCCL refuses".to_string()),
        (Err(why), false, _) => Some(why.clone()),
        (Ok(_), false, _) => Some("another rank cannot use NCCL".to_string()),
    };
    Ok(Agreement {
        nccl: all_ready && !shared,
        why_not_nccl,
        ranks_on_my_gpu,
    })
}

type Group = Arc<dyn ProcessGroup>;

/// Attaches, in the one order every rank follows, a device communicator made by `collectives` to
/// each group of `RankGroups::device_capable(muon)`, then point-to-point channels made by `peers`
/// to the pipeline group; each wrapped in the flight recorder when it is on.
fn attach_road<B: Backend>(
    d: &Distributed,
    muon: bool,
    collectives: impl Fn(&Group, &str) -> Result<Arc<dyn DeviceGroup<B>>>,
    peers: impl Fn(&Group, &str) -> Result<Arc<dyn DevicePeers<B>>>,
) -> Result<()> {
    for (group, name) in d.groups.device_capable(muon) {
        attach(
            group.as_ref(),
            recorded(group.as_ref(), collectives(group, name)?),
        );
    }
    if let Some((group, name)) = d.groups.pipeline() {
        attach_peers(
            group.as_ref(),
            recorded_peers(group.as_ref(), peers(group, name)?),
        );
    }
    Ok(())
}

/// The collectives of a CPU rank: the host road (it takes part in the agreement all the same),
/// or with `TITAN_DEVICE_COLLECTIVES=host` the device road run through the host.
pub fn for_cpu(dist: Option<&Distributed>, muon: bool) -> Result<DeviceRoad> {
    let Some(d) = dist else {
        return Ok(DeviceRoad::host());
    };
    agree(d, None, Err("this rank runs on the CPU".to_string()))?;
    match std::env::var("TITAN_DEVICE_COLLECTIVES").as_deref() {
        Err(_) | Ok("") => Ok(DeviceRoad::host()),
        Ok("host") => {
            attach_road::<CpuBackend>(
                d,
                muon,
                |group, _| Ok(Arc::new(HostDeviceGroup::new(group.clone()))),
                |group, _| Ok(Arc::new(HostDeviceGroup::new(group.clone()))),
            )?;
            Ok(DeviceRoad {
                carrier: Some("host-run device groups"),
                ranks_on_my_gpu: 1,
            })
        }
        Ok(other) => bail!("TITAN_DEVICE_COLLECTIVES={other}: the CPU knows only `host` (the device road run through the host transport, for tests)"),
    }
}

/// The collectives of a CUDA rank: NCCL when every rank of the job has a GPU of its own (NCCL
/// refuses two ranks on one), the NCCL library loads, and `TITAN_NCCL` is not `off`: a
/// communicator is then attached to every group a layout runs device collectives over (DDP's
/// sums, FSDP's gathers and reduce-scatters, tensor parallelism's rows, context parallelism's
/// `allgather` and ring, expert parallelism's rows, the experts' shards; with `muon` the whole
/// job's, for Muon's exchange), and point-to-point channels to the pipeline group (the stage
/// transfers). Otherwise the host road.
pub fn for_cuda(
    dist: Option<&Distributed>,
    be: &CudaBackend,
    (quiet, muon): (bool, bool),
) -> Result<DeviceRoad> {
    let Some(d) = dist else {
        return Ok(DeviceRoad::host());
    };
    let pci = be.pci_location();
    let local = if std::env::var("TITAN_NCCL").as_deref() == Ok("off") {
        Err("TITAN_NCCL=off".to_string())
    } else if !CudaLib::Nccl.is_present() {
        Err(format!("{} not found", CudaLib::Nccl.describe()))
    } else {
        pci.as_ref().map(|_| ()).map_err(|e| e.to_string())
    };
    let agreed = agree(d, pci.ok(), local)?;
    let ranks_on_my_gpu = agreed.ranks_on_my_gpu.max(1);
    if !agreed.nccl {
        if d.rank == 0 && !quiet {
            outln!(
                "note: collectives go through host copies, not NCCL ({})",
                agreed.why_not_nccl.as_deref().unwrap_or("unknown")
            );
        }
        return Ok(DeviceRoad {
            carrier: None,
            ranks_on_my_gpu,
        });
    }
    attach_road::<CudaBackend>(
        d,
        muon,
        |group, name| Ok(Arc::new(d.nccl_over(group.as_ref(), name, be)?)),
        |group, name| Ok(Arc::new(d.nccl_peers_over(group.as_ref(), name, be)?)),
    )?;
    if d.rank == 0 && !quiet {
        outln!("collectives on the GPUs through NCCL ({} ranks)", d.world);
    }
    Ok(DeviceRoad {
        carrier: Some("NCCL"),
        ranks_on_my_gpu,
    })
}
