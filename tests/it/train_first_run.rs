//! A newcomer's first real run through `tunestudio train`: a learning rate far outside the
//! usual range for the model stops the run like an error-level data lint (exit 2, overridable
//! by name); a loss spike is reported as it happens and can stop the run; a resume names what
//! its run config changed and refuses a change that breaks the exact continuation.

use crate::train_common;

use std::path::{Path, PathBuf};
use std::process::Output;

use train_common::*;
use tunestudio::train::{read_metrics, Event, FinishReason, RunConfig};

fn save(cfg: &RunConfig, path: &Path) -> PathBuf {
    cfg.clone().with_absolute_paths().save(path).unwrap();
    path.to_path_buf()
}

fn train(config: &Path, extra: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["train", "--config"])
        .arg(config)
        .args(extra)
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The demo's 3e-3 on a pretrained model's full fine-tuning (150× the usual 2e-5): the run
/// does not start, exit 2, and the message names the setting and the fix; allowed by name,
/// it trains and the override is recorded.
#[test]
fn a_learning_rate_far_above_the_usual_stops_the_run_until_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(&tmp.path().join("out"), 1);
    cfg.data.allow.clear();
    cfg.training.learning_rate = 3e-3;
    cfg.training.warmup_ratio = 0.1;
    let path = save(&cfg, &tmp.path().join("run.toml"));
    let out = train(&path, &[]);
    let shown = text(&out);
    assert_eq!(out.status.code(), Some(2), "{shown}");
    assert!(shown.contains("training.learning_rate"), "{shown}");
    assert!(shown.contains("2e-5"), "{shown}");
    assert!(!tmp.path().join("out").join("checkpoint-1").exists());

    let out = train(&path, &["--allow-lint", "learning-rate"]);
    assert!(out.status.success(), "{}", text(&out));
    let events = read_metrics(&tmp.path().join("out")).unwrap();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::LintAllowed { lint } if lint.lint == "learning-rate")),
        "the override is not recorded"
    );
}

/// bf16-mixed on the CPU: where the CPU has no bf16 arithmetic (AVX512-BF16 or AMX) the run
/// is told, by name and with the fix, that its products widen to f32 and run slower than fp32;
/// it is a warning, so the run still trains. Where the CPU has it, nothing is said.
#[test]
fn half_precision_on_a_cpu_without_its_arithmetic_is_named_and_still_trains() {
    use tunestudio::model::ops::kernel_path::Bf16Kernel;
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(&tmp.path().join("out"), 1);
    cfg.training.precision = tunestudio::settings::Precision::Bf16Mixed;
    let path = save(&cfg, &tmp.path().join("run.toml"));
    let out = train(&path, &[]);
    let shown = text(&out);
    assert!(out.status.success(), "{shown}");
    let bf16_kernel = [Bf16Kernel::Avx512Bf16, Bf16Kernel::Amx]
        .into_iter()
        .any(Bf16Kernel::available);
    let named = shown.contains("widens its operands to f32");
    eprintln!("bf16 kernel on this CPU: {bf16_kernel}; lint shown: {named}");
    assert_eq!(named, !bf16_kernel, "{shown}");
    if named {
        assert!(shown.contains("training.precision = \"fp32\""), "{shown}");
    }
}

