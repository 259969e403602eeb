//! Point-to-point transfers between pipeline ranks: a stage's output activations to the next
//! stage's rank, and a stage's input gradient back to the previous stage's rank.
//!
//! Every rank knows the whole schedule, so it knows which transfers each peer sends it and in
//! what order (the order of the peer's actions). During a step a receiving thread per peer reads
//! them in that order into a mailbox, as soon as the compute thread waits for one of them, and a
//! sending thread per peer writes this rank's in the order they are produced; the compute thread
//! only posts what it produced and takes what it needs. A rank that computes therefore never
//! blocks on a full socket (its sending thread does), transfers run during compute, and the ranks
//! can never deadlock on the order of their sends (the schedule check proves the compute order
//! itself cannot). Each receive and send has the group's timeout, and a wait on the mailbox gives
//! up after the same time, naming the peer and the transfer.
//!
//! The transfers are the backend's buffers. When the pipeline group carries device channels
//! (`comm::device_group::DevicePeers`: NCCL between GPUs) they go from device buffer to device
//! buffer; otherwise the sending thread copies the buffer to the host for the group's transport
//! and the receiving thread copies what arrived back to the device (`Carrier`).

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};

use super::schedule::{Schedule, Work};
use crate::backend::Backend;
use crate::comm::device_group::{peers_of, DevicePeers};
use crate::comm::group::ProcessGroup;

/// What travels: the input activations of `stage` (sent by the previous stage's rank after its
/// forward) or the gradient of the output of `stage` (sent by the next stage's rank after its
/// backward), for one microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transfer {
    Activation { stage: usize, microbatch: usize },
    Gradient { stage: usize, microbatch: usize },
}

/// Values a transfer holds: a stage's input activations as the workspace stores its block inputs
/// (bf16 pairs under bf16 mixed precision: half the f32 values), an output gradient in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferLens {
    pub activation: usize,
    pub gradient: usize,
}

impl Transfer {
    /// Values this transfer holds.
    pub fn len(&self, lens: TransferLens) -> usize {
        match self {
            Transfer::Activation { .. } => lens.activation,
            Transfer::Gradient { .. } => lens.gradient,
        }
    }
}

impl std::fmt::Display for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transfer::Activation { stage, microbatch } => write!(
                f,
                "the input activations of stage {stage}, microbatch {microbatch}"
            ),
            Transfer::Gradient { stage, microbatch } => write!(
                f,
                "the output gradient of stage {stage}, microbatch {microbatch}"
            ),
        }
    }
}

/// What `from`'s actions send to `to`, in the order `from` runs them (a transfer is sent right
/// after the forward or backward that produced it).
pub fn sent_from_to(schedule: &Schedule, from: usize, to: usize) -> Vec<Transfer> {
    let last = schedule.stages() - 1;
    schedule.actions[from]
        .iter()
        .filter_map(|a| {
            let (s, m) = (a.stage, a.microbatch);
            match a.work {
                Work::Forward if s < last && schedule.placement[s + 1] == to && to != from => {
                    Some(Transfer::Activation {
                        stage: s + 1,
                        microbatch: m,
                    })
                }
                Work::Backward | Work::BackwardInput
                    if s > 0 && schedule.placement[s - 1] == to && to != from =>
                {
                    Some(Transfer::Gradient {
                        stage: s - 1,
                        microbatch: m,
                    })
                }
                _ => None,
            }
        })
        .collect()
}

/// Transfers received and not yet taken, how many of each peer's transfers the compute thread
/// has asked for, and the first error of a transfer thread.
struct Received<P> {
    values: HashMap<Transfer, P>,
    /// Per peer: transfers asked for so far (a prefix of its send order).
    wanted: HashMap<usize, usize>,
    failed: Option<String>,
    done: bool,
}

impl<P> Default for Received<P> {
    fn default() -> Self {
        Received {
            values: HashMap::new(),
            wanted: HashMap::new(),
            failed: None,
            done: false,
        }
    }
}

/// What the receiving threads hand to the compute thread. A receiving thread reads a peer's next
/// transfer only once the compute thread waits for it or a later one, so each socket read's
/// timeout measures a real wait, as a collective's does (a peer may rightly stay silent for most
/// of a step, as under GPipe).
pub struct Mailbox<P> {
    state: Mutex<Received<P>>,
    changed: Condvar,
    /// Each transfer's place in its sender's order.
    position: HashMap<Transfer, usize>,
}

