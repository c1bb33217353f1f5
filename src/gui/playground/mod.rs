//! Playground: load two models side by side (the run's base model, a run checkpoint, or a
//! model folder with an optional adapter), ask both the same prompt and watch the answers
//! stream; run a prompt list in batch and export the comparison as JSONL.
//!
//! - this file: the panel's state, the actions it queues ([`PgAction`], carried out by
//!   [`apply`]) and the reducer of its job reports ([`on_message`]);
//! - the background work in [`worker`], every piece of it a job of [`Jobs`] (so
//!   [`Jobs::in_flight`] counts loads, dialogs, file reads and generations alike);
//! - the drawing in [`view`].

mod view;
mod worker;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tunestudio::infer::{
    GenEvent, GenerationRequest, Generator, Prompt, SamplingParams, StopReason,
};

use crate::gui::error::{ErrorKind, JobError};
use crate::gui::jobs::Jobs;
use crate::gui::session::Session;

pub use crate::gui::action::{PgAction, PgPick};
pub use worker::Generation;

/// Where a side's model comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SideSource {
    /// The run config's model (random-initialised when the config says so).
    RunModel,
    /// A `checkpoint-<step>` folder of a run.
    Checkpoint,
    /// A model folder or hub id.
    Folder,
    /// A GGUF file (what llama.cpp and Ollama will run).
    Gguf,
}

/// One side's answer to the current prompt.
#[derive(Debug, Default)]
pub struct SideOutput {
    /// The text so far.
    pub text: String,
    /// Tokens generated so far.
    pub tokens: usize,
    /// Tokens in the prompt (after `Started`).
    pub prompt_tokens: Option<usize>,
    /// When generation started (for the live rate).
    pub started_at: Option<Instant>,
    /// The final end-to-end rate.
    pub tokens_per_sec: Option<f64>,
    /// Why it ended.
    pub stop_reason: Option<StopReason>,
    /// A generation error.
    pub error: Option<String>,
}

impl SideOutput {
    /// Tokens per second: final when done, live otherwise.
    pub fn rate(&self) -> Option<f64> {
        self.tokens_per_sec.or_else(|| {
            let secs = self.started_at?.elapsed().as_secs_f64();
            (secs > 0.0 && self.tokens > 0).then(|| self.tokens as f64 / secs)
        })
    }
}

/// One side of the comparison.
pub struct PlaygroundSide {
    /// Which kind of source is chosen.
    pub source: SideSource,
    /// The checkpoint folder (for [`SideSource::Checkpoint`]).
    pub checkpoint: String,
    /// The model folder or hub id (for [`SideSource::Folder`]).
    pub folder: String,
    /// An optional PEFT adapter folder attached to the run model or the folder model.
    pub adapter: String,
    /// A load is in flight (its sequence number).
    pub loading: Option<u64>,
    /// Sequence number of the latest load request (older results are dropped).
    pub seq: u64,
    /// The loaded model.
    pub generator: Option<Arc<Generator>>,
    /// What was loaded, for the header.
    pub loaded_name: String,
    /// Why loading failed.
    pub load_error: Option<JobError>,
    /// The running generation (dropping it cancels it).
    pub handle: Option<Generation>,
    /// Sequence number of the latest generation (older events are dropped).
    pub gen_seq: u64,
    /// The answer.
    pub output: SideOutput,
}

impl PlaygroundSide {
    fn new(source: SideSource) -> Self {
        PlaygroundSide {
            source,
            checkpoint: String::new(),
            folder: String::new(),
            adapter: String::new(),
            loading: None,
            seq: 0,
            generator: None,
            loaded_name: String::new(),
            load_error: None,
            handle: None,
            gen_seq: 0,
            output: SideOutput::default(),
        }
    }

    /// Whether a generation is streaming.
    pub fn generating(&self) -> bool {
        self.handle.is_some()
    }

    /// Folds one generation event in; returns whether the generation is over.
    fn apply_event(&mut self, ev: GenEvent) -> bool {
        match ev {
            GenEvent::Started { prompt_tokens } => {
                self.output.prompt_tokens = Some(prompt_tokens);
                false
            }
            GenEvent::Token { text, .. } => {
                self.output.text.push_str(&text);
                self.output.tokens += 1;
                false
            }
            GenEvent::Done(out) => {
                self.output.text = out.text;
                self.output.tokens = out.tokens;
                self.output.tokens_per_sec = Some(out.tokens_per_sec);
                self.output.stop_reason = Some(out.stop_reason);
                true
            }
            GenEvent::Error { message } => {
                self.output.error = Some(message);
                true
            }
        }
    }
}

