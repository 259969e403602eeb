//! The predicted step time of a layout (docs/plan.md): each rank's compute from TorchTitan's FLOP
//! count at the device's achieved rate plus a cost per block and microbatch, the pipeline's bubble
//! from the schedule simulator run on those costs, the optimizer step, and each parallelism's
//! collectives as alpha-beta sums over the link its group crosses, minus what the device overlaps.

use super::device::{Device, Link};
use super::layout::{AcChoice, Layout};
use crate::model::ModelArgs;
use crate::parallel::pipeline::plan::PipelinePlan;
use crate::parallel::pipeline::schedule::{Action, Work};
use crate::parallel::pipeline::stage::StageSplit;

/// What a layout is predicted to do per optimizer step.
#[derive(Debug, Clone, Copy, Default)]
pub struct Prediction {
    pub step_s: f64,
    /// Tokens per second over the job (`titan bench train`'s `tokens_per_s`).
    pub tokens_per_s: f64,
    pub compute_s: f64,
    /// The pipeline's idle share (0 without a pipeline).
    pub bubble: f64,
    pub exposed_comm_s: f64,
    /// Model FLOP utilisation against the device's peak (TorchTitan's count).
    pub mfu: f64,
}

/// One layout of one job on one device kind.
pub struct Weighing<'a> {
    pub layout: &'a Layout,
    pub args: &'a ModelArgs,
    pub seq: usize,
    /// Microbatch steps per optimizer step (gradient accumulation).
    pub accum: usize,
    pub device: &'a Device,
    pub world: usize,
    /// The pipeline the trainer would run (its schedule and stage split), None without one.
    pub pipeline: Option<&'a PipelinePlan>,
    /// `[parallelism] enable_async_tensor_parallel`.
    pub async_tp: bool,
    /// Parameters a token multiplies in float8 GEMMs (`Float8Conversion::params_per_token`):
    /// their FLOPs run at the device's `float8_speedup`.
    pub float8_params: f64,
}

/// A step's communication (see `Weighing::comm`).
struct Comm {
    busy_s: f64,
    exposed_s: f64,
    waits_s: f64,
    /// The pipeline transfers' share of `waits_s`: on a crowded host each is a hand-off between
    /// ranks that share cores, which the host pays for as work (`predict`).
    pipeline_waits_s: f64,
}

/// `Σ count · (time, wait)`, as (time, wait).
fn sum(parts: &[(f64, (f64, f64))]) -> (f64, f64) {
    parts
        .iter()
        .fold((0.0, 0.0), |(t, w), (n, (ti, wi))| (t + n * ti, w + n * wi))
}

fn scale((t, w): (f64, f64), n: f64) -> (f64, f64) {
    (t * n, w * n)
}

/// A collective's shape.
#[derive(Clone, Copy)]
enum Collective {
    AllGather,
    ReduceScatter,
    AllReduce,
    AllToAll,
    PointToPoint,
}

