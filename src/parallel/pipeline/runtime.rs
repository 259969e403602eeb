//! One pipeline rank at run time: the stages it holds, a workspace per microbatch it keeps at once,
//! and the execution of its schedule's actions over one local batch, with the activations and
//! gradients that cross ranks moving on their own threads (`transfer`).
//!
//! A microbatch takes a workspace at its first action on this rank and gives it back after its
//! last, so every stage of that microbatch on this rank (the two arms of a "V", the loops of an
//! interleaved schedule) shares it: the hand-over between two stages on the same rank is the
//! block boundary inside the workspace, and needs no copy. The last stage computes the loss and
//! its gradient in its forward (titan's head is fused), so its backward starts from there; the
//! loss is normalised by the step's global number of targets, as in every layout.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};

use super::schedule::{Schedule, Work};
use super::stage::StageSplit;
use super::transfer::{with_transfers, Transfer};
use crate::backend::{Backend, LossSum};
use crate::comm::group::ProcessGroup;
use crate::model::activation_checkpoint::ActivationPlan;
use crate::model::{Llama, LocalShapes, ParamSet, Workspace};

/// A pipeline rank's stages, schedule and workspaces.
pub struct PipelineRank<B: Backend> {
    pub schedule: Schedule,
    pub split: StageSplit,
    group: Arc<dyn ProcessGroup>,
    /// Rows (sequences) of one microbatch.
    pub microbatch_rows: usize,
    seq: usize,
    slots: Vec<Workspace<B>>,
    /// Whether each of rank's actions is the last of its microbatch here.
    last_of_microbatch: Vec<bool>,
    /// The output is tied to the embedding: its gradient is summed over the two stages holding it.
    tied: bool,
    timeout: Duration,
    /// Seconds spent running schedules, and of those waiting for another rank's transfer (the
    /// measured bubble), since `take_bubble`.
    ran_s: f64,
    waited_s: f64,
}

