//! Chat samples for supervised fine-tuning (`[training] dataset = "chat"`): rows (JSONL lines or
//! Parquet rows) of `messages` (`role`, `content`) or a `prompt`/`response` pair, rendered with the tokenizer's own chat
//! template as transformers' `apply_chat_template` renders it, with the assistant's tokens told
//! apart from the rest so that only they count as targets.
//!
//! The template is Jinja, run by MiniJinja (a maintained engine, as transformers runs Jinja2):
//! `trim_blocks` and `lstrip_blocks` on as transformers sets them, Python's string methods
//! (`strip`, `startswith`, ...) through minijinja-contrib's `pycompat`, `raise_exception`, and the
//! tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables. It is read from
//! `chat_template.jinja` beside `tokenizer.json`, or from `tokenizer_config.json`'s
//! `chat_template` (a string, or a list of named templates of which `default` is taken).
//!
//! Which tokens are the assistant's: for each assistant turn, the conversation before it rendered
//! with the generation prompt must be a prefix of the conversation through it; the text between
//! the two is the turn (its content and its end-of-turn tokens), and the tokens whose text starts
//! inside it are the assistant's. A template for which that does not hold is refused by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use minijinja::{Environment, ErrorKind};
use serde::Serialize;

use super::documents::DocumentSource;
use super::tokenizer::Tokenizer;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The roles a row may use.
pub const ROLES: &[&str] = &["system", "user", "assistant", "tool"];

/// A row's conversation: its `messages`, or `prompt` and `response` as a user and an assistant
/// turn. `at` names the row (file and line) in errors.
pub fn parse_row(line: &str, at: &str) -> Result<Vec<Message>> {
    let row: serde_json::Value =
        serde_json::from_str(line).map_err(|e| anyhow!("{at}: not valid JSON: {e}"))?;
    let text = |v: &serde_json::Value, what: &str| -> Result<String> {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("{at}: {what} is not a string"))
    };
    let messages = match (row.get("messages"), row.get("prompt"), row.get("response")) {
        (Some(m), _, _) => {
            let list = m
                .as_array()
                .ok_or_else(|| anyhow!("{at}: `messages` is not a list"))?;
            list.iter()
                .enumerate()
                .map(|(i, m)| {
                    let field = |k: &str| {
                        let v = m.get(k).ok_or_else(|| anyhow!("{at}: messages[{i}] has no `{k}`"))?;
                        text(v, &format!("messages[{i}].{k}"))
                    };
                    Ok(Message {
                        role: field("role")?,
                        content: field("content")?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        }
        (None, Some(p), Some(r)) => vec![
            Message {
                role: "user".into(),
                content: text(p, "`prompt`")?,
            },
            Message {
                role: "assistant".into(),
                content: text(r, "`response`")?,
            },
        ],
        _ => bail!("{at}: a chat row needs `messages` (a list of `role`/`content`) or `prompt` and `response`"),
    };
    if let Some((i, m)) = messages
        .iter()
        .enumerate()
        .find(|(_, m)| !ROLES.contains(&m.role.as_str()))
    {
        bail!(
            "{at}: messages[{i}] has the unknown role `{}` (accepted: {})",
            m.role,
            ROLES.join(", ")
        );
    }
    if !messages.iter().any(|m| m.role == "assistant") {
        bail!("{at}: the conversation has no assistant turn, so nothing in it would be trained on");
    }
    Ok(messages)
}

/// The chat rows at `path`: JSONL lines, or Parquet rows (a `.parquet` file, or a folder holding
/// one), each handed on as its JSON object.
pub fn chat_rows(path: &Path) -> Result<Box<dyn DocumentSource>> {
    let parquet = |p: &Path| p.extension().is_some_and(|e| e == "parquet");
    let is_parquet = match path.is_dir() {
        true => std::fs::read_dir(path)
            .map(|d| d.flatten().any(|e| parquet(&e.path())))
            .unwrap_or(false),
        false => parquet(path),
    };
    Ok(match is_parquet {
        true => Box::new(super::parquet::ParquetSource::open_chat(path)?),
        false => Box::new(super::documents::ChatSource::open(path)?),
    })
}

/// A tokenizer's chat template, ready to render.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... of `tokenizer_config.json`.
    special_tokens: BTreeMap<String, String>,
    /// Where the template came from, for errors.
    source: PathBuf,
}

impl ChatTemplate {
    /// The template of the tokenizer at `tokenizer_json` (its folder's `chat_template.jinja` or
    /// `tokenizer_config.json`).
    pub fn beside(tokenizer_json: &Path) -> Result<Self> {
        let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", config_path.display()))?,
            Err(_) => serde_json::Value::Null,
        };
        let jinja = dir.join("chat_template.jinja");
        let (template, source) = match std::fs::read_to_string(&jinja) {
            Ok(t) => (t, jinja),
            Err(_) => (template_in_config(&config, &config_path)?, config_path),
        };
        let special_tokens = special_tokens(&config);
        Self::new(template, special_tokens, source)
    }

    fn new(
        template: String,
        special_tokens: BTreeMap<String, String>,
        source: PathBuf,
    ) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", template)
            .map_err(|e| anyhow!("chat template {}: {e:#}", source.display()))?;
        Ok(ChatTemplate {
            env,
            special_tokens,
            source,
        })
    }

    /// The conversation as the template renders it.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut context: BTreeMap<String, minijinja::Value> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), minijinja::Value::from(v.as_str())))
            .collect();
        context.insert(
            "messages".into(),
            minijinja::Value::from_serialize(messages),
        );
        context.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(add_generation_prompt),
        );
        let template = self.env.get_template("chat").expect("added in `new`");
        template
            .render(context)
            .map_err(|e| anyhow!("chat template {}: {e:#}", self.source.display()))
    }
}

