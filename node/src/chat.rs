//! Text for people: tokenizers, chat formats and their stop tokens.
//!
//! Owns: [`tokenizer`] (byte-level BPE from a model folder's `tokenizer.json`, exact for
//! o200k_harmony and Qwen2/Qwen3), [`harmony`] (GPT-OSS's Harmony format: render a
//! conversation to ids, parse generated ids back into messages with channels) and [`chatml`]
//! (Qwen3's ChatML template). Special-token ids always come from the tokenizer by name.
//!
//! Non-goals here: sessions, KV reuse, sampling (in `stormo_engine::sampling`), servers.

pub mod chatml;
pub mod harmony;
pub mod tokenizer;

pub use tokenizer::{DecodeError, EncodeError, LoadError, StreamDecoder, TokenId, Tokenizer};