/// One prompt of a batch with both answers.
#[derive(Debug, Clone)]
pub struct BatchRow {
    /// The prompt.
    pub prompt: String,
    /// The left answer (or its error).
    pub left: String,
    /// The right answer (or its error).
    pub right: String,
}

/// The Playground panel's state.
pub struct PlaygroundState {
    /// Left and right.
    pub sides: [PlaygroundSide; 2],
    /// The prompt typed.
    pub prompt: String,
    /// Use the chat template (when the models have one).
    pub chat: bool,
    /// The system prompt (chat only; empty = the template's default).
    pub system: String,
    /// Sampling settings.
    pub params: SamplingParams,
    /// The last problem (empty prompt, bad settings, file errors).
    pub error: Option<JobError>,
    /// An informational message (exports, loaded prompt lists).
    pub message: Option<String>,
    /// How many validation prompts to take.
    pub validation_count: usize,
    /// Prompts of the batch.
    pub batch_prompts: Vec<String>,
    /// Answers of the batch so far.
    pub batch_rows: Vec<BatchRow>,
    /// The prompt of the batch being answered.
    pub batch_next: Option<usize>,
    /// The prompt list is being read.
    pub prompts_loading: bool,
    /// Where "Export comparison" writes.
    pub export_path: String,
    /// The run's checkpoints `(step, folder)`, as the last listing job found them.
    pub checkpoints: Vec<(u64, PathBuf)>,
    /// What the checkpoint list was last requested for (`None`: list again).
    pub checkpoints_key: Option<String>,
    temp_seq: u64,
}

impl Default for PlaygroundState {
    fn default() -> Self {
        PlaygroundState {
            sides: [
                PlaygroundSide::new(SideSource::RunModel),
                PlaygroundSide::new(SideSource::Checkpoint),
            ],
            prompt: String::new(),
            chat: false,
            system: String::new(),
            params: SamplingParams {
                max_new_tokens: 64,
                ..SamplingParams::default()
            },
            error: None,
            message: None,
            validation_count: 5,
            batch_prompts: Vec::new(),
            batch_rows: Vec::new(),
            batch_next: None,
            prompts_loading: false,
            export_path: String::new(),
            checkpoints: Vec::new(),
            checkpoints_key: None,
            temp_seq: 0,
        }
    }
}

impl PlaygroundState {
    /// Whether anything runs in the background (the app keeps repainting then).
    pub fn busy(&self) -> bool {
        self.prompts_loading
            || self
                .sides
                .iter()
                .any(|s| s.loading.is_some() || s.generating())
    }

    /// Whether any side is generating.
    pub fn generating(&self) -> bool {
        self.sides.iter().any(PlaygroundSide::generating)
    }

    /// Whether every loaded side has a chat template (and at least one is loaded).
    pub fn chat_available(&self) -> bool {
        let loaded: Vec<_> = self
            .sides
            .iter()
            .filter_map(|s| s.generator.as_ref())
            .collect();
        !loaded.is_empty() && loaded.iter().all(|g| g.has_chat_template())
    }

    /// Takes a list of prompts read by a job (or the reason it could not be read).
    fn take_prompts(&mut self, result: Result<(Vec<String>, String), JobError>) {
        self.prompts_loading = false;
        match result {
            Ok((prompts, message)) => {
                self.message = Some(message);
                self.batch_prompts = prompts;
                self.error = None;
            }
            Err(e) => self.error = Some(e),
        }
    }
}

