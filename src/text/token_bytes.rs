//! The bytes a token id stands for.
//!
//! Decoding one token alone loses them: a token holding half of "ש" decodes to U+FFFD or
//! to nothing. So the bytes are read from the token's vocabulary string, undoing the
//! tokenizer's own encoding of bytes:
//! * byte-level BPE (GPT-2 style) writes every byte as a printable character (`Ġ` for a
//!   space, `×©` for the bytes D7 A9);
//! * SentencePiece byte fallback writes a lone byte as `<0xD7>` and a space as `▁`;
//! * added tokens (`<|im_start|>`) are their text.

use std::collections::{HashMap, HashSet};
use tokenizers::Tokenizer;

/// The bytes of each of `ids` (empty for an id outside the vocabulary).
pub fn token_bytes(tokenizer: &Tokenizer, ids: &[u32]) -> Vec<Vec<u8>> {
    let byte_level = uses_byte_level(tokenizer);
    let added: HashSet<u32> = tokenizer
        .get_added_tokens_decoder()
        .keys()
        .copied()
        .collect();
    let table = byte_level.then(unicode_to_byte);
    ids.iter()
        .map(|&id| {
            let Some(piece) = tokenizer.id_to_token(id) else {
                return Vec::new();
            };
            if added.contains(&id) {
                return piece.into_bytes();
            }
            match &table {
                Some(t) => byte_level_bytes(&piece, t),
                None => sentencepiece_bytes(&piece),
            }
        })
        .collect()
}

/// Whether the tokenizer's decoder (or one in its sequence) is byte-level.
fn uses_byte_level(tokenizer: &Tokenizer) -> bool {
    tokenizer
        .get_decoder()
        .and_then(|d| serde_json::to_string(d).ok())
        .is_some_and(|json| json.contains("\"ByteLevel\""))
}

/// GPT-2's `bytes_to_unicode`, inverted: printable bytes stand for themselves, the others
/// (controls, space, 0x7F–0xA0, 0xAD) for U+0100 onwards in byte order.
fn unicode_to_byte() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = HashMap::with_capacity(256);
    let mut next = 256u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        };
        table.insert(c, b);
    }
    table
}

/// A byte-level vocabulary string back to bytes; a character outside the byte alphabet
/// (a hand-added token) is kept as its UTF-8.
fn byte_level_bytes(piece: &str, table: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(piece.len());
    for c in piece.chars() {
        match table.get(&c) {
            Some(&b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

/// A SentencePiece vocabulary string back to bytes: `<0xHH>` is one byte, `▁` a space.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    let hex = piece
        .strip_prefix("<0x")
        .and_then(|h| h.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        .and_then(|h| u8::from_str_radix(h, 16).ok());
    match hex {
        Some(b) => vec![b],
        None => piece.replace('▁', " ").into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_round_trips() {
        let t = unicode_to_byte();
        assert_eq!(t.len(), 256);
        assert_eq!(byte_level_bytes("Ġthe", &t), b" the");
        assert_eq!(byte_level_bytes("×©", &t), [0xD7, 0xA9]);
        assert_eq!(byte_level_bytes("Ċ", &t), b"\n");
    }

    #[test]
    fn sentencepiece_byte_fallback() {
        assert_eq!(sentencepiece_bytes("<0xD7>"), [0xD7]);
        assert_eq!(sentencepiece_bytes("▁שלום"), " שלום".as_bytes());
        assert_eq!(sentencepiece_bytes("<0xZZ>"), b"<0xZZ>");
    }
}
