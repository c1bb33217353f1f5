//! The background trainer thread: event order, pause, stop, errors, metrics.jsonl.

use crate::train_common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use train_common::*;
use tunestudio::train::render::{self, dispatch, EventRenderer};
use tunestudio::train::{read_metrics, Command, Event, FinishReason, Trainer, TrainerHandle};

fn next(h: &TrainerHandle, timeout_secs: u64) -> Event {
    h.events
        .recv_timeout(Duration::from_secs(timeout_secs))
        .expect("no event from the trainer thread in time")
}

fn wait_for(h: &TrainerHandle, kind: &str, seen: &mut Vec<Event>) -> Event {
    loop {
        let e = next(h, 120);
        seen.push(e.clone());
        if e.kind() == kind {
            return e;
        }
        assert!(
            !matches!(e, Event::Finished { .. }),
            "finished while waiting for {kind}: {seen:?}"
        );
    }
}

#[test]
fn events_arrive_in_order_and_are_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_config(tmp.path(), 4);
    c.training.micro_batch = 2;
    c.data.validation_ratio = 0.01;
    c.eval.eval_every = 2;
    c.eval.max_batches = 2;
    c.checkpoint.save_every = 0;
    c.checkpoint.save_final = true;
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = wakes.clone();
    let h = Trainer::spawn(
        c,
        Some(Arc::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
        })),
    );
    // Nothing happens before Start.
    assert!(h.events.recv_timeout(Duration::from_millis(200)).is_err());
    assert!(h.send(Command::Start));
    let mut all = Vec::new();
    loop {
        let e = next(&h, 120);
        all.push(e.clone());
        if matches!(e, Event::Finished { .. }) {
            break;
        }
    }
    h.join();
    let kinds: Vec<String> = all
        .iter()
        .filter(|e| {
            matches!(
                e.kind(),
                "step" | "eval" | "checkpoint_saved" | "finished" | "started"
            )
        })
        .map(|e| match e {
            Event::Step { step, .. } => format!("step{step}"),
            Event::Eval { step, .. } => format!("eval{step}"),
            Event::CheckpointSaved { step, .. } => format!("ckpt{step}"),
            other => other.kind().to_string(),
        })
        .collect();
    assert_eq!(
        kinds,
        ["started", "step1", "step2", "eval2", "step3", "step4", "eval4", "ckpt4", "finished"],
        "{all:?}"
    );
    assert!(all.iter().any(|e| matches!(e, Event::Memory { .. })));
    match all.last().unwrap() {
        Event::Finished {
            reason,
            step,
            last_checkpoint,
            ..
        } => {
            assert_eq!(*reason, FinishReason::Completed);
            assert_eq!(*step, 4);
            assert!(last_checkpoint.as_ref().unwrap().ends_with("checkpoint-4"));
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(
        wakes.load(Ordering::SeqCst),
        all.len(),
        "the waker runs once per event"
    );
    // metrics.jsonl holds the same events (status lines excepted).
    let recorded = read_metrics(tmp.path()).unwrap();
    let sent: Vec<&Event> = all.iter().filter(|e| e.kind() != "status").collect();
    assert_eq!(recorded.len(), sent.len());
    for (a, b) in recorded.iter().zip(sent) {
        assert_eq!(a.kind(), b.kind());
    }
    let curves = tunestudio::train::RunCurves::from_events(&recorded);
    assert_eq!(curves.loss.len(), 4);
    assert_eq!(curves.eval_loss.len(), 2);
}

#[test]
fn pause_resume_and_stop() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_config(tmp.path(), 10_000);
    c.training.micro_batch = 1;
    c.data.max_length = 48;
    let h = Trainer::spawn(c, None);
    h.send(Command::Start);
    let mut seen = Vec::new();
    wait_for(&h, "step", &mut seen);
    h.send(Command::Pause);
    let paused_at = match wait_for(&h, "paused", &mut seen) {
        Event::Paused { step } => step,
        _ => unreachable!(),
    };
    // No step events while paused.
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_millis(700) {
        if let Ok(e) = h.events.recv_timeout(Duration::from_millis(50)) {
            assert!(
                !matches!(e, Event::Step { .. }),
                "a step ran while paused: {e:?}"
            );
        }
    }
    h.send(Command::Resume);
    wait_for(&h, "resumed", &mut seen);
    match wait_for(&h, "step", &mut seen) {
        Event::Step { step, .. } => assert_eq!(step, paused_at + 1),
        _ => unreachable!(),
    }
    // Stop: at most the step in flight finishes, then Finished.
    h.send(Command::Stop);
    let mut steps_after_stop = 0;
    let stopped = Instant::now();
    loop {
        match next(&h, 30) {
            Event::Step { .. } => steps_after_stop += 1,
            Event::Finished { reason, .. } => {
                assert_eq!(reason, FinishReason::Stopped);
                break;
            }
            _ => {}
        }
    }
    assert!(
        steps_after_stop <= 1,
        "{steps_after_stop} steps ran after Stop"
    );
    assert!(stopped.elapsed() < Duration::from_secs(10));
    let joined = Instant::now();
    h.join();
    assert!(joined.elapsed() < Duration::from_secs(5));
}

