//! tunestudio: a fine-tuning studio for causal language models.
//!
//! The library is the whole engine with no GUI dependency: model loading and a
//! training-ready decoder ([`model`]), datasets, chat templates and label masks
//! ([`data`]), the background trainer ([`train`]), the memory planner ([`plan`]),
//! device discovery and placement ([`devices`]) and generation ([`infer`]).
//! Data flows one way: run config → plan → trainer → events → UI.

pub mod data;
pub mod devices;
pub mod infer;
pub mod mem;
pub mod model;
pub mod paths;
pub mod plan;
pub mod train;