/// What the playground's jobs report (inside [`crate::gui::jobs::JobOutput::Playground`]).
pub enum PgMsg {
    /// Side `side`'s load number `seq` finished.
    Loaded {
        /// The side.
        side: usize,
        /// The load request.
        seq: u64,
        /// The generator and its name, or why not.
        result: Result<(Arc<Generator>, String), JobError>,
    },
    /// A file dialog chose a path.
    Picked(PgPick, PathBuf),
    /// A prompt list was read: the prompts and what to say about them.
    Prompts(Result<(Vec<String>, String), JobError>),
    /// The run's checkpoints were listed.
    Checkpoints(Vec<(u64, PathBuf)>),
    /// An event of side `side`'s generation number `seq`.
    Gen {
        /// The side.
        side: usize,
        /// The generation.
        seq: u64,
        /// The event.
        event: GenEvent,
    },
    /// Side `side`'s generation number `seq` has ended (after its last event).
    GenEnded {
        /// The side.
        side: usize,
        /// The generation.
        seq: u64,
    },
    /// The comparison was written (what to say), or not.
    Exported(Result<String, JobError>),
}

const SIDE_NAMES: [&str; 2] = ["Left", "Right"];

/// The in-app picker's title and what it chooses (as the system dialog's filters).
pub fn pick_kind(target: PgPick) -> (&'static str, crate::gui::file_picker::PickKind) {
    use crate::gui::file_picker::PickKind;
    match target {
        PgPick::Checkpoint(_) => ("Choose a checkpoint folder", PickKind::Folder),
        PgPick::Folder(_) => ("Choose a model folder", PickKind::Folder),
        PgPick::Adapter(_) => ("Choose an adapter folder", PickKind::Folder),
        PgPick::Gguf(_) => ("Choose a GGUF file", PickKind::File(vec!["gguf"])),
        PgPick::Prompts => (
            "Choose a prompt list",
            PickKind::File(vec!["txt", "jsonl", "ndjson"]),
        ),
        PgPick::Export => ("Export the comparison", PickKind::Save(vec!["jsonl"])),
    }
}

/// A dialog's answer (system or in-app) as a report for [`on_message`] (`None`: nothing
/// to report).
pub fn picked(target: PgPick, path: Option<PathBuf>) -> Option<PgMsg> {
    match path {
        Some(p) => Some(PgMsg::Picked(target, p)),
        None if target == PgPick::Prompts => Some(PgMsg::Prompts(Err(JobError::other(
            "no prompt file chosen",
        )))),
        None => None,
    }
}

/// Folds a job's report into the state; returns the follow-up actions (the reducer of the
/// playground: no I/O, no threads).
pub fn on_message(pg: &mut PlaygroundState, msg: PgMsg) -> Vec<PgAction> {
    match msg {
        PgMsg::Loaded { side, seq, result } => {
            let sd = &mut pg.sides[side];
            if sd.seq != seq {
                return Vec::new();
            }
            sd.loading = None;
            match result {
                Ok((g, name)) => {
                    sd.generator = Some(g);
                    sd.loaded_name = name;
                    sd.load_error = None;
                }
                Err(e) => {
                    sd.generator = None;
                    sd.loaded_name.clear();
                    sd.load_error = Some(e);
                }
            }
            if !pg.chat_available() {
                pg.chat = false;
            }
        }
        PgMsg::Picked(target, path) => {
            let text = path.display().to_string();
            match target {
                PgPick::Checkpoint(i) => pg.sides[i].checkpoint = text,
                PgPick::Folder(i) | PgPick::Gguf(i) => pg.sides[i].folder = text,
                PgPick::Adapter(i) => pg.sides[i].adapter = text,
                PgPick::Export => pg.export_path = text,
                PgPick::Prompts => {
                    pg.prompts_loading = true;
                    return vec![PgAction::ReadPrompts(path)];
                }
            }
        }
        PgMsg::Prompts(result) => pg.take_prompts(result),
        PgMsg::Checkpoints(list) => pg.checkpoints = list,
        PgMsg::Gen { side, seq, event } => {
            let sd = &mut pg.sides[side];
            if sd.handle.as_ref().is_some_and(|h| h.seq == seq) && sd.apply_event(event) {
                sd.handle = None;
            }
        }
        PgMsg::GenEnded { side, seq } => {
            let sd = &mut pg.sides[side];
            // A thread that ended without its last event (it cannot, but never hang on it).
            if sd.handle.as_ref().is_some_and(|h| h.seq == seq) {
                if sd.output.stop_reason.is_none() && sd.output.error.is_none() {
                    sd.output.error = Some("the generation thread ended unexpectedly".into());
                }
                sd.handle = None;
            }
        }
        PgMsg::Exported(result) => match result {
            Ok(message) => {
                pg.error = None;
                pg.message = Some(message);
            }
            Err(e) => pg.error = Some(e),
        },
    }
    Vec::new()
}

