//! Playground: load two models side by side (the run's base model, a run checkpoint, or a
//! model folder with an optional adapter), ask both the same prompt and watch the answers
//! stream; run a prompt list in batch and export the comparison as JSONL.
//!
//! Loading, file dialogs and prompt lists run on worker threads that report over one
//! channel ([`PgMsg`]); generation runs through [`spawn_generation`], one handle per side.
//! The panel only edits [`PlaygroundState`] and queues [`PgAction`]s.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use crossbeam_channel::{unbounded, Receiver, Sender};
use eframe::egui::{self, RichText, Ui};

use tunestudio::data::{self, Format, TokenizerBundle};
use tunestudio::infer::{
    spawn_generation, GenEvent, GenerationHandle, GenerationRequest, Generator, ModelSpec, Prompt,
    SamplingParams, StopReason,
};
use tunestudio::train::{self, RunConfig};

use crate::gui::app::Action;
use crate::gui::state::AppState;
use crate::gui::theme;

/// Where a side's model comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SideSource {
    /// The run config's model (random-initialised when the config says so).
    RunModel,
    /// A `checkpoint-<step>` folder of a run.
    Checkpoint,
    /// A model folder or hub id.
    Folder,
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
    pub load_error: Option<String>,
    /// The running generation.
    pub handle: Option<GenerationHandle>,
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
            output: SideOutput::default(),
        }
    }

    /// Whether a generation is streaming.
    pub fn generating(&self) -> bool {
        self.handle.is_some()
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
    pub error: Option<String>,
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
    tx: Sender<PgMsg>,
    rx: Receiver<PgMsg>,
    temp_seq: u64,
}

impl Default for PlaygroundState {
    fn default() -> Self {
        let (tx, rx) = unbounded();
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
            tx,
            rx,
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
}

/// The in-app picker's title and what it chooses (as the system dialog's filters).
fn pick_kind(target: PgPick) -> (&'static str, crate::gui::file_picker::PickKind) {
    use crate::gui::file_picker::PickKind;
    match target {
        PgPick::Checkpoint(_) => ("Choose a checkpoint folder", PickKind::Folder),
        PgPick::Folder(_) => ("Choose a model folder", PickKind::Folder),
        PgPick::Adapter(_) => ("Choose an adapter folder", PickKind::Folder),
        PgPick::Prompts => (
            "Choose a prompt list",
            PickKind::File(vec!["txt", "jsonl", "ndjson"]),
        ),
        PgPick::Export => ("Export the comparison", PickKind::Save(vec!["jsonl"])),
    }
}

/// Hands a dialog's answer (system or in-app) to the playground's message loop.
fn send_picked(tx: &crossbeam_channel::Sender<PgMsg>, target: PgPick, picked: Option<PathBuf>) {
    match picked {
        Some(p) => {
            let _ = tx.send(PgMsg::Picked(target, p));
        }
        None if target == PgPick::Prompts => {
            let _ = tx.send(PgMsg::Prompts(Err("no prompt file chosen".into())));
        }
        None => {}
    }
}

/// The in-app picker's answer for a playground field (`None`: cancelled).
pub fn picked(s: &mut AppState, target: PgPick, path: Option<PathBuf>) {
    send_picked(&s.playground.tx, target, path);
}

/// What a file dialog of the playground chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PgPick {
    /// A side's checkpoint folder.
    Checkpoint(usize),
    /// A side's model folder.
    Folder(usize),
    /// A side's adapter folder.
    Adapter(usize),
    /// A prompt list (.txt / .jsonl).
    Prompts,
    /// Where to export the comparison.
    Export,
}

/// What the playground asks the app to do.
#[derive(Debug, Clone)]
pub enum PgAction {
    /// Load side 0 (left) or 1 (right).
    Load(usize),
    /// Answer the prompt on both sides.
    Generate,
    /// Stop both sides (and the batch).
    Cancel,
    /// Open a file dialog.
    Pick(PgPick),
    /// Take prompts from the run's validation split.
    ValidationPrompts,
    /// Answer every prompt of the list on both sides.
    RunBatch,
    /// Write the comparison as JSONL.
    Export,
}

/// Reports of the playground's worker threads.
enum PgMsg {
    Loaded {
        side: usize,
        seq: u64,
        result: Result<(Arc<Generator>, String), String>,
    },
    Picked(PgPick, PathBuf),
    Prompts(Result<Vec<String>, String>),
}

