//! `tunestudio preview`: the tokens of a few rows coloured by what is
//! trained (like Axolotl's `--debug`: each token as `text(label, id)`),
//! then stats and lints.
//!
//! Preference data (the format is `auto` and the first row is a TRL / LLaMA-Factory pair) is
//! shown as pairs instead: prompt, chosen and rejected, each as tokens with their lengths and
//! what truncation cut, then the pair lints (`preview_pairs.rs`).
//!
//! Exit status: 0 when no error-level lint fires, 2 when one does that is not allowed by name
//! (`--allow-lint`, `[data] allow`: the lints that would stop `tunestudio train`), 1 on
//! errors (unreadable data, bad config).

use anyhow::Context;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use tunestudio::data::lints::blocking;
use tunestudio::data::preference::{is_preference_data, PairLimits};
use tunestudio::data::{
    open_data, preview_opened, DataConfig, DataPreview, Format, Lint, PreviewOptions, RowSelection,
    Severity, TokenClass, TokenSpan, TokenizerBundle,
};
use tunestudio::train::RunConfig;
// Terminals apply bidi themselves, so the text stays in logical order; only spaces between
// tokens separate them.
use tunestudio::text::visible_keep_spaces as visible;

/// Arguments of `tunestudio preview`.
#[derive(Debug, clap::Args)]
pub struct PreviewArgs {
    /// A run config (`run.toml`): `[model] source` and `[data]` are read from it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model folder or hub id whose tokenizer and chat template are used
    /// (overrides `[model] source`).
    #[arg(long)]
    pub model: Option<String>,
    /// Data file, folder or hub dataset id (overrides `data.path`).
    #[arg(long)]
    pub data: Option<String>,
    /// Dataset format (auto, text, alpaca, prompt_completion, chat, sharegpt,
    /// llamafactory_v1, pretokenized); overrides `data.format`.
    #[arg(long)]
    pub format: Option<Format>,
    /// Maximum sequence length (overrides `data.max_length`).
    #[arg(long)]
    pub max_length: Option<usize>,
    /// Show the first N rows.
    #[arg(long, default_value_t = 3)]
    pub rows: usize,
    /// Show these rows instead (repeatable: `--row 3 --row 17`).
    #[arg(long)]
    pub row: Vec<usize>,
    /// Batch size for padding display and padding-waste stats (default:
    /// `[training] micro_batch` of `--config`, else 8).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Compute stats and lints from the shown rows only (for huge datasets).
    #[arg(long)]
    pub quick: bool,
    /// Print the preview as JSON instead of coloured text.
    #[arg(long)]
    pub json: bool,
    /// No ANSI colours (also when NO_COLOR is set or stdout is not a terminal).
    #[arg(long)]
    pub no_color: bool,
    /// Exit 0 despite an error-level lint, by name (repeatable; adds to `[data] allow`), as
    /// `tunestudio train --allow-lint` trains despite it, e.g. `--allow-lint pair-identical`.
    #[arg(long = "allow-lint", value_name = "LINT")]
    pub allow_lint: Vec<String>,
    /// Preference pairs: prompt tokens kept, from the prompt's end (TRL's `max_prompt_length`).
    #[arg(long)]
    pub max_prompt_length: Option<usize>,
    /// Preference pairs: tokens kept of each completion, from its start
    /// (TRL's `max_completion_length`).
    #[arg(long)]
    pub max_completion_length: Option<usize>,
}

/// Runs `tunestudio preview`.
pub fn run(args: PreviewArgs) -> anyhow::Result<ExitCode> {
    let run_config = args.config.as_deref().map(read_run_config).transpose()?;
    if let Some(config) = grpo_run(&args, run_config.as_ref()) {
        return crate::cli::preview_rollouts::run(&config, args.rows, args.json, use_color(&args));
    }
    let (model, cfg, micro_batch) = resolve(&args, run_config.as_ref())?;
    let tok = TokenizerBundle::from_source(&model)
        .with_context(|| format!("cannot load the tokenizer of {model}"))?;
    let opts = PreviewOptions {
        rows: if args.row.is_empty() {
            RowSelection::First(args.rows)
        } else {
            RowSelection::Indices(args.row.clone())
        },
        batch_size: args.batch_size.or(micro_batch).unwrap_or(8).max(1),
        full_scan: !args.quick,
    };
    let data = open_data(&cfg).with_context(|| format!("cannot preview {}", cfg.path))?;
    if is_preference_data(&cfg, &data).with_context(|| format!("cannot preview {}", cfg.path))? {
        let defaults = PairLimits::default();
        let limits = PairLimits {
            max_prompt_length: args.max_prompt_length.or(defaults.max_prompt_length),
            max_completion_length: args
                .max_completion_length
                .or(defaults.max_completion_length),
        };
        let color = use_color(&args);
        return crate::cli::preview_pairs::run(&cfg, &tok, &data, &opts, limits, args.json, color);
    }
    let mut preview = preview_opened(&cfg, &tok, &data, &opts)
        .with_context(|| format!("cannot preview {}", cfg.path))?;
    if let Some(run) = &run_config {
        preview.lints.extend(settings_lints(run, &model, &preview));
    }
    let code = exit_code(&preview.lints, &cfg.allow);
    write_out(code, |out| {
        if args.json {
            write_json(out, &preview)
        } else {
            render(out, &cfg, &tok, &preview, use_color(&args))
        }
    })
}

