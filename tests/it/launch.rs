//! A torchrun-style launch through the real binary: ranks started as processes meet at the
//! TCP rendezvous on 127.0.0.1, agree on the id, and a rank that never starts stops rank 0
//! with its name instead of a hang (`tunestudio launch check`, docs/multi-node.md).

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `tunestudio <args>` as rank `rank` of `world`, with torchrun's variables and nothing of a
/// launcher this test runs under.
fn rank(rank: usize, world: usize, port: u16, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tunestudio"));
    cmd.args(args)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TUNESTUDIO_RENDEZVOUS_TIMEOUT_SECS", "20")
        .env_remove("TUNESTUDIO_LAUNCHER")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn spawn(mut cmd: Command) -> Child {
    cmd.spawn().unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn line<'a>(out: &'a Output, prefix: &str) -> &'a str {
    std::str::from_utf8(&out.stdout)
        .unwrap()
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{}", text(out)))
}

/// Two ranks, rank 1 started first: both exit 0 and print the same id fingerprint and the
/// same hosts, each its own rank.
#[test]
fn two_ranks_agree_on_the_id_through_the_rendezvous() {
    let port = free_port();
    let one = spawn(rank(1, 2, port, &["launch", "check"]));
    std::thread::sleep(Duration::from_millis(300));
    let zero = spawn(rank(0, 2, port, &["launch", "check"]));
    let zero = zero.wait_with_output().unwrap();
    let one = one.wait_with_output().unwrap();
    assert!(zero.status.success(), "rank 0:\n{}", text(&zero));
    assert!(one.status.success(), "rank 1:\n{}", text(&one));
    let id = line(&zero, "id: ");
    assert_eq!(id.len(), "id: ".len() + 12, "{id}");
    assert_eq!(id, line(&one, "id: "));
    assert_eq!(line(&zero, "hosts: "), line(&one, "hosts: "));
    assert!(text(&zero).contains("rank 0 of 2"), "{}", text(&zero));
    assert!(text(&one).contains("rank 1 of 2"), "{}", text(&one));
    assert!(text(&one).contains("started by torchrun"), "{}", text(&one));
}

/// A world of two whose rank 1 never starts: rank 0 gives up after the 3 s it was given,
/// exits non-zero, and names rank 1 and the address it waited at.
#[test]
fn a_rank_that_never_starts_stops_rank_0_with_its_name() {
    let port = free_port();
    let mut cmd = rank(0, 2, port, &["launch", "check"]);
    cmd.env("TUNESTUDIO_RENDEZVOUS_TIMEOUT_SECS", "3");
    let started = Instant::now();
    let out = cmd.output().unwrap();
    let took = started.elapsed();
    let shown = text(&out);
    assert!(!out.status.success(), "{shown}");
    assert!(
        shown.contains(&format!(
            "rank 1 (of 2) did not join the rendezvous at 127.0.0.1:{port} within 3 s"
        )),
        "{shown}"
    );
    assert!(took < Duration::from_secs(15), "took {took:?}");
}

/// Without a launcher the check says how to start one; a wrong variable is named.
#[test]
fn the_check_without_a_launcher_says_how_to_start_one() {
    let out = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["launch", "check"])
        .env("TUNESTUDIO_LAUNCHER", "none")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("torchrun --no-python"),
        "{}",
        text(&out)
    );

    let mut cmd = rank(0, 2, free_port(), &["launch", "check"]);
    cmd.env("MASTER_PORT", "http");
    let out = cmd.output().unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("MASTER_PORT=\"http\" is not a TCP port"),
        "{}",
        text(&out)
    );
}

/// The demo run, two steps, writing its outputs under `out`.
fn demo_config(dir: &std::path::Path) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cfg = tunestudio::train::RunConfig::load(&root.join("assets/demo.toml")).unwrap();
    cfg.output_dir = dir.join("out");
    cfg.training.max_steps = Some(2);
    cfg.eval.eval_every = 0;
    cfg.checkpoint.save_every = 0;
    cfg.checkpoint.save_final = true;
    let path = dir.join("run.toml");
    cfg.with_absolute_paths().save(&path).unwrap();
    path
}