/// What a side loads, captured on the UI thread.
enum LoadSpec {
    Run {
        config: Box<RunConfig>,
        adapter: Option<PathBuf>,
    },
    Checkpoint {
        dir: PathBuf,
        temp: PathBuf,
    },
    Folder {
        model: String,
        adapter: Option<PathBuf>,
    },
}

const SIDE_NAMES: [&str; 2] = ["Left", "Right"];

/// The run config's model in f32 on the CPU, without the run's LoRA (random-initialised
/// when the config says so, e.g. the demo), with its folder.
fn run_model(config: &RunConfig) -> Result<(tunestudio::model::CausalLm, PathBuf), String> {
    let mut c = config.clone();
    c.lora.enabled = false;
    c.training.precision = train::Precision::Fp32;
    c.model.dtype = train::ModelDtype::F32;
    c.training.activation_checkpointing = false;
    train::step::build_model(&c, &Device::Cpu).map_err(|e| e.to_string())
}

fn load(spec: LoadSpec) -> Result<(Arc<Generator>, String), String> {
    match spec {
        LoadSpec::Run { config, adapter } => {
            let (mut lm, dir) = run_model(&config)?;
            let mut name = format!("run model {}", config.model.source);
            if let Some(a) = &adapter {
                lm.load_adapter(a).map_err(|e| {
                    format!(
                        "the adapter {} does not fit the run model {}: {e}",
                        a.display(),
                        config.model.source
                    )
                })?;
                name = format!("{name} + {}", a.display());
            }
            let tok_dir = adapter
                .as_ref()
                .filter(|a| a.join("tokenizer.json").is_file())
                .cloned()
                .unwrap_or(dir);
            let tok = TokenizerBundle::load(&tok_dir).map_err(|e| e.to_string())?;
            let g = Generator::from_model(&lm, tok, &name).map_err(|e| e.to_string())?;
            Ok((Arc::new(g), name))
        }
        LoadSpec::Checkpoint { dir, temp } => {
            // A checkpoint may hold only the trained weights: export a complete model folder
            // (the adapter merged for LoRA runs) and load that.
            let _ = std::fs::remove_dir_all(&temp);
            let r = train::export_full(&dir, &temp, DType::F32)
                .map_err(|e| e.to_string())
                .and_then(|folder| {
                    Generator::load(&ModelSpec::new(folder.display().to_string()))
                        .map_err(|e| e.to_string())
                });
            // The weights are in memory now; the folder is not needed any more.
            let _ = std::fs::remove_dir_all(&temp);
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_else(|| dir.display().to_string());
            r.map(|g| (Arc::new(g), name))
        }
        LoadSpec::Folder { model, adapter } => {
            let mut spec = ModelSpec::new(model.clone());
            if let Some(a) = adapter {
                spec = spec.with_adapter(a);
            }
            let g = Generator::load(&spec).map_err(|e| e.to_string())?;
            let name = g.name().to_string();
            Ok((Arc::new(g), name))
        }
    }
}

/// Reads a prompt list: `.txt` one prompt per non-empty line; `.jsonl` one JSON string or
/// object per line (its `prompt`, `instruction` (+ `input`), `question` or `text`).
pub fn read_prompt_file(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let jsonl = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("ndjson"));
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if !jsonl {
            out.push(line.to_string());
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            format!(
                "{} line {}: not JSON ({e}); write one JSON string or object per line",
                path.display(),
                i + 1
            )
        })?;
        let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
        let p = if let Some(t) = v.as_str() {
            Some(t.to_string())
        } else if let Some(p) = s("prompt") {
            Some(p)
        } else if let Some(ins) = s("instruction") {
            Some(match s("input").filter(|x| !x.trim().is_empty()) {
                Some(inp) => format!("{ins}\n\n{inp}"),
                None => ins,
            })
        } else {
            s("question").or_else(|| s("text"))
        };
        match p {
            Some(p) if !p.trim().is_empty() => out.push(p),
            _ => {
                return Err(format!(
                    "{} line {}: no `prompt`, `instruction`, `question` or `text` field",
                    path.display(),
                    i + 1
                ))
            }
        }
    }
    if out.is_empty() {
        return Err(format!("{} holds no prompts", path.display()));
    }
    Ok(out)
}

