//! Validation (`[validation]`): every `freq` steps, the mean token loss (and its perplexity) over
//! `steps` batches of held-out data, computed under the training's layout (`RankLayout::loss`) and
//! averaged over the data-parallel ranks. Each validation reads the same batches, from the
//! dataset's start, through a loader of its own, so the training's data position and curve are
//! untouched. A validation shape other than the training's gets its own workspace, keeping no
//! activations past each block (nothing runs backward).

use anyhow::{bail, Result};

use super::metrics::ValidationMetrics;
use crate::backend::Backend;
use crate::config::Config;
use crate::data::{load_tokenizer, DataLoader, LoaderState};
use crate::model::activation_checkpoint::AcMode;
use crate::model::{LocalShapes, ParamDtype, Workspace};
use crate::parallel::layout::RankLayout;

pub struct Validator<B: Backend> {
    loader: DataLoader,
    steps: usize,
    /// Its own workspace when the validation shape differs from the training's.
    own_workspace: Option<Workspace<B>>,
}

impl<B: Backend> Validator<B> {
    /// None when `[validation]` is off. `dp_rank`/`dp_size` split the held-out batches as the
    /// training's.
    pub fn from_config(
        be: &B,
        cfg: &Config,
        local: &LocalShapes,
        vocab: usize,
        dp_rank: usize,
        dp_size: usize,
    ) -> Result<Option<Self>> {
        if !cfg.validation.enable {
            return Ok(None);
        }
        let (batch, seq) = cfg.validation_shape();
        let tokens = batch * local.local_seq(seq);
        if !tokens.is_multiple_of(local.tp) {
            bail!("[validation] local_batch_size {batch} × seq_len {seq} / context_parallel_degree {} = {tokens} tokens do not split into tensor_parallel_degree {} equal sequence-parallel shards", local.cp, local.tp);
        }
        let tokenizer = load_tokenizer(&cfg.model.tokenizer_path)?;
        let loader = DataLoader::for_validation(cfg, tokenizer, vocab, dp_rank, dp_size)?;
        // A pipeline rank's step workspace holds one microbatch of its own stages: validation
        // runs whole batches through every block position, so it has its own.
        let pipelined = cfg.parallelism.pipeline_parallel_degree > 1;
        let own_shape = (batch, seq) != (cfg.training.local_batch_size, cfg.training.seq_len);
        let own_workspace = (own_shape || pipelined).then(|| {
            let param_dtype = ParamDtype::from_config(&cfg.training.mixed_precision_param);
            let plan = param_dtype.activation_plan(AcMode::Full, local.n_layers);
            Workspace::planned(be, local, batch, seq, plan)
        });
        Ok(Some(Validator {
            loader,
            steps: cfg.validation.steps as usize,
            own_workspace,
        }))
    }

    /// The validation after `step` (every rank of the job calls this together).
    pub fn run(
        &mut self,
        be: &B,
        layout: &mut RankLayout<B>,
        step: u64,
    ) -> Result<ValidationMetrics> {
        self.loader.restore(LoaderState::default())?;
        let batches: Vec<Vec<u32>> = (0..self.steps)
            .map(|_| self.loader.next_batch())
            .collect::<Result<_>>()?;
        // None: the training workspace (same shapes, no pipeline).
        let ws = self.own_workspace.as_mut();
        let (sum, count) = layout.loss(be, ws, &batches)?;
        let sum = layout.sum_over_batch(sum)?;
        let count = layout.sum_over_batch(count as f64)?;
        let loss = sum / count.max(1.0);
        Ok(ValidationMetrics {
            step,
            validation_loss: loss,
            validation_perplexity: loss.exp(),
        })
    }
}
