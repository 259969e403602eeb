//! Replica-group fault tolerance on one rank (`[fault_tolerance]`, torchft's `Manager`): this job
//! is one replica group of several, each an ordinary job with its own layout; at every step
//! boundary its ranks join the lighthouse's quorum (`comm::quorum`), and each rank averages its
//! gradients (its shard, under FSDP) with the same rank of every live replica.
//!
//! - A replica that dies or hangs past `process_group_timeout_ms` fails the cross-replica
//!   average: the others drop that step (no update; the next batch is trained instead, as
//!   torchft drops it) and continue with the replicas still live, without restarting.
//! - A replica behind the quorum (restarted, or one that missed an update) receives from the
//!   first up-to-date member, rank by rank, its weights, AdamW moments, data position and routing
//!   bias, and goes on from that member's step: no checkpoint is read.
//!
//! Every replica must have the same layout (each rank's shards the same shape); a transfer whose
//! sizes differ is refused, naming them. The cross-replica groups meet through the lighthouse's
//! store, with the secret the replica groups share (`--job-secret-file`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};

use super::optimizer::Optimizer;
use super::semi_sync::SemiSync;
use crate::backend::Backend;
use crate::comm::auth::JobSecret;
use crate::comm::group::{ProcessGroup, ReduceOp, TcpGroup};
use crate::comm::quorum::{Quorum, QuorumClient};
use crate::config::Config;
use crate::data::{DataLoader, LoaderState};
use crate::model::ParamSet;
use crate::parallel::layout::RankLayout;

/// The largest metadata message a transfer accepts (bytes).
const MAX_META: usize = 1 << 20;

/// One rank's membership in the replica groups.
pub struct ReplicaSync {
    client: QuorumClient,
    replica_id: usize,
    rank: usize,
    host: String,
    timeout: Duration,
    min_replicas: usize,
    quorum: Option<Quorum>,
    /// The same rank of every live replica (None when alone).
    group: Option<TcpGroup>,
    /// Every rank of this replica group (None in a one-process group): its ranks agree on whether
    /// each step's cross-replica average went through everywhere.
    own_group: Option<Arc<dyn ProcessGroup>>,
    /// Semi-synchronous training (None: gradients averaged every step).
    pub semi: Option<SemiSync>,
    /// A semi-synchronous sync failed here: this replica reports a step less at the next quorum,
    /// so that it takes the state of one whose sync went through (when any did).
    stale: bool,
    /// The live replica groups last reported (`membership_change`).
    reported_live: usize,
}

/// What a rank's training state needs beside the layout to continue another replica's run.
pub struct ReplicaParts<'a, B: Backend> {
    pub layout: &'a mut RankLayout<B>,
    pub opt: &'a mut Optimizer<B>,
    pub loader: &'a mut DataLoader,
}

/// A transfer's first message.
#[derive(Serialize, Deserialize)]
struct Meta {
    step: u64,
    epoch: u64,
    consumed: u64,
    expert_bias: Option<Vec<Vec<f32>>>,
    lens: Vec<usize>,
    /// Semi-synchronous training's θ_g and outer momentum, per tensor.
    semi_lens: Vec<usize>,
}

/// What `start_step` found.
pub struct StepStart {
    /// The last step committed (another replica's when this one recovered).
    pub committed: u64,
    /// The replica recovered from, when this one was behind.
    pub recovered_from: Option<usize>,
}

impl ReplicaSync {
    /// Rank `rank` of `world` of this job (every rank of it in `own_group`), when
    /// `[fault_tolerance] enable`.
    pub fn from_config(
        cfg: &Config,
        rank: usize,
        world: usize,
        own_group: Option<Arc<dyn ProcessGroup>>,
    ) -> Result<Option<Self>> {
        let ft = &cfg.fault_tolerance;
        if !ft.enable {
            return Ok(None);
        }
        let secret = JobSecret::from_env()?.ok_or_else(|| anyhow!("[fault_tolerance]: no secret to prove to the lighthouse: start every replica group and `titan lighthouse` with the same --job-secret-file (or TITAN_JOB_SECRET_FILE)"))?;
        let timeout = Duration::from_millis(ft.process_group_timeout_ms);
        let addr = ft.lighthouse_addr()?;
        let quorum_timeout = Duration::from_secs(ft.quorum_timeout_seconds);
        let me = (ft.replica_id, rank, world);
        let client = QuorumClient::connect(&addr, &secret, me, quorum_timeout)?;
        let host = match std::env::var("TITAN_HOST") {
            Ok(h) if !h.is_empty() => h,
            _ => "127.0.0.1".to_string(),
        };
        Ok(Some(ReplicaSync {
            client,
            replica_id: ft.replica_id,
            rank,
            host,
            timeout,
            min_replicas: ft.min_replica_size,
            quorum: None,
            group: None,
            own_group,
            reported_live: 0,
            semi: SemiSync::from_config(ft)?
                .map(|s| s.dumping_as(format!("replica{}-rank{rank}", ft.replica_id))),
            stale: false,
        }))
    }

