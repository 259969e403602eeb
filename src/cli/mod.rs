//! The `titan` command: argument parsing and dispatch to the subcommands.

pub mod bench;
pub mod bench_attention;
mod bench_report;
pub mod cuda;
pub mod generate;
pub mod lighthouse;
pub mod pipeline;
pub mod plan;
pub mod plot;
mod tokenizer_chat;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "titan",
    version,
    about = "Rust-native LLM pretraining (Llama 3), the counterpart of TorchTitan"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a model. With no arguments: the Llama 3 debug model on the built-in corpus, on CPU.
    Train {
        /// A TOML job config (TorchTitan section and key names); defaults to configs/debug_model.toml.
        #[arg(long)]
        config: Option<PathBuf>,
        /// No progress bar or per-step lines (metrics.jsonl is still written).
        #[arg(long)]
        quiet: bool,
        /// Worker processes to start on this node (one rank each); 1 trains in this process.
        #[arg(long, default_value_t = 1)]
        nproc: usize,
        /// Nodes in the job (run the same command on each, with its --node-rank), or MIN:MAX for an
        /// elastic job that goes on with the nodes present (node 0, which hosts the store, must stay);
        /// N:N keeps N nodes and lets a node whose launcher was restarted rejoin.
        #[arg(long, default_value = "1", value_parser = parse_nnodes)]
        nnodes: NodeCount,
        /// Elastic jobs: how long node 0 waits for more than MIN nodes before each generation.
        #[arg(long, default_value_t = 60)]
        rdzv_timeout: u64,
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Address of node 0, where the rendezvous store runs.
        #[arg(long, default_value = "127.0.0.1")]
        master_addr: String,
        /// The rendezvous store's port on node 0. One node: any free port the system picks
        /// unless given; several nodes: 29500 unless given (every node must name the same).
        #[arg(long)]
        master_port: Option<u16>,
        /// Restart the whole group this many times after a rank fails (resuming from the latest checkpoint).
        #[arg(long, default_value_t = 0)]
        max_restarts: usize,
        /// A file (mode 0600) holding the job secret, 64 hex digits, the same on every node: only
        /// processes that hold it join the job. One node draws a fresh one when it is not given.
        #[arg(long)]
        job_secret_file: Option<PathBuf>,
        /// Lay each generation's ranks out as `titan plan` ranks them best for its world size (an
        /// elastic job re-plans when nodes leave or join; this host's CPU calibration).
        #[arg(long)]
        replan: bool,
        /// Overrides: --section.key VALUE (e.g. --training.steps 50 --model.flavor 8B).
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "--section.key VALUE"
        )]
        overrides: Vec<String>,
    },
    /// Sample text from a trained checkpoint (KV cache; temperature 0 is greedy).
    Generate(generate::GenerateArgs),
    /// Convert checkpoints to and from Hugging Face Llama safetensors.
    Convert {
        #[command(subcommand)]
        direction: ConvertCommand,
    },
    /// Tokenizer tools.
    Tokenizer {
        #[command(subcommand)]
        action: TokenizerCommand,
    },
    /// The CUDA backend: library check, NVRTC build of the kernels, CUDA-vs-CPU check.
    Cuda {
        #[command(subcommand)]
        action: cuda::CudaCommand,
    },
    /// Draw loss (with validation loss), grad norm and tokens/s against steps from metrics.jsonl
    /// files, one run or several side by side, as an SVG.
    Plot(plot::PlotArgs),
    /// The fault-tolerance lighthouse: replica groups (`[fault_tolerance]`) agree on each step's
    /// quorum through it.
    Lighthouse(lighthouse::LighthouseArgs),
    /// The fastest layout that fits: enumerates the layouts of a job over --ngpu GPUs of a kind
    /// (or --nproc CPU ranks here), drops those the memory estimate refuses, ranks the rest by a
    /// cost model (docs/plan.md) and prints the best, with its TOML.
    Plan(plan::PlanArgs),
    /// Pipeline schedules: print and draw one.
    Pipeline {
        #[command(subcommand)]
        what: PipelineCommand,
    },
    /// Tools for a run that went wrong.
    Debug {
        #[command(subcommand)]
        what: DebugCommand,
    },
    /// Benchmarks (not tests): print throughput, GFLOP/s and memory.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Subcommand, Debug)]
