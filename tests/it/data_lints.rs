//! Lints (pre-tokenised label bugs at error level and the CLI's exit code),
//! collation of prepared samples, and the `tunestudio preview` binary.

use crate::data_support;

use data_support::{dataset, tiny_llama, tiny_llama_dir, write_parquet, Col};
use std::path::{Path, PathBuf};
use std::process::Command;
use tunestudio::data::{
    batch_indices, collate, has_errors, prepare_dataset, preview_dataset, CollateOptions,
    DataConfig, Format, LintKind, PreviewOptions, RowSelection, Severity, TokenClass,
    TokenizerBundle, IGNORE_INDEX,
};

fn ids(n: usize, offset: i64) -> Vec<i64> {
    (0..n as i64).map(|i| 100 + offset + i).collect()
}

/// Rows with `labels = [1] * len`, as JSONL and as Parquet.
fn write_bad_pretokenized(dir: &Path) -> (PathBuf, PathBuf) {
    let rows: Vec<Vec<i64>> = (0..6).map(|r| ids(10 + r, r as i64)).collect();
    let labels: Vec<Vec<i64>> = rows.iter().map(|r| vec![1; r.len()]).collect();
    let jsonl = dir.join("bad.jsonl");
    let text: Vec<String> = rows
        .iter()
        .zip(&labels)
        .map(|(i, l)| serde_json::json!({"input_ids": i, "labels": l}).to_string())
        .collect();
    std::fs::write(&jsonl, text.join("\n")).unwrap();
    let pq = dir.join("bad.parquet");
    write_parquet(
        &pq,
        &[
            Col::IntLists("input_ids", rows),
            Col::IntLists("labels", labels),
        ],
    );
    (jsonl, pq)
}

fn preview(path: &Path, tok: &TokenizerBundle) -> tunestudio::data::DataPreview {
    preview_dataset(
        &DataConfig::new(path.display().to_string()),
        tok,
        &PreviewOptions::default(),
    )
    .unwrap()
}

#[test]
fn labels_all_ones_is_an_error_for_jsonl_and_parquet() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let (jsonl, pq) = write_bad_pretokenized(dir.path());
    for path in [jsonl, pq] {
        let p = preview(&path, &tok);
        assert_eq!(p.format, Format::Pretokenized, "{}", path.display());
        let lint = p
            .lints
            .iter()
            .find(|l| l.kind == LintKind::LabelsMismatch)
            .expect("labels lint");
        assert_eq!(lint.severity, Severity::Error);
        assert_eq!(lint.count, 6);
        assert_eq!(lint.examples, vec![0, 1, 2, 3, 4]);
        assert!(p.has_errors());
        assert!(has_errors(&p.lints));
        assert_eq!(p.lints[0].severity, Severity::Error, "worst first");
        assert_eq!(p.rows[0].tokens[3].class, TokenClass::Mismatch);
        assert_eq!(p.rows[0].tokens[3].label, 1);
        // The missing EOS is reported too.
        assert!(p.lints.iter().any(|l| l.kind == LintKind::MissingEos));
    }
}