    /// Live replica groups in the current quorum.
    pub fn live(&self) -> usize {
        self.quorum.as_ref().map_or(1, |q| q.members.len())
    }

    /// The live replica groups before and now, when they changed since the last call (not at the
    /// first quorum).
    pub fn membership_change(&mut self) -> Option<(usize, usize)> {
        let now = self.live();
        let before = std::mem::replace(&mut self.reported_live, now);
        // The first quorum is no change.
        (before != now && before != 0).then_some((before, now))
    }

    /// At a step boundary, having committed `committed`: joins the quorum (waiting for
    /// `min_replica_size` live replicas) and, when behind it, takes the state of an up-to-date
    /// member; an up-to-date source sends its state to those behind. Semi-synchronous training
    /// syncs here first (`sync_point`).
    pub fn start_step<B: Backend>(
        &mut self,
        be: &B,
        committed: u64,
        parts: &mut ReplicaParts<'_, B>,
    ) -> Result<StepStart> {
        loop {
            let reported = committed.saturating_sub(self.stale as u64);
            let q = self.client.join(reported)?;
            if q.members.len() < self.min_replicas {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            if self.quorum.as_ref().map(|x| x.id) != Some(q.id) {
                self.group = None;
            }
            self.quorum = Some(q.clone());
            let met = self.meet(be, &q, reported, parts);
            // The group's ranks go on together: when any of them failed to meet the quorum, all
            // join the next (one rank rejoining alone would leave the others waiting for it in
            // the step's collectives).
            let failed_here = met.is_err();
            let met = match (met, self.any_rank(failed_here)?) {
                (Ok(_), true) => Err(anyhow!(
                    "another rank of this replica group failed to meet it"
                )),
                (met, _) => met,
            };
            match met {
                Ok(start) => {
                    if start.recovered_from.is_some() {
                        self.stale = false;
                    }
                    let committed = start.committed.max(committed);
                    return Ok(StepStart { committed, ..start });
                }
                Err(e) => {
                    errln!(
                        "[fault_tolerance] replica {} rank {}: quorum {} failed ({e:#}); joining the next",
                        self.replica_id, self.rank, q.id
                    );
                    self.forget();
                }
            }
        }
    }

    /// Whether step `step` ends at a semi-synchronous sync point.
    pub fn syncs_after(&self, step: u64) -> bool {
        self.semi.as_ref().is_some_and(|s| s.syncs_after(step))
    }

    /// With the quorum `q`: the semi-synchronous sync, then the state from an up-to-date member
    /// to those behind.
    fn meet<B: Backend>(
        &mut self,
        be: &B,
        q: &Quorum,
        reported: u64,
        parts: &mut ReplicaParts<'_, B>,
    ) -> Result<StepStart> {
        let alone = StepStart {
            committed: reported,
            recovered_from: None,
        };
        if q.members.len() > 1 && self.group.is_none() {
            let me = q
                .index_of(self.replica_id)
                .ok_or_else(|| anyhow!("a quorum without this replica (a titan bug)"))?;
            // Every member names it alike: the lighthouse's round, and the rank in the replica.
            let name = format!("ft-round{}-rank{}", self.client.round(), self.rank);
            let (n, t) = (q.members.len(), self.timeout);
            self.group = Some(TcpGroup::connect(
                self.client.store(),
                &name,
                me,
                n,
                &self.host,
                t,
                t,
            )?);
        }
        let group = self.group.as_ref().map(|g| g as &dyn ProcessGroup);
        if let Some(semi) = self.semi.as_mut() {
            let (weights, _) = parts.layout.weights_and_grads();
            let contributes = reported >= q.max_step();
            if !semi.sync(be, weights, group, contributes)? {
                self.stale = true;
                self.forget();
                return Ok(alone);
            }
        }
        let Some(group) = self.group.as_ref() else {
            return Ok(alone);
        };
        let me = q.index_of(self.replica_id).unwrap_or(0);
        let (max, source) = (q.max_step(), q.source());
        let semi = self.semi.as_mut();
        if reported < max {
            let step = receive_state(be, group, source, parts, semi)?;
            return Ok(StepStart {
                committed: step,
                recovered_from: Some(q.members[source].replica_id),
            });
        }
        if me == source {
            let mut semi = semi;
            for (i, m) in q.members.iter().enumerate() {
                if m.step < max {
                    send_state(be, group, i, reported, parts, semi.as_deref_mut())?;
                }
            }
        }
        Ok(alone)
    }

    /// Averages `grads` with the same rank of every live replica. False when a replica was lost
    /// on the way at any rank of this group (they agree, so that all of them drop the step or
    /// none: a rank whose own average went through while another's failed would otherwise apply a
    /// step the others drop, and wait for them in the next collective); the gradients are then
    /// not to be applied.
    pub fn average<B: Backend>(&mut self, be: &B, grads: &mut ParamSet<B>) -> Result<bool> {
        // Every rank of the group votes every step, alone in the quorum or not, so that the votes
        // pair up even when the group's ranks see the quorum differently.
        let averaged = match &self.group {
            None => Ok(None),
            Some(group) => {
                let mut packed: Vec<f32> = Vec::new();
                for b in &grads.bufs {
                    packed.extend(be.download(b));
                }
                group
                    .all_reduce(&mut packed, ReduceOp::Avg)
                    .map(|_| Some(packed))
            }
        };
        // Any rank's failure fails the step everywhere, and so do ranks that disagree on whether
        // the group is alone (some averaged, some did not).
        let alone = self.group.is_none() as u8 as f32;
        let [failed, alone_somewhere, averaged_somewhere] =
            self.over_group([averaged.is_err() as u8 as f32, alone, 1.0 - alone])?;
        let failed_anywhere =
            failed != 0.0 || (alone_somewhere != 0.0 && averaged_somewhere != 0.0);
        let packed = match averaged {
            Err(e) => {
                errln!(
                    "[fault_tolerance] replica {} rank {}: the gradient average failed ({e:#}); this step is dropped",
                    self.replica_id, self.rank
                );
                None
            }
            Ok(_) if failed_anywhere => {
                errln!(
                    "[fault_tolerance] replica {} rank {}: the gradient average failed or was skipped on another rank of this group; this step is dropped",
                    self.replica_id, self.rank
                );
                None
            }
            Ok(packed) => Some(packed),
        };
        let Some(packed) = packed else {
            self.forget();
            return Ok(false);
        };
        let Some(packed) = packed else {
            return Ok(true);
        };
        let mut at = 0;
        for b in grads.bufs.iter_mut() {
            let n = be.len(b);
            *b = be.upload(&packed[at..at + n]);
            at += n;
        }
        Ok(true)
    }

    /// Max of `flags` over the ranks of this replica group (every rank asks together).
    fn over_group<const N: usize>(&self, mut flags: [f32; N]) -> Result<[f32; N]> {
        if let Some(own) = &self.own_group {
            own.all_reduce(&mut flags, ReduceOp::Max)?;
        }
        Ok(flags)
    }

    /// Whether `failed` holds on any rank of this replica group.
    fn any_rank(&self, failed: bool) -> Result<bool> {
        Ok(self.over_group([failed as u8 as f32])?[0] != 0.0)
    }

    /// Drops the quorum and its group (a member was lost): the next step joins anew.
    fn forget(&mut self) {
        self.group = None;
        self.quorum = None;
    }
}

/// `bytes` as f32 words (their bit patterns, never computed with), after a two-word length.
fn send_bytes(group: &TcpGroup, peer: usize, bytes: &[u8]) -> Result<()> {
    let len = bytes.len() as u64;
    let header = [
        f32::from_bits(len as u32),
        f32::from_bits((len >> 32) as u32),
    ];
    group.send(&header, peer)?;
    let words: Vec<f32> = bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(w))
        })
        .collect();
    group.send(&words, peer)
}

