//! Text generation for the playground and `tunestudio generate`: the project's own decoder
//! with a key/value cache, sampling, chat formatting and token streaming.
//!
//! Layout: [`engine`] is the cached forward pass on detached weights ([`InferModel`],
//! [`KvCache`]); [`sampling`] picks tokens ([`SamplingParams`], [`Sampler`]); [`text`] turns
//! tokens into whole-character text deltas and watches for stop strings; [`generator`]
//! loads a model (base, fine-tuned, or base + PEFT adapter) with its tokenizer and runs the
//! generation loop ([`Generator`]); [`stream`] runs it on a background thread
//! ([`spawn_generation`] → [`GenerationHandle`] of [`GenEvent`]s).
//!
//! ```no_run
//! use std::sync::Arc;
//! use tunestudio::infer::{spawn_generation, GenEvent, GenerationRequest, Generator, ModelSpec, Prompt, SamplingParams};
//! let g = Arc::new(Generator::load(&ModelSpec::new("HuggingFaceTB/SmolLM2-135M-Instruct"))?);
//! let h = spawn_generation(GenerationRequest {
//!     generator: g,
//!     prompt: Prompt::chat(None, "Hello!"),
//!     params: SamplingParams::default(),
//! });
//! for ev in h.events.iter() {
//!     if let GenEvent::Token { text, .. } = ev { print!("{text}"); }
//! }
//! # Ok::<(), tunestudio::infer::InferError>(())
//! ```
//!
//! Nothing here prints.

pub mod engine;
pub mod error;
pub mod generator;
pub mod gguf_model;
pub mod rollout;
pub mod sampling;
pub mod stream;
pub mod text;

pub use engine::{InferModel, KvCache};
pub use error::InferError;
pub use generator::{GenerationOutput, Generator, ModelSpec, Prompt, StopReason, TokenEvent};
pub use gguf_model::{GgufModel, GgufSession};
pub use rollout::{sample_group, GroupSample, SampledCompletion};
pub use sampling::{argmax, Sampler, SamplingParams};
pub use stream::{spawn_generation, GenEvent, GenerationHandle, GenerationRequest};
pub use text::{IncrementalDecoder, StopCheck, StopMatcher};