#[test]
fn setup_errors_become_events_and_the_process_lives_on() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_config(tmp.path(), 3);
    c.data.path = tmp.path().join("missing.json").display().to_string();
    c.training.gradient_accumulation = 0;
    let h = Trainer::spawn(c, None);
    h.send(Command::Start);
    let mut error = None;
    loop {
        match next(&h, 60) {
            Event::Error { message, hint, .. } => error = Some((message, hint)),
            Event::Finished { reason, .. } => {
                assert_eq!(reason, FinishReason::Failed);
                break;
            }
            _ => {}
        }
    }
    h.join();
    let (message, hint) = error.expect("no error event");
    assert!(
        message.contains("training.gradient_accumulation"),
        "{message}"
    );
    assert!(!hint.is_empty());
}

#[test]
fn save_now_writes_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_config(tmp.path(), 10_000);
    c.training.micro_batch = 1;
    c.data.max_length = 48;
    let h = Trainer::spawn(c, None);
    h.send(Command::Start);
    let mut seen = Vec::new();
    wait_for(&h, "step", &mut seen);
    h.send(Command::SaveNow);
    h.send(Command::Stop);
    let saved = match wait_for(&h, "checkpoint_saved", &mut seen) {
        Event::CheckpointSaved { path, step } => {
            assert!(step >= 1);
            path
        }
        _ => unreachable!(),
    };
    assert!(saved.join("trainer_state.json").is_file());
    assert!(saved.join("optimizer.safetensors").is_file());
    assert!(saved.join("trainable.safetensors").is_file());
    loop {
        if let Event::Finished { reason, .. } = next(&h, 30) {
            assert_eq!(reason, FinishReason::Stopped);
            break;
        }
    }
    h.join();
}

#[test]
fn a_run_predicted_to_exhaust_host_memory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_config(tmp.path(), 3);
    c.training.micro_batch = 1 << 20;
    c.data.max_length = 256;
    let h = Trainer::spawn(c, None);
    h.send(Command::Start);
    let started = Instant::now();
    let mut error = None;
    loop {
        match next(&h, 60) {
            Event::Error { message, hint, .. } => error = Some((message, hint)),
            Event::Started { .. } => panic!("a run that cannot fit was started"),
            Event::Finished { reason, .. } => {
                assert_eq!(reason, FinishReason::Failed);
                break;
            }
            _ => {}
        }
    }
    h.join();
    let (message, hint) = error.expect("no error event");
    assert!(message.contains("memory plan"), "{message}");
    assert!(!hint.is_empty());
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the model was loaded before the check"
    );
}

/// Records which [`EventRenderer`] method each event reached, with its step where it has one.
#[derive(Default)]
struct Recorder {
    seen: Vec<String>,
}

impl Recorder {
    fn saw(&mut self, kind: &str, step: Option<u64>) {
        self.seen
            .push(step.map_or(kind.to_string(), |s| format!("{kind}{s}")));
    }
}

