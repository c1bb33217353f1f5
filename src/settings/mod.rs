//! The settings vocabulary every layer shares: the types a run config, the memory planner,
//! device placement and the studio all speak ([`Precision`], [`Strategy`]).
//!
//! This module sits below the planner and the trainer and imports neither, so the dependency
//! arrow points one way: `settings ← plan ← train ← cli / gui`. A type that both
//! the planner and the trainer need belongs here, never in `train` (the planner must not
//! import the trainer: `tests/it/layering.rs` checks it).

mod precision;
mod quantize;
mod strategy;

pub use precision::{Precision, UnknownPrecision};
pub use quantize::{QuantFormat, Quantization, UnknownQuantization};
pub use strategy::{ShardMode, Strategy, UnknownShardMode, UnknownStrategy};