/// Up to `n` prompts from the run's validation rows (the user turn / instruction).
fn validation_prompts(cfg: data::DataConfig, n: usize) -> Result<Vec<String>, String> {
    let opened = data::prepare::open_data(&cfg).map_err(|e| e.to_string())?;
    let (ds, idx): (&data::Dataset, Vec<usize>) = match &opened.separate_validation {
        Some(v) => (v, (0..v.len()).collect()),
        None => (&opened.main, opened.heldout_indices.clone()),
    };
    if idx.is_empty() {
        return Err(
            "the run has no validation rows: set a validation ratio or a validation file in Dataset"
                .into(),
        );
    }
    let mut out = Vec::new();
    let mut format = cfg.format;
    for i in idx.into_iter().take(n) {
        let row = ds.row(i).map_err(|e| e.to_string())?;
        if format == Format::Auto {
            format = data::detect_format(&row, &cfg.columns).unwrap_or(Format::Text);
        }
        let loc = || ds.location(i);
        let ex = data::to_example(&row, format, &cfg.columns, &loc).map_err(|e| e.to_string())?;
        let p = match ex {
            data::Example::Text { text } => text.chars().take(200).collect(),
            data::Example::PromptCompletion { prompt, .. } => prompt,
            data::Example::Chat { messages } => messages
                .iter()
                .find(|m| m.role == "user")
                .map(|m| m.content.clone())
                .unwrap_or_default(),
            data::Example::Pretokenized { .. } => continue,
        };
        if !p.trim().is_empty() {
            out.push(p);
        }
    }
    if out.is_empty() {
        return Err("no usable prompt in the validation rows".into());
    }
    Ok(out)
}

/// Drains worker reports and generation events into the state. Returns `true` when
/// something changed.
pub fn poll(s: &mut AppState) -> bool {
    let pg = &mut s.playground;
    let mut changed = false;
    while let Ok(msg) = pg.rx.try_recv() {
        changed = true;
        match msg {
            PgMsg::Loaded { side, seq, result } => {
                let sd = &mut pg.sides[side];
                if sd.seq != seq {
                    continue;
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
                    PgPick::Folder(i) => pg.sides[i].folder = text,
                    PgPick::Adapter(i) => pg.sides[i].adapter = text,
                    PgPick::Export => pg.export_path = text,
                    PgPick::Prompts => {
                        pg.prompts_loading = false;
                        match read_prompt_file(&path) {
                            Ok(p) => {
                                pg.message = Some(format!("{} prompts from {text}", p.len()));
                                pg.batch_prompts = p;
                                pg.error = None;
                            }
                            Err(e) => pg.error = Some(e),
                        }
                    }
                }
            }
            PgMsg::Prompts(r) => {
                pg.prompts_loading = false;
                match r {
                    Ok(p) => {
                        pg.message = Some(format!("{} validation prompts", p.len()));
                        pg.batch_prompts = p;
                        pg.error = None;
                    }
                    Err(e) => pg.error = Some(e),
                }
            }
        }
    }
    for sd in pg.sides.iter_mut() {
        let Some(h) = &sd.handle else { continue };
        let mut finished = false;
        while let Ok(ev) = h.events.try_recv() {
            changed = true;
            match ev {
                GenEvent::Started { prompt_tokens } => {
                    sd.output.prompt_tokens = Some(prompt_tokens)
                }
                GenEvent::Token { text, .. } => {
                    sd.output.text.push_str(&text);
                    sd.output.tokens += 1;
                }
                GenEvent::Done(out) => {
                    sd.output.text = out.text;
                    sd.output.tokens = out.tokens;
                    sd.output.tokens_per_sec = Some(out.tokens_per_sec);
                    sd.output.stop_reason = Some(out.stop_reason);
                    finished = true;
                }
                GenEvent::Error { message } => {
                    sd.output.error = Some(message);
                    finished = true;
                }
            }
        }
        // A thread that ended without its last event (it cannot, but never hang on it).
        if !finished && h.is_finished() && h.events.is_empty() {
            if sd.output.stop_reason.is_none() && sd.output.error.is_none() {
                sd.output.error = Some("the generation thread ended unexpectedly".into());
            }
            finished = true;
        }
        if finished {
            sd.handle = None;
        }
    }
    // The batch moves on when both sides are done with the current prompt.
    if let Some(i) = pg.batch_next {
        if !pg.generating() {
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
                if start_generation(pg, &next).is_ok() {
                    pg.batch_next = Some(i + 1);
                }
            }
            changed = true;
        }
    }
    changed
}

