//! Tokenise + label throughput of the data pipeline (prints, asserts nothing).
//!
//! `cargo run --release --example data_bench` — reports the 999-row
//! alpaca_en_demo.json and a 50,000-row alpaca file (the demo repeated),
//! tokenised with the tiny-llama (SmolLM2) tokenizer and ChatML template.

use std::time::Instant;
use tunestudio::data::prepare::{label_dataset, Pipeline};
use tunestudio::data::{open_data, prepare_opened, DataConfig, TokenizerBundle};
use tunestudio::paths::shared_dir;

/// CPU seconds (user + system) of this process so far: on a shared machine
/// wall time depends on other load, CPU time much less.
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (tick(11) + tick(12)) / 100.0
}

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let shared = shared_dir();
    let t0 = Instant::now();
    let tok = TokenizerBundle::load(&shared.join("fixtures/tiny-llama"))?;
    println!("tokenizer load: {:.3} s", t0.elapsed().as_secs_f64());
    println!("threads: {}", rayon::current_num_threads());

    let alpaca = shared.join("datasets/alpaca_en_demo.json");
    let dir = tempfile::tempdir()?;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&alpaca)?)?;
    let big: Vec<&serde_json::Value> = rows.iter().cycle().take(50_000).collect();
    let big_path = dir.path().join("alpaca_50k.json");
    std::fs::write(&big_path, serde_json::to_string(&big)?)?;

    for (name, path, runs) in [
        ("alpaca_en_demo (999 rows)", alpaca.clone(), 3),
        ("alpaca x50 (50,000 rows)", big_path, 1),
    ] {
        let cfg = DataConfig::new(path.display().to_string());
        for run in 0..runs {
            let t = Instant::now();
            let data = open_data(&cfg)?;
            let t_open = t.elapsed().as_secs_f64();
            let (t, c) = (Instant::now(), cpu_secs());
            let first = data.main.row(0)?;
            let pipe = Pipeline::new(&cfg, &tok, &first, "row 0")?;
            let labelled = label_dataset(&pipe, &data.main, &data.train_indices, false)?.len();
            let t_label = t.elapsed().as_secs_f64();
            let c_label = cpu_secs() - c;
            let t = Instant::now();
            let prepared = prepare_opened(&cfg, &tok, &data, 8)?;
            let t_prepare = t.elapsed().as_secs_f64();
            println!(
                "{name} run {run}: open {t_open:.3} s, tokenise+label {t_label:.3} s wall / {c_label:.2} CPU-s ({:.0} rows/s, {} tokens), full prepare incl. lints+stats {t_prepare:.3} s, {} samples",
                labelled as f64 / t_label,
                prepared.train_stats.total_tokens,
                prepared.train.len()
            );
        }
    }
    Ok(())
}
