//! GGUF export of a run checkpoint, a Hugging Face model folder or a PEFT adapter folder:
//! works out where each weight comes from (the run's f32 masters, its trained tensors, the
//! base model's shards, an adapter to merge) and streams them through [`crate::gguf`].
//! A run from a random start whose base was never saved is rebuilt in memory instead.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use crate::gguf::{
    self, modelfile_text, ExportProgress, FileSource, GgufError, GgufPlan, GgufQuant, LoraMerge,
    ModelSource, ModelfileSpec, NamedFiles, WeightSource,
};
use crate::model::{ModelConfig, ModelError};

use super::checkpoint;
use super::config::InitMode;
use super::error::TrainError;
use super::export::checkpoint_config;
use super::samples::locate_model;

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct GgufExport {
    /// The GGUF file.
    pub path: PathBuf,
    /// The Ollama Modelfile beside it (`<stem>.Modelfile`).
    pub modelfile: PathBuf,
    /// The plan it followed (sizes, types, stop tokens).
    pub plan: GgufPlan,
}

/// What to export from: the resolved weight source and the model it describes.
pub struct ExportSource {
    /// The model's config.
    pub config: ModelConfig,
    /// The folder with its tokenizer files.
    pub model_dir: PathBuf,
    /// A name for `general.name` and file names.
    pub name: String,
    /// Where the weights come from.
    pub weights: Box<dyn WeightSource>,
}

fn model_err(context: String) -> impl FnOnce(ModelError) -> TrainError {
    move |cause| TrainError::Model { context, cause }
}

fn folder_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into())
}

/// Resolves `path`: a `checkpoint-<step>` folder, a run folder (its newest checkpoint), a
/// PEFT adapter folder (merged into `base`, or into the model its config names), or a
/// Hugging Face model folder.
pub fn export_source(path: &Path, base: Option<&Path>) -> Result<ExportSource, TrainError> {
    if path.join(checkpoint::STATE_FILE).is_file() {
        return checkpoint_source(path);
    }
    if let Some(ck) = checkpoint::latest_checkpoint(path) {
        return checkpoint_source(&ck);
    }
    if path.join("adapter_config.json").is_file() {
        return adapter_source(path, base);
    }
    let files =
        crate::model::resolve_model(&path.display().to_string()).map_err(model_err(format!(
            "`{}` is neither a run checkpoint, a PEFT adapter folder nor a model folder",
            path.display()
        )))?;
    let config = ModelConfig::from_file(&files.config).map_err(model_err(format!(
        "cannot read `{}`",
        files.config.display()
    )))?;
    let weights = NamedFiles::open(&files.weights, "")?;
    Ok(ExportSource {
        config,
        name: folder_name(&files.dir),
        model_dir: files.dir,
        weights: Box::new(FileSource {
            overrides: vec![],
            base: Some(weights),
            lora: None,
        }),
    })
}

fn adapter_source(dir: &Path, base: Option<&Path>) -> Result<ExportSource, TrainError> {
    let cfg_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|cause| TrainError::Io {
        path: cfg_path.clone(),
        cause,
    })?;
    let lora = crate::model::parse_adapter_config(&text, &cfg_path.display().to_string())
        .map_err(model_err("cannot read the adapter".into()))?;
    let named: Option<String> = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| {
            v.get("base_model_name_or_path")?
                .as_str()
                .map(str::to_string)
        });
    let base_spec = match (base, named) {
        (Some(b), _) => b.display().to_string(),
        (None, Some(n)) => {
            // PEFT writes the name it was given; a sibling folder of that name is the
            // usual layout of a local base.
            let sibling = dir.parent().map(|p| p.join(&n));
            match sibling.filter(|s| s.is_dir()) {
                Some(s) => s.display().to_string(),
                None => n,
            }
        }
        (None, None) => {
            return Err(GgufError::Unsupported {
                what: format!("the adapter `{}`", dir.display()),
                hint: "its adapter_config.json names no base model; pass --base <model folder>"
                    .into(),
            }
            .into())
        }
    };
    let files = crate::model::resolve_model(&base_spec).map_err(model_err(format!(
        "cannot find the adapter's base model `{base_spec}` (pass --base <model folder>)"
    )))?;
    let config = ModelConfig::from_file(&files.config).map_err(model_err(format!(
        "cannot read `{}`",
        files.config.display()
    )))?;
    let adapter = NamedFiles::open(
        &[dir.join("adapter_model.safetensors")],
        "base_model.model.",
    )?;
    Ok(ExportSource {
        config,
        name: format!("{}-{}", folder_name(&files.dir), folder_name(dir)),
        model_dir: files.dir.clone(),
        weights: Box::new(FileSource {
            overrides: vec![],
            base: Some(NamedFiles::open(&files.weights, "")?),
            lora: Some(LoraMerge {
                factors: vec![adapter],
                scale: lora.scale(),
            }),
        }),
    })
}

