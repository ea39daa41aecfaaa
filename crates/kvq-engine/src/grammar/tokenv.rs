//! The token environment llguidance computes masks over: every token id's bytes in a trie built
//! from kvq's own `Tokenizer` (byte-level BPE, SentencePiece byte fallback), special tokens
//! marked so grammar text can never produce them, and tokenization through the same tokenizer.

use kvq_models::Tokenizer;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use std::sync::Arc;

/// A `TokenizerEnv` over a kvq tokenizer.
pub(crate) struct KvqTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl KvqTokEnv {
    /// Builds the trie: token `id`'s entry is the bytes it decodes to, or for a special
    /// token, llguidance's marker byte followed by its text (so only a grammar naming it
    /// explicitly can allow it). Ids the vocabulary skips get no bytes.
    pub(crate) fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, String> {
        let vocab = tokenizer.vocab_size();
        let eos = tokenizer.eos_token_ids().to_vec();
        let Some(&first_eos) = eos.first() else {
            return Err("the tokenizer names no end-of-sequence token".into());
        };
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.id_to_token(id) {
                None => Vec::new(),
                Some(text) if tokenizer.is_special(id) || eos.contains(&id) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(text.as_bytes());
                    w
                }
                Some(_) => tokenizer.token_bytes(id),
            })
            .collect();
        let mut info = TokRxInfo::new(vocab as u32, first_eos);
        info.tok_bos = tokenizer.bos_token_id();
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        Ok(Self { trie, tokenizer })
    }
}

impl TokenizerEnv for KvqTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}