fn recv_bytes(group: &TcpGroup, peer: usize) -> Result<Vec<u8>> {
    let mut header = [0f32; 2];
    group.recv(&mut header, peer)?;
    let len = header[0].to_bits() as u64 | ((header[1].to_bits() as u64) << 32);
    if len > MAX_META as u64 {
        bail!("[fault_tolerance] a state transfer from replica rank {peer} announces {len} bytes of metadata (at most {MAX_META})");
    }
    let mut words = vec![0f32; (len as usize).div_ceil(4)];
    group.recv(&mut words, peer)?;
    let mut bytes: Vec<u8> = words
        .iter()
        .flat_map(|w| w.to_bits().to_le_bytes())
        .collect();
    bytes.truncate(len as usize);
    Ok(bytes)
}

/// The buffers a transfer carries, in order: weights, then AdamW's two moments.
fn state_bufs<'p, B: Backend>(
    weights: &'p ParamSet<B>,
    opt: &'p Optimizer<B>,
) -> impl Iterator<Item = &'p B::Buf> {
    weights
        .bufs
        .iter()
        .chain(&opt.exp_avg.bufs)
        .chain(&opt.exp_avg_sq.bufs)
}

/// Sends this rank's state at step `step` to member `peer`.
fn send_state<B: Backend>(
    be: &B,
    group: &TcpGroup,
    peer: usize,
    step: u64,
    parts: &mut ReplicaParts<'_, B>,
    semi: Option<&mut SemiSync>,
) -> Result<()> {
    let loader = parts.loader.state();
    let expert_bias = parts.layout.model.expert_bias();
    let (weights, _) = parts.layout.weights_and_grads();
    let lens = state_bufs(weights, parts.opt).map(|b| be.len(b)).collect();
    let outer: Vec<&Vec<f32>> = semi
        .map(|s| s.global.iter().chain(&s.momentum).collect())
        .unwrap_or_default();
    let meta = Meta {
        step,
        epoch: loader.epoch,
        consumed: loader.consumed,
        expert_bias,
        lens,
        semi_lens: outer.iter().map(|v| v.len()).collect(),
    };
    send_bytes(group, peer, &serde_json::to_vec(&meta)?)?;
    for b in state_bufs(weights, parts.opt) {
        group.send(&be.download(b), peer)?;
    }
    for v in outer {
        group.send(v, peer)?;
    }
    Ok(())
}