/// `tunestudio train` as the only rank of a torchrun world: it joins the rendezvous with
/// itself, trains, and as rank 0 writes the metrics and the final checkpoint.
#[test]
fn a_world_of_one_trains_through_the_launcher() {
    let tmp = tempfile::tempdir().unwrap();
    let config = demo_config(tmp.path());
    let config = config.to_str().unwrap();
    let out = rank(0, 1, free_port(), &["train", "--config", config])
        .output()
        .unwrap();
    let shown = text(&out);
    assert!(out.status.success(), "{shown}");
    assert!(shown.contains("rank 0 of 1"), "{shown}");
    let events = tunestudio::train::read_metrics(&tmp.path().join("out")).unwrap();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, tunestudio::train::Event::Finished { .. })),
        "rank 0 wrote no finished run to metrics.jsonl"
    );
    assert!(tmp.path().join("out/checkpoint-2").is_dir(), "{shown}");
}

/// The demo run (full fine-tuning) with the smallest shapes that still take every path:
/// `steps` steps of `gradient_accumulation = 2`, `micro_batch` rows per rank, 64 tokens,
/// its outputs under `dir/<output>`, a checkpoint at the end only.
fn small_demo_config(
    dir: &std::path::Path,
    output: &str,
    micro_batch: usize,
    steps: u64,
) -> std::path::PathBuf {
    small_config(dir, output, micro_batch, steps, |_| {})
}

/// [`small_demo_config`] with `edit` applied last.
fn small_config(
    dir: &std::path::Path,
    output: &str,
    micro_batch: usize,
    steps: u64,
    edit: impl Fn(&mut tunestudio::train::RunConfig),
) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cfg = tunestudio::train::RunConfig::load(&root.join("assets/demo.toml")).unwrap();
    cfg.output_dir = dir.join(output);
    cfg.training.max_steps = Some(steps);
    cfg.training.micro_batch = micro_batch;
    cfg.training.gradient_accumulation = 2;
    cfg.data.max_length = 64;
    cfg.eval.eval_every = 0;
    cfg.checkpoint.save_every = 0;
    cfg.checkpoint.save_final = true;
    edit(&mut cfg);
    let path = dir.join(format!("{output}.toml"));
    cfg.with_absolute_paths().save(&path).unwrap();
    path
}

/// Trains `rank0.toml` and `rank1.toml` (under `dir`) as a world of two, then `single.toml`
/// in one process; rank 0's step losses and gradient norms, and their worst relative
/// difference from the one process's.
fn world_of_two_and_one_process(dir: &std::path::Path) -> (Vec<(f64, f64)>, f64) {
    let port = free_port();
    let config = |name: &str| dir.join(format!("{name}.toml")).display().to_string();
    let (zero_cfg, one_cfg) = (config("rank0"), config("rank1"));
    let started = Instant::now();
    let one = spawn(rank(1, 2, port, &["train", "--config", &one_cfg]));
    let zero = spawn(rank(0, 2, port, &["train", "--config", &zero_cfg]));
    let (zero, one) = (
        zero.wait_with_output().unwrap(),
        one.wait_with_output().unwrap(),
    );
    let world_took = started.elapsed();
    assert!(zero.status.success(), "rank 0:\n{}", text(&zero));
    assert!(one.status.success(), "rank 1:\n{}", text(&one));
    let started = Instant::now();
    let single = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["train", "--config", &config("single")])
        .env("TUNESTUDIO_LAUNCHER", "none")
        .output()
        .unwrap();
    let single_took = started.elapsed();
    assert!(single.status.success(), "{}", text(&single));
    let world = step_losses(&dir.join("rank0"));
    let alone = step_losses(&dir.join("single"));
    assert_eq!(world.len(), alone.len(), "{}", text(&zero));
    let mut worst = 0f64;
    for ((wl, wg), (al, ag)) in world.iter().zip(&alone) {
        worst = worst
            .max(((wl - al) / al).abs())
            .max(((wg - ag) / ag).abs());
    }
    eprintln!(
        "world of 2 vs one process: losses {world:?} vs {alone:?}, worst relative difference \
         {worst:.2e}; world {world_took:?}, one process {single_took:?}"
    );
    (world, worst)
}

