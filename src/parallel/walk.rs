//! The one walk over the blocks, for every layout: a rank runs its action list (`Schedule`) over
//! the microbatches of a local batch, each action a stage's forward or backward (or a zero-bubble
//! schedule's weight-gradient half), and calls the parameter hooks (`ParamHooks`) around every
//! unit it visits: the embedding, each block, the head.
//!
//! - One process, DDP, FSDP, TP, CP and EP run the trivial list: one stage holding every block,
//!   a forward then a backward (`Walk::one_stage`). A pipeline rank runs its schedule's list
//!   (`Walk::pipelined`), activations and gradients crossing ranks on their own threads
//!   (`pipeline::transfer`).
//! - Where the weights and gradients come from is the hooks' business: whole sets (one process,
//!   DDP reducing each block's gradients during the last microbatch's backward) or FSDP shards
//!   (each block all-gathered before its forward and its gradients reduce-scattered after its
//!   backward, FSDP2's hooks; under a pipeline, every held parameter gathered for the pass).
//! - Validation runs the same walk without the backward (`PassKind::LossOnly`: a forward-only list).
//! - Generation too (`PassKind::LastLogits`, `Decoder::forward_cached`): the workspace holds the KV
//!   cache every block reads and extends; the head keeps the last position's logits.
//!
//! A microbatch takes a workspace at its first action on this rank and gives it back after its
//! last, so every stage of that microbatch on this rank (the two arms of a "V", the loops of an
//! interleaved schedule) shares it: the hand-over between two stages on the same rank is the
//! block boundary inside the workspace, and needs no copy. The last stage computes the loss and
//! its gradient in its forward (titan's head is fused), so its backward starts from there.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};

use super::pipeline::schedule::{Action, Schedule, Work};
use super::pipeline::stage::StageSplit;
use super::pipeline::transfer::{with_transfers, SendTo, Transfer, TransferLens};
use crate::backend::{Backend, LossSum};
use crate::comm::group::ProcessGroup;
use crate::model::activation_checkpoint::ActivationPlan;
use crate::model::moe::stats::ExpertFigures;
use crate::model::parallel_linear::DeferredWeightGrad;
use crate::model::{Decoder, KvCache, LocalShapes, ParamSet, Workspace};

/// A part of the model the walk visits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Embedding,
    Block(usize),
    /// The final norm, output projection and loss (their forward and backward are one op).
    Head,
}

/// What a pass over one local batch computes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PassKind {
    /// Forward and backward, gradients added scaled by `grad_scale`; `last_microbatch` when no
    /// accumulation step follows before the optimizer.
    Train {
        grad_scale: f32,
        last_microbatch: bool,
    },
    /// The loss alone (validation).
    LossOnly,
    /// The logits of the last position, the blocks reading and extending the workspace's KV
    /// cache (generation).
    LastLogits,
}

impl PassKind {
    /// Whether a backward follows the forward.
    pub fn has_backward(self) -> bool {
        matches!(self, PassKind::Train { .. })
    }
}

/// Where the walk's weights and gradients come from, called around each unit it visits (all
/// no-ops by default: whole sets in one process).
pub trait ParamHooks<B: Backend> {
    /// The weights the model computes with and the gradients it adds into.
    fn sets(&mut self) -> (&ParamSet<B>, &mut ParamSet<B>);
    /// Before a pass; `blocks[l]` are block `l`'s parameters.
    fn begin_pass(&mut self, _be: &B, _pass: PassKind, _blocks: &[Vec<usize>]) -> Result<()> {
        Ok(())
    }
    fn before_forward(&mut self, _be: &B, _unit: Unit) -> Result<()> {
        Ok(())
    }
    fn after_forward(&mut self, _be: &B, _unit: Unit) -> Result<()> {
        Ok(())
    }
    fn before_backward(&mut self, _be: &B, _unit: Unit) -> Result<()> {
        Ok(())
    }
    fn after_backward(&mut self, _be: &B, _unit: Unit) -> Result<()> {
        Ok(())
    }
    /// After a pass that succeeded. `complete` finishes the working gradients (a pipeline's tied
    /// embedding summed over its two stages) for a state that hands them on after each pass.
    fn end_pass(
        &mut self,
        _be: &B,
        _complete: &dyn Fn(&mut ParamSet<B>) -> Result<()>,
    ) -> Result<()> {
        Ok(())
    }
}