impl<B: Backend> PipelineRank<B> {
    /// Rank `group.rank()` of the pipeline running `schedule` over the stages of `split`, its
    /// blocks keeping what `plan` says, with microbatches of `microbatch_rows` sequences of `seq`
    /// tokens on shapes `m`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        be: &B,
        schedule: Schedule,
        split: StageSplit,
        group: Arc<dyn ProcessGroup>,
        m: &LocalShapes,
        microbatch_rows: usize,
        seq: usize,
        plan: &ActivationPlan,
        tied: bool,
        timeout: Duration,
    ) -> Result<Self> {
        let me = group.rank();
        if schedule.ranks() != group.size() || schedule.stages() != split.len() {
            bail!(
                "pipeline: schedule {} has {} ranks and {} stages, the pipeline {} ranks and {} stages",
                schedule.name,
                schedule.ranks(),
                schedule.stages(),
                group.size(),
                split.len()
            );
        }
        let (last_of_microbatch, slots_needed) = schedule.microbatch_lifetimes(me);
        let here = Self::blocks_of(&schedule, &split, me);
        let plan = plan.only(|l| here.contains(&l));
        let slots = (0..slots_needed)
            .map(|_| Workspace::planned(be, m, microbatch_rows, seq, plan.clone()))
            .collect();
        Ok(PipelineRank {
            schedule,
            split,
            group,
            microbatch_rows,
            seq,
            slots,
            last_of_microbatch,
            tied,
            timeout,
            ran_s: 0.0,
            waited_s: 0.0,
        })
    }

    /// The share of the time spent in schedules since the last call that this rank waited for
    /// another rank's activations or gradients (its measured bubble); `None` before any ran.
    pub fn take_bubble(&mut self) -> Option<f64> {
        let b = (self.ran_s > 0.0).then(|| self.waited_s / self.ran_s);
        self.ran_s = 0.0;
        self.waited_s = 0.0;
        b
    }

    /// The blocks pipeline rank `r` runs.
    fn blocks_of(schedule: &Schedule, split: &StageSplit, r: usize) -> Vec<usize> {
        schedule
            .stages_of(r)
            .into_iter()
            .flat_map(|s| split.stages[s].blocks.clone())
            .collect()
    }

    pub fn group(&self) -> &dyn ProcessGroup {
        self.group.as_ref()
    }

    /// Whether this rank's stages hold the parameter `name` (`plan::holds`).
    pub fn holds(&self, name: &str) -> bool {
        super::plan::holds(
            &self.schedule,
            &self.split,
            self.tied,
            self.group.rank(),
            name,
        )
    }

    /// The schedule (name, microbatches, bubble under unit costs) and one line per stage: where
    /// it runs and what it holds.
    pub fn describe(&self) -> String {
        let bubble = self.schedule.unit_bubble().map_or(String::new(), |b| {
            format!(", bubble {b:.3} under unit costs")
        });
        format!(
            "pipeline: {} over {} ranks, {} microbatches of {} sequences{bubble}, up to {} held per rank here\n{}",
            self.schedule.name,
            self.schedule.ranks(),
            self.schedule.microbatches,
            self.microbatch_rows,
            self.slots.len(),
            self.split.describe(&self.schedule.placement)
        )
    }

    /// With the output tied to the embedding (held by the first and the last stage): sums the
    /// two stages' gradients of it over the pipeline group, so both hold the whole gradient and
    /// take the same optimizer step (every pipeline rank calls this together, once per gradient).
    pub fn sum_tied_grad(&self, be: &B, model: &Llama<B>, grads: &mut ParamSet<B>) -> Result<()> {
        if !self.tied {
            return Ok(());
        }
        let id = model.ids.tok_embeddings;
        let numel: usize = grads.shapes[id].iter().product();
        let here = self.holds(&grads.names[id]);
        let mut v = if here {
            be.download(&grads.bufs[id])
        } else {
            vec![0f32; numel]
        };
        self.group
            .all_reduce(&mut v, crate::comm::group::ReduceOp::Sum)?;
        if here {
            grads.bufs[id] = be.upload(&v);
        }
        Ok(())
    }

    /// The parameter this rank holds as a copy whose gradient the norm must not count again: the
    /// tied embedding on a rank holding the last stage but not the first.
    pub fn copy_not_to_count(&self, model: &Llama<B>) -> Option<usize> {
        let first = self.holder("tok_embeddings.weight");
        (self.tied && self.group.rank() != first && self.holds("tok_embeddings.weight"))
            .then_some(model.ids.tok_embeddings)
    }

    /// Whether pipeline rank `r` holds parameter `name`.
    pub fn holds_on(&self, r: usize, name: &str) -> bool {
        super::plan::holds(&self.schedule, &self.split, self.tied, r, name)
    }

    /// The pipeline rank holding parameter `name` (a checkpoint's part for it).
    pub fn holder(&self, name: &str) -> usize {
        super::plan::holder(&self.schedule, &self.split, self.tied, name)
    }

    /// Workspaces this rank keeps (one per microbatch held at once).
    pub fn workspaces(&self) -> usize {
        self.slots.len()
    }

    /// Forward and backward of one local batch (`[rows, seq+1]` tokens) cut into the schedule's
    /// microbatches: gradients of this rank's stages added into `grads` (scaled by `grad_scale`),
    /// returning this rank's sum of token losses (non-zero on the last stage's rank only).
    pub fn forward_backward(
        &mut self,
        be: &B,
        model: &Llama<B>,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        tokens: &[u32],
        grad_scale: f32,
    ) -> Result<f64> {
        let row = self.seq + 1;
        let rows = tokens.len() / row;
        let microbatches = self.schedule.microbatches;
        if rows != microbatches * self.microbatch_rows {
            bail!(
                "pipeline: a local batch of {rows} sequences does not make the schedule's {microbatches} microbatches of {} sequences",
                self.microbatch_rows
            );
        }
        let chunk = self.microbatch_rows * row;
        let me = self.group.rank();
        let len = be.len(self.slots[0].block_input(0));
        let PipelineRank {
            schedule,
            split,
            group,
            slots,
            last_of_microbatch,
            timeout,
            ..
        } = self;
        let (schedule, split, timeout) = (&*schedule, &*split, *timeout);
        let placement = &schedule.placement;
        let started = Instant::now();
        let mut waited = 0.0;
        let loss = with_transfers(group.as_ref(), schedule, len, |mailbox, send| {
            let mut take = |t: Transfer, peer: usize| {
                let t0 = Instant::now();
                let v = mailbox.take(t, peer, timeout);
                waited += t0.elapsed().as_secs_f64();
                v
            };
            let mut free: Vec<usize> = (0..slots.len()).rev().collect();
            let mut slot_of = std::collections::HashMap::new();
            let mut deferred = std::collections::HashMap::new();
            let mut loss = 0.0;
            for (i, a) in schedule.actions[me].iter().enumerate() {
                let (s, mb) = (a.stage, a.microbatch);
                let slot = match slot_of.get(&mb) {
                    Some(&k) => k,
                    None => {
                        let k = free.pop().ok_or_else(|| {
                            anyhow!("pipeline: no free workspace for microbatch {mb} (a bug in the slot count)")
                        })?;
                        model.load_tokens(
                            be,
                            &mut slots[k],
                            &tokens[mb * chunk..(mb + 1) * chunk],
                        )?;
                        slot_of.insert(mb, k);
                        k
                    }
                };
                let ws = &mut slots[slot];
                let stage = &split.stages[s];
                match a.work {
                    Work::Forward => {
                        let _span = crate::trace::span_named("pipeline", || format!("{a}"));
                        let head = Head::Train { grads, grad_scale };
                        let sum = forward_stage(
                            be, model, params, ws, split, placement, me, s, mb, head, &mut take,
                            send,
                        )?;
                        loss += sum.map_or(0.0, |l| l.sum);
                    }
                    Work::Backward | Work::BackwardInput => {
                        let _span = crate::trace::span_named("pipeline", || format!("{a}"));
                        // Zero-bubble: the projections' weight gradients wait for the `W`.
                        let split = a.work == Work::BackwardInput;
                        let later = RefCell::new(Vec::new());
                        if !stage.head && placement[s + 1] != me {
                            let t = Transfer::Gradient {
                                stage: s,
                                microbatch: mb,
                            };
                            let v = take(t, placement[s + 1])?;
                            *ws.carried_grad_mut() = be.upload(&v);
                        }
                        for l in stage.blocks.clone().rev() {
                            if split {
                                model.block_backward_input(be, params, grads, ws, l, &later)?;
                            } else {
                                model.block_backward(be, params, grads, ws, l)?;
                            }
                        }
                        if split {
                            deferred.insert((s, mb), later.into_inner());
                        }
                        if stage.embedding {
                            model.embed_backward(be, grads, ws)?;
                        } else if placement[s - 1] != me {
                            let t = Transfer::Gradient {
                                stage: s - 1,
                                microbatch: mb,
                            };
                            send(placement[s - 1], t, be.download(ws.carried_grad()))?;
                        }
                    }
                    Work::BackwardWeight => {
                        let _span = crate::trace::span_named("pipeline", || format!("{a}"));
                        let later = deferred.remove(&(s, mb)).ok_or_else(|| {
                            anyhow!("pipeline: {a} runs before its input-gradient action {s}I{mb}")
                        })?;
                        model.apply_weight_grads(be, grads, later);
                    }
                }
                if last_of_microbatch[i] {
                    slot_of.remove(&mb);
                    free.push(slot);
                }
            }
            Ok(loss)
        })?;
        self.ran_s += started.elapsed().as_secs_f64();
        self.waited_s += waited;
        Ok(loss)
    }
}