/// The run config of `--config`, read by the one run.toml reader as `tunestudio plan` reads
/// it (keys the preview does not use may be anything `train` would reject, and `train` names
/// them); a `[data]` key that does not parse is an error, since the preview reads `[data]`.
fn read_run_config(path: &std::path::Path) -> anyhow::Result<RunConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the run config {}", path.display()))?;
    let base = path.parent().unwrap_or(std::path::Path::new("."));
    let origin = path.display().to_string();
    let (config, problems) = tunestudio::train::read_run_config_leniently(&text, &origin, base)?;
    let data_problems: Vec<String> = problems
        .iter()
        .filter(|p| p.field.starts_with("data."))
        .map(|p| format!("  {}: {}", p.field, p.message))
        .collect();
    if !data_problems.is_empty() {
        anyhow::bail!(
            "{origin}: [data] has settings the preview cannot read:\n{}",
            data_problems.join("\n")
        );
    }
    Ok(config)
}

/// A GRPO run config (`[training] method = "grpo"`) that `train` would accept, with the flags
/// applied: its preview samples completions and scores them (`preview_rollouts.rs`). `None`
/// for any other run, and for a GRPO config with problems (its data is previewed instead).
fn grpo_run(args: &PreviewArgs, run_config: Option<&RunConfig>) -> Option<RunConfig> {
    let mut config = run_config.filter(|c| c.training.method.is_grpo())?.clone();
    if !config.validate().is_empty() {
        return None;
    }
    if let Some(m) = &args.model {
        config.model.source = m.clone();
    }
    if let Some(d) = &args.data {
        config.data.path = d.clone();
    }
    if let Some(n) = args.max_prompt_length {
        config.grpo.max_prompt_length = n;
    }
    if let Some(n) = args.max_completion_length {
        config.grpo.max_completion_length = n;
    }
    for lint in &args.allow_lint {
        if !config.data.allow.contains(lint) {
            config.data.allow.push(lint.clone());
        }
    }
    Some(config)
}

/// The model source and the data settings: the run config's, overridden by the flags (each
/// `--allow-lint` added to `[data] allow`).
fn resolve(
    args: &PreviewArgs,
    run_config: Option<&RunConfig>,
) -> anyhow::Result<(String, DataConfig, Option<usize>)> {
    let (model_source, mut cfg, micro_batch) = match run_config {
        Some(run) => (
            Some(run.model_source()).filter(|m| !m.is_empty()),
            run.resolved_data(),
            Some(run.training.micro_batch),
        ),
        None => (None, DataConfig::default(), None),
    };
    if let Some(d) = &args.data {
        cfg.path = d.clone();
    }
    if let Some(f) = args.format {
        cfg.format = f;
    }
    if let Some(m) = args.max_length {
        cfg.max_length = m;
    }
    for lint in &args.allow_lint {
        if !cfg.allow.contains(lint) {
            cfg.allow.push(lint.clone());
        }
    }
    let model = args.model.clone().or(model_source).context(
        "no model: pass --model DIR (or a hub id) or --config run.toml with [model] source",
    )?;
    if cfg.path.trim().is_empty() {
        anyhow::bail!("no data: pass --data PATH or --config run.toml with [data] path");
    }
    Ok((model, cfg, micro_batch))
}

fn use_color(args: &PreviewArgs) -> bool {
    !args.no_color && std::env::var_os("NO_COLOR").is_none() && std::io::stdout().is_terminal()
}

/// 2 when an error-level lint fires that `allow` does not name (it would stop a run), else 0.
pub(crate) fn exit_code(lints: &[Lint], allow: &[String]) -> ExitCode {
    if blocking(lints, allow).is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    }
}

/// Pretty JSON and a newline.
pub(crate) fn write_json(
    out: &mut impl Write,
    value: &impl serde::Serialize,
) -> anyhow::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value)?;
    writeln!(out)?;
    Ok(())
}