fn checkpoint_source(ck: &Path) -> Result<ExportSource, TrainError> {
    let run = checkpoint_config(ck)?;
    let state = checkpoint::read_state(ck)?;
    let located = locate_model(&run)?;
    let (model_dir, config_path, has_weights) = (located.dir, located.config, located.has_weights);
    let config = ModelConfig::from_file(&config_path).map_err(model_err(format!(
        "cannot read `{}`",
        config_path.display()
    )))?;
    let random = match run.model.init {
        InitMode::Random => true,
        InitMode::Pretrained => false,
        InitMode::Auto => !has_weights,
    };
    let run_name = run
        .output_dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| folder_name(&model_dir));
    let name = format!("{}-step{}", run_name, state.step);
    if random && state.lora {
        // The frozen base exists only as the seed that made it: rebuild it in memory.
        let mut model = super::export::load_trained_model(ck)?.0;
        model
            .merge_lora()
            .map_err(model_err("cannot merge the adapter".into()))?;
        return Ok(ExportSource {
            config,
            model_dir,
            name,
            weights: Box::new(ModelSource(model)),
        });
    }
    let mut overrides = Vec::new();
    if state.precision.master_weights() {
        overrides.push(NamedFiles::open(
            &[ck.join(checkpoint::OPTIMIZER_FILE)],
            "master.",
        )?);
    }
    overrides.push(NamedFiles::open(
        &[ck.join(checkpoint::TRAINABLE_FILE)],
        "",
    )?);
    let base = if random {
        None
    } else {
        let files = crate::model::resolve_model(&run.model_source()).map_err(model_err(
            format!("cannot find the base model `{}`", run.model_source()),
        ))?;
        Some(NamedFiles::open(&files.weights, "")?)
    };
    let weights: Box<dyn WeightSource> = if state.lora {
        Box::new(FileSource {
            overrides: vec![],
            base,
            lora: Some(LoraMerge {
                factors: overrides,
                scale: run.lora.to_model_config().scale(),
            }),
        })
    } else {
        Box::new(FileSource {
            overrides,
            base,
            lora: None,
        })
    };
    Ok(ExportSource {
        config,
        model_dir,
        name,
        weights,
    })
}

/// The default file of an export: `<name>-<quant>.gguf` in the run folder (beside the
/// checkpoints) or beside the model folder.
pub fn default_gguf_path(path: &Path, source: &ExportSource, quant: GgufQuant) -> PathBuf {
    let folder = if path.join(checkpoint::STATE_FILE).is_file() {
        path.parent().map(Path::to_path_buf)
    } else if checkpoint::latest_checkpoint(path).is_some() {
        Some(path.to_path_buf())
    } else {
        path.parent().map(Path::to_path_buf)
    };
    folder.unwrap_or_else(|| PathBuf::from(".")).join(format!(
        "{}-{}.gguf",
        source.name,
        quant.name()
    ))
}

/// Plans the export of `source` as `quant` (reads the tokenizer; no weight is read).
pub fn plan_gguf(source: &ExportSource, quant: GgufQuant) -> Result<GgufPlan, TrainError> {
    Ok(gguf::plan_export(
        &source.config,
        &source.model_dir,
        quant,
        &source.name,
    )?)
}

/// Writes `source` as a `quant` GGUF file at `dest` and an Ollama `Modelfile` beside it.
/// `progress` may cancel; then neither file is left behind.
pub fn export_gguf(
    source: &ExportSource,
    quant: GgufQuant,
    dest: &Path,
    replace: bool,
    progress: &mut dyn FnMut(&ExportProgress) -> ControlFlow<()>,
) -> Result<GgufExport, TrainError> {
    let plan = plan_gguf(source, quant)?;
    let path = gguf::write_gguf(&plan, source.weights.as_ref(), dest, replace, progress)?;
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let text = modelfile_text(&ModelfileSpec {
        gguf_file: file_name,
        stop_tokens: plan.stop_tokens.clone(),
        chat_template: plan.chat_template.clone(),
        system_prompt: None,
    });
    // `<stem>.Modelfile`: several quantizations of one run sit in one folder.
    let stem = path
        .file_stem()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into());
    let modelfile = path.with_file_name(format!("{stem}.Modelfile"));
    write_file_atomically(&modelfile, text.as_bytes())?;
    Ok(GgufExport {
        path,
        modelfile,
        plan,
    })
}

/// Writes `bytes` under a temporary name beside `path`, then renames it into place.
fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let tmp = path.with_file_name(format!(".{}.tmp-{}", folder_name(path), std::process::id()));
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |cause| TrainError::Io { path: p, cause }
    };
    std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}
