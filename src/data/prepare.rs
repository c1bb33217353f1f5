//! The pipeline: open the data, split it, detect the format, tokenise and
//! label every row (in parallel), lint, compute stats, pack.

use crate::data::config::{DataConfig, Format};
use crate::data::formats::{detect_format, to_example};
use crate::data::hub;
use crate::data::labels::{label_example, pack, LabelContext, LabelledRow, TokenizedSample};
use crate::data::lints::{lint_rows, Lint, LintContext};
use crate::data::readers::{resolve_source, txt_per_file, Dataset};
use crate::data::stats::{compute_stats, DataStats};
use crate::data::template::{ChatTemplate, TemplateTokens, FALLBACK_CHATML};
use crate::data::tokenizer::{PadToken, TokenizerBundle};
use crate::data::DataError;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;
use std::path::Path;

/// The opened data and how it splits into train/validation.
#[derive(Debug)]
pub struct OpenedData {
    /// Rows of `data.path`.
    pub main: Dataset,
    /// Rows of `data.validation_path`, or the validation-named files of a
    /// folder/hub dataset.
    pub separate_validation: Option<Dataset>,
    /// Indices of `main` used for training.
    pub train_indices: Vec<usize>,
    /// Indices of `main` held out for validation (`validation_ratio`).
    pub heldout_indices: Vec<usize>,
}

impl OpenedData {
    /// Whether `main` row `i` is held out for validation.
    pub fn is_heldout(&self, i: usize) -> bool {
        self.heldout_indices.binary_search(&i).is_ok()
    }
}

/// A deterministic split of `0..n`: `(train, validation)`, both sorted.
/// `ratio > 0` holds out `round(n*ratio)` rows (at least 1, at most n-1).
pub fn split_indices(n: usize, ratio: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    if ratio <= 0.0 || n < 2 {
        return ((0..n).collect(), Vec::new());
    }
    let n_val = ((n as f64 * ratio).round() as usize).clamp(1, n - 1);
    let mut idx: Vec<usize> = (0..n).collect();
    idx.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let mut val = idx[..n_val].to_vec();
    let mut train = idx[n_val..].to_vec();
    val.sort_unstable();
    train.sort_unstable();
    (train, val)
}

/// Opens `cfg`'s data using the default HF cache and `HF_HUB_OFFLINE`.
pub fn open_data(cfg: &DataConfig) -> Result<OpenedData, DataError> {
    open_data_with_cache(cfg, &hub::hub_cache_dir(), hub::hub_offline())
}

/// Opens `cfg`'s data, resolving hub ids through `cache_dir`.
pub fn open_data_with_cache(
    cfg: &DataConfig,
    cache_dir: &Path,
    offline: bool,
) -> Result<OpenedData, DataError> {
    cfg.validate()?;
    let src = resolve_source(&cfg.path, cache_dir, offline)?;
    let main = Dataset::open_files(&src.train, txt_per_file(cfg.txt_split, &src))?;
    let mut separate_validation = None;
    let (train_indices, heldout_indices) = if let Some(vp) = &cfg.validation_path {
        let vsrc = resolve_source(vp, cache_dir, offline)?;
        separate_validation = Some(Dataset::open_files(
            &vsrc.train,
            txt_per_file(cfg.txt_split, &vsrc),
        )?);
        ((0..main.len()).collect(), Vec::new())
    } else if cfg.validation_ratio > 0.0 {
        split_indices(main.len(), cfg.validation_ratio, cfg.seed)
    } else {
        if !src.validation.is_empty() {
            separate_validation = Some(Dataset::open_files(
                &src.validation,
                txt_per_file(cfg.txt_split, &src),
            )?);
        }
        ((0..main.len()).collect(), Vec::new())
    };
    Ok(OpenedData {
        main,
        separate_validation,
        train_indices,
        heldout_indices,
    })
}