/// What the last stage's forward does after the blocks: the loss with its gradient (training),
/// or the loss alone (validation).
enum Head<'a, B: Backend> {
    Train {
        grads: &'a mut ParamSet<B>,
        grad_scale: f32,
    },
    LossOnly,
}

/// The forward of stage `s` for microbatch `mb` on pipeline rank `me`: its input embedded,
/// received (`take`) or already in the workspace (the previous stage ran here), its blocks, then
/// the head (returning the loss) or its output sent on (`send`).
#[allow(clippy::too_many_arguments)]
fn forward_stage<B: Backend>(
    be: &B,
    model: &Llama<B>,
    params: &ParamSet<B>,
    ws: &mut Workspace<B>,
    split: &StageSplit,
    placement: &[usize],
    me: usize,
    s: usize,
    mb: usize,
    head: Head<'_, B>,
    take: &mut dyn FnMut(Transfer, usize) -> Result<Vec<f32>>,
    send: &dyn Fn(usize, Transfer, Vec<f32>) -> Result<()>,
) -> Result<Option<LossSum>> {
    let stage = &split.stages[s];
    if stage.embedding {
        model.embed_forward(be, params, ws)?;
    } else if placement[s - 1] != me {
        let t = Transfer::Activation {
            stage: s,
            microbatch: mb,
        };
        let v = take(t, placement[s - 1])?;
        *ws.block_input_mut(stage.blocks.start) = be.upload(&v);
    }
    for l in stage.blocks.clone() {
        model.block_forward(be, params, ws, l)?;
    }
    if stage.head {
        return Ok(Some(match head {
            Head::Train { grads, grad_scale } => {
                model.head_forward_backward(be, params, grads, ws, grad_scale)?
            }
            Head::LossOnly => model.head_loss(be, params, ws)?,
        }));
    }
    if placement[s + 1] != me {
        let t = Transfer::Activation {
            stage: s + 1,
            microbatch: mb,
        };
        send(
            placement[s + 1],
            t,
            be.download(ws.block_input(stage.blocks.end)),
        )?;
    }
    Ok(None)
}

