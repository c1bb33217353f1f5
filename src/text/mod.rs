//! Showing model text as it reads: right-to-left scripts in visual order and byte-split
//! tokens as the characters they form. Pure text logic, no GUI: the studio and the CLI are
//! thin users of it.
//!
//! * [`bidi`]: the Unicode Bidirectional Algorithm (UAX #9) for display — a paragraph's
//!   direction from its first strong character, and a line cut into pieces in visual order
//!   ([`BidiParagraph::visual_pieces`], [`visual_order`]).
//! * [`shaper`]: the text to hand a shaper that reverses right-to-left script runs itself
//!   (egui 0.37 shapes with HarfBuzz's direction guess), so pieces already in visual order
//!   are not reversed twice.
//! * [`groups`]: consecutive tokens whose bytes form whole UTF-8 characters only together
//!   (byte-level BPE splits most Hebrew, Arabic and CJK characters) as one [`TokenGroup`].
//! * [`token_bytes`]: the bytes each token id stands for, from a `tokenizers` tokenizer.
//! * [`visible`]: whitespace and control characters made visible in a token chip.
//!
//! Nothing here prints.

pub mod bidi;
pub mod groups;
pub mod shaper;
pub mod token_bytes;
pub mod visible;

pub use bidi::{
    first_strong_direction, has_rtl_letters, visual_order, BidiParagraph, Direction, VisualPiece,
};
pub use groups::{group_tokens, hex_bytes, TokenGroup};
pub use shaper::for_script_shaper;
pub use token_bytes::token_bytes;
pub use visible::{visible, visible_char, visible_keep_spaces};
