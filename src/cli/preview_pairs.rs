//! `tunestudio preview` on preference data: for each shown pair the prompt, then the chosen
//! and the rejected completion (one after the other: token lists are too wide to sit side by
//! side in a terminal), each as `text(label, id)` tokens coloured by class with its length and
//! what truncation cut; then pair stats and the pair lints.
//!
//! Exit status as for SFT data: 2 when an error-level lint fires that is not allowed by name.

use crate::cli::preview::{exit_code, group_body, render_lints, write_json, write_out, Style};
use std::io::Write;
use std::process::ExitCode;
use tunestudio::data::preference::{
    preview_pairs_opened, PairLimits, PairPreview, PartPreview, PreferencePreview,
};
use tunestudio::data::{DataConfig, OpenedData, PreviewOptions, SplitName, TokenizerBundle};
use tunestudio::text::visible_keep_spaces as visible;

/// Previews `data` as preference pairs.
pub fn run(
    cfg: &DataConfig,
    tok: &TokenizerBundle,
    data: &OpenedData,
    opts: &PreviewOptions,
    limits: PairLimits,
    json: bool,
    color: bool,
) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    let preview = preview_pairs_opened(cfg, tok, data, opts, limits)
        .with_context(|| format!("cannot preview {}", cfg.path))?;
    let code = exit_code(&preview.lints, &cfg.allow);
    write_out(code, |out| {
        if json {
            write_json(out, &preview)
        } else {
            render(out, cfg, tok, &preview, color)
        }
    })
}

fn limit(n: Option<usize>) -> String {
    n.map_or_else(|| "none".into(), |n| n.to_string())
}

fn render(
    out: &mut impl Write,
    cfg: &DataConfig,
    tok: &TokenizerBundle,
    p: &PreferencePreview,
    color: bool,
) -> anyhow::Result<()> {
    let st = Style { on: color };
    writeln!(
        out,
        "{} {}  format: {} (preference pairs)  pairs: {} ({} train, {} validation)",
        st.paint("1", "dataset"),
        cfg.path,
        p.format,
        p.num_rows,
        p.num_train_rows,
        p.num_validation_rows
    )?;
    writeln!(
        out,
        "tokenizer {}  vocab {}  max_prompt_length {} (keeps the end)  max_completion_length {} (keeps the start)",
        tok.origin.display(),
        tok.vocab_size(),
        limit(p.limits.max_prompt_length),
        limit(p.limits.max_completion_length),
    )?;
    writeln!(out, "chat template: {}", p.chat_template_origin)?;
    writeln!(
        out,
        "legend: {} {} {}  — each token is text(label, id); the model sees prompt + chosen and prompt + rejected",
        st.paint("32", "trained"),
        st.paint("31", "masked(-100)"),
        st.paint("1;35", "label≠token"),
    )?;
    for pair in &p.pairs {
        render_pair(out, &st, pair)?;
    }
    render_stats(out, &st, p)?;
    render_lints(out, &st, &p.lints, &cfg.allow)?;
    Ok(())
}

/// One pair: a header, then the prompt, chosen and rejected parts.
fn render_pair(out: &mut impl Write, st: &Style, pair: &PairPreview) -> std::io::Result<()> {
    writeln!(out)?;
    let mut head = format!(
        "── pair {} · {} · prompt {} · chosen {} · rejected {} tokens",
        pair.index,
        pair.location,
        pair.prompt.num_tokens(),
        pair.chosen.num_tokens(),
        pair.rejected.num_tokens()
    );
    if pair.split == SplitName::Validation {
        head.push_str(" · validation");
    }
    writeln!(out, "{}", st.paint("1", &head))?;
    render_part(out, st, "prompt", &pair.prompt, "start")?;
    render_part(out, st, "chosen", &pair.chosen, "end")?;
    render_part(out, st, "rejected", &pair.rejected, "end")?;
    Ok(())
}

/// `name · N tokens, T trained · truncation cut K from the start/end (of F)`, then the tokens.
fn render_part(
    out: &mut impl Write,
    st: &Style,
    name: &str,
    part: &PartPreview,
    cut_from: &str,
) -> std::io::Result<()> {
    let mut head = format!("{name} · {} tokens", part.num_tokens());
    if name == "prompt" {
        head.push_str(", masked");
    } else {
        head.push_str(&format!(", {} trained", part.num_trained));
    }
    if part.cut > 0 {
        head.push_str(&format!(
            " · truncation cut {} from the {cut_from} (of {})",
            part.cut, part.full_len
        ));
    } else {
        head.push_str(" · not truncated");
    }
    if part.eos_appended {
        head.push_str(" · EOS appended");
    }
    if part.prompt_differs {
        head.push_str(" · PROMPT TOKENS DIFFER");
    }
    writeln!(out, "{}", st.paint("4", &head))?;
    let mut line = String::new();
    for g in part.groups() {
        line.push_str(&group_body(st, &visible(&g.text), &part.tokens[g.tokens]));
        line.push(' ');
    }
    if line.is_empty() {
        line.push_str("(empty)");
    }
    writeln!(out, "{}", line.trim_end())
}

/// Pair length and truncation figures.
fn render_stats(out: &mut impl Write, st: &Style, p: &PreferencePreview) -> std::io::Result<()> {
    let s = &p.stats;
    let pct = |c: usize| 100.0 * c as f64 / s.num_pairs.max(1) as f64;
    writeln!(out)?;
    writeln!(
        out,
        "{} ({})",
        st.paint("1", "── stats"),
        if p.full_scan {
            "all training pairs"
        } else {
            "shown pairs only (--quick)"
        }
    )?;
    writeln!(
        out,
        "pairs {}  prompt mean {:.1} max {}  chosen mean {:.1}  rejected mean {:.1}  longest sequence {}",
        s.num_pairs, s.mean_prompt, s.max_prompt, s.mean_chosen, s.mean_rejected, s.max_sequence
    )?;
    writeln!(
        out,
        "truncated: {} prompts ({:.1}%) lost tokens from their start, {} pairs ({:.1}%) a completion's end",
        s.num_prompt_cut,
        pct(s.num_prompt_cut),
        s.num_completion_cut,
        pct(s.num_completion_cut)
    )?;
    Ok(())
}