/// Fixed sets: one process computing with `params` into `grads`.
pub struct FixedSets<'a, B: Backend> {
    pub params: &'a ParamSet<B>,
    pub grads: &'a mut ParamSet<B>,
}

impl<B: Backend> ParamHooks<B> for FixedSets<'_, B> {
    fn sets(&mut self) -> (&ParamSet<B>, &mut ParamSet<B>) {
        (self.params, self.grads)
    }
}

/// A rank's action list with its workspaces, and (pipeline) the group its transfers cross.
pub struct Walk<B: Backend> {
    pub schedule: Schedule,
    pub split: StageSplit,
    /// The pipeline group (None: one stage on this rank alone).
    group: Option<Arc<dyn ProcessGroup>>,
    /// Rows (sequences) of one microbatch.
    pub microbatch_rows: usize,
    /// Positions of each whole sequence.
    pub seq: usize,
    slots: Vec<Workspace<B>>,
    /// Whether each of this rank's actions is the last of its microbatch here.
    last_of_microbatch: Vec<bool>,
    timeout: Duration,
    /// Seconds spent running schedules, and of those waiting for another rank's transfer (the
    /// measured bubble), since `take_bubble`.
    ran_s: f64,
    waited_s: f64,
}

/// One stage's forward or backward of microbatch `mb` in `ws`, with the rank's transfers.
struct StageRun<'r, B: Backend> {
    be: &'r B,
    model: &'r Decoder<B>,
    split: &'r StageSplit,
    placement: &'r [usize],
    me: usize,
    pass: PassKind,
}

type Take<'t, B> = dyn FnMut(Transfer, usize) -> Result<<B as Backend>::Buf> + 't;

impl<B: Backend> Walk<B> {
    /// The trivial list of one process (or one rank of any layout without a pipeline): a single
    /// stage holding every block, a forward then a backward of one microbatch in `ws`.
    pub fn one_stage(ws: Workspace<B>, n_layers: usize, seq: usize) -> Result<Self> {
        let act = |work| Action {
            stage: 0,
            work,
            microbatch: 0,
        };
        let schedule = Schedule {
            name: "one stage".into(),
            microbatches: 1,
            placement: vec![0],
            actions: vec![vec![act(Work::Forward), act(Work::Backward)]],
        };
        Ok(Walk {
            microbatch_rows: ws.batch,
            split: StageSplit::balanced(n_layers, 1)?,
            last_of_microbatch: vec![false, true],
            schedule,
            group: None,
            seq,
            slots: vec![ws],
            timeout: Duration::MAX,
            ran_s: 0.0,
            waited_s: 0.0,
        })
    }

    /// Rank `group.rank()` of the pipeline running `schedule` over the stages of `split`, its
    /// blocks keeping what `plan` says, with microbatches of `microbatch_rows` sequences of `seq`
    /// tokens on shapes `m`.
    pub fn pipelined(
        be: &B,
        p: PipelineParts,
        m: &LocalShapes,
        plan: &ActivationPlan,
    ) -> Result<Self> {
        let PipelineParts {
            schedule,
            split,
            group,
            microbatch_rows,
            seq,
            timeout,
        } = p;
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
        let here = blocks_of(&schedule, &split, me);
        let plan = plan.only(|l| here.contains(&l));
        // One microbatch runs at a time: the first workspace holds the transient buffers, which
        // the others borrow while they run (`run_actions`).
        let slots = (0..slots_needed)
            .map(|k| match k {
                0 => Workspace::planned(be, m, microbatch_rows, seq, plan.clone()),
                _ => Workspace::planned_borrowing(be, m, microbatch_rows, seq, plan.clone()),
            })
            .collect();
        Ok(Walk {
            schedule,
            split,
            group: Some(group),
            microbatch_rows,
            seq,
            slots,
            last_of_microbatch,
            timeout,
            ran_s: 0.0,
            waited_s: 0.0,
        })
    }

