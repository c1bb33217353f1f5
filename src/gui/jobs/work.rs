//! The jobs' work itself: model and dataset summaries, the plan request, run history and
//! exports, called on the jobs' threads.

use super::*;

/// Total size of the files under `dir` (a download in progress).
pub(super) fn folder_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                stack.push(e.path());
            } else if meta.is_file() {
                total += meta.len();
            }
        }
    }
    total
}

/// Resolves a model and reads what the Model panel shows.
pub fn model_info(source: &str) -> Result<ModelInfo, JobError> {
    let source = source.trim();
    if source.is_empty() {
        return Err(JobError::of(
            ErrorKind::Config,
            "no model chosen: type a folder or a hub id like HuggingFaceTB/SmolLM2-135M",
        ));
    }
    let local = Path::new(source);
    // A local folder without weights is still a usable model (random initialisation),
    // so read it directly instead of requiring safetensors.
    // A bare config.json (e.g. a real architecture without its weights) is enough to plan memory.
    let (dir, weight_files, config_path) = if local.is_file() {
        let dir = local.parent().map(Path::to_path_buf).unwrap_or_default();
        (dir, Vec::new(), local.to_path_buf())
    } else if local.is_dir() {
        let weights = model::ModelFiles::from_dir(local)
            .map(|f| f.weights)
            .unwrap_or_default();
        (local.to_path_buf(), weights, local.join("config.json"))
    } else {
        let files = model::resolve_model(source)?;
        (files.dir.clone(), files.weights, files.config.clone())
    };
    let config = ModelConfig::from_file(&config_path)?;
    let dtype = ["torch_dtype", "dtype"].iter().find_map(|k| {
        config
            .raw
            .get(*k)
            .and_then(|v| v.as_str())
            .map(str::to_string)
    });
    let weight_bytes = weight_files
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let has_tokenizer = dir.join("tokenizer.json").is_file();
    let chat_template = if !has_tokenizer {
        None
    } else if dir.join("chat_template.jinja").is_file() {
        Some("chat_template.jinja".to_string())
    } else {
        std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .filter(|v| v.get("chat_template").is_some_and(|c| !c.is_null()))
            .map(|_| "tokenizer_config.json".to_string())
    };
    Ok(ModelInfo {
        source: source.to_string(),
        dir,
        parameters: config.num_parameters(),
        config,
        dtype,
        weight_files,
        weight_bytes,
        has_tokenizer,
        chat_template,
    })
}

/// The tokenizer of `model_dir`, from the cache when it is the same folder.
pub(super) fn tokenizer_for(
    cache: &Mutex<Option<(PathBuf, Arc<TokenizerBundle>)>>,
    model_dir: &str,
) -> Result<Arc<TokenizerBundle>, JobError> {
    let key = PathBuf::from(model_dir);
    if let Ok(guard) = cache.lock() {
        if let Some((dir, tok)) = guard.as_ref() {
            if *dir == key {
                return Ok(Arc::clone(tok));
            }
        }
    }
    let tok = Arc::new(TokenizerBundle::from_source(model_dir)?);
    if let Ok(mut guard) = cache.lock() {
        *guard = Some((key, Arc::clone(&tok)));
    }
    Ok(tok)
}

/// Opens a dataset and summarises it.
pub fn dataset_summary(cfg: &DataConfig) -> Result<DatasetSummary, JobError> {
    cfg.validate()?;
    let opened = data::open_data(cfg)?;
    let n = opened.main.len();
    let (detected, preference, columns, first_row) = if n > 0 {
        let row = opened.main.row(0)?;
        let columns = row
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        let mut text = serde_json::to_string_pretty(&row).unwrap_or_default();
        if text.chars().count() > 600 {
            text = text.chars().take(600).collect::<String>() + " …";
        }
        // As the preview decides (`is_preference_data`): pairs only under `format = auto`.
        let preference = (cfg.format == data::Format::Auto)
            .then(|| pref::detect_preference_format(&row, &cfg.columns))
            .flatten();
        (
            data::detect_format(&row, &cfg.columns),
            preference,
            columns,
            text,
        )
    } else {
        (None, None, Vec::new(), String::new())
    };
    Ok(DatasetSummary {
        files: opened
            .main
            .files()
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        num_rows: n,
        train_rows: opened.train_indices.len(),
        validation_rows: opened.heldout_indices.len()
            + opened.separate_validation.as_ref().map_or(0, |v| v.len()),
        detected,
        preference,
        columns,
        first_row,
    })
}

