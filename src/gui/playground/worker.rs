//! The Playground's background work, all of it through [`Jobs`] (so the status bar and
//! [`Jobs::in_flight`] count it): loading a side's model, file dialogs, reading prompt
//! lists, listing checkpoints, exporting the comparison, and streaming a generation.
//! Each job reports a [`PgMsg`] inside [`JobOutput::Playground`]; nothing here touches the
//! UI state.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device};

use tunestudio::data::{self, Format, TokenizerBundle};
use tunestudio::infer::{spawn_generation, GenerationRequest, Generator, ModelSpec};
use tunestudio::train::{self, RunConfig};

use super::{BatchRow, PgMsg, PgPick};
use crate::gui::error::{ErrorKind, JobError};
use crate::gui::jobs::{JobOutput, Jobs};

/// What a side loads, captured on the UI thread (no file system access there).
pub(super) enum LoadSpec {
    /// The run config's model, with an optional adapter.
    Run {
        config: Box<RunConfig>,
        adapter: Option<PathBuf>,
    },
    /// A checkpoint folder (`None`: the latest one in `out_dir`).
    Checkpoint {
        dir: Option<PathBuf>,
        out_dir: PathBuf,
        temp: PathBuf,
    },
    /// A model folder (`local`, when it exists) or a hub id (`typed`).
    Folder {
        typed: String,
        local: PathBuf,
        adapter: Option<PathBuf>,
    },
}

/// A loaded side: the generator and what to call it.
pub(super) type Loaded = (Arc<Generator>, String);

/// A running generation as the UI holds it: dropping it cancels the generation.
#[derive(Debug)]
pub struct Generation {
    /// Which generation of its side this is (stale events are dropped).
    pub seq: u64,
    cancel: Arc<AtomicBool>,
}

impl Generation {
    /// Asks the generation to stop before its next token.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// Loads side `side` (request `seq`) in a job.
pub(super) fn load_side(jobs: &Jobs, side: usize, seq: u64, spec: LoadSpec) {
    jobs.spawn("playground-load", move |_| {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(spec)))
            .unwrap_or_else(|_| Err(JobError::other("loading the model panicked (a bug)")));
        Some(JobOutput::Playground(PgMsg::Loaded { side, seq, result }))
    });
}

/// Streams `request` for side `side`: the library's generation thread produces the events,
/// a job forwards each one (waking the UI) and ends when the generation ends.
pub(super) fn generate(
    jobs: &Jobs,
    side: usize,
    seq: u64,
    request: GenerationRequest,
) -> Generation {
    let handle = spawn_generation(request);
    let cancel = handle.cancel_flag();
    jobs.spawn("playground-generate", move |tx| {
        // The channel closes when the generation thread ends (after `Done` or `Error`).
        for event in handle.events.iter() {
            tx.send(JobOutput::Playground(PgMsg::Gen { side, seq, event }));
        }
        Some(JobOutput::Playground(PgMsg::GenEnded { side, seq }))
    });
    Generation { seq, cancel }
}

/// Opens the system file dialog for `target` in a job, in the first of `starts` that is a
/// folder.
pub(super) fn pick(jobs: &Jobs, target: PgPick, starts: Vec<PathBuf>) {
    jobs.spawn("playground-dialog", move |_| {
        let mut d = rfd::FileDialog::new();
        if let Some(dir) = starts.into_iter().find(|d| crate::gui::disk::is_dir(d)) {
            d = d.set_directory(dir);
        }
        let picked = match target {
            PgPick::Checkpoint(_) | PgPick::Folder(_) | PgPick::Adapter(_) => d.pick_folder(),
            PgPick::Gguf(_) => d.add_filter("GGUF", &["gguf"]).pick_file(),
            PgPick::Prompts => d
                .add_filter("prompts", &["txt", "jsonl", "ndjson"])
                .pick_file(),
            PgPick::Export => d
                .add_filter("JSON lines", &["jsonl"])
                .set_file_name("comparison.jsonl")
                .save_file(),
        };
        super::picked(target, picked).map(JobOutput::Playground)
    });
}

