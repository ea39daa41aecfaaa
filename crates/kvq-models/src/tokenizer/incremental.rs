//! Streaming detokenization: turns generated ids into text chunks that never split a UTF-8 character.

use std::sync::Arc;

use super::Tokenizer;
use crate::Result;

/// Decodes a stream of token ids piece by piece.
///
/// Uses the prefix-window technique of text-generation-inference: keep the ids since the last
/// emitted boundary (`prefix_offset..read_offset` already emitted, `read_offset..` pending),
/// decode the window with and without the pending ids and emit the difference once it no longer
/// ends in U+FFFD (an incomplete multi-byte character). Decoding a window rather than the single
/// new id keeps decoders that look at neighbours (leading-space stripping) correct.
///
/// The concatenation of every [`push`](Self::push) result and the final [`flush`](Self::flush)
/// equals `tokenizer.decode(all_ids, skip_special)`.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    tok: Arc<Tokenizer>,
    skip_special: bool,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// A decoder with no ids yet.
    pub fn new(tok: Arc<Tokenizer>, skip_special: bool) -> Self {
        Self {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Every id pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Adds `id` and returns the text it completes (often empty while a character is incomplete).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let (prefix, text) = self.window()?;
        if text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        match text.strip_prefix(prefix.as_str()) {
            Some(new) if !new.is_empty() => {
                let new = new.to_owned();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                Ok(new)
            }
            _ => Ok(String::new()),
        }
    }

    /// Returns whatever has not been emitted yet (including U+FFFD for a dangling partial
    /// character) and starts over with no pending ids.
    pub fn flush(&mut self) -> Result<String> {
        let (prefix, text) = self.window()?;
        let rest = match text.strip_prefix(prefix.as_str()) {
            Some(rest) => rest.to_owned(),
            // A decoder whose output for the prefix is not a prefix of the longer window: fall
            // back to byte position, at a char boundary.
            None => {
                let mut cut = prefix.len().min(text.len());
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text[cut..].to_owned()
            }
        };
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(rest)
    }

    /// (decode of the emitted context, decode of context plus pending ids).
    fn window(&self) -> Result<(String, String)> {
        let prefix = self.tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let text = self
            .tok
            .decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        Ok((prefix, text))
    }
}
