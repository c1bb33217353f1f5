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

/// A world of two in a build without NCCL: both ranks meet, then stop at once with an error
/// naming the feature, and neither trains.
#[cfg(not(feature = "nccl"))]
#[test]
fn a_world_of_two_without_nccl_stops_every_rank_naming_the_feature() {
    let tmp = tempfile::tempdir().unwrap();
    let config = demo_config(tmp.path());
    let config = config.to_str().unwrap();
    let port = free_port();
    let one = spawn(rank(1, 2, port, &["train", "--config", config]));
    let zero = spawn(rank(0, 2, port, &["train", "--config", config]));
    for (name, child) in [("rank 0", zero), ("rank 1", one)] {
        let out = child.wait_with_output().unwrap();
        let shown = text(&out);
        assert!(!out.status.success(), "{name}: {shown}");
        assert!(shown.contains("`nccl` feature"), "{name}: {shown}");
    }
    assert!(!tmp.path().join("out/metrics.jsonl").exists());
}