/// Reads a prompt list file in a job.
pub(super) fn read_prompts(jobs: &Jobs, path: PathBuf) {
    jobs.spawn("playground-prompts", move |_| {
        let result = read_prompt_file(&path)
            .map(|p| {
                let msg = format!("{} prompts from {}", p.len(), path.display());
                (p, msg)
            })
            .map_err(|e| JobError::of(ErrorKind::Data, e));
        Some(JobOutput::Playground(PgMsg::Prompts(result)))
    });
}

/// Takes up to `n` prompts from the run's validation rows in a job.
pub(super) fn take_validation_prompts(jobs: &Jobs, cfg: data::DataConfig, n: usize) {
    jobs.spawn("playground-prompts", move |_| {
        let result = validation_prompts(cfg, n).map(|p| {
            let msg = format!("{} validation prompts", p.len());
            (p, msg)
        });
        Some(JobOutput::Playground(PgMsg::Prompts(result)))
    });
}

/// Lists the checkpoints of `out_dir` in a job.
pub(super) fn list_checkpoints(jobs: &Jobs, out_dir: PathBuf) {
    jobs.spawn("playground-checkpoints", move |_| {
        let list = train::list_checkpoints(&out_dir);
        Some(JobOutput::Playground(PgMsg::Checkpoints(list)))
    });
}

/// Writes the comparison to `path` in a job.
pub(super) fn export(
    jobs: &Jobs,
    rows: Vec<BatchRow>,
    names: [String; 2],
    settings: serde_json::Value,
    path: PathBuf,
) {
    jobs.spawn("playground-export", move |_| {
        let result = write_comparison(&rows, &names, &settings, &path)
            .map(|n| format!("exported {n} row(s) to {}", path.display()))
            .map_err(|e| JobError::of(ErrorKind::Io, e));
        Some(JobOutput::Playground(PgMsg::Exported(result)))
    });
}

/// The run config's model in f32 on the CPU, without the run's LoRA (random-initialised
/// when the config says so, e.g. the demo), with its folder.
fn run_model(config: &RunConfig) -> Result<(tunestudio::model::CausalLm, PathBuf), JobError> {
    let mut c = config.clone();
    c.lora.enabled = false;
    c.training.precision = train::Precision::Fp32;
    c.model.dtype = train::ModelDtype::F32;
    c.training.activation_checkpointing = false;
    Ok(train::step::build_model(&c, &Device::Cpu)?)
}

fn load(spec: LoadSpec) -> Result<Loaded, JobError> {
    match spec {
        LoadSpec::Run { config, adapter } => load_run_model(&config, adapter),
        LoadSpec::Checkpoint { dir, out_dir, temp } => {
            let dir = match dir {
                Some(d) => d,
                None => train::latest_checkpoint(&out_dir).ok_or_else(|| {
                    JobError::of(
                        ErrorKind::Io,
                        format!(
                            "no checkpoint in {}: train first, or choose a checkpoint folder",
                            out_dir.display()
                        ),
                    )
                })?,
            };
            load_checkpoint(&dir, &temp)
        }
        LoadSpec::Folder {
            typed,
            local,
            adapter,
        } => {
            let model = if local.exists() {
                local.display().to_string()
            } else {
                typed
            };
            let mut spec = ModelSpec::new(model);
            if let Some(a) = adapter {
                spec = spec.with_adapter(a);
            }
            let g = Generator::load(&spec)?;
            let name = g.name().to_string();
            Ok((Arc::new(g), name))
        }
    }
}

