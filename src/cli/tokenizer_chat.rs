//! `titan tokenizer chat`: each row of a chat JSONL file as training will see it, rendered with the
//! tokenizer's chat template, its ids and which of them are the assistant's (the targets that
//! count), so a template can be checked before training.

use std::path::Path;

use anyhow::Result;

use crate::data::chat::{chat_rows, encode_chat, parse_row, ChatTemplate};
use crate::data::tokenizer::{HfTokenizer, Tokenizer};

/// `tokenizer`: a `tokenizer.json` or the folder holding it.
pub fn run(tokenizer: &Path, input: &Path, json: bool) -> Result<()> {
    let file = match tokenizer.is_dir() {
        true => tokenizer.join("tokenizer.json"),
        false => tokenizer.to_path_buf(),
    };
    let tok = HfTokenizer::from_file(&file)?;
    let template = ChatTemplate::beside(&file)?;
    let mut rows = chat_rows(input)?;
    while let Some(line) = rows.next_document()? {
        let at = rows.last_position().unwrap_or_default();
        let messages = parse_row(&line, &at)?;
        let tokens = encode_chat(&template, &tok, &messages, &at)?;
        if json {
            let row = serde_json::json!({
                "row": at,
                "text": template.render(&messages, false)?,
                "ids": tokens.ids,
                "assistant_mask": tokens.assistant_mask,
            });
            outln!("{row}");
            continue;
        }
        let counted = tokens.assistant_mask.iter().filter(|&&m| m == 1).count();
        outln!(
            "{at}: {} tokens, {counted} of them the assistant's",
            tokens.ids.len()
        );
        let assistant: Vec<u32> = tokens
            .ids
            .iter()
            .zip(&tokens.assistant_mask)
            .filter(|(_, &m)| m == 1)
            .map(|(&t, _)| t)
            .collect();
        outln!("  all:       {:?}", tok.decode(&tokens.ids)?);
        outln!("  assistant: {:?}", tok.decode(&assistant)?);
    }
    Ok(())
}