pub enum ConvertCommand {
    /// titan checkpoint → HF folder (model.safetensors + config.json), loadable by `transformers`.
    HfExport {
        checkpoint: PathBuf,
        out_dir: PathBuf,
        /// Storage dtype of the exported weights: float32 or bfloat16.
        #[arg(long, default_value = "float32")]
        dtype: String,
    },
    /// A LoRA checkpoint's adapters → Hugging Face PEFT folder (adapter_model.safetensors +
    /// adapter_config.json), for `peft.PeftModel.from_pretrained` on the base model.
    PeftExport {
        checkpoint: PathBuf,
        out_dir: PathBuf,
    },
    /// HF Llama folder (config.json + *.safetensors) → titan checkpoint (step-0, fresh optimizer state).
    HfImport {
        hf_dir: PathBuf,
        out_checkpoint_dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
pub enum PipelineCommand {
    /// Each rank's actions, the timeline under unit costs and the bubble fraction of a schedule
    /// (`--svg FILE` draws it).
    Show(pipeline::ShowArgs),
}

#[derive(Subcommand, Debug)]
pub enum DebugCommand {
    /// Read every rank's flight recorder dump (`{dump_folder}/comm_traces`) and say which ranks
    /// never entered which collective, which disagree on one, and which rank died first.
    FlightRecorder {
        /// The folder holding the `rank_{r}.json` dumps.
        dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
pub enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer (HF tokenizer.json) from text, JSONL or a folder of them.
    Train {
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        vocab_size: usize,
        #[arg(long)]
        output: PathBuf,
    },
    /// Each row of a chat JSONL as training sees it: rendered with the tokenizer's chat template,
    /// its ids, and which are the assistant's (`assistant_mask`: 1 on the tokens that count).
    Chat {
        /// A Hugging Face tokenizer.json, or the folder holding it (and its chat template).
        #[arg(long)]
        tokenizer: PathBuf,
        /// Chat rows: `messages` (role, content) or `prompt`/`response`, one JSON object a line.
        #[arg(long)]
        input: PathBuf,
        /// One JSON object a row: `row`, `text`, `ids`, `assistant_mask`.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Train steps on synthetic tokens; median tokens/s, GFLOP/s and peak memory after warm-up.
    Train(bench::BenchTrainArgs),
    /// Bus bandwidth of all-reduce, all-gather and reduce-scatter across local ranks.
    Comm(bench::BenchCommArgs),
    /// Causal attention alone, forward and backward: median ms and TFLOP/s (FlashAttention's count).
    Attention(bench_attention::BenchAttentionArgs),
    /// fp32 GEMM GFLOP/s of the CPU backend for the model's shapes (the ceiling for `bench train`).
    Gemm {
        /// CPU threads (0: every core).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Extra shapes as MxKxN, optionally :TT for op(A), op(B) with T = n or t (repeatable).
        #[arg(long)]
        shape: Vec<String>,
    },
}

/// The command line with every `--section.key VALUE` (or `--section.key=VALUE`) override moved
/// after the other arguments, so that flags and overrides may come in any order: clap reads the
/// subcommand's own flags first and hands the overrides over as its trailing arguments. An
/// override is a `--` argument whose name holds a dot; its value is the next argument.
pub fn overrides_last(args: Vec<String>) -> Vec<String> {
    let mut rest = Vec::with_capacity(args.len());
    let mut overrides = Vec::new();
    let mut it = args.into_iter();
    if let Some(program) = it.next() {
        rest.push(program);
    }
    while let Some(arg) = it.next() {
        let name = arg
            .strip_prefix("--")
            .map(|a| a.split('=').next().unwrap_or(a));
        match name {
            // `--` ends the options: what follows stays where it is.
            Some("") => {
                rest.push(arg);
                rest.extend(it.by_ref());
            }
            Some(n) if n.contains('.') => {
                let has_value = arg.contains('=');
                overrides.push(arg);
                if !has_value {
                    overrides.extend(it.next());
                }
            }
            _ => rest.push(arg),
        }
    }
    rest.extend(overrides);
    rest
}

/// `--nnodes`: `N` nodes (a fixed job), or `MIN:MAX` (elastic: nodes meet at each generation's
/// rendezvous, so a node that fails may leave and one that is restarted rejoins; `N:N` keeps the
/// size fixed while letting a restarted node back in).
#[derive(Debug, Clone, Copy)]
pub struct NodeCount {
    min: usize,
    max: usize,
    elastic: bool,
}

/// `--nnodes N` or `MIN:MAX` (1 ≤ MIN ≤ MAX).
fn parse_nnodes(s: &str) -> std::result::Result<NodeCount, String> {
    let count = |v: &str| {
        v.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| (1..=1 << 16).contains(&n))
            .ok_or_else(|| format!("`{v}` is not a node count from 1 to 65536"))
    };
    match s.split_once(':') {
        None => count(s).map(|n| NodeCount {
            min: n,
            max: n,
            elastic: false,
        }),
        Some((min, max)) => {
            let (min, max) = (count(min)?, count(max)?);
            if min > max {
                return Err(format!("MIN {min} is above MAX {max} (expected MIN:MAX)"));
            }
            Ok(NodeCount {
                min,
                max,
                elastic: true,
            })
        }
    }
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train {
            config,
            quiet,
            nproc,
            nnodes:
                NodeCount {
                    min: min_nodes,
                    max: nnodes,
                    elastic,
                },
            rdzv_timeout,
            node_rank,
            master_addr,
            master_port,
            max_restarts,
            job_secret_file,
            replan,
            overrides,
        } => {
            let cfg = crate::config::Config::load(config.as_deref(), &overrides)?;
            let replan = match replan {
                true => Some(crate::plan::replanner(
                    &cfg,
                    config.clone(),
                    overrides.clone(),
                    nproc,
                )?),
                false => None,
            };
            if nproc * nnodes > 1 {
                // Refuse a mesh the workers would refuse, before starting any of them (an elastic
                // job's at every size it may take: fixed degrees that fit one size only are
                // named now, not when a node leaves).
                for n in (min_nodes..=nnodes).filter(|_| replan.is_none()) {
                    crate::launch::check_mesh(&cfg, nproc * n).map_err(|e| match min_nodes < nnodes {
                        true => anyhow::anyhow!("--nnodes {min_nodes}:{nnodes}: the layout must fit every node count, and at {n} node(s) ({} ranks): {e:#}; leave the degree that absorbs the change at -1 (e.g. data_parallel_shard_degree)", nproc * n),
                        false => e,
                    })?;
                }
                let mut worker_args = vec!["train".to_string()];
                if let Some(c) = &config {
                    worker_args.extend(["--config".to_string(), c.display().to_string()]);
                }
                if quiet {
                    worker_args.push("--quiet".into());
                }
                worker_args.extend(overrides);
                let o = crate::launch::launcher::LaunchOptions {
                    nproc,
                    nnodes,
                    node_rank,
                    elastic: (elastic && nnodes > 1).then_some(
                        crate::launch::rendezvous::Elastic {
                            min_nodes,
                            max_nodes: nnodes,
                            timeout: std::time::Duration::from_secs(rdzv_timeout),
                        },
                    ),
                    master_addr,
                    master_port: master_port.unwrap_or(if nnodes > 1 { 29500 } else { 0 }),
                    max_restarts,
                    worker_args,
                    rank0_stdout_plain: false,
                    secret: crate::launch::secret::for_launcher(
                        job_secret_file.as_deref(),
                        nnodes,
                        cfg.comm.insecure_no_auth,
                    )?,
                    init_timeout: std::time::Duration::from_secs(cfg.comm.init_timeout_seconds),
                    replan,
                };
                return crate::launch::launcher::launch(&o);
            }
            if let Some(file) = &job_secret_file {
                // One process reads its secret (the lighthouse's, under fault tolerance) where a
                // launched worker does; set here, before any thread starts. Read now, so a bad
                // file is refused before training.
                crate::comm::auth::JobSecret::from_file(file)?;
                std::env::set_var(crate::comm::auth::SECRET_FILE_ENV, file);
            }
            crate::train::train(
                &cfg,
                &crate::train::RunOptions {
                    quiet,
                    stop_after: None,
                },
            )?;
            Ok(())
        }
        Command::Generate(args) => generate::run(&args),
        Command::Plot(args) => plot::run(&args),
        Command::Lighthouse(args) => lighthouse::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Pipeline {
            what: PipelineCommand::Show(args),
        } => pipeline::show(&args),
        Command::Debug {
            what: DebugCommand::FlightRecorder { dir },
        } => {
            let dumps = crate::comm::flight_recorder::read_dumps(&dir)?;
            outln!("{}", crate::comm::flight_recorder::analyze(&dumps));
            Ok(())
        }
        Command::Convert { direction } => match direction {
            ConvertCommand::HfExport {
                checkpoint,
                out_dir,
                dtype,
            } => crate::checkpoint::hf::export(
                &checkpoint,
                &out_dir,
                crate::tensor::DType::parse(&dtype)?,
            ),
            ConvertCommand::PeftExport {
                checkpoint,
                out_dir,
            } => crate::checkpoint::peft::export(&checkpoint, &out_dir),
            ConvertCommand::HfImport {
                hf_dir,
                out_checkpoint_dir,
            } => crate::checkpoint::hf::import(&hf_dir, &out_checkpoint_dir),
        },
        Command::Tokenizer { action } => match action {
            TokenizerCommand::Train {
                input,
                vocab_size,
                output,
            } => crate::data::bpe::train_bpe(&input, vocab_size, &output),
            TokenizerCommand::Chat {
                tokenizer,
                input,
                json,
            } => tokenizer_chat::run(&tokenizer, &input, json),
        },
        Command::Cuda { action } => cuda::run(&action),
        Command::Bench { what } => match what {
            BenchCommand::Train(args) => bench::run_train(&args),
            BenchCommand::Gemm { threads, shape } => bench::run_gemm(threads, &shape),
            BenchCommand::Comm(args) => bench::run_comm(&args),
            BenchCommand::Attention(args) => bench_attention::run_attention(&args),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn overrides_move_after_the_flags() {
        assert_eq!(
            overrides_last(args(
                "titan train --training.steps 5 --nproc 2 --model.flavor=1B --quiet"
            )),
            args("titan train --nproc 2 --quiet --training.steps 5 --model.flavor=1B")
        );
        // Values with dots stay with their flags; a negative value stays with its override.
        assert_eq!(
            overrides_last(args(
                "titan train --checkpoint.load_step -1 --config a.toml --master-addr 10.0.0.1"
            )),
            args("titan train --config a.toml --master-addr 10.0.0.1 --checkpoint.load_step -1")
        );
    }

    #[test]
    fn every_subcommand_parses_flags_after_overrides() {
        let cli = Cli::try_parse_from(overrides_last(args(
            "titan train --training.steps 5 --nproc 2 --max-restarts 1",
        )))
        .unwrap();
        match cli.command {
            Command::Train {
                nproc,
                max_restarts,
                overrides,
                ..
            } => {
                assert_eq!((nproc, max_restarts), (2, 1));
                assert_eq!(overrides, args("--training.steps 5"));
            }
            other => panic!("{other:?}"),
        }
        let cli = Cli::try_parse_from(overrides_last(args(
            "titan bench train --parallelism.tensor_parallel_degree 2 --nproc 2 --json",
        )))
        .unwrap();
        match cli.command {
            Command::Bench {
                what: BenchCommand::Train(a),
            } => {
                assert!(a.json && a.nproc == 2);
                assert_eq!(a.overrides, args("--parallelism.tensor_parallel_degree 2"));
            }
            other => panic!("{other:?}"),
        }
    }
}
