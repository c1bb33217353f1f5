//! GPUs & memory → Strategy "sharded data parallel (ZeRO)" and its Shard choice (issue #57):
//! the plan follows them rank by rank, as `tunestudio plan --strategy sharded --shard …`
//! plans the same run; ZeRO-3 divides the weights too, and Auto-fit applies its choice.

use std::time::Duration;

use egui_kittest::kittest::Queryable;

use super::{
    cli_request, dictalm_config, harness_without_gpus, pick, wait_for, wait_for_current_plan,
    wait_for_plan_of,
};
use crate::gui::panels::devices::bar_label;
use tunestudio::plan::Plan;
use tunestudio::settings::{ShardMode, Strategy};

/// `tunestudio plan` of the DictaLM config's settings on two 80 GiB GPUs, sharded as `shard`.
fn cli_sharded_plan(shard: &str) -> Plan {
    let model = tunestudio::paths::shared_dir().join("model-configs/dictalm2-7b.json");
    let model = model.display().to_string();
    let argv = [
        "plan",
        "--model-config",
        &model,
        "--devices",
        "2x80GiB",
        "--precision",
        "fp32",
        "--micro-batch",
        "1",
        "--accumulation",
        "4",
        "--seq-len",
        "512",
        "--checkpointing",
        "--strategy",
        "sharded",
        "--shard",
        shard,
    ];
    tunestudio::plan::plan(&cli_request(&argv)).expect("the CLI's plan")
}

#[test]
fn the_studio_plans_sharded_data_parallel_per_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dictalm_config(dir.path());
    let mut h = harness_without_gpus(&config, dir.path());
    wait_for_plan_of(&mut h, &["cpu"]);
    pick(&mut h, "Plan for", "A machine to rent or queue for");
    pick(&mut h, "GPUs", "2 GPUs");
    pick(&mut h, "GPU model", "A100 80 GB");
    wait_for_plan_of(&mut h, &["cuda:0=81920MiB", "cuda:1=81920MiB"]);
    pick(&mut h, "Strategy", "data parallel");
    wait_for_current_plan(&mut h, "the data-parallel plan", |r| {
        r.strategy == Strategy::DataParallel
    });
    let dp = h.state().panels.devices.plan.plan.clone().expect("plan");

    // Sharded: the Shard choice appears, ZeRO-2 by default, and the plan follows it.
    pick(&mut h, "Strategy", "sharded data parallel (ZeRO)");
    wait_for_current_plan(&mut h, "the sharded plan", |r| {
        r.strategy == Strategy::Sharded && r.shard == ShardMode::GradientsAndOptimizer
    });
    assert!(h.query_by_label("Shard").is_some(), "no Shard choice");
    let zero2 = h.state().panels.devices.plan.plan.clone().expect("plan");
    let cli = cli_sharded_plan("gradients-and-optimizer");
    assert_eq!(zero2.per_device.len(), 2);
    for ((s, c), d) in zero2
        .per_device
        .iter()
        .zip(&cli.per_device)
        .zip(&dp.per_device)
    {
        assert_eq!(
            (s.peak_bytes, s.optimizer_states_bytes, s.collective_bytes),
            (c.peak_bytes, c.optimizer_states_bytes, c.collective_bytes),
            "{}: the studio's plan is the CLI's",
            s.device.name
        );
        // Each rank keeps half of AdamW's state (DictaLM's tensors all divide by 2).
        assert_eq!(2 * s.optimizer_states_bytes, d.optimizer_states_bytes);
        assert!(
            h.query_by_label(&bar_label(s)).is_some(),
            "no bar `{}` on screen",
            bar_label(s)
        );
    }

    // Everything (ZeRO-3): the weights divided too.
    pick(&mut h, "Shard", "everything (ZeRO-3)");
    wait_for_current_plan(&mut h, "the ZeRO-3 plan", |r| {
        r.shard == ShardMode::Everything
    });
    assert_eq!(
        h.state().session.config.devices.shard,
        ShardMode::Everything
    );
    let zero3 = h.state().panels.devices.plan.plan.clone().expect("plan");
    let cli = cli_sharded_plan("everything");
    for ((s, c), z2) in zero3
        .per_device
        .iter()
        .zip(&cli.per_device)
        .zip(&zero2.per_device)
    {
        assert_eq!(s.peak_bytes, c.peak_bytes, "{}", s.device.name);
        assert!(s.weights_bytes < z2.weights_bytes, "{}", s.device.name);
    }

    // Auto-fit proposes only what the trainer runs.
    h.get_by_label("Auto-fit").click();
    wait_for(&mut h, "auto-fit", Duration::from_secs(90), |a| {
        !a.panels.devices.plan.autofit_applied.is_empty()
            && a.jobs.in_flight() == 0
            && !a.panels.devices.plan.loading
    });
}

/// Export → "Launch on several machines": the torchrun line and the Slurm script for the
/// machines × GPUs chosen, training the run config the panel saves, and what the launched ranks
/// will do with it (data parallel, ZeRO-2, or the refusal each rank would stop with).
#[test]
fn the_export_panel_prints_the_launch_for_the_machines_chosen() {
    use crate::gui::session::Panel;
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = super::harness(Panel::Export, out.path());
    h.run_steps(4);
    h.get_by_label("Launch on several machines (torchrun, Slurm)")
        .click();
    h.run_steps(4);
    let config = h.state().panels.export.config_path.clone();
    assert!(
        !config.is_empty(),
        "the panel proposes where the config goes"
    );
    {
        let e = &mut h.state_mut().panels.export;
        e.launch_nodes = 3;
        e.launch_gpus_per_node = 4;
    }
    h.run_steps(4);
    let quoted = tunestudio::devices::launch::commands::shell_quoted(&config);
    assert!(h
        .query_by_label_contains("torchrun --nnodes 3 --nproc-per-node 4 --node-rank $NODE_RANK")
        .is_some());
    // The headless command, the torchrun line and the Slurm script.
    assert_eq!(
        h.query_all_by_label_contains(&format!("train --config {quoted}"))
            .count(),
        3
    );
    assert!(h
        .query_by_label_contains("#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=4")
        .is_some());
    assert!(h
        .query_by_label_contains("12 ranks, one process per GPU")
        .is_some());
    // What the ranks will do with the session's config: the demo's single device trains data
    // parallel; sharded, ZeRO-2 over the 12 ranks; ZeRO-3 is refused by name, as every rank
    // would refuse it.
    assert!(h
        .query_by_label_contains("The ranks train data parallel over 12 ranks")
        .is_some());
    {
        let config = &mut h.state_mut().session.config;
        config.devices.strategy = tunestudio::settings::Strategy::Sharded;
    }
    h.run_steps(4);
    assert!(h
        .query_by_label_contains("The ranks train sharded data parallel (ZeRO-2) over 12 ranks")
        .is_some());
    h.state_mut().session.config.devices.shard = tunestudio::settings::ShardMode::Everything;
    h.run_steps(4);
    assert!(h
        .query_by_label_contains("every rank stops before training")
        .is_some());
    assert!(h
        .query_by_label_contains("(ZeRO-2) but not the weights yet")
        .is_some());
}
