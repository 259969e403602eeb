//! A LoRA run's adapters in Hugging Face PEFT's format: `adapter_model.safetensors` (each factor
//! under its base linear's transformers name, `base_model.model.{module}.lora_A.weight` and
//! `lora_B.weight`) and `adapter_config.json` (`peft_type` LORA, `r`, `lora_alpha`, the adapted
//! modules), which `peft.PeftModel.from_pretrained` puts on the base model it came from. The
//! factors keep titan's values; `B` of the q and k projections takes the same row permutation as
//! their weights (titan's interleaved RoPE pairs against transformers' halves, `hf`).

use std::path::Path;

use anyhow::{anyhow, Result};
use serde_json::json;

use super::hf::{write_atomic, write_folder_file};
use crate::backend::cpu::CpuBackend;
use crate::model::families;
use crate::model::lora::{base_of, LORA_A};
use crate::tensor::Tensor;

/// Writes the adapters of the LoRA checkpoint `checkpoint` into `out_dir` in PEFT's format.
pub fn export(checkpoint: &Path, out_dir: &Path) -> Result<()> {
    let be = CpuBackend::new();
    let dir = super::resolve_checkpoint_dir(checkpoint)?;
    let (args, params) = super::load_weights(&be, &dir)?;
    let lora = args.lora.clone().ok_or_else(|| {
        anyhow!(
            "{}: not a LoRA checkpoint (its run did not name `lora` in [model] converters); `convert hf-export` writes the whole model",
            dir.display()
        )
    })?;
    let family = families::of_args(&args)?;
    let mut tensors = Vec::new();
    let mut modules = Vec::new();
    for ((name, shape), buf) in params.names.iter().zip(&params.shapes).zip(&params.bufs) {
        let Some(base) = base_of(name) else {
            continue;
        };
        let hf_base = family.hf_name(&args, &base);
        let module = hf_base
            .strip_suffix(".weight")
            .expect("a linear's weight")
            .to_string();
        let factor_a = name.ends_with(LORA_A);
        // `A` is `[rank, in]`: its rows are not the projection's. `B`'s rows are.
        let data = match factor_a {
            true => buf.clone(),
            false => family.export_rows(&args, &base, buf, lora.rank),
        };
        let factor = if factor_a { "lora_A" } else { "lora_B" };
        tensors.push((
            format!("base_model.model.{module}.{factor}.weight"),
            Tensor::from_f32(shape.clone(), data),
        ));
        if factor_a {
            modules.push(module);
        }
    }
    write_folder_file(out_dir, "adapter_model.safetensors", &tensors)?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "base_model_name_or_path": null,
        "modules_to_save": null,
        // Whole module names: exactly the adapted linears (a last name such as `gate_proj`
        // would also match a mixture of experts' unadapted experts).
        "target_modules": modules,
    });
    write_atomic(
        &out_dir.join("adapter_config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    outln!(
        "exported the LoRA adapters of {} to {} ({} linears, rank {}, alpha {}; load them with peft.PeftModel.from_pretrained on the base model)",
        dir.display(),
        out_dir.display(),
        modules.len(),
        lora.rank,
        lora.alpha
    );
    Ok(())
}
