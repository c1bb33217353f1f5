//! The model engine: Hugging Face Llama / Mistral / Qwen2 checkpoints loaded into a
//! training-ready decoder that matches transformers (logits, loss, gradients), with LoRA,
//! activation checkpointing, a torch-exact AdamW and HF-compatible saving.
//!
//! Layout: [`config`] parses `config.json`; [`hub`] finds model files (local or HF cache) and
//! [`locate`] a model's folder without reading its weights;
//! [`weights`] memory-maps safetensors; [`decoder`] is the model, `layer_weights` the weights of
//! one of its layers, `native_layer` a layer as one CPU op with a hand-written backward and
//! `side_grads` the gradients such ops produce outside the graph; [`loss`] the chunked
//! causal-LM loss; [`checkpoint`] activation checkpointing; [`lora`] PEFT adapters;
//! [`preference`] the DPO / IPO / ORPO losses on sequence log-probabilities; [`grpo`] GRPO's
//! advantages, completion log-probabilities and clipped-surrogate loss;
//! [`adamw`] the optimizer; [`save`] `save_pretrained`; [`bench`] the training benchmark.
//! [`quant`] stores the frozen base quantized for QLoRA (GGML blocks, a GGUF cache).
//! [`reference_ops`] holds the composite differentiable ops and [`ops`] the fused kernels.

pub mod adamw;
pub mod bench;
mod checkpoint;
pub mod config;
pub mod decoder;
pub mod error;
pub mod gradients;
pub mod grpo;
pub mod hub;
mod kernels;
pub mod layer_source;
mod layer_weights;
pub mod locate;
pub mod lora;
pub mod loss;
mod native_embedding;
mod native_layer;
pub mod ops;
pub mod ops_mode;
pub mod placed;
pub mod preference;
pub mod quant;
pub mod reference_ops;
pub mod save;
mod side_grads;
pub mod weights;

pub use adamw::{AdamW, AdamWConfig, OptimizerOffload, StatePlacement, StateSource};
pub use bench::{matmul_simd, run_training_bench, BenchConfig, BenchReport};
pub use config::{Architecture, ModelConfig, RopeScaling};
pub use decoder::{rope_inv_freq, CausalLm, LossOutput, IGNORE_INDEX, LOSS_CHUNK_TOKENS};
pub use error::ModelError;
pub use gradients::{Gradients, NamedParam};
pub use hub::{model_config_path, resolve_model, resolve_model_in, HubOptions, ModelFiles};
pub use layer_source::LayerSource;
pub use locate::{locate_model, ModelLocation};
pub use lora::LINEAR_MODULES;
pub use lora::{parse_adapter_config, LoraConfig};
pub use ops_mode::{OpsMode, OPS_ENV};
pub use placed::{Home, Placed, DISTINCT_CPU_DEVICES_ENV};
pub use quant::QuantSummary;
pub use save::dtype_name;
pub use side_grads::GradientSink;