    /// The pipeline group, when this rank is one stage of several.
    pub fn pipeline_group(&self) -> Option<&dyn ProcessGroup> {
        self.group.as_deref()
    }

    /// The expert load and auxiliary loss the microbatches trained since the last call, summed
    /// over this rank's workspaces (None for a dense model).
    pub fn take_expert_stats(&mut self, be: &B) -> Option<ExpertFigures> {
        let mut slots = self
            .slots
            .iter_mut()
            .filter_map(|w| w.take_expert_stats(be));
        let mut total = slots.next()?;
        slots.for_each(|s| total.add(&s));
        Some(total)
    }

    /// Workspaces this rank keeps (one per microbatch held at once).
    pub fn workspaces(&self) -> usize {
        self.slots.len()
    }

    /// The share of the time spent in schedules since the last call that this rank waited for
    /// another rank's activations or gradients (its measured bubble); `None` before any ran.
    pub fn take_bubble(&mut self) -> Option<f64> {
        let b = (self.ran_s > 0.0).then(|| self.waited_s / self.ran_s);
        self.ran_s = 0.0;
        self.waited_s = 0.0;
        b
    }

    /// Forward and backward of one local batch (`[rows, seq+1]` tokens) cut into the schedule's
    /// microbatches: gradients of this rank's blocks added through `hooks` (scaled by
    /// `grad_scale`), returning this rank's sum of token losses (non-zero on the last stage's
    /// rank only).
    pub fn forward_backward(
        &mut self,
        be: &B,
        model: &Decoder<B>,
        hooks: &mut dyn ParamHooks<B>,
        tokens: &[u32],
        pass: PassKind,
        complete: &dyn Fn(&mut ParamSet<B>) -> Result<()>,
    ) -> Result<f64> {
        let started = Instant::now();
        let Walk {
            schedule,
            split,
            group,
            slots,
            last_of_microbatch,
            timeout,
            microbatch_rows,
            seq,
            ..
        } = self;
        let list = ActionList {
            schedule,
            split,
            group: group.as_deref(),
            timeout: *timeout,
            last_of_microbatch,
            microbatch_rows: *microbatch_rows,
            seq: *seq,
        };
        let pass = Pass {
            tokens,
            kind: pass,
            complete,
        };
        let (sum, waited) = run_list(be, model, hooks, &list, slots, pass)?;
        self.ran_s += started.elapsed().as_secs_f64();
        self.waited_s += waited;
        Ok(sum.sum)
    }

    /// The loss of `tokens` (`[rows, seq+1]`) without gradients (validation), as one microbatch
    /// through this rank's stages in `ws` (None: the training workspace, when the shapes are
    /// the same): this rank's loss sum and target count (non-zero on the last stage's rank only).
    pub fn loss(
        &mut self,
        be: &B,
        model: &Decoder<B>,
        hooks: &mut dyn ParamHooks<B>,
        ws: Option<&mut Workspace<B>>,
        tokens: &[u32],
    ) -> Result<(f64, u64)> {
        let forwards = self.forward_only_schedule();
        let last_of_microbatch = vec![false; forwards.actions[self.me()].len()];
        let ws = match ws {
            Some(ws) => ws,
            None => &mut self.slots[0],
        };
        let list = ActionList {
            schedule: &forwards,
            split: &self.split,
            group: self.group.as_deref(),
            timeout: self.timeout,
            last_of_microbatch: &last_of_microbatch,
            microbatch_rows: ws.batch,
            seq: ws.seq * model.local.cp,
        };
        let pass = Pass {
            tokens,
            kind: PassKind::LossOnly,
            complete: &|_| Ok(()),
        };
        let (sum, _) = run_list(be, model, hooks, &list, std::slice::from_mut(ws), pass)?;
        Ok((sum.sum, sum.count as u64))
    }