/// `(loss, grad_norm)` of every step rank 0 (or the single process) wrote.
fn step_losses(out: &std::path::Path) -> Vec<(f64, f64)> {
    tunestudio::train::read_metrics(out)
        .unwrap()
        .into_iter()
        .filter_map(|e| match e {
            tunestudio::train::Event::Step {
                loss, grad_norm, ..
            } => Some((loss, grad_norm)),
            _ => None,
        })
        .collect()
}

/// Two `tunestudio train` processes (WORLD_SIZE=2, one row per rank per micro-step) train as
/// one process with two rows per micro-step: the same losses and gradient norms within 1e-6
/// of their size (measured 8.0e-8 on 2026-12-06, f32 rounding: the sum of the ranks'
/// gradients is not the one backward's sum; with the token count left unsummed the losses are
/// 3× off). Rank 0 writes the metrics and the checkpoint; rank 1, given an output folder of
/// its own, writes nothing there.
#[test]
fn two_processes_train_as_one_with_twice_the_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let steps = 3;
    small_demo_config(tmp.path(), "rank0", 1, steps);
    small_demo_config(tmp.path(), "rank1", 1, steps);
    small_demo_config(tmp.path(), "single", 2, steps);
    let (world, worst) = world_of_two_and_one_process(tmp.path());
    assert_eq!(world.len(), steps as usize);
    assert!(worst <= 1e-6, "worst relative difference {worst:e}");
    assert!(tmp
        .path()
        .join(format!("rank0/checkpoint-{steps}"))
        .is_dir());
    assert!(!tmp.path().join("rank1").exists(), "rank 1 wrote outputs");
}

/// Three rows, one per rank per micro-step, no accumulation: step 2's micro-step is one row,
/// so rank 1 has no row and no gradient. It still takes part in the step's sum (with zeros),
/// and the run is the one process's, data parallel and sharded.
#[test]
fn a_rank_without_rows_still_takes_part_in_the_step() {
    let tmp = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(root.join("assets/demo-data.json")).unwrap())
            .unwrap();
    let data = tmp.path().join("three.json");
    std::fs::write(&data, serde_json::to_string(&rows[..3]).unwrap()).unwrap();
    let edit = |cfg: &mut tunestudio::train::RunConfig| {
        cfg.data.path = data.display().to_string();
        cfg.data.validation_ratio = 0.0;
        cfg.training.gradient_accumulation = 1;
    };
    small_config(tmp.path(), "rank0", 1, 2, edit);
    small_config(tmp.path(), "rank1", 1, 2, edit);
    small_config(tmp.path(), "single", 2, 2, edit);
    let (world, worst) = world_of_two_and_one_process(tmp.path());
    assert_eq!(world.len(), 2);
    assert!(worst <= 1e-6, "worst relative difference {worst:e}");

    // Sharded (ZeRO-2): the rank without rows still gives every tensor to the reduce-scatter
    // (zeros) and steps its ranges with the others' sums.
    let sharded = |cfg: &mut tunestudio::train::RunConfig| {
        edit(cfg);
        cfg.devices.strategy = tunestudio::settings::Strategy::Sharded;
    };
    let dir = tmp.path().join("sharded");
    std::fs::create_dir_all(&dir).unwrap();
    small_config(&dir, "rank0", 1, 2, sharded);
    small_config(&dir, "rank1", 1, 2, sharded);
    small_config(&dir, "single", 2, 2, edit);
    let (world, worst) = world_of_two_and_one_process(&dir);
    assert_eq!(world.len(), 2);
    assert!(
        worst <= 1e-6,
        "sharded: worst relative difference {worst:e}"
    );
}