/// Receives member `source`'s state into this rank's; returns its step.
fn receive_state<B: Backend>(
    be: &B,
    group: &TcpGroup,
    source: usize,
    parts: &mut ReplicaParts<'_, B>,
    semi: Option<&mut SemiSync>,
) -> Result<u64> {
    let meta: Meta = serde_json::from_slice(&recv_bytes(group, source)?)
        .map_err(|e| anyhow!("[fault_tolerance] a malformed state transfer: {e}"))?;
    let (weights, _) = parts.layout.weights_and_grads();
    let mine: Vec<usize> = state_bufs(weights, parts.opt).map(|b| be.len(b)).collect();
    if mine != meta.lens {
        bail!("[fault_tolerance] replica groups with different layouts: this rank holds tensors of {} values, the up-to-date replica's {} (every replica group must use the same parallelism)", mine.iter().sum::<usize>(), meta.lens.iter().sum::<usize>());
    }
    let mut received = Vec::with_capacity(mine.len());
    for &n in &mine {
        let mut v = vec![0f32; n];
        group.recv(&mut v, source)?;
        received.push(be.upload(&v));
    }
    let n = weights.bufs.len();
    let mut it = received.into_iter();
    for b in weights.bufs.iter_mut() {
        *b = it.next().expect("as many as sent");
    }
    for set in [&mut parts.opt.exp_avg, &mut parts.opt.exp_avg_sq] {
        for b in set.bufs.iter_mut().take(n) {
            *b = it.next().expect("as many as sent");
        }
    }
    if let Some(bias) = &meta.expert_bias {
        parts.layout.model.set_expert_bias(be, bias)?;
    }
    parts.loader.restore(LoaderState {
        epoch: meta.epoch,
        consumed: meta.consumed,
        buffer: Vec::new(),
    })?;
    receive_outer_state(group, source, &meta, semi)?;
    Ok(meta.step)
}

/// Semi-synchronous training's θ_g and outer momentum from member `source` (`meta.semi_lens`:
/// the tensors of each, in order), refused when only one side trains semi-synchronously.
fn receive_outer_state(
    group: &TcpGroup,
    source: usize,
    meta: &Meta,
    semi: Option<&mut SemiSync>,
) -> Result<()> {
    let Some(semi) = semi else {
        if !meta.semi_lens.is_empty() {
            bail!("[fault_tolerance] the up-to-date replica trains semi-synchronously and this one does not: every replica group needs the same semi_sync_method");
        }
        return Ok(());
    };
    // θ_g and the momentum are shaped like the weights (`meta.lens`' first third, checked
    // against this rank's own before anything is allocated).
    let weights = &meta.lens[..meta.lens.len() / 3];
    let half = weights.len();
    if meta.semi_lens != [weights, weights].concat() {
        bail!("[fault_tolerance] the up-to-date replica's semi-synchronous state is not shaped like the weights: every replica group needs the same semi_sync_method and layout");
    }
    let mut vectors = Vec::with_capacity(meta.semi_lens.len());
    for &n in &meta.semi_lens {
        let mut v = vec![0f32; n];
        group.recv(&mut v, source)?;
        vectors.push(v);
    }
    semi.momentum = vectors.split_off(half);
    semi.global = vectors;
    Ok(())
}
