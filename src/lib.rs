//! tunestudio: a fine-tuning studio for causal language models.
//!
//! The library is the whole engine with no GUI dependency: model loading and a
//! training-ready decoder ([`model`]), datasets, chat templates and label masks
//! ([`data`]), the background trainer ([`train`]), the memory planner ([`plan`]),
//! device discovery and placement ([`devices`]), generation ([`infer`]) and the shaping of
//! model text for display: right-to-left order and byte-split tokens ([`text`]), and the
//! settings types every layer shares ([`settings`]); models and datasets come from the
//! Hugging Face hub as its environment variables say ([`hub_env`]).
//! Data flows one way: run config → plan → trainer → events → UI; modules depend downward
//! only (`settings ← plan ← train`: the planner imports nothing from the trainer).

pub mod data;
pub mod devices;
pub mod gguf;
pub mod hub_env;
pub mod infer;
pub mod mem;
pub mod model;
pub mod paths;
pub mod plan;
pub mod settings;
pub mod text;
pub mod train;
pub mod units;
