//! Guard rails through `tunestudio train`: the founding case's data bug (`labels = [1] * len`)
//! stops the run before any weight is read; an expert's named override trains and is recorded.

use crate::train_common::{tiny_config, tiny_llama};

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tunestudio::train::{read_metrics, Event, RunConfig};

/// Pre-tokenised rows whose labels are all 1 (the founding user's `labels = [1] * len`).
fn founding_rows(dir: &Path) -> PathBuf {
    let path = dir.join("tokenized.jsonl");
    let rows: Vec<String> = (0..12)
        .map(|r| {
            let ids: Vec<i64> = (0..20 + r).map(|i| 100 + i).chain([2]).collect();
            let labels = vec![1; ids.len()];
            serde_json::json!({ "input_ids": ids, "labels": labels }).to_string()
        })
        .collect();
    std::fs::write(&path, rows.join("\n")).unwrap();
    path
}

/// tiny-llama's config and tokenizer with a weights file that cannot be read: a run that got
/// as far as loading weights would fail on it with a model error instead.
fn model_with_unreadable_weights(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    for entry in std::fs::read_dir(tiny_llama()).unwrap().flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().ends_with(".safetensors") {
            std::fs::copy(entry.path(), m.join(&name)).unwrap();
        }
    }
    std::fs::write(m.join("model.safetensors"), b"not a safetensors file").unwrap();
    m
}

fn train(config: &RunConfig, dir: &Path, extra: &[&str]) -> Output {
    let path = dir.join(format!("run-{}.toml", extra.len()));
    config.clone().with_absolute_paths().save(&path).unwrap();
    Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["train", "--config"])
        .arg(&path)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn the_founding_label_bug_stops_training_until_allowed_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(&tmp.path().join("blocked"), 2);
    cfg.data = tunestudio::data::DataConfig::new(founding_rows(tmp.path()).display().to_string());
    cfg.data.allow = vec!["learning-rate".into()];
    cfg.model.source = model_with_unreadable_weights(tmp.path())
        .display()
        .to_string();

    let out = train(&cfg, tmp.path(), &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("labels-mismatch"), "{stderr}");
    assert!(stderr.contains("--allow-lint labels-mismatch"), "{stderr}");
    assert!(
        !stderr.contains("safetensors"),
        "weights were read: {stderr}"
    );

    // The same data with the override, on a model with real weights: it trains, and the
    // override is on record.
    cfg.model.source = tiny_llama().display().to_string();
    cfg.output_dir = tmp.path().join("allowed");
    let out = train(&cfg, tmp.path(), &["--allow-lint", "labels-mismatch"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let events = read_metrics(&cfg.output_dir).unwrap();
    let allowed: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            Event::LintAllowed { lint } => Some(lint.lint.as_str()),
            _ => None,
        })
        .collect();
    // The tiny fixture's config allows its from-scratch learning rate by name too.
    assert_eq!(allowed, ["labels-mismatch", "learning-rate"]);
    assert!(events
        .iter()
        .any(|e| matches!(e, Event::Step { step: 2, .. })));

    // A misspelt override is a config error naming the valid names.
    cfg.data.allow = vec!["label-mismatch".into()];
    let out = train(&cfg, tmp.path(), &["--max-steps", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("data.allow") && stderr.contains("labels-mismatch"),
        "{stderr}"
    );
}

/// A fresh `tunestudio train` never writes into another run's folder; resuming it does.
#[test]
fn a_new_run_refuses_another_runs_folder_unless_resuming() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(&tmp.path().join("out"), 2);
    cfg.checkpoint.save_final = true;
    let first = train(&cfg, tmp.path(), &[]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let again = train(&cfg, tmp.path(), &[]);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success());
    assert!(
        stderr.contains("already holds a run") && stderr.contains("checkpoint-2"),
        "{stderr}"
    );
    assert!(stderr.contains("--resume latest"), "{stderr}");
    cfg.training.max_steps = Some(3);
    let resumed = train(&cfg, tmp.path(), &["--resume", "latest"]);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
}