/// tiny-llama at its steady 1e-3, until step 10's rate is multiplied by 1000 (the
/// `TUNESTUDIO_INJECT_LR_SPIKE` switch: a rate typed with the wrong exponent). The loss of
/// the next step jumps far above its recent median. The watch reports it (CLI and
/// metrics.jsonl) with a tenth of the rate; with `on_divergence = "stop"` the run ends there,
/// exit 1, and the newest checkpoint is the step before the spike.
#[test]
fn a_loss_spike_is_reported_and_stop_keeps_the_checkpoint_before_it() {
    let tmp = tempfile::tempdir().unwrap();
    let spike = |config: &Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
            .args(["train", "--config"])
            .arg(config)
            .env(
                tunestudio::train::divergence::INJECT_LR_SPIKE_ENV,
                "10:1000",
            )
            .output()
            .unwrap()
    };
    let out_dir = tmp.path().join("warn");
    let cfg = tiny_config(&out_dir, 16);
    let path = save(&cfg, &tmp.path().join("warn.toml"));
    let out = spike(&path);
    let shown = text(&out);
    assert!(out.status.success(), "{shown}");
    assert!(shown.contains("the loss diverged at step"), "{shown}");
    let (spike_step, loss, median, suggested, stopped) = read_metrics(&out_dir)
        .unwrap()
        .into_iter()
        .find_map(|e| match e {
            Event::Divergence {
                step,
                loss,
                median_loss,
                suggested_learning_rate,
                stopped,
            } => Some((step, loss, median_loss, suggested_learning_rate, stopped)),
            _ => None,
        })
        .expect("a divergence event in metrics.jsonl");
    assert_eq!(spike_step, 11, "the step after the rate's spike");
    assert!(loss > 2.0 * median, "{loss} vs median {median}");
    assert!((suggested - 1e-4).abs() < 1e-12, "{suggested}");
    assert!(!stopped);
    // Without the spike nothing is reported.
    let calm = tmp.path().join("calm");
    let calm_path = save(&tiny_config(&calm, 16), &tmp.path().join("calm.toml"));
    let out = train(&calm_path, &[]);
    assert!(!text(&out).contains("diverged"), "{}", text(&out));

    let stop_dir = tmp.path().join("stop");
    let mut cfg = tiny_config(&stop_dir, 16);
    cfg.training.on_divergence = tunestudio::train::divergence::OnDivergence::Stop;
    cfg.checkpoint.save_every = 1;
    cfg.checkpoint.keep_last = 0;
    let path = save(&cfg, &tmp.path().join("stop.toml"));
    let out = spike(&path);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let finished = read_metrics(&stop_dir)
        .unwrap()
        .into_iter()
        .find_map(|e| match e {
            Event::Finished {
                reason,
                step,
                last_checkpoint,
                ..
            } => Some((reason, step, last_checkpoint)),
            _ => None,
        })
        .expect("a finished event");
    assert_eq!(finished.0, FinishReason::Diverged);
    assert_eq!(finished.1, spike_step, "stopped at the spike's step");
    let newest = tunestudio::train::list_checkpoints(&stop_dir)
        .last()
        .map(|(step, _)| *step)
        .expect("checkpoints before the spike");
    // The loss of step 11 was made by the weights step 10 wrote: step 9's checkpoint is the
    // last good one; the later ones are set aside.
    assert_eq!(
        newest,
        spike_step - 2,
        "the newest checkpoint is the last good one"
    );
    assert!(stop_dir
        .join(format!("checkpoint-{}-diverged", spike_step - 1))
        .is_dir());
    assert_eq!(
        finished.2.as_deref(),
        tunestudio::train::latest_checkpoint(&stop_dir).as_deref()
    );
}

/// Resuming with `micro_batch` 4 → 2 names the old and new effective batch and trains on;
/// with another LoRA rank the resume is refused (exit 1) unless `--allow-config-change`
/// — where the checkpoint cannot load into the new shape anyway, so it still fails cleanly.
#[test]
fn a_resume_names_what_changed_and_refuses_what_breaks_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    let mut cfg = tiny_config(&out_dir, 4);
    cfg.checkpoint.save_every = 2;
    cfg.checkpoint.keep_last = 0;
    cfg.lora.enabled = true;
    cfg.lora.r = 4;
    cfg.training.learning_rate = 2e-4;
    let path = save(&cfg, &tmp.path().join("run.toml"));
    let out = train(&path, &["--max-steps", "2"]);
    assert!(out.status.success(), "{}", text(&out));
    let ckpt = tunestudio::train::latest_checkpoint(&out_dir).expect("a checkpoint");

    let mut smaller = cfg.clone();
    smaller.training.micro_batch = 2;
    let changed = save(&smaller, &tmp.path().join("smaller.toml"));
    let out = train(&changed, &["--resume", &ckpt.display().to_string()]);
    let shown = text(&out);
    assert!(out.status.success(), "{shown}");
    assert!(
        shown.contains("training.micro_batch") && shown.contains("from 4 to 2 rows"),
        "{shown}"
    );

    let mut rank = cfg.clone();
    rank.lora.r = 8;
    let changed = save(&rank, &tmp.path().join("rank.toml"));
    let out = train(&changed, &["--resume", &ckpt.display().to_string()]);
    let shown = text(&out);
    assert_eq!(out.status.code(), Some(1), "{shown}");
    assert!(
        shown.contains("lora.r") && shown.contains("--allow-config-change"),
        "{shown}"
    );
}