impl EventRenderer for Recorder {
    fn status(&mut self, _: &str) {
        self.saw("status", None);
    }
    fn started(&mut self, e: render::Started<'_>) {
        self.saw("started", Some(e.start_step));
    }
    fn step(&mut self, e: render::Step<'_>) {
        self.saw("step", Some(e.step));
    }
    fn eval(&mut self, e: render::Eval) {
        self.saw("eval", Some(e.step));
    }
    fn memory(&mut self, e: render::Memory<'_>) {
        self.saw("memory", Some(e.step));
    }
    fn checkpoint_saved(&mut self, step: u64, _: &std::path::Path) {
        self.saw("checkpoint_saved", Some(step));
    }
    fn paused(&mut self, step: u64) {
        self.saw("paused", Some(step));
    }
    fn resumed(&mut self, step: u64) {
        self.saw("resumed", Some(step));
    }
    fn divergence(&mut self, e: render::Divergence) {
        self.saw("divergence", Some(e.step));
    }
    fn warning(&mut self, _: &str) {
        self.saw("warning", None);
    }
    fn error(&mut self, e: render::ErrorReport<'_>) {
        self.saw("error", e.step);
    }
    fn lints_blocked(&mut self, _: &[tunestudio::train::LintFinding]) {
        self.saw("lints_blocked", None);
    }
    fn out_of_memory(&mut self, e: render::OutOfMemory<'_>) {
        self.saw("out_of_memory", Some(e.step));
    }
    fn lint_allowed(&mut self, _: &tunestudio::train::LintFinding) {
        self.saw("lint_allowed", None);
    }
    fn completions(&mut self, step: u64, _: &tunestudio::train::SampledGroup) {
        self.saw("completions", Some(step));
    }
    fn finished(&mut self, e: render::Finished<'_>) {
        self.saw("finished", Some(e.step));
    }
}

/// The step an event carries, as the recorder notes it.
fn step_of(e: &Event) -> Option<u64> {
    match e {
        Event::Started { start_step, .. } => Some(*start_step),
        Event::Step { step, .. }
        | Event::Eval { step, .. }
        | Event::Memory { step, .. }
        | Event::CheckpointSaved { step, .. }
        | Event::Paused { step }
        | Event::Resumed { step }
        | Event::Divergence { step, .. }
        | Event::OutOfMemory { step, .. }
        | Event::Finished { step, .. } => Some(*step),
        Event::Error { step, .. } => *step,
        _ => None,
    }
}

/// `dispatch` hands a renderer every event of a real run, in order, each to the method of its
/// kind with its fields.
#[test]
fn a_renderer_sees_every_event_of_a_run_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_config(tmp.path(), 3);
    c.training.micro_batch = 2;
    c.data.validation_ratio = 0.01;
    c.eval.eval_every = 2;
    c.eval.max_batches = 1;
    c.checkpoint.save_final = true;
    let h = Trainer::spawn(c, None);
    assert!(h.send(Command::Start));
    let mut all = Vec::new();
    let mut recorder = Recorder::default();
    loop {
        let e = next(&h, 120);
        dispatch(&e, &mut recorder);
        all.push(e.clone());
        if matches!(e, Event::Finished { .. }) {
            break;
        }
    }
    h.join();
    let expected: Vec<String> = all
        .iter()
        .map(|e| step_of(e).map_or(e.kind().to_string(), |s| format!("{}{s}", e.kind())))
        .collect();
    assert_eq!(recorder.seen, expected);
    let milestones: Vec<&str> = recorder
        .seen
        .iter()
        .map(String::as_str)
        .filter(|k| !k.starts_with("status") && !k.starts_with("memory"))
        .filter(|k| !k.starts_with("warning") && !k.starts_with("lint_allowed"))
        .collect();
    assert_eq!(
        milestones,
        [
            "started0",
            "step1",
            "step2",
            "eval2",
            "step3",
            "eval3",
            "checkpoint_saved3",
            "finished3"
        ]
    );
}