    fn me(&self) -> usize {
        self.group.as_ref().map_or(0, |g| g.rank())
    }

    /// Each rank runs its stages' forwards in order: a forward-only list of one microbatch.
    fn forward_only_schedule(&self) -> Schedule {
        Schedule {
            name: "forward only".into(),
            microbatches: 1,
            placement: self.schedule.placement.clone(),
            actions: (0..self.schedule.ranks())
                .map(|r| {
                    self.schedule
                        .stages_of(r)
                        .into_iter()
                        .map(|stage| Action {
                            stage,
                            work: Work::Forward,
                            microbatch: 0,
                        })
                        .collect()
                })
                .collect(),
        }
    }
}

/// What `Walk::pipelined` builds from (`PipelinePlan::build`).
pub struct PipelineParts {
    pub schedule: Schedule,
    pub split: StageSplit,
    pub group: Arc<dyn ProcessGroup>,
    pub microbatch_rows: usize,
    pub seq: usize,
    pub timeout: Duration,
}

/// The blocks pipeline rank `r` runs.
pub fn blocks_of(schedule: &Schedule, split: &StageSplit, r: usize) -> Vec<usize> {
    schedule
        .stages_of(r)
        .into_iter()
        .flat_map(|s| split.stages[s].blocks.clone())
        .collect()
}

/// A rank's actions over one local batch, how the batch is cut into microbatches, the stages
/// and the pipeline group its transfers cross (None: one stage alone).
struct ActionList<'a> {
    schedule: &'a Schedule,
    split: &'a StageSplit,
    group: Option<&'a dyn ProcessGroup>,
    timeout: Duration,
    last_of_microbatch: &'a [bool],
    microbatch_rows: usize,
    seq: usize,
}

/// One pass over a local batch: its tokens, what it computes, and how the working gradients are
/// completed before a state hands them on (`ParamHooks::end_pass`).
struct Pass<'a, B: Backend> {
    tokens: &'a [u32],
    kind: PassKind,
    complete: &'a dyn Fn(&mut ParamSet<B>) -> Result<()>,
}

/// Runs this rank's actions of `list` over `tokens` with the workspaces `slots`: the loss (sum
/// and count) and the seconds spent waiting for other ranks.
fn run_list<B: Backend>(
    be: &B,
    model: &Decoder<B>,
    hooks: &mut dyn ParamHooks<B>,
    list: &ActionList<'_>,
    slots: &mut [Workspace<B>],
    pass: Pass<'_, B>,
) -> Result<(LossSum, f64)> {
    let (tokens, group, timeout) = (pass.tokens, list.group, list.timeout);
    let row = list.seq + 1;
    let rows = tokens.len() / row.max(1);
    let microbatches = list.schedule.microbatches;
    if rows != microbatches * list.microbatch_rows || !tokens.len().is_multiple_of(row) {
        bail!(
            "a local batch of {} tokens is not the schedule's {microbatches} microbatches of {} sequences of {row}",
            tokens.len(),
            list.microbatch_rows
        );
    }
    let blocks: Vec<Vec<usize>> = model.ids.layers.iter().map(|l| l.all()).collect();
    hooks.begin_pass(be, pass.kind, &blocks)?;
    let me = group.map_or(0, |g| g.rank());
    let run = StageRun {
        be,
        model,
        split: list.split,
        placement: &list.schedule.placement,
        me,
        pass: pass.kind,
    };
    let mut waited = 0.0;
    let loss = match group {
        None => {
            let mut take = |t: Transfer, _| -> Result<B::Buf> {
                bail!("one stage alone receives nothing, yet {t} was awaited (a titan bug)")
            };
            let send = |_, t: Transfer, _| -> Result<()> {
                bail!("one stage alone sends nothing, yet {t} was sent (a titan bug)")
            };
            run_actions(&run, hooks, list, slots, tokens, &mut take, &send)?
        }
        Some(g) => {
            let lens = TransferLens {
                activation: slots[0].block_input_len(),
                gradient: be.len(slots[0].carried_grad()),
            };
            with_transfers(be, g, list.schedule, lens, |mailbox, send| {
                let mut take = |t: Transfer, peer: usize| {
                    let t0 = Instant::now();
                    let v = mailbox.take(t, peer, timeout);
                    waited += t0.elapsed().as_secs_f64();
                    v
                };
                run_actions(&run, hooks, list, slots, tokens, &mut take, send)
            })?
        }
    };
    hooks.end_pass(be, pass.complete)?;
    Ok((loss, waited))
}

