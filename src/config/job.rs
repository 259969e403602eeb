//! `[job]`: the run's name and its dump folder, under which every other output (checkpoints,
//! traces, metrics) is written.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Config;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobConfig {
    pub dump_folder: String,
    pub description: String,
}

impl Default for JobConfig {
    fn default() -> Self {
        JobConfig {
            dump_folder: "./outputs".into(),
            description: "Llama 3 debug model on the built-in corpus".into(),
        }
    }
}

impl Config {
    pub fn dump_folder(&self) -> PathBuf {
        PathBuf::from(&self.job.dump_folder)
    }
}
