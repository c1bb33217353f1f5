//! `tunestudio preview --config run.toml` on a GRPO run: the rollout preview. For a few prompts,
//! `num_generations` completions sampled with the run's model and settings, each with its
//! tokens, every reward function's value, the weighted reward, the advantage over its group and
//! whether it hit `max_completion_length`; then TRL's reward metrics and the lints (a reward
//! that is the same for every completion of every group fires the zero-advantage lint).
//!
//! Exit status as for SFT data: 2 when an error-level lint fires that is not allowed by name.

use crate::cli::preview::{exit_code, render_lints, write_json, write_out, Style};
use std::io::Write;
use std::process::ExitCode;
use tunestudio::text::visible_keep_spaces as visible;
use tunestudio::train::rollout_preview::{rollout_preview, PreviewGroup, RolloutPreview};
use tunestudio::train::RunConfig;

/// Previews the rollouts of `config`'s first `prompts` prompts.
pub fn run(
    config: &RunConfig,
    prompts: usize,
    json: bool,
    color: bool,
) -> anyhow::Result<ExitCode> {
    let preview = rollout_preview(config, 0, prompts)?;
    let code = exit_code(&preview.lints, &config.data.allow);
    write_out(code, |out| {
        if json {
            write_json(out, &preview)
        } else {
            render(out, config, &preview, color)
        }
    })
}

fn render(
    out: &mut impl Write,
    config: &RunConfig,
    p: &RolloutPreview,
    color: bool,
) -> anyhow::Result<()> {
    let st = Style { on: color };
    let g = &config.grpo;
    writeln!(
        out,
        "{} {}  GRPO rollouts: {} completions per prompt, temperature {}, top_p {}, top_k {}, max_completion_length {}",
        st.paint("1", "dataset"),
        config.data.path,
        g.num_generations,
        g.temperature,
        g.top_p,
        g.top_k,
        g.max_completion_length,
    )?;
    writeln!(
        out,
        "rewards: {}  (sampled with the model as the run starts, seed {})",
        p.reward_names.join(", "),
        config.training.seed
    )?;
    for group in &p.groups {
        render_group(out, &st, group, &p.reward_names)?;
    }
    writeln!(out)?;
    for (name, v) in &p.metrics {
        if name.starts_with("reward") || name.starts_with("frac") || name.contains("clipped") {
            writeln!(out, "  {name:<32} {v:.4}")?;
        }
    }
    render_lints(out, &st, &p.lints, &config.data.allow)?;
    Ok(())
}

fn render_group(
    out: &mut impl Write,
    st: &Style,
    g: &PreviewGroup,
    names: &[String],
) -> std::io::Result<()> {
    writeln!(out)?;
    writeln!(
        out,
        "{}",
        st.paint(
            "1",
            &format!("── prompt row {} · {} tokens", g.row, g.prompt_tokens)
        )
    )?;
    writeln!(out, "{}", st.paint("2", &visible(&g.prompt)))?;
    for (i, c) in g.completions.iter().enumerate() {
        let rewards: Vec<String> = names
            .iter()
            .zip(&c.rewards)
            .map(|(n, r)| format!("{n} {r:.3}"))
            .collect();
        let cut = if c.truncated {
            st.paint("33", " truncated (no EOS)")
        } else {
            String::new()
        };
        writeln!(
            out,
            "  [{i}] reward {:.3} ({})  advantage {:+.3}  {} tokens{cut}",
            c.reward,
            rewards.join(", "),
            c.advantage,
            c.tokens.len(),
        )?;
        let tokens: Vec<String> = c
            .tokens
            .iter()
            .map(|t| st.paint("32", &format!("{}({})", visible(&t.text), t.id)))
            .collect();
        writeln!(out, "      {}", tokens.join(" "))?;
    }
    Ok(())
}
