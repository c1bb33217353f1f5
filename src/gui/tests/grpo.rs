//! GRPO in the studio (issue #59 item 6): a GRPO run's Preview samples each shown prompt's
//! group with the run's model and settings and shows every completion with its tokens, its
//! rewards and its advantage; a reward that is the same for every completion fires the
//! zero-advantage lint before the run; the micro-batch is labelled in prompts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use eframe::egui;
use egui_kittest::kittest::Queryable;
use egui_kittest::Harness;

use super::{app_harness, wait_for};
use crate::gui::app::{StartOptions, StudioApp};
use crate::gui::run_state::RunPhase;
use crate::gui::session::Panel;
use tunestudio::train::grpo_rewards::RewardSpec;
use tunestudio::train::FinishReason;
use tunestudio::train::TrainingMethod;

/// Prompts as TRL's conversational `prompt` column, with an `answer` column.
fn write_prompts(dir: &Path) -> PathBuf {
    let rows: Vec<serde_json::Value> = (0..6)
        .map(|i| {
            serde_json::json!({
                "prompt": [{"role": "user", "content": format!("Name a city. ({i})")}],
                "answer": format!("{i}"),
            })
        })
        .collect();
    let path = dir.join("prompts.json");
    std::fs::write(&path, serde_json::to_string(&rows).expect("json")).expect("write prompts");
    path
}

/// A GRPO + LoRA run of the demo model (random weights) with a reward it sometimes earns (a
/// completion that starts with a capital letter) and one no 4-token completion can change (a
/// length penalty beyond 100 tokens: always 0).
fn grpo_run(dir: &Path) -> PathBuf {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/demo-model");
    let text = format!(
        r#"output_dir = {out:?}
[model]
source = {model:?}
init = "random"
[data]
path = {data:?}
validation_ratio = 0.0
[training]
method = "grpo"
micro_batch = 2
max_steps = 4
learning_rate = 5e-6
seed = 7
[grpo]
num_generations = 8
max_prompt_length = 64
max_completion_length = 4
[[grpo.reward]]
kind = "format"
name = "capital"
pattern = "[A-Z].*"
[[grpo.reward]]
kind = "length"
name = "short"
target_tokens = 100
[lora]
enabled = true
r = 8
[devices]
devices = ["cpu"]
"#,
        out = dir.join("out").display().to_string(),
        model = model.display().to_string(),
        data = write_prompts(dir).display().to_string(),
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, text).expect("write run.toml");
    path
}

/// Clicks "Sample rollouts", waits for the answer and returns it.
fn sample(
    h: &mut Harness<'static, StudioApp>,
    what: &str,
) -> tunestudio::train::rollout_preview::RolloutPreview {
    h.get_by_label("Sample rollouts").click();
    h.step();
    wait_for(h, what, Duration::from_secs(120), |a| {
        let p = &a.panels.preview;
        a.jobs.in_flight() == 0
            && !p.loading
            && (p.rollouts.preview().is_some() || p.error.is_some())
    });
    let p = &h.state().panels.preview;
    assert!(p.error.is_none(), "{:?}", p.error);
    p.rollouts.preview().cloned().expect("a rollout preview")
}