#[test]
fn pretokenized_variants() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let w = |name: &str, rows: Vec<serde_json::Value>| {
        let p = dir.path().join(name);
        let text: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
        std::fs::write(&p, text.join("\n")).unwrap();
        p
    };
    // Correct: labels = ids with a masked prompt, EOS at the end, right padding masked.
    let good = w(
        "good.jsonl",
        vec![serde_json::json!({
            "input_ids": [100, 101, 102, 2, 2, 2],
            "labels": [-100, 101, 102, 2, -100, -100],
            "attention_mask": [1, 1, 1, 1, 0, 0]
        })],
    );
    let p = preview(&good, &tok);
    assert!(!p.has_errors(), "{:?}", p.lints);
    assert_eq!(p.rows[0].num_tokens, 4, "padding positions are dropped");
    assert_eq!(p.stats.trained_tokens, 3);

    // Pre-shifted labels: error, and the message says so.
    let shifted = w(
        "shifted.jsonl",
        vec![serde_json::json!({"input_ids": [100, 101, 102, 2], "labels": [101, 102, 2, -100]})],
    );
    let p = preview(&shifted, &tok);
    let lint = p
        .lints
        .iter()
        .find(|l| l.kind == LintKind::LabelsMismatch)
        .unwrap();
    assert_eq!(lint.severity, Severity::Error);
    assert!(lint.message.contains("pre-shifted"), "{}", lint.message);

    // Padding trained: attention_mask 0 with a label.
    let pad = w(
        "pad.jsonl",
        vec![
            serde_json::json!({"input_ids": [100, 101, 2, 2], "labels": [100, 101, 2, 2], "attention_mask": [1, 1, 1, 0]}),
        ],
    );
    let p = preview(&pad, &tok);
    let lint = p
        .lints
        .iter()
        .find(|l| l.kind == LintKind::PaddingTrained)
        .unwrap();
    assert_eq!(lint.severity, Severity::Error);

    // All -100: dropped with a count; mismatched lengths: a clear error.
    let none = w(
        "none.jsonl",
        vec![
            serde_json::json!({"input_ids": [100, 101, 2], "labels": [-100, -100, -100]}),
            serde_json::json!({"input_ids": [100, 101, 2]}),
        ],
    );
    let p = preview(&none, &tok);
    let lint = p
        .lints
        .iter()
        .find(|l| l.kind == LintKind::ZeroTrainedTokens)
        .unwrap();
    assert_eq!((lint.count, lint.examples.clone()), (1, vec![0]));
    let bad_len = w(
        "len.jsonl",
        vec![serde_json::json!({"input_ids": [100, 101, 2], "labels": [1]})],
    );
    let err = prepare_dataset(&DataConfig::new(bad_len.display().to_string()), &tok, 8)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("len.jsonl line 1") && err.contains("same length"),
        "{err}"
    );
    let oov = w(
        "oov.jsonl",
        vec![serde_json::json!({"input_ids": [100, 999999]})],
    );
    let err = prepare_dataset(&DataConfig::new(oov.display().to_string()), &tok, 8)
        .unwrap_err()
        .to_string();
    assert!(err.contains("vocabulary"), "{err}");
}

#[test]
fn text_lints_duplicates_empty_and_no_pad_no_template() {
    let dir = tempfile::tempdir().unwrap();
    // A tokenizer folder without pad token and without chat template.
    let tdir = dir.path().join("tok");
    std::fs::create_dir(&tdir).unwrap();
    std::fs::copy(
        tiny_llama_dir().join("tokenizer.json"),
        tdir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        tdir.join("tokenizer_config.json"),
        r#"{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}"#,
    )
    .unwrap();
    let tok = TokenizerBundle::load(&tdir).unwrap();
    assert!(tok.chat_template.is_none());
    let data = dir.path().join("d.jsonl");
    std::fs::write(
        &data,
        "{\"text\": \"same\"}\n{\"text\": \"   \"}\n{\"text\": \"same\"}\n{\"text\": \"other\"}\n",
    )
    .unwrap();
    let p = preview(&data, &tok);
    let kinds: Vec<LintKind> = p.lints.iter().map(|l| l.kind).collect();
    assert!(kinds.contains(&LintKind::DuplicateRows), "{kinds:?}");
    assert!(kinds.contains(&LintKind::EmptyRows));
    assert!(kinds.contains(&LintKind::NoPadToken));
    assert!(p.pad_is_fallback);
    assert_eq!(p.stats.num_dropped, 1);
    let dup = p
        .lints
        .iter()
        .find(|l| l.kind == LintKind::DuplicateRows)
        .unwrap();
    assert_eq!(dup.examples, vec![2]);

    // Chat data without a template: ChatML fallback + warning.
    let chat = dir.path().join("c.jsonl");
    std::fs::write(
        &chat,
        r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}"#,
    )
    .unwrap();
    let p = preview(&chat, &tok);
    assert!(p
        .lints
        .iter()
        .any(|l| l.kind == LintKind::ChatWithoutTemplate));
    assert_eq!(
        p.rows[0].text.as_deref(),
        Some("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n")
    );
    assert!(!p.has_errors());
}