impl<P> Mailbox<P> {
    fn new(position: HashMap<Transfer, usize>) -> Self {
        Mailbox {
            state: Mutex::new(Received::default()),
            changed: Condvar::new(),
            position,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Received<P>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, t: Transfer, values: P) {
        self.lock().values.insert(t, values);
        self.changed.notify_all();
    }

    fn fail(&self, why: String) {
        self.lock().failed.get_or_insert(why);
        self.changed.notify_all();
    }

    /// The pass is over (or failed): receiving threads waiting for demand stop.
    fn finish(&self) {
        self.lock().done = true;
        self.changed.notify_all();
    }

    /// For the receiving thread of `peer`: waits until transfer number `k` of its order is wanted
    /// (true), or the pass ended (false).
    fn wait_wanted(&self, peer: usize, k: usize) -> bool {
        let mut s = self.lock();
        loop {
            if s.done || s.failed.is_some() {
                return false;
            }
            if s.wanted.get(&peer).is_some_and(|&w| w > k) {
                return true;
            }
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits up to `timeout` for `t` from pipeline rank `peer`.
    pub fn take(&self, t: Transfer, peer: usize, timeout: Duration) -> Result<P> {
        let deadline = Instant::now() + timeout;
        let k = self.position.get(&t).copied().ok_or_else(|| {
            anyhow!("pipeline: {t} is not sent by pipeline rank {peer} in this schedule (a bug)")
        })?;
        let mut s = self.lock();
        let w = s.wanted.entry(peer).or_default();
        *w = (*w).max(k + 1);
        self.changed.notify_all();
        loop {
            if let Some(v) = s.values.remove(&t) {
                return Ok(v);
            }
            if let Some(why) = &s.failed {
                return Err(anyhow!(
                    "pipeline: waiting for {t} from pipeline rank {peer}: {why}"
                ));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(anyhow!(
                    "pipeline: pipeline rank {peer} did not send {t} within {timeout:.0?} (train_timeout_seconds): did it fail or stop?"
                ));
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// How this rank's transfers travel: between device buffers over the pipeline group's channels,
/// or copied to the host for the group's transport and back.
enum Carrier<'g, B: Backend> {
    Host(&'g dyn ProcessGroup),
    Device(Arc<dyn DevicePeers<B>>),
}

impl<'g, B: Backend> Carrier<'g, B> {
    fn of(group: &'g dyn ProcessGroup) -> Self {
        match peers_of::<B>(group) {
            Some(device) => Carrier::Device(device),
            None => Carrier::Host(group),
        }
    }

    fn send(&self, be: &B, buf: B::Buf, peer: usize) -> Result<()> {
        match self {
            Carrier::Host(group) => group.send(&be.download_owned(buf), peer),
            Carrier::Device(device) => device.send(be, &buf, peer),
        }
    }

    fn recv(&self, be: &B, len: usize, peer: usize) -> Result<B::Buf> {
        match self {
            Carrier::Host(group) => {
                let mut values = vec![0f32; len];
                group.recv(&mut values, peer)?;
                Ok(be.upload_owned(values))
            }
            Carrier::Device(device) => {
                let mut buf = be.uninit(len);
                device.recv(be, &mut buf, peer)?;
                Ok(buf)
            }
        }
    }

    /// Whether transfers both ways with pipeline rank `peer` can travel (device channels join
    /// only some pairs).
    fn reaches(&self, peer: usize) -> bool {
        match self {
            Carrier::Host(_) => true,
            Carrier::Device(device) => device.reaches(peer),
        }
    }

    /// After a failed transfer: device channels may hold work that will never complete.
    fn abort(&self) {
        if let Carrier::Device(device) = self {
            device.abort();
        }
    }
}

/// Sends a transfer's buffer to a pipeline rank.
pub type SendTo<'t, B> = dyn Fn(usize, Transfer, <B as Backend>::Buf) -> Result<()> + 't;

/// Runs `compute` with this rank's transfers of one pass of `schedule` moving on their own
/// threads: `compute` gets the mailbox to take received buffers from and a function that sends a
/// transfer to a pipeline rank. Each transfer holds the values `lens` says for its kind; receives
/// and sends have the group's timeout.
pub fn with_transfers<B: Backend, T>(
    be: &B,
    group: &dyn ProcessGroup,
    schedule: &Schedule,
    lens: TransferLens,
    compute: impl FnOnce(&Mailbox<B::Buf>, &SendTo<'_, B>) -> Result<T>,
) -> Result<T> {
    let carrier = Carrier::<B>::of(group);
    let me = group.rank();
    let peers: Vec<usize> = (0..schedule.ranks()).filter(|&p| p != me).collect();
    let incoming: HashMap<usize, Vec<Transfer>> = peers
        .iter()
        .map(|&p| (p, sent_from_to(schedule, p, me)))
        .collect();
    for &peer in &peers {
        let exchanges = !incoming[&peer].is_empty() || !sent_from_to(schedule, me, peer).is_empty();
        if exchanges && !carrier.reaches(peer) {
            bail!(
                "pipeline: schedule {} moves activations or gradients between pipeline ranks {me} and {peer}, which the device's channels do not join (NCCL's join neighbouring ranks, r and r + 1 mod {}): place consecutive stages on neighbouring ranks, or run with TITAN_NCCL=off",
                schedule.name,
                schedule.ranks()
            );
        }
    }
    let position = incoming
        .values()
        .flat_map(|list| list.iter().enumerate().map(|(k, &t)| (t, k)))
        .collect();
    let mailbox = Mailbox::new(position);
    std::thread::scope(|scope| {
        let mut receivers = Vec::new();
        let mut outboxes: HashMap<usize, mpsc::Sender<(Transfer, B::Buf)>> = HashMap::new();
        let carrier = &carrier;
        let mut senders = Vec::new();
        for &peer in &peers {
            let expected = incoming[&peer].clone();
            if !expected.is_empty() {
                let mailbox = &mailbox;
                receivers.push(scope.spawn(move || {
                    for (k, t) in expected.into_iter().enumerate() {
                        if !mailbox.wait_wanted(peer, k) {
                            return;
                        }
                        match carrier.recv(be, t.len(lens), peer) {
                            Ok(buf) => mailbox.put(t, buf),
                            Err(e) => {
                                carrier.abort();
                                mailbox.fail(format!("{e:#}"));
                                return;
                            }
                        }
                    }
                }));
            }
            if !sent_from_to(schedule, me, peer).is_empty() {
                let (tx, rx) = mpsc::channel::<(Transfer, B::Buf)>();
                outboxes.insert(peer, tx);
                let mailbox = &mailbox;
                senders.push(scope.spawn(move || -> Result<()> {
                    for (t, buf) in rx {
                        if let Err(e) = carrier.send(be, buf, peer) {
                            carrier.abort();
                            let e = anyhow!("pipeline: sending {t} to pipeline rank {peer}: {e:#}");
                            // The compute thread stops waiting at once, with this error.
                            mailbox.fail(format!("{e:#}"));
                            return Err(e);
                        }
                    }
                    Ok(())
                }));
            }
        }
        let send = |peer: usize, t: Transfer, buf: B::Buf| -> Result<()> {
            if be.len(&buf) != t.len(lens) {
                return Err(anyhow!(
                    "pipeline: {t} holds {} values, expected {}",
                    be.len(&buf),
                    t.len(lens)
                ));
            }
            outboxes
                .get(&peer)
                .ok_or_else(|| anyhow!("pipeline: the schedule sends nothing to pipeline rank {peer}, yet {t} is sent there"))?
                .send((t, buf))
                .map_err(|_| anyhow!("pipeline: the sending thread to pipeline rank {peer} stopped before {t}"))
        };
        let result = compute(&mailbox, &send);
        drop(outboxes);
        mailbox.finish();
        let mut sent = Ok(());
        for s in senders {
            let r = s
                .join()
                .unwrap_or_else(|_| Err(anyhow!("pipeline: a sending thread panicked")));
            if sent.is_ok() {
                sent = r;
            }
        }
        for r in receivers {
            let _ = r.join();
        }
        // A failed send is the cause of whatever the compute thread then ran into.
        sent?;
        result
    })
}