/// A world of two resumes from rank 0's checkpoint of step 2 (every rank reads the same
/// folder) and makes the uninterrupted world's steps 3 and 4.
#[test]
fn a_world_resumes_from_rank_0s_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let every_two = |cfg: &mut tunestudio::train::RunConfig| cfg.checkpoint.save_every = 2;
    for output in ["rank0", "rank1"] {
        small_config(tmp.path(), output, 1, 4, every_two);
    }
    let port = free_port();
    let config = |name: &str| {
        tmp.path()
            .join(format!("{name}.toml"))
            .display()
            .to_string()
    };
    let run_world = |zero: &str, one: &str, extra: &[&str]| {
        let args = |cfg: String| {
            let mut a = vec!["train".to_string(), "--config".into(), cfg];
            a.extend(extra.iter().map(ToString::to_string));
            a
        };
        let (a0, a1) = (args(config(zero)), args(config(one)));
        let one = spawn(rank(
            1,
            2,
            port,
            &a1.iter().map(String::as_str).collect::<Vec<_>>(),
        ));
        let zero = spawn(rank(
            0,
            2,
            port,
            &a0.iter().map(String::as_str).collect::<Vec<_>>(),
        ));
        let (zero, one) = (
            zero.wait_with_output().unwrap(),
            one.wait_with_output().unwrap(),
        );
        assert!(zero.status.success(), "rank 0:\n{}", text(&zero));
        assert!(one.status.success(), "rank 1:\n{}", text(&one));
    };
    run_world("rank0", "rank1", &[]);
    let uninterrupted = step_losses(&tmp.path().join("rank0"));
    // Rank 0 resumes into a folder of its own, holding the run up to step 2.
    let resumed = tmp.path().join("resumed");
    std::fs::create_dir_all(resumed.join("checkpoint-2")).unwrap();
    for entry in std::fs::read_dir(tmp.path().join("rank0/checkpoint-2")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(
            entry.path(),
            resumed.join("checkpoint-2").join(entry.file_name()),
        )
        .unwrap();
    }
    small_config(tmp.path(), "resumed", 1, 4, every_two);
    let from = resumed.join("checkpoint-2").display().to_string();
    run_world("resumed", "rank1", &["--resume", &from]);
    let after = step_losses(&resumed);
    assert_eq!(after, uninterrupted[2..].to_vec());
    assert!(!tmp.path().join("rank1").exists(), "rank 1 wrote outputs");
}

/// Rank 1 fails in step 2 (an injected out-of-memory): rank 0, waiting in that step's sum,
/// stops within seconds with a message naming rank 1, and exits non-zero.
#[test]
fn a_failing_rank_stops_the_other_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let zero_cfg = small_demo_config(tmp.path(), "rank0", 1, 20);
    let one_cfg = small_demo_config(tmp.path(), "rank1", 1, 20);
    let port = free_port();
    let mut one = rank(
        1,
        2,
        port,
        &["train", "--config", one_cfg.to_str().unwrap()],
    );
    one.env("TUNESTUDIO_INJECT_OOM", "2:forward");
    let one = one.spawn().unwrap();
    let zero = spawn(rank(
        0,
        2,
        port,
        &["train", "--config", zero_cfg.to_str().unwrap()],
    ));
    let one = one.wait_with_output().unwrap();
    let one_ended = Instant::now();
    let zero = zero.wait_with_output().unwrap();
    let lag = one_ended.elapsed();
    let shown = text(&zero);
    eprintln!("rank 0 stopped {lag:?} after rank 1");
    assert!(!one.status.success(), "rank 1:\n{}", text(&one));
    assert!(!zero.status.success(), "rank 0:\n{shown}");
    assert!(shown.contains("rank 1 (of 2)"), "rank 0:\n{shown}");
    assert!(
        lag < Duration::from_secs(5),
        "rank 0 stopped {lag:?} after rank 1"
    );
    assert!(!tmp.path().join("rank1").exists(), "rank 1 wrote outputs");
}