impl<B: Backend> PipelineRank<B> {
    /// The loss of `tokens` (`[rows, seq+1]`) without gradients (validation), as one microbatch
    /// through the stages in `ws` (a workspace of that shape, not the schedule's): this rank's
    /// loss sum and target count (non-zero on the last stage's rank only).
    pub fn loss(
        &self,
        be: &B,
        model: &Llama<B>,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
    ) -> Result<(f64, u64)> {
        let me = self.group.rank();
        let placement = &self.schedule.placement;
        // Each rank runs its stages' forwards in order: a forward-only "schedule" of one microbatch.
        let forwards = Schedule {
            name: "forward only".into(),
            microbatches: 1,
            placement: placement.clone(),
            actions: (0..self.schedule.ranks())
                .map(|r| {
                    self.schedule
                        .stages_of(r)
                        .into_iter()
                        .map(|stage| super::schedule::Action {
                            stage,
                            work: Work::Forward,
                            microbatch: 0,
                        })
                        .collect()
                })
                .collect(),
        };
        model.load_tokens(be, ws, tokens)?;
        let len = be.len(ws.block_input(0));
        let timeout = self.timeout;
        with_transfers(self.group.as_ref(), &forwards, len, |mailbox, send| {
            let mut take = |t: Transfer, peer: usize| mailbox.take(t, peer, timeout);
            let mut out = (0.0, 0u64);
            for s in self.schedule.stages_of(me) {
                let head = Head::LossOnly;
                let sum = forward_stage(
                    be,
                    model,
                    params,
                    ws,
                    &self.split,
                    placement,
                    me,
                    s,
                    0,
                    head,
                    &mut take,
                    send,
                )?;
                if let Some(l) = sum {
                    out = (l.sum, l.count as u64);
                }
            }
            Ok(out)
        })
    }
}