/// Moves a batch on once both sides are done with its current prompt (every frame).
pub fn tick(pg: &mut PlaygroundState, jobs: &Jobs) {
    let Some(i) = pg.batch_next else { return };
    if pg.generating() {
        return;
    }
    let answer = |o: &SideOutput| match &o.error {
        Some(e) => format!("error: {e}"),
        None => o.text.clone(),
    };
    let cancelled = pg
        .sides
        .iter()
        .any(|sd| sd.output.stop_reason == Some(StopReason::Cancelled));
    if let Some(p) = pg.batch_prompts.get(i).cloned() {
        pg.batch_rows.push(BatchRow {
            prompt: p,
            left: answer(&pg.sides[0].output),
            right: answer(&pg.sides[1].output),
        });
    }
    pg.batch_next = None;
    if !cancelled && i + 1 < pg.batch_prompts.len() {
        let next = pg.batch_prompts[i + 1].clone();
        if start_generation(pg, jobs, &next).is_ok() {
            pg.batch_next = Some(i + 1);
        }
    }
}

/// Starts both loaded sides on `prompt` with the current settings.
fn start_generation(pg: &mut PlaygroundState, jobs: &Jobs, prompt: &str) -> Result<(), JobError> {
    if prompt.trim().is_empty() {
        return Err(JobError::of(
            ErrorKind::Config,
            "the prompt is empty: type a prompt first",
        ));
    }
    pg.params.validate()?;
    if pg.sides.iter().all(|sd| sd.generator.is_none()) {
        return Err(JobError::of(
            ErrorKind::Model,
            "no model is loaded: press Load on the left or right side first",
        ));
    }
    let system = Some(pg.system.trim()).filter(|s| !s.is_empty());
    for (i, sd) in pg.sides.iter_mut().enumerate() {
        sd.handle = None;
        sd.output = SideOutput::default();
        let Some(g) = sd.generator.clone() else {
            continue;
        };
        let p = if pg.chat && g.has_chat_template() {
            Prompt::chat(system, prompt)
        } else {
            Prompt::Completion(prompt.to_string())
        };
        sd.output.started_at = Some(Instant::now());
        sd.gen_seq += 1;
        let request = GenerationRequest {
            generator: g,
            prompt: p,
            params: pg.params.clone(),
        };
        sd.handle = Some(worker::generate(jobs, i, sd.gen_seq, request));
    }
    Ok(())
}

fn settings_json(pg: &PlaygroundState) -> serde_json::Value {
    let p = &pg.params;
    serde_json::json!({
        "chat": pg.chat,
        "system": pg.system,
        "max_new_tokens": p.max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "repetition_penalty": p.repetition_penalty,
        "seed": p.seed,
        "stop_on_eos": p.stop_on_eos,
    })
}

/// The rows "Export comparison" writes: the batch table, else the current prompt.
fn comparison_rows(pg: &PlaygroundState) -> Result<Vec<BatchRow>, JobError> {
    if !pg.batch_rows.is_empty() {
        return Ok(pg.batch_rows.clone());
    }
    let have_output = pg
        .sides
        .iter()
        .any(|sd| sd.output.stop_reason.is_some() || sd.output.error.is_some());
    if !have_output || pg.prompt.trim().is_empty() {
        return Err(JobError::other(
            "nothing to export yet: generate an answer or run a prompt list",
        ));
    }
    Ok(vec![BatchRow {
        prompt: pg.prompt.clone(),
        left: pg.sides[0].output.text.clone(),
        right: pg.sides[1].output.text.clone(),
    }])
}