/// Two `tunestudio train` processes with `strategy = "sharded"` (ZeRO-2 across processes: each
/// keeps half of every tensor's AdamW state, the gradients reduce-scattered and the updated
/// halves all-gathered over the TCP group) train as one process with twice the rows, within
/// 1e-6; rank 0's checkpoint holds the optimizer state whole (rank 1 hands its halves over), so
/// one process resumes from it and makes the world's steps 3 and 4.
#[test]
fn two_sharded_processes_train_as_one_and_one_process_resumes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let steps = 4;
    let sharded = |cfg: &mut tunestudio::train::RunConfig| {
        cfg.devices.strategy = tunestudio::settings::Strategy::Sharded;
        cfg.checkpoint.save_every = 2;
    };
    small_config(tmp.path(), "rank0", 1, steps, sharded);
    small_config(tmp.path(), "rank1", 1, steps, sharded);
    small_demo_config(tmp.path(), "single", 2, steps);
    let (world, worst) = world_of_two_and_one_process(tmp.path());
    assert_eq!(world.len(), steps as usize);
    assert!(worst <= 1e-6, "worst relative difference {worst:e}");
    assert!(!tmp.path().join("rank1").exists(), "rank 1 wrote outputs");

    let resumed = tmp.path().join("resumed");
    std::fs::create_dir_all(resumed.join("checkpoint-2")).unwrap();
    for entry in std::fs::read_dir(tmp.path().join("rank0/checkpoint-2")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(
            entry.path(),
            resumed.join("checkpoint-2").join(entry.file_name()),
        )
        .unwrap();
    }
    let config = small_demo_config(tmp.path(), "resumed", 2, steps);
    let from = resumed.join("checkpoint-2");
    let out = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["train", "--config"])
        .arg(&config)
        .arg("--resume")
        .arg(&from)
        .env("TUNESTUDIO_LAUNCHER", "none")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let after = step_losses(&resumed);
    assert_eq!(after.len(), 2, "{}", text(&out));
    for ((al, ag), (wl, wg)) in after.iter().zip(&world[2..]) {
        let worst = ((al - wl) / wl).abs().max(((ag - wg) / wg).abs());
        assert!(
            worst <= 1e-6,
            "resumed {al}/{ag} against the world's {wl}/{wg}: {worst:e}"
        );
    }
}

/// DPO across two `tunestudio train` processes (full fine-tuning, each with its frozen
/// reference copy; data parallel, then ZeRO-2): each takes its global rank's pairs of every
/// micro-step, the pairs and the rewards are summed over the processes, and the run is one
/// process's with twice the pairs, losses and gradient norms within 1e-6.
#[test]
fn two_processes_train_dpo_as_one() {
    use tunestudio::settings::Strategy;
    let tmp = tempfile::tempdir().unwrap();
    for strategy in [Strategy::DataParallel, Strategy::Sharded] {
        let dir = tmp.path().join(strategy.to_string());
        let write = |name: &str, micro_batch: usize, strategy: Strategy| {
            let mut c = super::preference_train::multi_device_config(
                &dir.join(format!("{name}-data")),
                false,
                micro_batch,
                &["cpu"],
                strategy,
            );
            c.training.max_steps = Some(3);
            c.output_dir = dir.join(name);
            c.with_absolute_paths()
                .save(&dir.join(format!("{name}.toml")))
                .unwrap();
        };
        write("rank0", 1, strategy);
        write("rank1", 1, strategy);
        write("single", 2, Strategy::Single);
        let (world, worst) = world_of_two_and_one_process(&dir);
        assert_eq!(world.len(), 3);
        assert!(
            worst <= 1e-6,
            "{strategy}: worst relative difference {worst:e}"
        );
        // Rank 0's logged TRL metrics are every process's pairs', as the one process logs them.
        let metrics = |out: &std::path::Path| -> Vec<std::collections::BTreeMap<String, f64>> {
            tunestudio::train::read_metrics(out)
                .unwrap()
                .into_iter()
                .filter_map(|e| match e {
                    tunestudio::train::Event::Step { metrics, .. } => Some(metrics),
                    _ => None,
                })
                .collect()
        };
        let (got, want) = (metrics(&dir.join("rank0")), metrics(&dir.join("single")));
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(
                g.keys().collect::<Vec<_>>(),
                w.keys().collect::<Vec<_>>(),
                "{strategy}"
            );
            assert!(w.contains_key("rewards/accuracies"), "{w:?}");
            for (key, wv) in w {
                let gv = g[key];
                assert!(
                    (gv - wv).abs() <= 1e-5 * wv.abs().max(1.0),
                    "{strategy} {key}: {gv} against one process's {wv}"
                );
            }
        }
    }
}
