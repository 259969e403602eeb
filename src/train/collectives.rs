//! Which way a data-parallel job moves its tensors between ranks: through host copies and the CPU
//! transport (the default), or through NCCL between GPUs. Every rank exchanges what it can do over
//! the CPU group first, so all of them take the same path, and a job that cannot use NCCL says why.

use std::collections::HashSet;

use anyhow::Result;

use crate::backend::cuda::libs::CudaLib;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::comm::queue::{CollectiveQueue, NcclQueue};
use crate::launch::{Distributed, MeshGroup};
use crate::parallel::ddp::{GradReducer, NcclGradReducer};

/// Collectives on the devices instead of host copies through the CPU transport (each None where
/// they go through the host).
pub struct DeviceComm<B: Backend> {
    pub data_parallel: Option<DataParallelComm<B>>,
    /// The tensor-parallel group's gathers and reduce-scatters of token rows.
    pub tensor_parallel: Option<Box<dyn CollectiveQueue<B> + Send>>,
    /// The context-parallel group's gathers of keys and values and reduce-scatters of their
    /// gradients (ring attention's `allgather`).
    pub context_parallel: Option<Box<dyn CollectiveQueue<B> + Send>>,
    /// FSDP's gathers and reduce-scatters of the routed experts under expert parallelism (over
    /// the ranks holding the same experts).
    pub expert_shard: Option<Box<dyn CollectiveQueue<B>>>,
}

impl<B: Backend> DeviceComm<B> {
    /// Whether any collective runs on the device (NCCL).
    pub fn on_device(&self) -> bool {
        self.data_parallel.is_some()
            || self.tensor_parallel.is_some()
            || self.context_parallel.is_some()
            || self.expert_shard.is_some()
    }

    /// Everything through the host.
    pub fn host() -> Self {
        DeviceComm {
            data_parallel: None,
            tensor_parallel: None,
            context_parallel: None,
            expert_shard: None,
        }
    }
}

/// DDP's gradient sum, or FSDP's gathers and reduce-scatters.
pub enum DataParallelComm<B: Backend> {
    Ddp(Box<dyn GradReducer<B>>),
    Fsdp(Box<dyn CollectiveQueue<B>>),
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
    let group = d.all.as_ref();
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

/// The collectives of a CPU rank: the host path (it takes part in the agreement all the same).
pub fn for_cpu<B: Backend>(dist: Option<&Distributed>) -> Result<DeviceComm<B>> {
    if let Some(d) = dist {
        agree(d, None, Err("this rank runs on the CPU".to_string()))?;
    }
    Ok(DeviceComm::host())
}

/// The collectives of a CUDA rank: NCCL when every rank of the job has a GPU of its own (NCCL
/// refuses two ranks on one), the NCCL library loads, and `TITAN_NCCL` is not `off`; DDP then sums
/// its gradients through it, FSDP gathers and reduce-scatters through it, and so do tensor
/// parallelism and context parallelism's `allgather`. Otherwise the host path. Also returns how many ranks share this rank's GPU
/// (itself included), for the memory check.
pub fn for_cuda(
    dist: Option<&Distributed>,
    be: &CudaBackend,
    quiet: bool,
) -> Result<(DeviceComm<CudaBackend>, usize)> {
    let Some(d) = dist else {
        return Ok((DeviceComm::host(), 1));
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
    let sharing = agreed.ranks_on_my_gpu.max(1);
    if !agreed.nccl {
        if d.rank == 0 && !quiet {
            outln!(
                "note: collectives go through host copies, not NCCL ({})",
                agreed.why_not_nccl.as_deref().unwrap_or("unknown")
            );
        }
        return Ok((DeviceComm::host(), sharing));
    }
    // Every rank creates its communicators in the same order (data parallel, tensor parallel,
    // context parallel, expert shards), so no two ranks wait for each other's next one.
    let data_parallel = if d.shard.is_some() {
        let shard = d
            .nccl_group(MeshGroup::Shard, be)?
            .expect("an FSDP job has a shard group");
        let replicate = d.nccl_group(MeshGroup::Replicate, be)?;
        Some(DataParallelComm::Fsdp(Box::new(NcclQueue::new(
            "FSDP", shard, replicate,
        ))))
    } else if d.dp.size() > 1 {
        let all = d
            .nccl_group(MeshGroup::DataParallel, be)?
            .expect("every job has a data-parallel group");
        Some(DataParallelComm::Ddp(Box::new(NcclGradReducer::new(all))))
    } else {
        None
    };
    let tensor_parallel = d.nccl_group(MeshGroup::Tensor, be)?.map(|tp| {
        Box::new(NcclQueue::new("tensor parallel", tp, None))
            as Box<dyn CollectiveQueue<CudaBackend> + Send>
    });
    let context_parallel = d.nccl_group(MeshGroup::Context, be)?.map(|cp| {
        Box::new(NcclQueue::new("context parallel", cp, None))
            as Box<dyn CollectiveQueue<CudaBackend> + Send>
    });
    let expert_shard = match d.nccl_group(MeshGroup::ExpertShard, be)? {
        Some(g) => {
            let replicate = d.nccl_group(MeshGroup::ExpertReplicate, be)?;
            Some(Box::new(NcclQueue::new("FSDP experts", g, replicate))
                as Box<dyn CollectiveQueue<CudaBackend>>)
        }
        None => None,
    };
    if d.rank == 0 && !quiet {
        outln!("collectives on the GPUs through NCCL ({} ranks)", d.world);
    }
    Ok((
        DeviceComm {
            data_parallel,
            tensor_parallel,
            context_parallel,
            expert_shard,
        },
        sharing,
    ))
}