#[test]
fn collation_of_prepared_samples() {
    let tok = tiny_llama();
    let p = prepare_dataset(&DataConfig::new(dataset("identity.json")), &tok, 4).unwrap();
    let lengths: Vec<usize> = p.train.iter().map(|s| s.len()).collect();
    let batches = batch_indices(&lengths, 4, true, true, 1, 0);
    let opts = CollateOptions::new(p.pad.id, 2048);
    let mut trained = 0;
    for b in &batches {
        let rows: Vec<&_> = b.iter().map(|&i| &p.train[i]).collect();
        let batch = collate(&rows, &opts);
        assert_eq!(batch.seq_len % 8, 0);
        assert!(batch.seq_len >= rows.iter().map(|s| s.len()).max().unwrap());
        for (r, s) in rows.iter().enumerate() {
            let row = &batch.labels[r * batch.seq_len..(r + 1) * batch.seq_len];
            assert_eq!(&row[..s.len()], &s.labels[..]);
            assert!(row[s.len()..].iter().all(|&l| l == IGNORE_INDEX));
            let ids = &batch.input_ids[r * batch.seq_len..(r + 1) * batch.seq_len];
            assert!(ids[s.len()..].iter().all(|&i| i == p.pad.id));
        }
        trained += batch.num_trained_tokens;
        let (i, m, l) = batch.to_tensors(&candle_core::Device::Cpu).unwrap();
        assert_eq!(i.dims(), &[batch.batch_size, batch.seq_len]);
        assert_eq!(m.dims(), l.dims());
    }
    assert_eq!(trained, p.train_stats.trained_tokens);
}

#[test]
fn preview_binary_exit_codes() {
    let bin = env!("CARGO_BIN_EXE_tunestudio");
    let dir = tempfile::tempdir().unwrap();
    let (jsonl, _) = write_bad_pretokenized(dir.path());
    let out = Command::new(bin)
        .args(["preview", "--no-color", "--rows", "1", "--model"])
        .arg(tiny_llama_dir())
        .arg("--data")
        .arg(&jsonl)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ERROR LabelsMismatch"), "{stdout}");
    assert!(
        stdout.contains("(1, 100)"),
        "text(label, id) rendering: {stdout}"
    );

    // A run config with [model] and [data] (relative paths, other tables ignored).
    std::fs::copy(
        dataset("alpaca_en_demo.json"),
        dir.path().join("alpaca.json"),
    )
    .unwrap();
    let run = format!(
        "output_dir = \"runs/x\"\n[model]\nsource = {:?}\ndtype = \"auto\"\n[training]\nmicro_batch = 2\n[data]\npath = \"alpaca.json\"\nmax_length = 512\n",
        tiny_llama_dir().display().to_string()
    );
    std::fs::write(dir.path().join("run.toml"), run).unwrap();
    let out = Command::new(bin)
        .args(["preview", "--no-color", "--row", "1", "--config"])
        .arg(dir.path().join("run.toml"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("format: alpaca") && stdout.contains("batch 2"),
        "{stdout}"
    );
    // The answer's tokens are trained (label = id), the prompt's masked (-100).
    assert!(
        stdout.contains("accelerated(18438, 18438)") && stdout.contains(" car(-100, 1076)"),
        "{stdout}"
    );

    // A `[data]` key the preview cannot read is an error naming it, read by the same reader
    // as `train` and `plan`; another table's unknown key is left to `train`.
    let typo = "output_dir = \"runs/x\"\n[training]\nlearning_rat = 1\n[data]\npath = \"alpaca.json\"\nmax_len = 3\n";
    std::fs::write(dir.path().join("typo.toml"), typo).unwrap();
    let out = Command::new(bin)
        .args(["preview", "--no-color", "--rows", "1", "--model"])
        .arg(tiny_llama_dir())
        .arg("--config")
        .arg(dir.path().join("typo.toml"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("typo.toml") && stderr.contains("data.max_len"),
        "{stderr}"
    );
    assert!(!stderr.contains("learning_rat"), "{stderr}");

    // Unreadable data: exit 1 with the location.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"a\"}\n{oops\n").unwrap();
    let out = Command::new(bin)
        .args(["preview", "--model"])
        .arg(tiny_llama_dir())
        .arg("--data")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
}

#[test]
fn quick_preview_reads_only_shown_rows() {
    let tok = tiny_llama();
    let opts = PreviewOptions {
        rows: RowSelection::First(2),
        batch_size: 8,
        full_scan: false,
    };
    let p = preview_dataset(&DataConfig::new(dataset("c4_demo.jsonl")), &tok, &opts).unwrap();
    assert_eq!(p.num_rows, 300);
    assert_eq!(p.stats.num_rows, 2);
    assert!(p.rows[0]
        .tokens
        .iter()
        .all(|t| t.class != TokenClass::Masked));
}