/// Carries out a playground action (called by the app after the frame). File dialogs are
/// the app's ([`crate::gui::action::Action::PlaygroundPick`]), as for every panel.
pub fn apply(pg: &mut PlaygroundState, s: &Session, action: PgAction, jobs: &Jobs) {
    match action {
        PgAction::Load(i) => load(pg, s, i, jobs),
        PgAction::Generate => {
            pg.batch_next = None;
            let prompt = pg.prompt.clone();
            pg.error = start_generation(pg, jobs, &prompt).err();
        }
        PgAction::Cancel => {
            for h in pg.sides.iter().filter_map(|sd| sd.handle.as_ref()) {
                h.cancel();
            }
        }
        PgAction::ValidationPrompts => {
            let n = pg.validation_count.max(1);
            pg.prompts_loading = true;
            worker::take_validation_prompts(jobs, s.config.resolved_data(), n);
        }
        PgAction::ReadPrompts(path) => {
            pg.prompts_loading = true;
            worker::read_prompts(jobs, path);
        }
        PgAction::RunBatch => run_batch(pg, jobs),
        PgAction::Export => export(pg, jobs),
        PgAction::RefreshCheckpoints(dir) => worker::list_checkpoints(jobs, dir),
    }
}

/// Starts loading side `i` from what its fields say.
fn load(pg: &mut PlaygroundState, s: &Session, i: usize, jobs: &Jobs) {
    let out_dir = s.output_dir();
    let config = &s.config;
    let sd = &pg.sides[i];
    let adapter = Some(sd.adapter.trim())
        .filter(|a| !a.is_empty())
        .map(|a| config.resolve_path(Path::new(a)));
    let spec = match sd.source {
        SideSource::RunModel => worker::LoadSpec::Run {
            config: Box::new(config.clone()),
            adapter,
        },
        SideSource::Checkpoint => {
            let ck = sd.checkpoint.trim();
            let dir = (!ck.is_empty()).then(|| config.resolve_path(Path::new(ck)));
            pg.temp_seq += 1;
            let temp = std::env::temp_dir().join(format!(
                "tunestudio-playground-{}-{}",
                std::process::id(),
                pg.temp_seq
            ));
            worker::LoadSpec::Checkpoint { dir, out_dir, temp }
        }
        SideSource::Folder | SideSource::Gguf => {
            let typed = sd.folder.trim().to_string();
            if typed.is_empty() {
                pg.sides[i].load_error = Some(JobError::of(
                    ErrorKind::Config,
                    "type a model folder, hub id or GGUF file first (or choose one)",
                ));
                return;
            }
            let local = config.resolve_path(Path::new(&typed));
            // A GGUF file is final: its adapter, if any, is merged in.
            let adapter = adapter.filter(|_| sd.source == SideSource::Folder);
            worker::LoadSpec::Folder {
                typed,
                local,
                adapter,
            }
        }
    };
    let sd = &mut pg.sides[i];
    sd.seq += 1;
    sd.loading = Some(sd.seq);
    sd.load_error = None;
    sd.handle = None;
    worker::load_side(jobs, i, sd.seq, spec);
}

/// Opens the system file dialog for `target` in a job (the app calls it when the session has
/// one; else it opens the in-app picker). `starts` are checked there, not on the UI thread.
pub fn open_system_dialog(jobs: &Jobs, target: PgPick, starts: Vec<PathBuf>) {
    worker::pick(jobs, target, starts);
}

fn run_batch(pg: &mut PlaygroundState, jobs: &Jobs) {
    let Some(first) = pg.batch_prompts.first().cloned() else {
        pg.error = Some(JobError::of(
            ErrorKind::Config,
            "the prompt list is empty: load a .txt/.jsonl file or take validation prompts",
        ));
        return;
    };
    pg.batch_rows.clear();
    match start_generation(pg, jobs, &first) {
        Ok(()) => {
            pg.error = None;
            pg.batch_next = Some(0);
        }
        Err(e) => pg.error = Some(e),
    }
}

fn export(pg: &mut PlaygroundState, jobs: &Jobs) {
    let p = pg.export_path.trim();
    if p.is_empty() {
        pg.error = Some(JobError::of(
            ErrorKind::Config,
            "choose a file to export to first",
        ));
        return;
    }
    let path = PathBuf::from(p);
    match comparison_rows(pg) {
        Ok(rows) => {
            let names = [
                pg.sides[0].loaded_name.clone(),
                pg.sides[1].loaded_name.clone(),
            ];
            worker::export(jobs, rows, names, settings_json(pg), path);
        }
        Err(e) => pg.error = Some(e),
    }
}

#[cfg(test)]
mod tests;
