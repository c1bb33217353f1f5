//! The integration tests, one binary (one link of candle, tokenizers and the GUI stack instead of one per
//! file). Tests that need a process of their own — a counting global allocator, environment variables —
//! are separate binaries beside this folder (`tests/*.rs`).

// Test code: helpers outside `#[test]` functions unwrap too (clippy's `allow-unwrap-in-tests`
// covers only the tests themselves); a panic here is a failed test, not a user's crash.
#![allow(clippy::unwrap_used)]
// A test reads top to bottom as one scenario (or one table, `plan_request::keys`); splitting it
// into helpers would hide the story, so long tests are allowed here.
#![allow(clippy::too_many_lines)]

mod data_support;
mod support;
#[path = "../train_common/mod.rs"]
mod train_common;

mod cli_start;
mod core_mutants;
mod data_datasets;
mod data_lints;
mod data_readers;
mod data_template_parity;
mod devices_discovery;
mod devices_fake_gpus;
mod devices_gpu_check;
mod devices_strategies;
mod docs_paths;
mod export_gguf;
mod grpo_loss;
mod grpo_split;
mod grpo_train;
mod gui_window;
mod headless;
mod hub_download;
mod infer_generate;
mod launch;
mod layering;
mod model_generic;
mod model_io;
mod model_lora;
mod model_native_layer;
mod model_parity;
mod model_qlora;
mod model_train;
mod ops_bench;
mod ops_grad;
mod plan_dry_run;
mod plan_request;
mod plan_rss;
mod plan_sharded;
mod plan_verdicts;
mod preference_data;
mod preference_loss;
mod preference_preview;
mod preference_train;
mod text_shaping;
mod train_config;
mod train_first_run;
mod train_guards;
mod train_loop;
mod train_lora;
mod train_multi_device;
mod train_resume;
mod train_sharded;
mod train_thread;