/// The planner's request for the studio's settings: the run config through the one adapter
/// ([`train::plan_request`]), with the model the studio has loaded, its devices and the trained
/// tokens of the dataset's preview scan (`None` before one, or with packing: the scan's samples
/// are not packed). Its output is also the studio's "plan is stale" key
/// ([`crate::gui::shared::PlanKey`]).
pub fn plan_request(
    model: &ModelConfig,
    config: &RunConfig,
    devices: Vec<DeviceSpec>,
    trained_tokens: Option<plan::TrainedTokens>,
) -> Result<PlanRequest, String> {
    let mut req = train::plan_request(config, model.clone(), devices);
    req.trained_tokens = trained_tokens;
    // The studio trains in its own process: its window is part of the resident set.
    if let Some(p) = req.process.as_mut() {
        p.gui = true;
    }
    Ok(req)
}

/// The model source resolved against the config's folder (reads the disk: call it in a job).
pub fn model_source(config: &RunConfig) -> String {
    // A config.json file is a valid (plan-only) source here, which the library's
    // folder-or-hub-id resolution does not cover.
    let src = config.model.source.trim();
    let candidate = config.resolve_path(Path::new(src));
    if !src.is_empty() && crate::gui::disk::is_file(&candidate) {
        return candidate.display().to_string();
    }
    if !src.is_empty() && crate::gui::disk::is_dir(&candidate) {
        return candidate.display().to_string();
    }
    src.to_string()
}

/// Reads runs: each folder with a `metrics.jsonl`, or its sub-folders that have one.
pub fn read_history(dirs: &[PathBuf]) -> (Vec<HistoryRun>, Vec<String>) {
    let mut candidates = Vec::new();
    for d in dirs {
        if d.join(train::METRICS_FILE).is_file() {
            candidates.push(d.clone());
        } else if let Ok(entries) = std::fs::read_dir(d) {
            for e in entries.flatten() {
                if e.path().join(train::METRICS_FILE).is_file() {
                    candidates.push(e.path());
                }
            }
        }
    }
    candidates.sort();
    candidates.dedup();
    let mut runs = Vec::new();
    let mut errors = Vec::new();
    for dir in candidates {
        match train::read_metrics(&dir) {
            Ok(events) => {
                let finished = events.iter().rev().find_map(|e| match e {
                    train::Event::Finished { reason, .. } => Some(*reason),
                    _ => None,
                });
                runs.push(HistoryRun {
                    curves: train::RunCurves::from_events(&events),
                    dir,
                    finished,
                });
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    (runs, errors)
}

/// An export the Export panel asked for.
pub struct ExportRequest {
    /// What to write.
    pub kind: ExportKind,
    /// The checkpoint (or model / adapter folder, for GGUF).
    pub checkpoint: PathBuf,
    /// The folder (HF exports) or file / folder (GGUF) to write.
    pub dest: PathBuf,
    /// Weights dtype of merged and full exports.
    pub dtype: candle_core::DType,
    /// GGUF file type.
    pub gguf_quant: tunestudio::gguf::GgufQuant,
    /// Overwrite an existing GGUF file.
    pub replace: bool,
    /// Where the GGUF export reports its bytes.
    pub progress: Arc<crate::gui::shared::ExportProgressCell>,
}

/// A GGUF export: `dest` is the file, or a folder for `<name>-<quant>.gguf`.
pub(super) fn export_gguf(
    checkpoint: &std::path::Path,
    dest: &std::path::Path,
    quant: tunestudio::gguf::GgufQuant,
    replace: bool,
    progress: &crate::gui::shared::ExportProgressCell,
) -> Result<PathBuf, JobError> {
    let source = train::export_source(checkpoint, None).map_err(JobError::from)?;
    let file = if dest
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        dest.to_path_buf()
    } else {
        let default = train::default_gguf_path(checkpoint, &source, quant);
        dest.join(default.file_name().unwrap_or_default())
    };
    let written = train::export_gguf(&source, quant, &file, replace, &mut |p| {
        progress.total_bytes.store(p.bytes_total, Ordering::Relaxed);
        progress.done_bytes.store(p.bytes_done, Ordering::Relaxed);
        std::ops::ControlFlow::Continue(())
    })
    .map_err(JobError::from)?;
    Ok(written.path)
}