/// Moves the transient buffers the workspaces share from `slots[*holder]` to `slots[to]`.
fn lend_transient<B: Backend>(slots: &mut [Workspace<B>], holder: &mut usize, to: usize) {
    if *holder != to {
        let (low, high) = slots.split_at_mut(to.max(*holder));
        low[to.min(*holder)].trade_transient(&mut high[0]);
        *holder = to;
    }
}

/// The actions themselves: each microbatch's tokens loaded into a free workspace at its first
/// action, the workspace freed after its last; the workspace running an action holds the
/// transient buffers, which go back to the first when the pass ends.
fn run_actions<B: Backend>(
    run: &StageRun<'_, B>,
    hooks: &mut dyn ParamHooks<B>,
    list: &ActionList<'_>,
    slots: &mut [Workspace<B>],
    tokens: &[u32],
    take: &mut Take<'_, B>,
    send: &SendTo<'_, B>,
) -> Result<LossSum> {
    let mut holder = 0;
    let ran = run_actions_lending(run, hooks, list, (slots, &mut holder), tokens, take, send);
    lend_transient(slots, &mut holder, 0);
    ran
}

fn run_actions_lending<B: Backend>(
    run: &StageRun<'_, B>,
    hooks: &mut dyn ParamHooks<B>,
    list: &ActionList<'_>,
    (slots, holder): (&mut [Workspace<B>], &mut usize),
    tokens: &[u32],
    take: &mut Take<'_, B>,
    send: &SendTo<'_, B>,
) -> Result<LossSum> {
    let chunk = list.microbatch_rows * (list.seq + 1);
    let mut free: Vec<usize> = (0..slots.len()).rev().collect();
    let mut slot_of = HashMap::new();
    let mut deferred = HashMap::new();
    let mut loss = LossSum { sum: 0.0, count: 0 };
    for (i, a) in list.schedule.actions[run.me].iter().enumerate() {
        let (s, mb) = (a.stage, a.microbatch);
        let slot = match slot_of.get(&mb) {
            Some(&k) => k,
            None => {
                let k = free.pop().ok_or_else(|| {
                    anyhow!(
                        "pipeline: no free workspace for microbatch {mb} (a bug in the slot count)"
                    )
                })?;
                let mb_tokens = &tokens[mb * chunk..(mb + 1) * chunk];
                run.model.load_tokens(run.be, &mut slots[k], mb_tokens)?;
                slot_of.insert(mb, k);
                k
            }
        };
        lend_transient(slots, holder, slot);
        let ws = &mut slots[slot];
        let _span = crate::trace::span_named("pipeline", || format!("{a}"));
        match a.work {
            Work::Forward => {
                if let Some(l) = run.forward_stage(hooks, ws, s, mb, take, send)? {
                    loss.sum += l.sum;
                    loss.count += l.count;
                }
            }
            Work::Backward | Work::BackwardInput => {
                // Zero-bubble: the projections' weight gradients wait for the `W`.
                let later = (a.work == Work::BackwardInput).then(|| RefCell::new(Vec::new()));
                run.backward_stage(hooks, ws, a, later.as_ref(), take, send)?;
                if let Some(later) = later {
                    deferred.insert((s, mb), later.into_inner());
                }
            }
            Work::BackwardWeight => {
                let later: Vec<DeferredWeightGrad<B>> =
                    deferred.remove(&(s, mb)).ok_or_else(|| {
                        anyhow!("pipeline: {a} runs before its input-gradient action {s}I{mb}")
                    })?;
                let (_, grads) = hooks.sets();
                run.model.apply_weight_grads(run.be, grads, later);
            }
        }
        if list.last_of_microbatch.get(i).copied().unwrap_or(false) {
            slot_of.remove(&mb);
            free.push(slot);
        }
    }
    Ok(loss)
}