/// Starts both loaded sides on `prompt` with the current settings.
fn start_generation(pg: &mut PlaygroundState, prompt: &str) -> Result<(), String> {
    if prompt.trim().is_empty() {
        return Err("the prompt is empty: type a prompt first".into());
    }
    pg.params.validate().map_err(|e| e.to_string())?;
    if pg.sides.iter().all(|sd| sd.generator.is_none()) {
        return Err("no model is loaded: press Load on the left or right side first".into());
    }
    let system = Some(pg.system.trim()).filter(|s| !s.is_empty());
    for sd in pg.sides.iter_mut() {
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
        sd.handle = Some(spawn_generation(GenerationRequest {
            generator: g,
            prompt: p,
            params: pg.params.clone(),
        }));
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

/// Writes the comparison (the batch table, else the current prompt) as JSONL.
fn export(pg: &PlaygroundState, path: &Path) -> Result<usize, String> {
    let rows: Vec<BatchRow> = if pg.batch_rows.is_empty() {
        let have_output = pg
            .sides
            .iter()
            .any(|sd| sd.output.stop_reason.is_some() || sd.output.error.is_some());
        if !have_output || pg.prompt.trim().is_empty() {
            return Err("nothing to export yet: generate an answer or run a prompt list".into());
        }
        vec![BatchRow {
            prompt: pg.prompt.clone(),
            left: pg.sides[0].output.text.clone(),
            right: pg.sides[1].output.text.clone(),
        }]
    } else {
        pg.batch_rows.clone()
    };
    let settings = settings_json(pg);
    let mut out = String::new();
    for r in &rows {
        let v = serde_json::json!({
            "prompt": r.prompt,
            "left": r.left,
            "right": r.right,
            "left_model": pg.sides[0].loaded_name,
            "right_model": pg.sides[1].loaded_name,
            "settings": settings,
        });
        out.push_str(&v.to_string());
        out.push('\n');
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let mut f =
        std::fs::File::create(path).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    f.write_all(out.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(rows.len())
}

/// Carries out a playground action (called by the app after the frame).
pub fn apply(s: &mut AppState, action: PgAction, ctx: &egui::Context) {
    match action {
        PgAction::Load(i) => {
            let out_dir = s.output_dir();
            let config = s.config.clone();
            let pg = &mut s.playground;
            let sd = &mut pg.sides[i];
            let adapter = Some(sd.adapter.trim())
                .filter(|a| !a.is_empty())
                .map(|a| config.resolve_path(Path::new(a)));
            let spec = match sd.source {
                SideSource::RunModel => LoadSpec::Run {
                    config: Box::new(config),
                    adapter,
                },
                SideSource::Checkpoint => {
                    let ck = sd.checkpoint.trim();
                    let dir = if ck.is_empty() {
                        match train::latest_checkpoint(&out_dir) {
                            Some(d) => d,
                            None => {
                                sd.load_error = Some(format!(
                                    "no checkpoint in {}: train first, or choose a checkpoint folder",
                                    out_dir.display()
                                ));
                                return;
                            }
                        }
                    } else {
                        config.resolve_path(Path::new(ck))
                    };
                    pg.temp_seq += 1;
                    let temp = std::env::temp_dir().join(format!(
                        "tunestudio-playground-{}-{}",
                        std::process::id(),
                        pg.temp_seq
                    ));
                    LoadSpec::Checkpoint { dir, temp }
                }
                SideSource::Folder => {
                    let m = sd.folder.trim();
                    if m.is_empty() {
                        sd.load_error =
                            Some("type a model folder or hub id first (or choose one)".into());
                        return;
                    }
                    let local = config.resolve_path(Path::new(m));
                    let model = if local.exists() {
                        local.display().to_string()
                    } else {
                        m.to_string()
                    };
                    LoadSpec::Folder { model, adapter }
                }
            };
            let sd = &mut pg.sides[i];
            sd.seq += 1;
            sd.loading = Some(sd.seq);
            sd.load_error = None;
            sd.handle = None;
            let (seq, tx, ctx) = (sd.seq, pg.tx.clone(), ctx.clone());
            let spawned = std::thread::Builder::new()
                .name("tunestudio-playground-load".into())
                .spawn(move || {
                    let result =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(spec)))
                            .unwrap_or_else(|_| Err("loading the model panicked (a bug)".into()));
                    let _ = tx.send(PgMsg::Loaded {
                        side: i,
                        seq,
                        result,
                    });
                    ctx.request_repaint();
                });
            if let Err(e) = spawned {
                sd.loading = None;
                sd.load_error = Some(format!("cannot start a loader thread: {e}"));
            }
        }
        PgAction::Generate => {
            let pg = &mut s.playground;
            pg.batch_next = None;
            let prompt = pg.prompt.clone();
            match start_generation(pg, &prompt) {
                Ok(()) => pg.error = None,
                Err(e) => pg.error = Some(e),
            }
        }
        PgAction::Cancel => {
            let pg = &mut s.playground;
            for sd in &pg.sides {
                if let Some(h) = &sd.handle {
                    h.cancel();
                }
            }
        }
        PgAction::Pick(target) => {
            let tx = s.playground.tx.clone();
            let ctx = ctx.clone();
            let start = Some(s.output_dir()).filter(|p| p.is_dir());
            if target == PgPick::Prompts {
                s.playground.prompts_loading = true;
            }
            if s.system_dialog.is_err() {
                let (title, kind) = pick_kind(target);
                s.open_picker(
                    crate::gui::state::PickFor::Playground(target),
                    title,
                    kind,
                    start,
                );
                return;
            }
            let _ = std::thread::Builder::new()
                .name("tunestudio-playground-dialog".into())
                .spawn(move || {
                    let mut d = rfd::FileDialog::new();
                    if let Some(dir) = start {
                        d = d.set_directory(dir);
                    }
                    let picked = match target {
                        PgPick::Checkpoint(_) | PgPick::Folder(_) | PgPick::Adapter(_) => {
                            d.pick_folder()
                        }
                        PgPick::Prompts => d
                            .add_filter("prompts", &["txt", "jsonl", "ndjson"])
                            .pick_file(),
                        PgPick::Export => d
                            .add_filter("JSON lines", &["jsonl"])
                            .set_file_name("comparison.jsonl")
                            .save_file(),
                    };
                    send_picked(&tx, target, picked);
                    ctx.request_repaint();
                });
        }
        PgAction::ValidationPrompts => {
            let cfg = s.config.resolved_data();
            let n = s.playground.validation_count.max(1);
            let tx = s.playground.tx.clone();
            let ctx = ctx.clone();
            s.playground.prompts_loading = true;
            let _ = std::thread::Builder::new()
                .name("tunestudio-playground-prompts".into())
                .spawn(move || {
                    let r = validation_prompts(cfg, n);
                    let _ = tx.send(PgMsg::Prompts(r));
                    ctx.request_repaint();
                });
        }
        PgAction::RunBatch => {
            let pg = &mut s.playground;
            let Some(first) = pg.batch_prompts.first().cloned() else {
                pg.error = Some(
                    "the prompt list is empty: load a .txt/.jsonl file or take validation prompts"
                        .into(),
                );
                return;
            };
            pg.batch_rows.clear();
            match start_generation(pg, &first) {
                Ok(()) => {
                    pg.error = None;
                    pg.batch_next = Some(0);
                }
                Err(e) => pg.error = Some(e),
            }
        }
        PgAction::Export => {
            let pg = &mut s.playground;
            let p = pg.export_path.trim();
            if p.is_empty() {
                pg.error = Some("choose a file to export to first".into());
                return;
            }
            let path = PathBuf::from(p);
            match export(pg, &path) {
                Ok(n) => {
                    pg.error = None;
                    pg.message = Some(format!("exported {n} row(s) to {}", path.display()));
                }
                Err(e) => pg.error = Some(e),
            }
        }
    }
}

fn push(actions: &mut Vec<Action>, a: PgAction) {
    actions.push(Action::Playground(a));
}

/// Draws the Playground panel.
pub fn show(ui: &mut Ui, s: &mut AppState, actions: &mut Vec<Action>) {
    theme::heading(
        ui,
        "Playground",
        "Ask two models the same prompt and compare the answers side by side.",
    );
    let checkpoints = train::list_checkpoints(&s.output_dir());
    let run_source = s.config.model.source.clone();
    let pg = &mut s.playground;

    ui.columns(2, |cols| {
        for (i, ui) in cols.iter_mut().enumerate() {
            side_picker(ui, i, pg, &checkpoints, &run_source, actions);
        }
    });

    theme::section(ui, "Ask both sides");
    let chat_ok = pg.chat_available();
    ui.horizontal(|ui| {
        let r = ui
            .add_enabled(chat_ok, egui::Checkbox::new(&mut pg.chat, "Chat"))
            .on_hover_text("Format the prompt with the models' chat template")
            .on_disabled_hover_text("Only when every loaded model has a chat template");
        let _ = r;
        if !chat_ok {
            ui.label(
                RichText::new("completion (no chat template)")
                    .small()
                    .weak(),
            );
        }
    });
    if pg.chat {
        egui::Grid::new("pg-system").num_columns(2).show(ui, |ui| {
            theme::text_row(
                ui,
                "System prompt",
                "Put first in the conversation (empty: the template's default)",
                &mut pg.system,
                "You are a helpful assistant.",
            );
        });
    }
    let l = ui.label("Prompt");
    ui.add(
        egui::TextEdit::multiline(&mut pg.prompt)
            .desired_rows(3)
            .desired_width(f32::INFINITY)
            .hint_text("Write a haiku about gradient descent."),
    )
    .labelled_by(l.id);

    egui::CollapsingHeader::new("Sampling")
        .default_open(true)
        .show(ui, |ui| {
            egui::Grid::new("pg-sampling")
                .num_columns(4)
                .show(ui, |ui| {
                    let p = &mut pg.params;
                    theme::drag_row(
                        ui,
                        "Max new tokens",
                        "Most tokens each side generates",
                        &mut p.max_new_tokens,
                        0..=100_000,
                        1.0,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Temperature",
                        "0 = greedy (always the most likely token)",
                        &mut p.temperature,
                        0.0..=5.0,
                        0.01,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Top-p",
                        "Nucleus sampling (1 = off)",
                        &mut p.top_p,
                        0.01..=1.0,
                        0.01,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Top-k",
                        "Keep the k most likely tokens (0 = off)",
                        &mut p.top_k,
                        0..=100_000,
                        1.0,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Repetition penalty",
                        "1 = off, 1.1 is typical",
                        &mut p.repetition_penalty,
                        0.01..=10.0,
                        0.01,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Seed",
                        "Same seed, same settings: same answer",
                        &mut p.seed,
                        0..=u64::MAX,
                        1.0,
                        "",
                    );
                    theme::check_row(
                        ui,
                        "Stop at end of sequence",
                        "Turn off to always generate the maximum number of tokens",
                        &mut p.stop_on_eos,
                        "stop at EOS",
                    );
                });
        });

    ui.horizontal(|ui| {
        let generating = pg.generating();
        let can = !generating && pg.sides.iter().any(|sd| sd.generator.is_some());
        if ui
            .add_enabled(
                can,
                egui::Button::new(RichText::new("Generate").strong())
                    .min_size(egui::vec2(100.0, 30.0)),
            )
            .on_hover_text("Answer the prompt on both sides")
            .on_disabled_hover_text("Load a model on at least one side first")
            .clicked()
        {
            push(actions, PgAction::Generate);
        }
        if ui
            .add_enabled(
                generating,
                egui::Button::new("Cancel").min_size(egui::vec2(90.0, 30.0)),
            )
            .on_hover_text("Stop both sides (and the batch)")
            .clicked()
        {
            push(actions, PgAction::Cancel);
        }
        if generating {
            ui.add(egui::Spinner::new());
        }
    });
    if let Some(e) = &pg.error {
        theme::error_box(ui, "Cannot generate", e);
    }
    if let Some(m) = &pg.message {
        ui.label(RichText::new(m).color(theme::ACCENT));
    }

    ui.add_space(6.0);
    ui.columns(2, |cols| {
        for (i, ui) in cols.iter_mut().enumerate() {
            answer(ui, i, &pg.sides[i]);
        }
    });

    theme::section(ui, "Prompt list");
    ui.horizontal(|ui| {
        if ui
            .button("Load prompts…")
            .on_hover_text(".txt: one prompt per line; .jsonl: `prompt` / `instruction` per line")
            .clicked()
        {
            push(actions, PgAction::Pick(PgPick::Prompts));
        }
        let l = ui.label("Validation prompts");
        ui.add(egui::DragValue::new(&mut pg.validation_count).range(1..=1000))
            .labelled_by(l.id);
        if ui
            .button("Take from validation")
            .on_hover_text("The first prompts of the run's validation split")
            .clicked()
        {
            push(actions, PgAction::ValidationPrompts);
        }
        let can_batch = !pg.batch_prompts.is_empty() && !pg.generating();
        if ui
            .add_enabled(can_batch, egui::Button::new("Run batch"))
            .on_hover_text("Answer every prompt of the list on both sides")
            .clicked()
        {
            push(actions, PgAction::RunBatch);
        }
        if pg.prompts_loading {
            ui.add(egui::Spinner::new());
        }
        ui.label(format!("{} prompt(s)", pg.batch_prompts.len()));
        if let Some(i) = pg.batch_next {
            ui.label(format!("answering {}/{}", i + 1, pg.batch_prompts.len()));
        }
    });
    if !pg.batch_rows.is_empty() {
        batch_table(ui, pg);
    }
    ui.horizontal(|ui| {
        let l = ui.label("Export file");
        ui.add(
            egui::TextEdit::singleline(&mut pg.export_path)
                .hint_text("comparison.jsonl")
                .desired_width(320.0),
        )
        .labelled_by(l.id);
        if ui
            .button("Choose…")
            .on_hover_text("Choose the export file")
            .clicked()
        {
            push(actions, PgAction::Pick(PgPick::Export));
        }
        if ui
            .button("Export comparison")
            .on_hover_text("Write prompt, left, right and the settings as JSON lines")
            .clicked()
        {
            push(actions, PgAction::Export);
        }
    });
}

fn side_picker(
    ui: &mut Ui,
    i: usize,
    pg: &mut PlaygroundState,
    checkpoints: &[(u64, PathBuf)],
    run_source: &str,
    actions: &mut Vec<Action>,
) {
    let name = SIDE_NAMES[i];
    theme::card(ui, |ui| {
        ui.label(RichText::new(name).strong());
        let sd = &mut pg.sides[i];
        egui::Grid::new(("pg-side", i))
            .num_columns(2)
            .show(ui, |ui| {
                theme::combo_row(
                    ui,
                    &format!("pg-source-{i}"),
                    &format!("{name} source"),
                    "Where this side's model comes from",
                    &mut sd.source,
                    &[
                        (SideSource::RunModel, "Run model"),
                        (SideSource::Checkpoint, "Run checkpoint"),
                        (SideSource::Folder, "Model folder"),
                    ],
                );
                match sd.source {
                    SideSource::RunModel => {
                        ui.label("Model");
                        ui.label(RichText::new(run_source).monospace());
                        ui.end_row();
                    }
                    SideSource::Checkpoint => {
                        let l = ui.label(format!("{name} checkpoint"));
                        ui.horizontal(|ui| {
                            ui.add(
                                egui::TextEdit::singleline(&mut sd.checkpoint)
                                    .hint_text("latest checkpoint of the run")
                                    .desired_width(200.0),
                            )
                            .labelled_by(l.id);
                            let current = if sd.checkpoint.is_empty() {
                                "latest".to_string()
                            } else {
                                "…".to_string()
                            };
                            egui::ComboBox::from_id_salt(("pg-ck", i))
                                .selected_text(current)
                                .width(80.0)
                                .show_ui(ui, |ui| {
                                    for (step, dir) in checkpoints {
                                        if ui
                                            .selectable_label(false, format!("step {step}"))
                                            .clicked()
                                        {
                                            sd.checkpoint = dir.display().to_string();
                                        }
                                    }
                                })
                                .response
                                .labelled_by(l.id);
                            if ui
                                .button("Choose…")
                                .on_hover_text(format!("Choose the {name} checkpoint folder"))
                                .clicked()
                            {
                                push(actions, PgAction::Pick(PgPick::Checkpoint(i)));
                            }
                        });
                        ui.end_row();
                    }
                    SideSource::Folder => {
                        let l = ui.label(format!("{name} model"));
                        ui.horizontal(|ui| {
                            ui.add(
                                egui::TextEdit::singleline(&mut sd.folder)
                                    .hint_text("model folder or org/name")
                                    .desired_width(240.0),
                            )
                            .labelled_by(l.id);
                            if ui
                                .button("Choose…")
                                .on_hover_text(format!("Choose the {name} model folder"))
                                .clicked()
                            {
                                push(actions, PgAction::Pick(PgPick::Folder(i)));
                            }
                        });
                        ui.end_row();
                    }
                }
                if sd.source != SideSource::Checkpoint {
                    let l = ui.label(format!("{name} adapter"));
                    ui.horizontal(|ui| {
                        ui.add(
                            egui::TextEdit::singleline(&mut sd.adapter)
                                .hint_text("optional PEFT adapter folder")
                                .desired_width(240.0),
                        )
                        .labelled_by(l.id);
                        if ui
                            .button("Choose…")
                            .on_hover_text(format!("Choose the {name} adapter folder"))
                            .clicked()
                        {
                            push(actions, PgAction::Pick(PgPick::Adapter(i)));
                        }
                    });
                    ui.end_row();
                }
            });
        ui.horizontal(|ui| {
            let loading = sd.loading.is_some();
            if ui
                .add_enabled(
                    !loading && !sd.generating(),
                    egui::Button::new(format!("Load {name}")),
                )
                .on_hover_text("Load this side's model in the background")
                .clicked()
            {
                push(actions, PgAction::Load(i));
            }
            if loading {
                ui.add(egui::Spinner::new());
                ui.label("loading…");
            } else if sd.generator.is_some() {
                ui.label(RichText::new(format!("loaded: {}", sd.loaded_name)).color(theme::OK));
            } else if sd.load_error.is_none() {
                ui.label(RichText::new("not loaded").weak());
            }
        });
        if let Some(e) = &sd.load_error {
            theme::error_box(ui, &format!("{name} could not be loaded"), e);
        }
    });
}

fn answer(ui: &mut Ui, i: usize, sd: &PlaygroundSide) {
    let name = SIDE_NAMES[i];
    theme::card(ui, |ui| {
        ui.horizontal(|ui| {
            ui.label(RichText::new(format!("{name} answer")).strong());
            let o = &sd.output;
            let mut info = format!("{} tokens", o.tokens);
            if let Some(r) = o.rate() {
                info.push_str(&format!(" · {r:.1} tok/s"));
            }
            if let Some(r) = &o.stop_reason {
                info.push_str(&format!(" · {r}"));
            } else if sd.generating() {
                info.push_str(" · generating");
            }
            ui.label(RichText::new(info).small().weak());
        });
        if let Some(e) = &sd.output.error {
            theme::error_box(ui, &format!("{name} failed"), e);
        }
        let font = egui::TextStyle::Monospace.resolve(ui.style());
        let color = ui.visuals().text_color();
        crate::gui::text::bidi_label(ui, &sd.output.text, font, color);
    });
}

fn batch_table(ui: &mut Ui, pg: &PlaygroundState) {
    egui::Grid::new("pg-batch")
        .num_columns(3)
        .striped(true)
        .max_col_width(360.0)
        .show(ui, |ui| {
            ui.label(RichText::new("Batch prompt").strong());
            ui.label(RichText::new(format!("Left: {}", pg.sides[0].loaded_name)).strong());
            ui.label(RichText::new(format!("Right: {}", pg.sides[1].loaded_name)).strong());
            ui.end_row();
            for r in &pg.batch_rows {
                let body = egui::TextStyle::Body.resolve(ui.style());
                let mono = egui::TextStyle::Monospace.resolve(ui.style());
                let color = ui.visuals().text_color();
                // Each cell in its own column-wide scope, so a right-to-left answer is
                // right-aligned within its column.
                for (text, font) in [(&r.prompt, body), (&r.left, mono.clone()), (&r.right, mono)] {
                    ui.vertical(|ui| {
                        ui.set_max_width(360.0);
                        crate::gui::text::bidi_label(ui, text, font, color);
                    });
                }
                ui.end_row();
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_files_read_txt_and_jsonl() {
        let dir = tempfile::tempdir().expect("tempdir");
        let txt = dir.path().join("p.txt");
        std::fs::write(&txt, "first\n\n  second  \n").expect("write");
        assert_eq!(
            read_prompt_file(&txt).expect("txt"),
            vec!["first", "second"]
        );
        let jl = dir.path().join("p.jsonl");
        std::fs::write(
            &jl,
            "\"plain\"\n{\"prompt\": \"a\"}\n{\"instruction\": \"b\", \"input\": \"c\"}\n",
        )
        .expect("write");
        assert_eq!(
            read_prompt_file(&jl).expect("jsonl"),
            vec!["plain", "a", "b\n\nc"]
        );
        std::fs::write(&jl, "{\"other\": 1}\n").expect("write");
        let e = read_prompt_file(&jl).expect_err("no prompt field");
        assert!(e.contains("line 1"), "{e}");
    }
}
