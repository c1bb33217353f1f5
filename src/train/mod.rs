//! The trainer: run configs, the training loop (precision modes, gradient accumulation,
//! activation checkpointing, LoRA), evaluation, checkpoints with exact resume, and the
//! background thread the GUI drives through [`Command`]s and [`Event`]s.
//!
//! Two ways to drive it:
//! - [`Trainer::spawn`] runs a [`RunConfig`] on a background thread; the front end sends
//!   [`Command`]s and receives [`Event`]s (also appended to `<output>/metrics.jsonl`).
//! - [`TrainingRun`] is the same loop, synchronously: `TrainingRun::new(config)?` then
//!   `.step()` until `.is_done()`; the tests and the dry run use it (the CLI runs the
//!   thread, through [`Trainer::spawn_with`]).

pub mod apply_plan;
pub mod checkpoint;
pub mod config;
pub mod device_check;
pub mod divergence;
pub mod dry_run;
pub mod error;
pub mod events;
pub mod export;
pub mod export_gguf;
pub mod grpo;
pub mod grpo_rewards;
pub mod loader;
pub mod memory;
pub mod metrics;
pub mod oom;
pub mod pairs;
pub mod placement;
pub mod plan_adapter;
pub mod precision;
pub mod preference;
pub mod render;
pub mod resume_changes;
pub mod rollout_preview;
pub mod samples;
pub mod schedule;
pub mod settings_lints;
pub mod step;
pub mod trainer;
pub mod validate;

pub use apply_plan::{apply_fix, apply_plan_request};
pub use checkpoint::{existing_run, latest_checkpoint, list_checkpoints, TrainerState};
pub use config::{
    CheckpointSection, DevicesSection, DpoLoss, EvalSection, GrpoLossType, GrpoSection, InitMode,
    LoraSection, ModelDtype, ModelSection, PreferenceSection, ReferenceMode, RunConfig,
    ScaleRewards, TrainingMethod, TrainingSection,
};
pub use device_check::{check_options, check_request};
pub use dry_run::dry_run;
pub use error::{ConfigError, ConfigProblem, Phase, TrainError};
pub use events::{
    Command, Event, FinishReason, LintFinding, MemoryScope, SampledGroup, SampledText,
};
pub use export::{export_adapter, export_full, export_merged};
pub use export_gguf::{
    default_gguf_path, export_gguf, export_source, plan_gguf, ExportSource, GgufExport,
};
pub use metrics::{read_metrics, MetricsWriter, RunCurves, METRICS_FILE};
pub use placement::{DeviceLayers, RunPlacement};
pub use plan_adapter::{
    local_plan_request, plan_devices, plan_model, plan_request, process_inputs,
    read_run_config_leniently,
};
pub use precision::{LossScaler, Precision, UnknownPrecision};
pub use render::{dispatch, EventRenderer};
pub use schedule::{LrSchedule, ScheduleKind};
pub use step::{
    last_rollouts, launched_training, EvalResult, StepGradients, StepOutcome, TrainingRun,
};
pub use trainer::{Trainer, TrainerHandle, TrainerOptions, Waker};