/// Format, template and masking decisions shared by every row.
pub struct Pipeline<'a> {
    /// The tokenizer.
    pub tok: &'a TokenizerBundle,
    /// The resolved format (never `Auto`).
    pub format: Format,
    /// Whether prompts are masked.
    pub completions_only: bool,
    /// The chat template (the model's, or the ChatML fallback).
    pub template: ChatTemplate,
    /// The tokenizer has no template and the fallback is in use.
    pub template_is_fallback: bool,
    cfg: &'a DataConfig,
}

impl<'a> Pipeline<'a> {
    /// Resolves the format from `first_row` (when `Auto`) and compiles the
    /// chat template.
    pub fn new(
        cfg: &'a DataConfig,
        tok: &'a TokenizerBundle,
        first_row: &serde_json::Value,
        first_location: &str,
    ) -> Result<Self, DataError> {
        let format = match cfg.format {
            Format::Auto => {
                detect_format(first_row, &cfg.columns).ok_or_else(|| DataError::UnknownFormat {
                    location: first_location.to_string(),
                    columns: first_row
                        .as_object()
                        .map(|o| o.keys().cloned().collect())
                        .unwrap_or_default(),
                })?
            }
            f => f,
        };
        let tokens = TemplateTokens {
            bos_token: tok.bos_token.clone(),
            eos_token: tok.eos_token.clone(),
            pad_token: tok.pad_token.clone(),
            unk_token: tok.unk_token.clone(),
        };
        let (template, template_is_fallback) = match &tok.chat_template {
            Some(src) => (ChatTemplate::new(src, tokens)?, false),
            None => (ChatTemplate::new(FALLBACK_CHATML, tokens)?, true),
        };
        Ok(Pipeline {
            tok,
            format,
            completions_only: cfg.completions_only_for(format),
            template,
            template_is_fallback,
            cfg,
        })
    }

    /// Whether the data is rendered with the chat template.
    pub fn is_chat(&self) -> bool {
        matches!(
            self.format,
            Format::Alpaca | Format::Chat | Format::ShareGpt | Format::LlamaFactoryV1
        )
    }

    /// Labels `indices` of `ds` (rows read with `rows`, in parallel).
    pub fn label_rows(
        &self,
        ds: &Dataset,
        indices: &[usize],
        rows: &[serde_json::Value],
        keep_text: bool,
    ) -> Result<Vec<LabelledRow>, DataError> {
        let ctx = LabelContext {
            tok: self.tok,
            template: Some(&self.template),
            completions_only: self.completions_only,
            max_length: self.cfg.max_length,
            keep_text,
        };
        indices
            .par_iter()
            .zip(rows.par_iter())
            .map(|(&i, row)| {
                let loc = || ds.location(i);
                let ex = to_example(row, self.format, &self.cfg.columns, &loc)?;
                label_example(i, &ex, &ctx, &loc)
            })
            .collect()
    }

    /// Dataset-level lint facts.
    pub fn lint_context(&self) -> LintContext {
        LintContext {
            no_pad_token: self.tok.pad().is_fallback,
            is_chat: self.is_chat(),
            no_chat_template: self.template_is_fallback,
            max_length: self.cfg.max_length,
        }
    }
}

/// Reads and labels `indices` of `ds`.
pub fn label_dataset(
    pipe: &Pipeline<'_>,
    ds: &Dataset,
    indices: &[usize],
    keep_text: bool,
) -> Result<Vec<LabelledRow>, DataError> {
    let in_order = indices.len() == ds.len() && indices.iter().enumerate().all(|(k, &i)| k == i);
    let rows = if in_order {
        ds.all_rows()?
    } else if indices.len() * 4 > ds.len() {
        let all = ds.all_rows()?;
        indices.iter().map(|&i| all[i].clone()).collect()
    } else {
        ds.rows_at(indices)?
    };
    pipe.label_rows(ds, indices, &rows, keep_text)
}