impl<B: Backend> StageRun<'_, B> {
    /// The forward of stage `s` for microbatch `mb`: its input embedded, received (`take`) or
    /// already in the workspace (the previous stage ran here), its blocks, then the head
    /// (returning the loss) or its output sent on (`send`).
    fn forward_stage(
        &self,
        hooks: &mut dyn ParamHooks<B>,
        ws: &mut Workspace<B>,
        s: usize,
        mb: usize,
        take: &mut Take<'_, B>,
        send: &SendTo<'_, B>,
    ) -> Result<Option<LossSum>> {
        let (be, model) = (self.be, self.model);
        let stage = &self.split.stages[s];
        if stage.embedding {
            hooks.before_forward(be, Unit::Embedding)?;
            model.embed_forward(be, hooks.sets().0, ws)?;
            hooks.after_forward(be, Unit::Embedding)?;
        } else if self.placement[s - 1] != self.me {
            let t = Transfer::Activation {
                stage: s,
                microbatch: mb,
            };
            let received = take(t, self.placement[s - 1])?;
            ws.receive_block_input(stage.blocks.start, received);
        }
        for l in stage.blocks.clone() {
            hooks.before_forward(be, Unit::Block(l))?;
            model.block_forward(be, hooks.sets().0, ws, l)?;
            hooks.after_forward(be, Unit::Block(l))?;
        }
        if !self.pass.has_backward() {
            // No backward follows: a mixture of experts' activations are not needed.
            ws.drop_expert_acts();
        }
        if stage.head {
            hooks.before_forward(be, Unit::Head)?;
            let (params, grads) = hooks.sets();
            let loss = match self.pass {
                PassKind::Train { grad_scale, .. } => {
                    model.head_forward_backward(be, params, grads, ws, grad_scale)?
                }
                PassKind::LossOnly => model.head_loss(be, params, ws)?,
                PassKind::LastLogits => {
                    model.head_last_logits(be, params, ws);
                    LossSum { sum: 0.0, count: 0 }
                }
            };
            hooks.after_forward(be, Unit::Head)?;
            return Ok(Some(loss));
        }
        if self.placement[s + 1] != self.me {
            let t = Transfer::Activation {
                stage: s + 1,
                microbatch: mb,
            };
            let out = be.copied(ws.block_input(stage.blocks.end));
            send(self.placement[s + 1], t, out)?;
        }
        Ok(None)
    }

    /// The backward of action `a`'s stage `s` for its microbatch `mb`, from the gradient of its output (left by
    /// the head, by the next stage here, or received) to its input's, sent on or into the
    /// embedding. With `later`, the projections' weight gradients are left there.
    fn backward_stage(
        &self,
        hooks: &mut dyn ParamHooks<B>,
        ws: &mut Workspace<B>,
        a: &Action,
        later: Option<&RefCell<Vec<DeferredWeightGrad<B>>>>,
        take: &mut Take<'_, B>,
        send: &SendTo<'_, B>,
    ) -> Result<()> {
        let (be, model) = (self.be, self.model);
        let (s, mb) = (a.stage, a.microbatch);
        let stage = &self.split.stages[s];
        if !stage.head && self.placement[s + 1] != self.me {
            let t = Transfer::Gradient {
                stage: s,
                microbatch: mb,
            };
            *ws.carried_grad_mut() = take(t, self.placement[s + 1])?;
        }
        for l in stage.blocks.clone().rev() {
            hooks.before_backward(be, Unit::Block(l))?;
            let (params, grads) = hooks.sets();
            match later {
                Some(later) => model.block_backward_input(be, params, grads, ws, l, later)?,
                None => model.block_backward(be, params, grads, ws, l)?,
            }
            hooks.after_backward(be, Unit::Block(l))?;
        }
        if stage.embedding {
            hooks.before_backward(be, Unit::Embedding)?;
            model.embed_backward(be, hooks.sets().1, ws)?;
            hooks.after_backward(be, Unit::Embedding)?;
        } else if self.placement[s - 1] != self.me {
            let t = Transfer::Gradient {
                stage: s - 1,
                microbatch: mb,
            };
            send(self.placement[s - 1], t, be.copied(ws.carried_grad()))?;
        }
        Ok(())
    }
}