/// Writes to stdout with `write`, then exits with `code`; a closed pipe
/// (`preview ... | head`) is not an error.
pub(crate) fn write_out(
    code: ExitCode,
    write: impl FnOnce(&mut std::io::StdoutLock<'static>) -> anyhow::Result<()>,
) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    match write(&mut out) {
        Err(e) if is_broken_pipe(&e) => Ok(code),
        Err(e) => Err(e),
        Ok(()) => Ok(code),
    }
}

/// The run config's settings lints (`train::settings_lints`), as `tunestudio train` would find
/// them on this data: they stop a run like the data's, so the preview shows them beside those.
/// Keys the lenient reader could not read stay at their defaults (`train` names them).
fn settings_lints(
    run: &RunConfig,
    model: &str,
    preview: &tunestudio::data::DataPreview,
) -> Vec<tunestudio::data::Lint> {
    use tunestudio::train::settings_lints::{settings_lints, SettingsContext};
    // A local folder has weights when it holds safetensors; a hub id names a pretrained model.
    let folder = std::path::Path::new(model);
    let has_weights = !folder.is_dir()
        || std::fs::read_dir(folder).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        });
    let ctx = SettingsContext::new(
        run,
        has_weights,
        preview.num_train_rows,
        preview.stats.max_length_seen,
    );
    settings_lints(run, &ctx)
        .into_iter()
        .filter(|l| !run.data.allow.iter().any(|a| a == l.kind.id()))
        .collect()
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            || c.downcast_ref::<serde_json::Error>()
                .and_then(|j| j.io_error_kind())
                .is_some_and(|k| k == std::io::ErrorKind::BrokenPipe)
    })
}

pub(crate) struct Style {
    pub(crate) on: bool,
}