#[test]
fn a_grpo_preview_shows_each_prompts_group_with_its_rewards_and_the_zero_advantage_lint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Preview),
        output_dir: Some(dir.path().join("out")),
        config: Some(grpo_run(dir.path())),
        ..StartOptions::default()
    };
    let mut h = app_harness(opts, 3000.0);
    wait_for(&mut h, "the demo model", Duration::from_secs(90), |a| {
        a.jobs.in_flight() == 0 && a.panels.model.info.is_some()
    });
    assert_eq!(
        h.state().session.config.training.method,
        TrainingMethod::Grpo
    );
    // Sampling loads the model: it waits for the user.
    assert!(h.state().panels.preview.rollouts.preview().is_none());
    assert!(
        h.query_by_label_contains("prompts 0–1 of").is_some(),
        "the navigator counts prompts"
    );
    let p = sample(&mut h, "the rollouts");
    assert_eq!(p.num_prompts, 6);
    assert_eq!(p.groups.len(), 2, "one group per prompt of the micro-batch");
    assert_eq!(p.reward_names, ["capital", "short"]);
    for g in &p.groups {
        assert_eq!(g.completions.len(), 8, "G completions per prompt");
        for c in &g.completions {
            assert_eq!(c.rewards.len(), 2, "a value from every reward function");
            assert!(c.tokens.len() <= 4 && !c.tokens.is_empty());
            assert_eq!(c.rewards[1], 0.0, "4 tokens are under the length target");
        }
    }
    let advantages: Vec<f32> = p
        .groups
        .iter()
        .flat_map(|g| g.completions.iter().map(|c| c.advantage))
        .collect();
    assert!(
        advantages.iter().any(|a| *a != 0.0),
        "the capital-letter reward tells some completions apart: {advantages:?}"
    );
    h.run_steps(2);

    // On screen: each group, each completion with its rewards, its advantage and its tokens.
    assert!(h.query_by_label("Prompt 0").is_some());
    assert!(h.query_by_label("Prompt 1").is_some());
    let first = &p.groups[0].completions[0];
    let rewards = format!(
        "reward {:.3} (capital {:.3}, short {:.3})",
        first.reward, first.rewards[0], first.rewards[1]
    );
    assert!(
        h.query_all_by_label(&rewards).next().is_some(),
        "no {rewards:?}"
    );
    let advantage = format!("advantage {:+.3}", first.advantage);
    assert!(
        h.query_all_by_label(&advantage).next().is_some(),
        "no {advantage:?}"
    );
    for i in 0..8 {
        assert_eq!(
            h.query_all_by_label(&format!("completion {i}")).count(),
            2,
            "completion {i}'s heading in each group"
        );
    }
    let token = &first.tokens[0];
    assert!(
        h.query_all_by_label_contains(&format!("(trained, id {}, position 0)", token.id))
            .next()
            .is_some(),
        "the first completion's first token is a chip"
    );
    assert!(h.query_by_label("Rollout lints (0)").is_some() || !p.lints.is_empty());
    assert!(!p
        .lints
        .iter()
        .any(|l| format!("{:?}", l.kind) == "GrpoZeroAdvantage"));

    // A reward every completion earns alike: nothing to learn, said before the run.
    h.state_mut().session.config.grpo.reward = vec![RewardSpec::length(100).named("short")];
    h.run_steps(2);
    assert!(
        h.query_by_label_contains("the settings changed since this sample")
            .is_some(),
        "a changed reward marks the shown sample stale"
    );
    let p = sample(&mut h, "the rollouts of the constant reward");
    assert_eq!(p.reward_names, ["short"]);
    let lint = p
        .lints
        .iter()
        .find(|l| format!("{:?}", l.kind) == "GrpoZeroAdvantage")
        .expect("the zero-advantage lint");
    assert!(lint.message.contains("short"), "{}", lint.message);
    h.run_steps(2);
    assert!(h.query_by_label("GrpoZeroAdvantage").is_some());
    assert!(h
        .query_by_label_contains("the settings changed since this sample")
        .is_none());

    // The run: the Run panel charts the rewards and shows the latest sampled completions.
    h.state_mut().session.panel = Panel::Run;
    h.run_steps(2);
    h.get_by_label("Start").click();
    h.run_steps(2);
    wait_for(
        &mut h,
        "the GRPO run to end",
        Duration::from_secs(120),
        |a| matches!(a.panels.run.live.phase, RunPhase::Finished(_)),
    );
    let live = &h.state().panels.run.live;
    assert_eq!(
        live.phase,
        RunPhase::Finished(FinishReason::Completed),
        "{:?}",
        live.error
    );
    assert_eq!(live.rewards["reward"].len(), 4, "{:?}", live.rewards);
    assert!(live.rewards.contains_key("rewards/short/mean"));
    let (step, group) = live.completions.clone().expect("the latest completions");
    assert_eq!(step, 4);
    assert_eq!(group.completions.len(), 8);
    assert_eq!(group.reward_names, ["short"]);
    h.run_steps(2);
    assert!(h.query_by_label("Latest completions (step 4)").is_some());
    assert!(h.query_by_label("Rewards").is_some());

    // The Training panel counts the micro-batch in prompts.
    h.state_mut().session.panel = Panel::Training;
    h.run_steps(3);
    assert!(
        h.query_by_label_contains("prompts per step").is_some(),
        "the effective batch is in prompts"
    );
}

/// The Training panel's GRPO card sets `[grpo] num_iterations`, which the trainer now runs.
#[test]
fn the_training_panel_sets_grpos_iterations_per_sample() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Training),
        output_dir: Some(dir.path().join("out")),
        config: Some(grpo_run(dir.path())),
        ..StartOptions::default()
    };
    let mut h = app_harness(opts, 3000.0);
    wait_for(&mut h, "the GRPO run", Duration::from_secs(90), |a| {
        a.jobs.in_flight() == 0 && a.session.config.training.method.is_grpo()
    });
    assert_eq!(h.state().session.config.grpo.num_iterations, 1);
    h.get_by_label("Iterations per sample").focus();
    h.step();
    h.key_press_modifiers(egui::Modifiers::COMMAND, egui::Key::A);
    h.step();
    h.get_by_label("Iterations per sample").type_text("3");
    h.step();
    h.key_press(egui::Key::Enter);
    // The new setting replans on a job (a spinner repaints meanwhile), so wait rather than
    // `run()`: on a slow CI machine the plan outlasts `run()`'s frame budget (stop 61).
    wait_for(
        &mut h,
        "the setting and its plan",
        Duration::from_secs(90),
        |a| a.jobs.in_flight() == 0 && a.session.config.grpo.num_iterations == 3,
    );
}