/// Out of memory is a report and a way out: an allocation failure injected at step 3's
/// backward ends the run with a checkpoint of step 2 and a report naming the phase;
/// `--on-oom auto-fit` resumes from it with fitted settings (same effective batch) and the
/// loss curve continues as the uninterrupted run's.
#[test]
fn out_of_memory_checkpoints_reports_and_auto_fit_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let config = |name: &str| {
        let mut c = tiny_config(&tmp.path().join(name), 6);
        c.training.micro_batch = 8;
        c.data.max_length = 128;
        c.checkpoint.save_final = true;
        c
    };
    let events_of = |name: &str| read_metrics(&tmp.path().join(name)).unwrap();
    let losses = |events: &[Event]| -> std::collections::BTreeMap<u64, f64> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Step { step, loss, .. } => Some((*step, *loss)),
                _ => None,
            })
            .collect()
    };
    let run = |cfg: &RunConfig, extra: &[&str], inject: bool| {
        let path = tmp.path().join(format!(
            "{}.toml",
            cfg.output_dir.display().to_string().len()
        ));
        cfg.clone().with_absolute_paths().save(&path).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tunestudio"));
        cmd.args(["train", "--config"]).arg(&path).args(extra);
        if inject {
            cmd.env(tunestudio::train::oom::INJECT_OOM_ENV, "3:backward");
        }
        cmd.output().unwrap()
    };
    let reference = run(&config("reference"), &[], false);
    assert!(
        reference.status.success(),
        "{}",
        String::from_utf8_lossy(&reference.stderr)
    );
    let uninterrupted = losses(&events_of("reference"));

    let stopped = run(&config("stopped"), &[], true);
    let stderr = String::from_utf8_lossy(&stopped.stderr);
    assert!(!stopped.status.success());
    // The device, with what the plan gave it and what it was seen to hold.
    assert!(
        stderr.contains("cpu ran out of memory at step 3 (backward, planned ")
            && stderr.contains(", seen "),
        "{stderr}"
    );
    let events = events_of("stopped");
    let report = events
        .iter()
        .find_map(|e| match e {
            Event::OutOfMemory {
                step,
                phase,
                checkpoint,
                refit,
                planned_bytes,
                observed_bytes,
                failure,
                ..
            } => {
                assert!(planned_bytes.is_some_and(|b| b > 0), "{e:?}");
                assert!(observed_bytes.is_some_and(|b| b > 0), "{e:?}");
                // Recognised by its error value: the injected failure's kind, not its words.
                assert_eq!(
                    failure.map(|f| f.api),
                    Some(tunestudio::mem::alloc_failure::FailedApi::Injected)
                );
                Some((*step, *phase, checkpoint.clone(), refit.clone()))
            }
            _ => None,
        })
        .expect("an out_of_memory event");
    assert_eq!(
        (report.0, report.1),
        (3, tunestudio::train::Phase::Backward)
    );
    assert!(report
        .2
        .as_ref()
        .is_some_and(|p| p.ends_with("checkpoint-2")));
    assert!(!report.3.is_empty(), "a fitted setting is proposed");
    assert_eq!(losses(&events).keys().copied().collect::<Vec<_>>(), [1, 2]);

    let fitted = run(&config("fitted"), &["--on-oom", "auto-fit"], true);
    let stderr = String::from_utf8_lossy(&fitted.stderr);
    assert!(fitted.status.success(), "{stderr}");
    assert!(
        stderr.contains("resuming from the last checkpoint with"),
        "{stderr}"
    );
    let events = events_of("fitted");
    let resumed = losses(&events);
    assert_eq!(
        resumed.keys().copied().collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    for (step, l) in &resumed {
        let u = uninterrupted[step];
        assert!(
            (u - l).abs() <= 1e-5,
            "step {step}: {l} vs uninterrupted {u}"
        );
    }
    // The resumed half ran with the fitted settings, from step 2's checkpoint.
    let ckpt = tunestudio::train::latest_checkpoint(&tmp.path().join("fitted"));
    let saved = RunConfig::load(&ckpt.unwrap().join("run.toml")).unwrap();
    assert!(saved.training.micro_batch < 8, "{:?}", saved.training);
    assert_eq!(
        saved.training.micro_batch * saved.training.gradient_accumulation,
        8,
        "same effective batch"
    );
    assert!(events.iter().any(|e| matches!(
        e,
        Event::Started {
            start_step: 2,
            resumed_from: Some(_),
            ..
        }
    )));
}