/// Everything the trainer needs.
#[derive(Debug, Clone)]
pub struct PreparedData {
    /// The resolved format.
    pub format: Format,
    /// Whether prompts are masked.
    pub completions_only: bool,
    /// Training samples (packed when `data.packing`), in dataset order.
    pub train: Vec<TokenizedSample>,
    /// Validation samples (packed when `data.packing`).
    pub validation: Vec<TokenizedSample>,
    /// Stats of the training split.
    pub train_stats: DataStats,
    /// Stats of the validation split, if any.
    pub validation_stats: Option<DataStats>,
    /// Lints of the training split (plus dataset-wide ones), worst first.
    pub lints: Vec<Lint>,
    /// Lints of the validation split.
    pub validation_lints: Vec<Lint>,
    /// The pad token for collation.
    pub pad: PadToken,
    /// Whether samples are packed.
    pub packed: bool,
    /// Rows read from `data.path`.
    pub num_source_rows: usize,
}

/// Reads, splits, tokenises and labels the dataset described by `cfg`.
/// `batch_size` only feeds the padding-waste statistic.
pub fn prepare_dataset(
    cfg: &DataConfig,
    tok: &TokenizerBundle,
    batch_size: usize,
) -> Result<PreparedData, DataError> {
    let data = open_data(cfg)?;
    prepare_opened(cfg, tok, &data, batch_size)
}

/// [`prepare_dataset`] on already opened data.
pub fn prepare_opened(
    cfg: &DataConfig,
    tok: &TokenizerBundle,
    data: &OpenedData,
    batch_size: usize,
) -> Result<PreparedData, DataError> {
    let first = data.main.row(0)?;
    let pipe = Pipeline::new(cfg, tok, &first, &data.main.location(0))?;
    let train_rows = label_dataset(&pipe, &data.main, &data.train_indices, false)?;
    let (val_rows, val_ds) = match &data.separate_validation {
        Some(v) => {
            let idx: Vec<usize> = (0..v.len()).collect();
            (label_dataset(&pipe, v, &idx, false)?, Some(v))
        }
        None if !data.heldout_indices.is_empty() => (
            label_dataset(&pipe, &data.main, &data.heldout_indices, false)?,
            Some(&data.main),
        ),
        None => (Vec::new(), None),
    };
    let lctx = pipe.lint_context();
    let lints = lint_rows(&train_rows, &lctx);
    let train_stats = compute_stats(&train_rows, batch_size, cfg.max_length);
    let keep = |rows: Vec<LabelledRow>| -> Vec<TokenizedSample> {
        rows.into_iter()
            .filter(|r| r.dropped.is_none())
            .map(|r| r.sample)
            .collect()
    };
    let (validation_stats, validation_lints) = if val_ds.is_some() {
        let vctx = LintContext {
            no_pad_token: false,
            ..lctx
        };
        (
            Some(compute_stats(&val_rows, batch_size, cfg.max_length)),
            lint_rows(&val_rows, &vctx),
        )
    } else {
        (None, Vec::new())
    };
    let mut train = keep(train_rows);
    let mut validation = keep(val_rows);
    if train.is_empty() {
        return Err(DataError::NothingToTrain {
            what: cfg.path.clone(),
            message: format!(
                "all {} rows were dropped ({}); see `tunestudio preview`",
                train_stats.num_rows,
                lints
                    .iter()
                    .map(|l| format!("{:?}: {}", l.kind, l.count))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    if cfg.packing {
        train = pack(&train, cfg.max_length);
        validation = pack(&validation, cfg.max_length);
    }
    Ok(PreparedData {
        format: pipe.format,
        completions_only: pipe.completions_only,
        train,
        validation,
        train_stats,
        validation_stats,
        lints,
        validation_lints,
        pad: tok.pad(),
        packed: cfg.packing,
        num_source_rows: data.main.len(),
    })
}
