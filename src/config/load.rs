//! Reading a job: the TOML file (or the embedded defaults), `--section.key value` overrides on
//! top, then deserialization and validation, every error naming the file and the overrides.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;

use super::Config;

/// The embedded default job (kept identical to `configs/debug_model.toml`, which a test checks).
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../configs/debug_model.toml");

impl Config {
    /// Reads `path` (or the built-in defaults when `None`) and applies `--section.key value` overrides.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Config> {
        let (source, text) = match path {
            Some(p) => (
                p.display().to_string(),
                std::fs::read_to_string(p)
                    .with_context(|| format!("cannot read config file {}", p.display()))?,
            ),
            None => (
                "built-in defaults (configs/debug_model.toml)".to_string(),
                DEFAULT_CONFIG_TOML.to_string(),
            ),
        };
        let mut table: toml::Table =
            toml::from_str(&text).map_err(|e| anyhow!("config {source}: {e}"))?;
        let pairs = parse_overrides(overrides)?;
        apply_overrides(&mut table, &pairs)?;
        rename_deprecated_keys(&mut table).map_err(|e| anyhow!("config {source}: {e}"))?;
        let with = if pairs.is_empty() {
            String::new()
        } else {
            format!(
                " with overrides {}",
                pairs
                    .iter()
                    .map(|(s, k, _)| format!("--{s}.{k}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        };
        let cfg: Config = Config::deserialize(toml::Value::Table(table))
            .map_err(|e| anyhow!("config {source}{with}: {e}"))?;
        cfg.validate()
            .map_err(|e| anyhow!("config {source}{with}: {e}"))?;
        Ok(cfg)
    }
}

/// Keys TorchTitan renamed, read under their new names with a warning: `(section, old, new)`.
const RENAMED_KEYS: &[(&str, &str, &str)] = &[("validation", "enabled", "enable")];

/// Moves each renamed key of `table` to its new name, warning; both names given is an error
/// unless they agree.
fn rename_deprecated_keys(table: &mut toml::Table) -> Result<()> {
    for &(section, old, new) in RENAMED_KEYS {
        let Some(toml::Value::Table(t)) = table.get_mut(section) else {
            continue;
        };
        let Some(value) = t.remove(old) else {
            continue;
        };
        match t.get(new) {
            Some(current) if *current != value => bail!(
                "[{section}] sets both `{new}` = {current} and its old name `{old}` = {value}; keep `{new}`"
            ),
            _ => {
                errln!("warning: [{section}] `{old}` is TorchTitan's old name of `{new}`; read as `{new}` (rename it)");
                t.insert(new.to_string(), value);
            }
        }
    }
    Ok(())
}

/// Sets each `(section, key, value)` in `table`, adding the section where the file has none; a
/// section may be nested (`quantize.linear.float8`).
fn apply_overrides(table: &mut toml::Table, pairs: &[(String, String, toml::Value)]) -> Result<()> {
    for (section, key, value) in pairs {
        let mut t = &mut *table;
        for part in section.split('.') {
            let entry = t
                .entry(part.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            t = match entry {
                toml::Value::Table(inner) => inner,
                _ => bail!("override --{section}.{key}: `{part}` is not a section"),
            };
        }
        t.insert(key.clone(), value.clone());
    }
    Ok(())
}

/// Splits `--section.key value` / `--section.key=value` pairs; values parse as TOML (number, bool,
/// string, array), falling back to a plain string.
pub fn parse_overrides(args: &[String]) -> Result<Vec<(String, String, toml::Value)>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        let Some(flag) = arg.strip_prefix("--") else {
            bail!("unexpected argument `{arg}`: overrides look like --section.key value");
        };
        let (name, value) = match flag.split_once('=') {
            Some((n, v)) => (n.to_string(), v.to_string()),
            None => {
                let v = args
                    .get(i + 1)
                    .ok_or_else(|| anyhow!("override --{flag} needs a value"))?;
                i += 1;
                (flag.to_string(), v.clone())
            }
        };
        let Some((section, key)) = name.rsplit_once('.') else {
            bail!("override --{name} must name a section and a key, like --training.steps 100");
        };
        let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or(toml::Value::String(value.clone()));
        out.push((section.to_string(), key.to_string(), parsed));
        i += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn embedded_defaults_equal_the_rust_defaults() {
        assert_eq!(Config::load(None, &[]).unwrap(), Config::default());
    }

    #[test]
    fn validations_old_key_enabled_reads_as_enable_and_a_conflict_is_refused() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let old = Config::load(None, &args(&["--validation.enabled", "true"])).unwrap();
        assert!(old.validation.enable);
        let both = [
            "--validation.enabled",
            "true",
            "--validation.enable",
            "true",
        ];
        assert!(Config::load(None, &args(&both)).unwrap().validation.enable);
        let clash = [
            "--validation.enabled",
            "false",
            "--validation.enable",
            "true",
        ];
        let err = Config::load(None, &args(&clash)).unwrap_err().to_string();
        assert!(err.contains("keep `enable`"), "{err}");
    }

    #[test]
    fn overrides_apply_with_types() {
        let args: Vec<String> = [
            "--training.steps",
            "7",
            "--model.flavor=8B",
            "--job.dump_folder",
            "/tmp/x",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let c = Config::load(None, &args).unwrap();
        assert_eq!(c.training.steps, 7);
        assert_eq!(c.model.flavor, "8B");
        assert_eq!(c.job.dump_folder, "/tmp/x");
    }

    #[test]
    fn unknown_key_names_the_key_and_accepted_ones() {
        let e = Config::load(None, &["--training.stepz".into(), "3".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("stepz") && e.contains("steps") && e.contains("--training.stepz"),
            "{e}"
        );
        let e = Config::load(None, &["--trainin.steps".into(), "3".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("trainin") && e.contains("training"), "{e}");
    }

    #[test]
    fn invalid_values_name_the_key() {
        let cases = [
            (vec!["--lr_scheduler.decay_type", "exp"], "cosine"),
            (vec!["--training.steps", "-3"], "steps"),
            (
                vec![
                    "--training.global_batch_size",
                    "12",
                    "--training.local_batch_size",
                    "8",
                ],
                "global_batch_size",
            ),
            (vec!["--training.dataset", "c5"], "synthetic"),
            (vec!["--model.flavor", "7B"], "405B"),
            (vec!["--training.device", "tpu"], "cuda"),
            (vec!["--optimizer.lr", "\"fast\""], "lr"),
        ];
        for (args, needle) in cases {
            let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
            let e = Config::load(None, &args).unwrap_err().to_string();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
    }

    #[test]
    fn malformed_file_names_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, "[training]\nsteps = 10\nseq_len = = 4\n").unwrap();
        let e = Config::load(Some(&p), &[]).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("line 3"), "{e}");
    }
}
