//! Turning a growing token sequence into text deltas that are always whole characters, and
//! holding back text that may turn out to be the start of a stop string.

/// Decodes a stream of token ids into text deltas.
///
/// Byte-level BPE splits multi-byte characters (Hebrew, CJK, emoji) over several tokens, and
/// SentencePiece decoders drop a leading space when a token is decoded alone. So the ids are
/// decoded together with a few tokens of context (`prefix`), and a delta is released only
/// once the decoded text grew and does not end in U+FFFD (an incomplete character).
pub struct IncrementalDecoder<F: Fn(&[u32]) -> String> {
    decode: F,
    ids: Vec<u32>,
    /// Start of the context window in `ids`.
    prefix_offset: usize,
    /// End of the text already released.
    read_offset: usize,
    /// Whether [`IncrementalDecoder::flush`] dropped an incomplete character.
    dropped_partial: bool,
}

impl<F: Fn(&[u32]) -> String> IncrementalDecoder<F> {
    /// A decoder using `decode` (ids → text), primed with `context` (e.g. the last few prompt
    /// tokens) whose text is never released.
    pub fn new(decode: F, context: &[u32]) -> Self {
        Self {
            decode,
            ids: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            dropped_partial: false,
        }
    }

    /// Adds a token; returns the text it completes (often empty: a partial character).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        let prefix = (self.decode)(&self.ids[self.prefix_offset..self.read_offset]);
        let full = (self.decode)(&self.ids[self.prefix_offset..]);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(delta) = full.strip_prefix(prefix.as_str()) {
                let delta = delta.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return delta;
            }
            // The context decoded differently once extended (a normaliser merged across
            // the boundary): release what follows the common part.
            let common = common_prefix_len(&prefix, &full);
            let delta = full[common..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return delta;
        }
        String::new()
    }

    /// Releases whatever is still held, whole characters only: when the stream ends between
    /// the tokens of one character (`max_new_tokens` cut it), those bytes would decode to
    /// U+FFFD, so they are dropped and [`IncrementalDecoder::dropped_partial`] says so.
    pub fn flush(&mut self) -> String {
        if self.read_offset == self.ids.len() {
            return String::new();
        }
        let prefix = (self.decode)(&self.ids[self.prefix_offset..self.read_offset]);
        let full = (self.decode)(&self.ids[self.prefix_offset..]);
        let common = common_prefix_len(&prefix, &full);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        let tail = &full[common..];
        let whole = tail.trim_end_matches('\u{FFFD}');
        self.dropped_partial |= whole.len() < tail.len();
        whole.to_string()
    }

    /// Whether [`IncrementalDecoder::flush`] dropped the bytes of an incomplete character.
    pub fn dropped_partial(&self) -> bool {
        self.dropped_partial
    }
}

/// Length in bytes of the common prefix of `a` and `b`, on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    let mut n = 0;
    for ((i, ca), cb) in a.char_indices().zip(b.chars()) {
        if ca != cb {
            return i;
        }
        n = i + ca.len_utf8();
    }
    n
}

/// Watches the output for stop strings. Text that could still become a stop string is held
/// back until it is clear either way, so a stop string is never shown.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What [`StopMatcher::push`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopCheck {
    /// Text that is safe to show now.
    pub release: String,
    /// The stop string found (generation should end), if any.
    pub stopped: Option<String>,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds decoded text.
    pub fn push(&mut self, text: &str) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck {
                release: text.to_string(),
                stopped: None,
            };
        }
        self.pending.push_str(text);
        // The earliest complete stop string wins.
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, s)) = found {
            let release = self.pending[..at].to_string();
            let stopped = Some(s.clone());
            self.pending.clear();
            return StopCheck { release, stopped };
        }
        // Hold back from the earliest position whose suffix starts some stop string.
        let hold = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len());
        let release = self.pending[..hold].to_string();
        self.pending.drain(..hold);
        StopCheck {
            release,
            stopped: None,
        }
    }

    /// Releases held-back text (generation ended without completing a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy byte-level "tokenizer": each id is one byte.
    fn bytes_decode(ids: &[u32]) -> String {
        let b: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
        String::from_utf8_lossy(&b).into_owned()
    }

    #[test]
    fn multibyte_characters_are_released_whole() {
        let text = "שלום 世界!";
        let mut d = IncrementalDecoder::new(bytes_decode, &[]);
        let mut out = String::new();
        for b in text.bytes() {
            let delta = d.push(b as u32);
            assert!(!delta.contains('\u{FFFD}'), "partial character released");
            out.push_str(&delta);
        }
        out.push_str(&d.flush());
        assert_eq!(out, text);
    }

    #[test]
    fn a_character_cut_at_the_end_is_dropped_not_shown_as_fffd() {
        let mut d = IncrementalDecoder::new(bytes_decode, &[]);
        let mut out = String::new();
        // "ab" then the first two bytes of "你" (E4 BD A0).
        for b in [b'a', b'b', 0xE4, 0xBD] {
            out.push_str(&d.push(b as u32));
        }
        out.push_str(&d.flush());
        assert_eq!(out, "ab");
        assert!(d.dropped_partial());
    }

    #[test]
    fn context_is_not_released() {
        let mut d = IncrementalDecoder::new(bytes_decode, &[b'a' as u32, b'b' as u32]);
        assert_eq!(d.push(b'c' as u32), "c");
    }

    #[test]
    fn stop_string_is_held_back_and_cut() {
        let mut m = StopMatcher::new(&["\nUser:".to_string()]);
        assert_eq!(m.push("Hello").release, "Hello");
        let c = m.push(" world\nUs");
        assert_eq!(c.release, " world");
        assert_eq!(c.stopped, None);
        let c = m.push("er: hi");
        assert_eq!(c.release, "");
        assert_eq!(c.stopped.as_deref(), Some("\nUser:"));
    }

    #[test]
    fn false_alarm_is_released() {
        let mut m = StopMatcher::new(&["END".to_string()]);
        assert_eq!(m.push("the E").release, "the ");
        assert_eq!(m.push("ND").stopped.as_deref(), Some("END"));
        let mut m = StopMatcher::new(&["END".to_string()]);
        assert_eq!(m.push("the E").release, "the ");
        assert_eq!(m.push("ast").release, "East");
        assert_eq!(m.push("E").release, "");
        assert_eq!(m.flush(), "E");
    }
}
