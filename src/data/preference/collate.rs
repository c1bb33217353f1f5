//! Pairs into one padded batch: the chosen sequences first, then the rejected ones, all
//! right-padded to one length, so a single forward pass scores both halves (TRL's
//! `concatenated_forward`) and the loss splits the result in two.

use super::tokenize::{PairSide, PreferencePair};
use crate::data::collate::{collate, Batch, CollateOptions};

/// Pads `pairs` into one batch of `2 × pairs.len()` rows: row `i` is pair `i`'s
/// `prompt + chosen`, row `pairs.len() + i` its `prompt + rejected`. Labels are -100 on
/// the prompt and on padding; the padded length is the longest of all rows, rounded up as
/// `opts` says (use `max_length` = `max_prompt_length + max_completion_length`).
pub fn collate_pairs(pairs: &[&PreferencePair], opts: &CollateOptions) -> Batch {
    let samples: Vec<_> = [PairSide::Chosen, PairSide::Rejected]
        .into_iter()
        .flat_map(|side| pairs.iter().map(move |p| p.sample(side)))
        .collect();
    let refs: Vec<_> = samples.iter().collect();
    collate(&refs, opts)
}