fn load_run_model(config: &RunConfig, adapter: Option<PathBuf>) -> Result<Loaded, JobError> {
    let (mut lm, dir) = run_model(config)?;
    let mut name = format!("run model {}", config.model.source);
    if let Some(a) = &adapter {
        lm.load_adapter(a).map_err(|e| {
            JobError::from(e).context(format!(
                "the adapter {} does not fit the run model {}",
                a.display(),
                config.model.source
            ))
        })?;
        name = format!("{name} + {}", a.display());
    }
    let tok_dir = adapter
        .as_ref()
        .filter(|a| a.join("tokenizer.json").is_file())
        .cloned()
        .unwrap_or(dir);
    let tok = TokenizerBundle::load(&tok_dir)?;
    let g = Generator::from_model(&lm, tok, &name)?;
    Ok((Arc::new(g), name))
}

/// A checkpoint may hold only the trained weights: export a complete model folder (the
/// adapter merged for LoRA runs) to `temp`, load that, and remove it again.
fn load_checkpoint(dir: &Path, temp: &Path) -> Result<Loaded, JobError> {
    let _ = std::fs::remove_dir_all(temp);
    let r = train::export_full(dir, temp, DType::F32)
        .map_err(JobError::from)
        .and_then(|folder| {
            Generator::load(&ModelSpec::new(folder.display().to_string())).map_err(JobError::from)
        });
    // The weights are in memory now; the folder is not needed any more.
    let _ = std::fs::remove_dir_all(temp);
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| dir.display().to_string());
    r.map(|g| (Arc::new(g), name))
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
        let where_ = || format!("{} line {}", path.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            format!(
                "{}: not JSON ({e}); write one JSON string or object per line",
                where_()
            )
        })?;
        match json_prompt(&v) {
            Some(p) if !p.trim().is_empty() => out.push(p),
            _ => {
                return Err(format!(
                    "{}: no `prompt`, `instruction`, `question` or `text` field",
                    where_()
                ))
            }
        }
    }
    if out.is_empty() {
        return Err(format!("{} holds no prompts", path.display()));
    }
    Ok(out)
}

/// The prompt of one JSON line: a string, or an object's `prompt`, `instruction` (+ `input`),
/// `question` or `text`.
fn json_prompt(v: &serde_json::Value) -> Option<String> {
    let s = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
    if let Some(t) = v.as_str() {
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
    }
}

/// Up to `n` prompts from the run's validation rows (the user turn / instruction).
fn validation_prompts(cfg: data::DataConfig, n: usize) -> Result<Vec<String>, JobError> {
    let opened = data::prepare::open_data(&cfg)?;
    let (ds, idx): (&data::Dataset, Vec<usize>) = match &opened.separate_validation {
        Some(v) => (v, (0..v.len()).collect()),
        None => (&opened.main, opened.heldout_indices.clone()),
    };
    if idx.is_empty() {
        return Err(JobError::of(
            ErrorKind::Config,
            "the run has no validation rows: set a validation ratio or a validation file in Dataset",
        ));
    }
    let mut out = Vec::new();
    let mut format = cfg.format;
    for i in idx.into_iter().take(n) {
        let row = ds.row(i)?;
        if format == Format::Auto {
            format = data::detect_format(&row, &cfg.columns).unwrap_or(Format::Text);
        }
        let loc = || ds.location(i);
        let ex = data::to_example(&row, format, &cfg.columns, &loc)?;
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
        return Err(JobError::of(
            ErrorKind::Data,
            "no usable prompt in the validation rows",
        ));
    }
    Ok(out)
}

/// Writes `rows` as JSONL with the models' names and the settings; returns the rows written.
fn write_comparison(
    rows: &[BatchRow],
    names: &[String; 2],
    settings: &serde_json::Value,
    path: &Path,
) -> Result<usize, String> {
    let mut out = String::new();
    for r in rows {
        let v = serde_json::json!({
            "prompt": r.prompt,
            "left": r.left,
            "right": r.right,
            "left_model": names[0],
            "right_model": names[1],
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