impl Style {
    pub(crate) fn paint(&self, code: &str, s: &str) -> String {
        if self.on {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
}

pub(crate) fn class_code(c: TokenClass) -> &'static str {
    match c {
        TokenClass::Trained => "32",
        TokenClass::Masked => "31",
        TokenClass::Mismatch => "1;35",
        TokenClass::Padding => "2",
    }
}

/// `text(label, id)` for one token; for the tokens of a character split between them
/// (byte-level BPE), the character once and each token's `label, id`, each in its class's
/// colour: `כ(-100, 162 · -100, 245)`.
pub(crate) fn group_body(st: &Style, text: &str, tokens: &[TokenSpan]) -> String {
    let parts: Vec<String> = tokens
        .iter()
        .map(|t| {
            let mut part = format!("{}, {}", t.label, t.id);
            if t.weight != 0.0 && t.weight != 1.0 {
                part.push_str(&format!(" w={}", t.weight));
            }
            st.paint(class_code(t.class), &part)
        })
        .collect();
    let first = tokens.first().map_or(TokenClass::Masked, |t| t.class);
    format!(
        "{}{}{}{}",
        st.paint(class_code(first), text),
        st.paint(class_code(first), "("),
        parts.join(" · "),
        st.paint(class_code(first), ")")
    )
}

fn render(
    out: &mut impl Write,
    cfg: &DataConfig,
    tok: &TokenizerBundle,
    p: &DataPreview,
    color: bool,
) -> anyhow::Result<()> {
    let st = Style { on: color };
    writeln!(
        out,
        "{} {}  format: {}  rows: {} ({} train, {} validation)",
        st.paint("1", "dataset"),
        cfg.path,
        p.format,
        p.num_rows,
        p.num_train_rows,
        p.num_validation_rows
    )?;
    writeln!(
        out,
        "tokenizer {}  vocab {}  pad {} ({}){}  max_length {}  batch {}  train on completions only: {}",
        tok.origin.display(),
        tok.vocab_size(),
        visible(&tok.token_texts(&[p.pad_id]).concat()),
        p.pad_id,
        if p.pad_is_fallback { " = EOS fallback" } else { "" },
        p.max_length,
        p.batch_size,
        if p.completions_only { "yes" } else { "no" },
    )?;
    if let Some(t) = &p.chat_template_origin {
        writeln!(out, "chat template: {t}")?;
    }
    writeln!(
        out,
        "legend: {} {} {} {}  — each token is text(label, id); a character split between tokens is text(label, id · label, id)",
        st.paint("32", "trained"),
        st.paint("31", "masked(-100)"),
        st.paint("1;35", "label≠token"),
        st.paint("2", "padding"),
    )?;
    render_rows(out, &st, p)?;
    render_stats(out, &st, p)?;
    render_lints(out, &st, &p.lints, &cfg.allow)?;
    Ok(())
}

/// Each shown row: its header line, then its tokens as text(label, id).
fn render_rows(out: &mut impl Write, st: &Style, p: &DataPreview) -> std::io::Result<()> {
    for r in &p.rows {
        writeln!(out)?;
        let mut head = format!(
            "── row {} · {} · {} tokens · {} trained",
            r.index, r.location, r.num_tokens, r.num_trained
        );
        if r.truncated {
            head.push_str(&format!(" · truncated from {}", r.full_len));
        }
        if let Some(d) = r.dropped {
            head.push_str(&format!(" · DROPPED: {}", d.describe()));
        }
        if r.split == tunestudio::data::SplitName::Validation {
            head.push_str(" · validation");
        }
        writeln!(out, "{}", st.paint("1", &head))?;
        let mut line = String::new();
        for g in r.groups(r.tokens.len()) {
            line.push_str(&group_body(st, &visible(&g.text), &r.tokens[g.tokens]));
            line.push(' ');
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// Row, token, truncation, padding and packing figures, and the token-length histogram.
fn render_stats(out: &mut impl Write, st: &Style, p: &DataPreview) -> std::io::Result<()> {
    let s = &p.stats;
    writeln!(out)?;
    writeln!(
        out,
        "{} ({})",
        st.paint("1", "── stats"),
        if p.full_scan {
            "all training rows"
        } else {
            "shown rows only (--quick)"
        }
    )?;
    writeln!(
        out,
        "rows {}  kept {}  dropped {}  tokens {}  trained {} ({:.1}%)",
        s.num_rows,
        s.num_samples,
        s.num_dropped,
        s.total_tokens,
        s.trained_tokens,
        100.0 * s.trained_fraction
    )?;
    writeln!(
        out,
        "length mean {:.1}  median {}  max {}  truncated at {}: {} rows ({:.1}%), {} lose trained tokens",
        s.mean_length,
        s.median_length,
        s.max_length_seen,
        p.max_length,
        s.num_truncated,
        100.0 * s.truncated_fraction,
        s.num_completion_truncated
    )?;
    writeln!(
        out,
        "padding waste at batch {}: {:.1}% in order, {:.1}% grouped by length;  packing: {} sequences of {} ({:.1}% full)",
        s.batch_size,
        100.0 * s.padding_waste,
        100.0 * s.padding_waste_grouped,
        s.packed_sequences,
        p.max_length,
        100.0 * s.packing_efficiency
    )?;
    let h = &s.histogram;
    let peak = h.counts.iter().copied().max().unwrap_or(0).max(1);
    let first = h.counts.iter().position(|&c| c > 0).unwrap_or(0);
    let last = h.counts.iter().rposition(|&c| c > 0).unwrap_or(0);
    writeln!(out, "token lengths (bin {}):", h.bin_width)?;
    for (i, &c) in h.counts.iter().enumerate().take(last + 1).skip(first) {
        let lo = i * h.bin_width;
        let bar = "█".repeat((c * 40).div_ceil(peak));
        let over = lo >= h.cutoff;
        let label = format!("{:>7}–{:<7} {:>6} ", lo, lo + h.bin_width - 1, c);
        let text = format!("{label}{bar}{}", if over { "  (truncated)" } else { "" });
        writeln!(out, "  {}", if over { st.paint("33", &text) } else { text })?;
    }
    Ok(())
}

/// The lints, each with its severity and example rows; an error allowed by name says so.
pub(crate) fn render_lints(
    out: &mut impl Write,
    st: &Style,
    lints: &[Lint],
    allow: &[String],
) -> std::io::Result<()> {
    writeln!(out)?;
    writeln!(out, "{}", st.paint("1", "── lints"))?;
    if lints.is_empty() {
        writeln!(out, "none")?;
    }
    let allowed = |l: &Lint| {
        l.severity == Severity::Error && blocking(std::slice::from_ref(l), allow).is_empty()
    };
    for l in lints {
        let (code, name) = match l.severity {
            Severity::Error => ("1;31", "ERROR"),
            Severity::Warning => ("33", "WARN "),
            Severity::Info => ("36", "INFO "),
        };
        let ex = if l.examples.is_empty() {
            String::new()
        } else {
            format!(
                " (rows {})",
                l.examples
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        let allowed = if allowed(l) {
            format!(" (allowed: {})", l.kind.id())
        } else {
            String::new()
        };
        writeln!(
            out,
            "{} {:?}: {}{}{}",
            st.paint(code, name),
            l.kind,
            l.message,
            ex,
            allowed
        )?;
    }
    Ok(())
}