/// One process's model API (tests, tools): the same walk, one stage, fixed sets.
impl<B: Backend> Decoder<B> {
    /// One forward and backward over `tokens` (`[batch, seq+1]`, inputs are the first `seq` of each
    /// row, targets the last `seq`). Gradients are *added* into `grads`, scaled by `grad_scale`
    /// (1 / global number of targets), so micro-batches accumulate into one big batch.
    pub fn forward_backward(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
        grad_scale: f32,
    ) -> Result<LossSum> {
        let pass = PassKind::Train {
            grad_scale,
            last_microbatch: true,
        };
        self.walk_one_stage(be, &mut FixedSets { params, grads }, ws, tokens, pass)
    }

    /// Loss without gradients (validation, tests).
    pub fn loss(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
    ) -> Result<LossSum> {
        let mut no_grads = ParamSet {
            names: Vec::new(),
            shapes: Vec::new(),
            bufs: Vec::new(),
        };
        let mut sets = FixedSets {
            params,
            grads: &mut no_grads,
        };
        self.walk_one_stage(be, &mut sets, ws, tokens, PassKind::LossOnly)
    }

    /// Runs `tokens` at positions `cache.len..` through the same walk (a forward-only list, the
    /// blocks attending to and extending `cache`) and returns the logits of the last one.
    pub fn forward_cached(
        &self,
        be: &B,
        params: &ParamSet<B>,
        cache: &mut KvCache<B>,
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        self.check_generation_step(cache, tokens)?;
        let n = tokens.len();
        let mut ws = Workspace::for_inference(be, &self.local, 1, n).with_kv_cache(cache.take());
        // One row of inputs; its targets are not read (no loss).
        let row: Vec<u32> = tokens.iter().copied().chain([0]).collect();
        let mut no_grads = ParamSet {
            names: Vec::new(),
            shapes: Vec::new(),
            bufs: Vec::new(),
        };
        let mut sets = FixedSets {
            params,
            grads: &mut no_grads,
        };
        let walked = self.walk_one_stage(be, &mut sets, &mut ws, &row, PassKind::LastLogits);
        let (returned, logits) = ws.take_generation_output();
        *cache = returned.ok_or_else(|| anyhow!("the walk lost the KV cache (a titan bug)"))?;
        walked?;
        cache.len += n;
        Ok(logits)
    }

    fn walk_one_stage(
        &self,
        be: &B,
        hooks: &mut dyn ParamHooks<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
        pass: PassKind,
    ) -> Result<LossSum> {
        let split = StageSplit::balanced(self.args.n_layers, 1)?;
        let act = |work| Action {
            stage: 0,
            work,
            microbatch: 0,
        };
        let actions = match pass {
            PassKind::Train { .. } => vec![act(Work::Forward), act(Work::Backward)],
            PassKind::LossOnly | PassKind::LastLogits => vec![act(Work::Forward)],
        };
        let schedule = Schedule {
            name: "one stage".into(),
            microbatches: 1,
            placement: vec![0],
            actions: vec![actions],
        };
        let list = ActionList {
            schedule: &schedule,
            split: &split,
            group: None,
            timeout: Duration::MAX,
            last_of_microbatch: &[],
            microbatch_rows: ws.batch,
            seq: ws.seq * self.local.cp,
        };
        let pass = Pass {
            tokens,
            kind: pass,
            complete: &|_| Ok(()),
        };
        let (loss, _) = run_list(be, self, hooks, &list, std::slice::from_mut(ws), pass)?;
        Ok(loss)
    }
}