impl Weighing<'_> {
    /// The step on the slowest rank: its critical path (the pipeline's schedule with its bubble,
    /// the optimizer, the communication left exposed, the waits between ranks) or, on a host
    /// whose ranks want more threads than it has cores, the host's whole work over its cores
    /// (a waiting rank's core then runs another rank), whichever is longer.
    pub fn predict(&self) -> Prediction {
        let l = self.layout;
        let (rate, crowd) = self.device.rank_rate(self.ranks_per_node());
        let blocks = self.blocks_per_rank();
        let mb_tokens = (l.microbatch_size * self.seq) as f64;
        // The rank's threads against the one thread the compute rates were measured with.
        let speedup = rate / self.device.compute.flops_per_s;
        let (forward, backward) = self.microbatch_compute_s(rate, speedup, mb_tokens);
        let steps = (l.microbatches() * self.accum) as f64;
        let busy_compute = (forward + backward) * steps;
        let (critical, bubble) = match self.pipeline {
            None => (busy_compute, 0.0),
            Some(p) => {
                let (span, bubble) = self.pipelined(p, (forward, backward));
                (span * self.accum as f64, bubble)
            }
        };
        let optimizer_s =
            self.params_per_rank() * self.device.compute.optimizer_s_per_param / speedup;
        let comm = self.comm(busy_compute, mb_tokens, blocks);
        // A pipeline transfer's wait on a core of its own falls in the bubble the simulation
        // already counts (the receiver idles until its input arrives), so it is not added here.
        let waits = comm.waits_s - comm.pipeline_waits_s;
        let dedicated = critical + optimizer_s + comm.exposed_s + waits;
        // A saturated host's cores run every rank's work, the copies of its collectives included
        // (a GPU's links run beside its compute: no such sum), and each pipeline transfer's
        // hand-off: the receiving rank wakes on a core other ranks share (measured on 2 cores:
        // PP 2 × FSDP 2's schedules order as their transfers, docs/plan.md).
        let hand_offs = match crowd > 1.0 {
            true => comm.pipeline_waits_s,
            false => 0.0,
        };
        let saturated = match self.device.cores {
            0 => 0.0,
            _ => (busy_compute + optimizer_s + comm.busy_s + hand_offs) * crowd,
        };
        let step_s = dedicated.max(saturated);
        let tokens = (l.local_batch * self.accum * self.seq * l.dp_replicate * l.dp_shard) as f64;
        let flops = self.args.flops_per_token(self.seq) * tokens;
        Prediction {
            step_s,
            tokens_per_s: tokens / step_s,
            compute_s: critical,
            bubble,
            exposed_comm_s: comm.exposed_s + comm.waits_s,
            mfu: flops / step_s / (self.world as f64 * self.device.peak_tflops * 1e12),
        }
    }

    fn ranks_per_node(&self) -> usize {
        self.world.min(self.device.per_node)
    }

    /// Blocks a rank runs (its stages' under a pipeline).
    fn blocks_per_rank(&self) -> f64 {
        self.args.n_layers as f64 / self.layout.pp as f64
    }

    /// (forward, backward) seconds of one microbatch of `tokens` rows on one rank, for the
    /// whole model split `pp` ways: FLOPs over `tp × cp`, the checkpointing's recompute in the
    /// backward, and the per-block cost.
    fn microbatch_compute_s(&self, rate: f64, speedup: f64, tokens: f64) -> (f64, f64) {
        let l = self.layout;
        let per_rank = tokens / (l.tp * l.cp * l.pp) as f64;
        let float8_flops = 6.0 * self.float8_params * per_rank;
        // Float8 FLOPs counted as the bf16 FLOPs they replace, at the device's float8 rate.
        let flops = self.args.flops_per_token(self.seq) * per_rank - float8_flops
            + float8_flops / self.device.float8_speedup;
        let recompute = match l.ac {
            AcChoice::None => 0.0,
            AcChoice::Op => 0.05,
            AcChoice::Full => 1.0,
        };
        let d = self.device;
        let moe = match self.args.moe.is_some() {
            true => d.moe_efficiency,
            false => 1.0,
        };
        let split = |degree: usize, e: f64| if degree > 1 { e } else { 1.0 };
        let efficiency = split(l.tp, d.tp_efficiency) * split(l.cp, d.cp_efficiency) * moe;
        let forward = flops / 3.0 / (rate * efficiency);
        let experts = self.grouped_gemm_extra_s(rate * efficiency, tokens);
        let overhead = self.device.compute.block_overhead_s * self.blocks_per_rank() / speedup;
        (
            forward + experts + overhead / 3.0,
            (forward + experts) * (2.0 + recompute) + overhead * 2.0 / 3.0,
        )
    }

    /// Seconds of a pipelined local batch (its microbatches through the schedule, as the
    /// simulator runs them on these costs) and the bubble. `(forward, backward)` are a rank's
    /// average (the model over `pp`); each stage costs its own share of the model (`stage_shares`),
    /// so a schedule whose placement leaves one rank more blocks, or the output beside as many
    /// blocks, shows the rank the others wait for.
    fn pipelined(&self, p: &PipelinePlan, (forward, backward): (f64, f64)) -> (f64, f64) {
        let shares = self.stage_shares(&p.split);
        let pp = self.layout.pp as f64;
        let ns = |s: f64| (s * 1e9).max(1.0) as u64;
        let cost = |a: Action| {
            let share = shares.get(a.stage).copied().unwrap_or(0.0) * pp;
            match a.work {
                Work::Forward => ns(forward * share),
                Work::Backward => ns(backward * share),
                Work::BackwardInput | Work::BackwardWeight => ns(backward * share / 2.0),
            }
        };
        match p.schedule.simulate(cost) {
            Ok(t) => (t.makespan as f64 * 1e-9, t.bubble()),
            Err(_) => (f64::INFINITY, 1.0),
        }
    }

    /// Each stage's share of the model's compute: its blocks' (alike), and the last stage's
    /// output projection and loss (TorchTitan's FLOP count of the output, `6 · dim · vocab` per
    /// token, of `flops_per_token`); the embedding's lookup costs nothing here.
    fn stage_shares(&self, split: &StageSplit) -> Vec<f64> {
        let a = self.args;
        let total = a.flops_per_token(self.seq).max(1.0);
        let head = (6.0 * (a.dim * a.vocab_size) as f64 / total).min(0.5);
        let block = (1.0 - head) / a.n_layers.max(1) as f64;
        split
            .stages
            .iter()
            .map(|st| st.blocks.len() as f64 * block + if st.head { head } else { 0.0 })
            .collect()
    }

    /// Parameters a rank holds whole (before FSDP sharding): its tensor-parallel and pipeline
    /// share, the routed experts split over expert parallelism.
    fn params_per_rank(&self) -> f64 {
        let l = self.layout;
        let total = self.args.num_params() as f64;
        let experts = self.expert_params();
        let held = (total - experts) + experts / l.ep as f64;
        held / (l.tp * l.pp) as f64
    }

    fn expert_params(&self) -> f64 {
        (0..self.args.n_layers)
            .filter_map(|i| self.args.moe_at(i))
            .map(|m| m.routed_params(self.args.dim) as f64)
            .sum()
    }

    /// The link a group over dims of `stride × size` consecutive-rank span crosses.
    fn link(&self, span: usize) -> Link {
        match span <= self.device.per_node {
            true => self.device.intra,
            false => self.device.inter,
        }
    }

    fn time(&self, link: Link, c: Collective, group: usize, bytes: f64) -> f64 {
        if group <= 1 {
            return 0.0;
        }
        let g = group as f64;
        let (steps, moved) = match c {
            Collective::AllGather | Collective::ReduceScatter => (g - 1.0, (g - 1.0) / g),
            Collective::AllReduce => (2.0 * (g - 1.0), 2.0 * (g - 1.0) / g),
            Collective::AllToAll => (g - 1.0, (g - 1.0) / g),
            Collective::PointToPoint => (1.0, 1.0),
        };
        steps * link.alpha_s + moved * bytes * link.beta_s_per_byte
    }

    /// A collective inside the step (the ranks wait on each other): its link's time and the
    /// device's per-collective wait.
    fn in_step(&self, link: Link, c: Collective, group: usize, bytes: f64) -> (f64, f64) {
        match group {
            0 | 1 => (0.0, 0.0),
            _ => (self.time(link, c, group, bytes), self.device.step_alpha_s),
        }
    }

    /// A step's communication: the link time (busy), the part no overlap hides (exposed), the
    /// waits of in-step collectives; `busy_compute` is the compute it can hide behind.
    fn comm(&self, busy_compute: f64, mb_tokens: f64, blocks: f64) -> Comm {
        let l = self.layout;
        let d = self.device;
        let microbatches = (l.microbatches() * self.accum) as f64;
        let (data, first_last) = self.data_parallel_s(blocks);
        let wire = d.wire_bytes as f64;
        let dim = self.args.dim as f64;
        let tp_bytes = mb_tokens / l.cp as f64 * dim * wire;
        let tp_link = self.link(l.tp);
        let ac = if l.ac == AcChoice::Full { 1.5 } else { 1.0 };
        let gather = self.in_step(tp_link, Collective::AllGather, l.tp, tp_bytes);
        let scatter = self.in_step(tp_link, Collective::ReduceScatter, l.tp, tp_bytes);
        let tp_count = 4.0 * blocks * ac;
        let tp = scale(
            sum(&[(tp_count, gather), (tp_count, scatter), (2.0, gather)]),
            microbatches,
        );
        let cp_kv = mb_tokens / l.cp as f64 * 2.0 * self.kv_width() * wire / l.tp as f64;
        let ring = self.in_step(self.link(l.tp * l.cp), Collective::PointToPoint, 2, cp_kv);
        let cp = scale(
            sum(&[(3.0 * (l.cp as f64 - 1.0) * blocks, ring)]),
            microbatches,
        );
        let ep = scale(self.expert_exchange_s(mb_tokens, wire), microbatches);
        let pp_bytes = mb_tokens / (l.cp * l.tp) as f64 * dim * wire;
        let hop = match l.pp {
            1 => (0.0, 0.0),
            _ => self.in_step(self.link(self.world), Collective::PointToPoint, 2, pp_bytes),
        };
        // Per microbatch the busiest pipeline rank sends and receives once across each stage
        // boundary it borders (`Schedule::crossings_of`).
        let crossings = self.pipeline.map_or(1, |p| {
            (0..l.pp)
                .map(|r| p.schedule.crossings_of(r))
                .max()
                .unwrap_or(1)
        });
        let pp = sum(&[(2.0 * crossings as f64 * microbatches, hop)]);
        let busy = data + tp.0 + cp.0 + ep.0 + pp.0;
        let waits = tp.1 + cp.1 + ep.1 + pp.1;
        let exposed = match d.overlaps {
            // GPU streams: FSDP's and DDP's collectives hide behind the blocks' compute but for
            // the first gather and the last reduce; the ring behind the attention; TP, EP and
            // the pipeline's transfers stay exposed.
            true => {
                (data - 0.8 * busy_compute).max(0.0)
                    + first_last
                    + tp.0 * self.tp_exposed_share()
                    + (cp.0 - 0.3 * busy_compute).max(0.0)
                    + ep.0
                    + pp.0
            }
            false => busy,
        };
        Comm {
            busy_s: busy,
            exposed_s: exposed,
            waits_s: waits,
            pipeline_waits_s: pp.1,
        }
    }

    /// The share of TP's collectives a GPU leaves exposed: all of them, or with async TP two
    /// thirds (its chunked collectives overlap the GEMMs only partly: TorchTitan measured 1.09×
    /// on Llama 3 8B and 70B with TP 8, which hides about a third; docs/plan.md).
    fn tp_exposed_share(&self) -> f64 {
        match self.async_tp {
            true => 2.0 / 3.0,
            false => 1.0,
        }
    }

    /// Data parallelism's collectives per step (FSDP's gathers and reduce-scatters, HSDP's and
    /// DDP's all-reduces), and the part no overlap hides (the first gather, the last reduce).
    fn data_parallel_s(&self, blocks: f64) -> (f64, f64) {
        let l = self.layout;
        let d = self.device;
        let params = self.params_per_rank();
        let (shard, replicate) = (l.dp_shard * l.cp, l.dp_replicate);
        let shard_link = self.link(l.tp * shard);
        let replicate_link = self.link(self.world / l.pp);
        let total = if shard > 1 {
            let gathers = if l.pp > 1 { 1.0 } else { 2.0 };
            let gather_bytes = params * d.wire_bytes as f64;
            gathers * self.time(shard_link, Collective::AllGather, shard, gather_bytes)
                + self.time(shard_link, Collective::ReduceScatter, shard, params * 4.0)
                + self.time(
                    replicate_link,
                    Collective::AllReduce,
                    replicate,
                    params * 4.0 / shard as f64,
                )
        } else {
            self.time(
                replicate_link,
                Collective::AllReduce,
                replicate,
                params * 4.0,
            )
        };
        (total, 2.0 * total / blocks.max(1.0) / 3.0)
    }

    /// Expert parallelism's dispatch and combine, forward and backward, per microbatch.
    fn expert_exchange_s(&self, mb_tokens: f64, wire: f64) -> (f64, f64) {
        let l = self.layout;
        let moe_blocks = (0..self.args.n_layers)
            .filter(|i| self.args.moe_at(*i).is_some())
            .count() as f64
            / l.pp as f64;
        let Some(moe) = (0..self.args.n_layers).find_map(|i| self.args.moe_at(i)) else {
            return (0.0, 0.0);
        };
        let bytes = mb_tokens / (l.cp * l.tp) as f64
            * moe.router.top_k as f64
            * self.args.dim as f64
            * wire;
        let link = self.link(l.tp * l.ep);
        sum(&[(
            4.0 * moe_blocks,
            self.in_step(link, Collective::AllToAll, l.ep, bytes),
        )])
    }

    /// Key plus value width of one token (all heads).
    fn kv_width(&self) -> f64 {
        let a = self.args;
        match &a.mla {
            Some(m) => (a.n_heads * (m.qk_head_dim() + m.v_head_dim)) as f64 / 2.0,
            None => (a.n_kv_heads * a.head_dim()) as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::device::gpu;

    #[test]
    fn float8_linears_are_faster_on_a_gpu_and_slower_emulated_on_the_cpu() {
        let args = crate::model::families::llama3::flavor("8B").unwrap();
        let layout = data_parallel(8, true);
        let mut device = gpu("h100").unwrap();
        for (speedup, faster) in [
            (device.float8_speedup, true),
            (crate::plan::device::emulated_float8_speedup(), false),
        ] {
            device.float8_speedup = speedup;
            let predict = |float8_params: f64| {
                Weighing {
                    layout: &layout,
                    args: &args,
                    seq: 8192,
                    accum: 1,
                    device: &device,
                    world: 8,
                    pipeline: None,
                    async_tp: false,
                    float8_params,
                }
                .predict()
            };
            let (bf16, float8) = (predict(0.0), predict(6.98e9));
            assert_eq!(
                float8.tokens_per_s > bf16.tokens_per_s,
                faster,
                "{bf16:?} {float8:?}"
            );
            // MFU counts the model's FLOPs whatever precision runs them.
            assert!((float8.mfu / bf16.mfu - float8.tokens_per_s / bf16.tokens_per_s).abs() < 1e-9);
        }
    }

    fn data_parallel(n: usize, shard: bool) -> Layout {
        Layout {
            pp: 1,
            dp_replicate: if shard { 1 } else { n },
            dp_shard: if shard { n } else { 1 },
            cp: 1,
            tp: 1,
            ep: 1,
            schedule: None,
            microbatch_size: 2,
            local_batch: 2,
            ac: AcChoice::Op,
        }
    }

    #[test]
    fn more_devices_never_predict_less_data_parallel_throughput() {
        for flavor in ["8B", "70B"] {
            let args = crate::model::families::llama3::flavor(flavor).unwrap();
            for kind in ["h100", "b200"] {
                let device = gpu(kind).unwrap();
                for shard in [true, false] {
                    let mut last = 0.0;
                    for n in (0..10).map(|p| 1usize << p) {
                        let layout = data_parallel(n, shard);
                        let p = Weighing {
                            layout: &layout,
                            args: &args,
                            seq: 8192,
                            accum: 1,
                            device: &device,
                            world: n,
                            pipeline: None,
                            async_tp: false,
                            float8_params: 0.0,
                        }
                        .predict();
                        assert!(
                            p.tokens_per_s >= last,
                            "{flavor} on {n} {kind}s (shard {shard}): {} < {last}",
                            p.tokens_per_s
                        );
                        assert!(p.mfu > 0.0 && p.mfu < 1.0, "{p:?}");
                        last = p.tokens_per_s;
                    }
                }
            }
        }
    }

    #[test]
    fn a_saturated_host_runs_every_ranks_work_and_a_crossing_group_takes_the_network() {
        let args = crate::model::families::llama3::flavor("debugmodel").unwrap();
        let mut cpu = gpu("h100").unwrap();
        cpu.cores = 2;
        cpu.overlaps = false;
        cpu.per_node = usize::MAX;
        let predict = |n: usize| {
            let layout = data_parallel(n, false);
            Weighing {
                layout: &layout,
                args: &args,
                seq: 256,
                accum: 1,
                device: &cpu,
                world: n,
                pipeline: None,
                async_tp: false,
                float8_params: 0.0,
            }
            .predict()
        };
        // Eight ranks on two cores: each step's tokens grow 4×, its time at least 4× (the host
        // computes every rank's batch on its two cores).
        let (two, eight) = (predict(2), predict(8));
        assert!(
            eight.step_s >= 4.0 * two.step_s * 0.999,
            "{two:?} {eight:?}"
        );
        let h100 = gpu("h100").unwrap();
        let layout = data_parallel(16, false);
        let w = Weighing {
            layout: &layout,
            args: &args,
            seq: 256,
            accum: 1,
            device: &h100,
            world: 16,
            pipeline: None,
            async_tp: false,
            float8_params: 0.0,
        };
        assert_eq!(w.link(8), h100.intra);
        assert_eq!(w.link(16), h100.inter);
    }

    /// Tokens per second of the debug model's PP 2 (× FSDP `shard`) with `schedule` over a local
    /// batch of 8 in microbatches of `rows`, on a 2-core host whose in-step hand-offs cost 4 ms.
    fn pipeline_tokens_per_s(schedule: &'static str, shard: usize, rows: usize) -> f64 {
        use crate::comm::shape_group::ShapeGroup;
        use crate::parallel::pipeline::plan::PipelineOptions;
        let args = crate::model::families::llama3::flavor("debugmodel").unwrap();
        let mut cpu = gpu("h100").unwrap();
        (cpu.cores, cpu.overlaps, cpu.per_node) = (2, false, usize::MAX);
        cpu.compute.flops_per_s = 9e10;
        cpu.step_alpha_s = 0.004;
        let options = PipelineOptions {
            pipeline_parallel_schedule: schedule,
            pipeline_parallel_schedule_csv: "",
            pipeline_parallel_microbatch_size: rows,
            pipeline_parallel_layers_per_stage: -1,
            pipeline_parallel_split_points: &[],
            local_batch_size: 8,
        };
        let group = std::sync::Arc::new(ShapeGroup::new("pp", 0, 2));
        let plan = PipelinePlan::new(&options, &args, group).unwrap();
        let layout = Layout {
            pp: 2,
            dp_shard: shard,
            schedule: Some(schedule),
            microbatch_size: rows,
            local_batch: 8,
            ac: AcChoice::None,
            ..data_parallel(1, true)
        };
        Weighing {
            layout: &layout,
            args: &args,
            seq: 256,
            accum: 1,
            device: &cpu,
            world: 2 * shard,
            pipeline: Some(&plan),
            async_tp: false,
            float8_params: 0.0,
        }
        .predict()
        .tokens_per_s
    }

    #[test]
    fn schedules_differ_by_their_stage_costs_and_on_a_crowded_host_by_their_transfers() {
        let on_two = |s: &'static str| pipeline_tokens_per_s(s, 1, 1);
        // A rank per core: the looped schedules' smaller bubble wins; a "V" puts the output
        // beside the first stage's block on one rank and four blocks on the other, which the
        // other waits for (each stage costs its own share).
        assert!(on_two("Interleaved1F1B") > 1.02 * on_two("1F1B"));
        assert!(on_two("1F1B") > 1.02 * on_two("ZBVZeroBubble"));
        assert_eq!(on_two("ZBVZeroBubble"), on_two("DualPipeV"));
        // Two ranks per core (PP 2 × FSDP 2, 4 microbatches of 2): the host runs every rank's
        // work whatever the schedule, and each transfer's hand-off costs: 1F1B crosses one
        // boundary per microbatch, a "V" two, the looped schedules three.
        let on_four = |s: &'static str| pipeline_tokens_per_s(s, 2, 2);
        assert!(on_four("1F1B") > 1.03 * on_four("ZBVZeroBubble"));
        assert!(on_four("ZBVZeroBubble") > 1.03 * on_four("Interleaved1F1B"));
    }
}