/// `chat_template` of a `tokenizer_config.json`: a string, or the `default` of named ones.
fn template_in_config(config: &serde_json::Value, path: &Path) -> Result<String> {
    match config.get("chat_template") {
        Some(serde_json::Value::String(t)) => Ok(t.clone()),
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(str::to_string)
            .ok_or_else(|| anyhow!("{}: `chat_template` has no template named `default`", path.display())),
        _ => bail!("the tokenizer has no chat template: neither chat_template.jinja nor a `chat_template` in {} (chat data needs the tokenizer's template)", path.display()),
    }
}

/// The special tokens of a `tokenizer_config.json` (`*_token`: a string, or an added token's
/// `content`).
fn special_tokens(config: &serde_json::Value) -> BTreeMap<String, String> {
    let Some(fields) = config.as_object() else {
        return BTreeMap::new();
    };
    fields
        .iter()
        .filter(|(k, _)| k.ends_with("_token"))
        .filter_map(|(k, v)| {
            let text = v.as_str().or_else(|| v.get("content")?.as_str())?;
            Some((k.clone(), text.to_string()))
        })
        .collect()
}

/// A conversation's tokens and which of them are the assistant's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatTokens {
    pub ids: Vec<u32>,
    /// 1 on the assistant's tokens (those that count as targets), 0 elsewhere.
    pub assistant_mask: Vec<u8>,
}

/// Renders and tokenizes `messages` (`at` names the row in errors).
pub fn encode_chat(
    template: &ChatTemplate,
    tokenizer: &dyn Tokenizer,
    messages: &[Message],
    at: &str,
) -> Result<ChatTokens> {
    let text = template
        .render(messages, false)
        .map_err(|e| anyhow!("{at}: {e:#}"))?;
    let mut spans = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let before = template.render(&messages[..i], true)?;
        let through = template.render(&messages[..=i], false)?;
        if !through.starts_with(&before) || !text.starts_with(&through) {
            bail!("{at}: the chat template {} does not render conversations as growing prefixes, so titan cannot tell the assistant's tokens (messages[{i}])", template.source.display());
        }
        spans.push(before.len()..through.len());
    }
    let (ids, offsets) = tokenizer.encode_with_offsets(&text)?;
    let assistant_mask = offsets
        .iter()
        .map(|&(start, _)| u8::from(spans.iter().any(|s| s.contains(&start))))
        .collect();
    Ok(ChatTokens {
        ids,
        assistant_mask,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ByteTokenizer;

    /// Llama 3's template (Meta-Llama-3-8B-Instruct's tokenizer_config.json).
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    fn llama3() -> ChatTemplate {
        let special = [("bos_token".to_string(), "<|begin_of_text|>".to_string())].into();
        ChatTemplate::new(LLAMA3.into(), special, "test".into()).unwrap()
    }

    fn message(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn llama3s_template_renders_as_transformers_does_and_marks_the_assistant() {
        let chat = [message("user", " Hi "), message("assistant", "Hello!")];
        let text = llama3().render(&chat, false).unwrap();
        assert_eq!(text, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>");
        let tokens = encode_chat(&llama3(), &ByteTokenizer, &chat, "row").unwrap();
        let assistant: Vec<u8> = tokens
            .ids
            .iter()
            .zip(&tokens.assistant_mask)
            .filter(|(_, &m)| m == 1)
            .map(|(&t, _)| t as u8)
            .collect();
        assert_eq!(String::from_utf8(assistant).unwrap(), "Hello!<|eot_id|>");
    }

    #[test]
    fn rows_without_an_assistant_or_with_an_unknown_role_are_refused_by_row() {
        let err = parse_row(
            r#"{"messages": [{"role": "user", "content": "x"}]}"#,
            "f.jsonl:3",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("f.jsonl:3") && err.contains("no assistant turn"),
            "{err}"
        );
        let err = parse_row(
            r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
            "f.jsonl:4",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("unknown role `robot`"), "{err}");
        let pair = parse_row(r#"{"prompt": "a", "response": "b"}"#, "f.jsonl:5").unwrap();
        assert_eq!(pair, vec![message("user", "a"), message("assistant", "b")]);
    }

    #[test]
    fn a_template_that_fails_to_render_names_its_file() {
        let t = ChatTemplate::new(
            "{{ raise_exception('only user turns') }}".into(),
            BTreeMap::new(),
            "dir/tokenizer_config.json".into(),
        )
        .unwrap();
        let err = format!(
            "{:#}",
            t.render(&[message("user", "x")], false).unwrap_err()
        );
        assert!(
            err.contains("dir/tokenizer_config.json") && err.contains("only user turns"),
            "{err}"
        );
    }
}
