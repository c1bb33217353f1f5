//! Reader errors name the file, line and fix; nothing panics on arbitrary bytes.

use crate::data_support;

use data_support::{tiny_llama, write_parquet, Col};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tunestudio::data::{
    open_data, prepare_dataset, prepare_opened, DataConfig, Dataset, Format, TokenizerBundle,
};

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn prepare_err(path: &Path, tok: &TokenizerBundle) -> String {
    prepare_dataset(&DataConfig::new(path.display().to_string()), tok, 8)
        .unwrap_err()
        .to_string()
}

#[test]
fn malformed_jsonl_line_names_file_and_line() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let mut lines: Vec<String> = (1..=40)
        .map(|i| format!("{{\"text\": \"row {i}\"}}"))
        .collect();
    lines[36] = "{\"text\": \"row 37\",}".into();
    let p = write(dir.path(), "bad.jsonl", lines.join("\n").as_bytes());
    let err = prepare_err(&p, &tok);
    assert!(
        err.contains("bad.jsonl") && err.contains("line 37"),
        "{err}"
    );
    // Opening (indexing) succeeds; reading the row fails with the location.
    let ds = Dataset::open_files(std::slice::from_ref(&p), false).unwrap();
    assert_eq!(ds.len(), 40);
    assert!(ds.row(35).is_ok());
    assert!(ds.row(36).unwrap_err().to_string().contains("line 37"));
    // A line that is valid JSON but not an object.
    let p = write(dir.path(), "arr.jsonl", b"{\"text\": \"a\"}\n[1, 2]\n");
    let err = prepare_err(&p, &tok);
    assert!(
        err.contains("line 2") && err.contains("JSON object"),
        "{err}"
    );
}

#[test]
fn csv_missing_mapped_column_lists_columns() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "qa.csv", b"query,reply\nwhat,that\n");
    let mut cfg = DataConfig::new(p.display().to_string());
    cfg.format = Format::PromptCompletion;
    cfg.columns.prompt = Some("question".into());
    cfg.columns.completion = Some("reply".into());
    let err = prepare_dataset(&cfg, &tok, 8).unwrap_err().to_string();
    assert!(err.contains("qa.csv row 0"), "{err}");
    assert!(
        err.contains("\"question\"") && err.contains("data.columns.prompt"),
        "{err}"
    );
    assert!(err.contains("query") && err.contains("reply"), "{err}");
    // Unrecognisable columns: the error lists them and names the settings.
    let p = write(dir.path(), "odd.csv", b"a,b\n1,2\n");
    let err = prepare_err(&p, &tok);
    assert!(
        err.contains("[a, b]") && err.contains("data.format"),
        "{err}"
    );
    // A ragged CSV.
    let p = write(dir.path(), "ragged.csv", b"text,x\nhello,1\nworld\n");
    let err = prepare_err(&p, &tok);
    assert!(err.contains("ragged.csv") && err.contains("CSV"), "{err}");
}

#[test]
fn empty_files_and_invalid_utf8_are_clear() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    for name in ["e.json", "e.jsonl", "e.csv", "e.txt", "e.parquet"] {
        let p = write(dir.path(), name, b"");
        let err = prepare_err(&p, &tok);
        assert!(
            err.contains(name) && err.contains("is empty"),
            "{name}: {err}"
        );
    }
    let p = write(dir.path(), "ws.jsonl", b"\n  \n\n");
    assert!(prepare_err(&p, &tok).contains("is empty"));
    let p = write(dir.path(), "arr.json", b"[]");
    assert!(prepare_err(&p, &tok).contains("is empty"));

    let bad = b"{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": \"caf\xe9\"}\n";
    for name in ["u.jsonl", "u.json", "u.txt"] {
        let p = write(dir.path(), name, bad);
        let err = prepare_err(&p, &tok);
        assert!(
            err.contains(name) && err.contains("line 3") && err.contains("UTF-8"),
            "{name}: {err}"
        );
    }
    let p = write(dir.path(), "u.csv", b"text\nok\ncaf\xe9\n");
    let err = prepare_err(&p, &tok);
    assert!(
        err.contains("u.csv") && err.contains("line 3") && err.contains("UTF-8"),
        "{err}"
    );

    let p = write(dir.path(), "x.parquet", b"PAR1 not really parquet PAR1");
    let err = prepare_err(&p, &tok);
    assert!(
        err.contains("x.parquet") && err.contains("Parquet"),
        "{err}"
    );
    let p = write(dir.path(), "x.xlsx", b"..");
    assert!(prepare_err(&p, &tok).contains("unsupported file type"));
    let err = prepare_err(&dir.path().join("missing.jsonl"), &tok);
    assert!(err.contains("not found"), "{err}");
    let empty_dir = dir.path().join("nothing");
    std::fs::create_dir(&empty_dir).unwrap();
    assert!(prepare_err(&empty_dir, &tok).contains("holds no data files"));
}

#[test]
fn json_variants_and_folders() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    // JSON lines saved as .json, a {"data": [...]} wrapper, a BOM.
    let a = write(
        dir.path(),
        "a.json",
        b"{\"text\": \"one\"}\n{\"text\": \"two\"}\n",
    );
    let b = write(dir.path(), "b.json", b"{\"data\": [{\"text\": \"three\"}]}");
    let c = write(dir.path(), "c.csv", b"\xef\xbb\xbftext\nfour\n");
    let ds = Dataset::open_files(&[a, b, c], false).unwrap();
    assert_eq!(ds.len(), 4);
    assert_eq!(ds.row(3).unwrap()["text"], "four");
    let cfg = DataConfig::new(dir.path().display().to_string());
    let data = open_data(&cfg).unwrap();
    assert_eq!(data.main.len(), 4);
    let p = prepare_opened(&cfg, &tok, &data, 8).unwrap();
    assert_eq!(p.train.len(), 4);
}

/// Valid seeds for mutation: a JSONL/JSON/CSV/text/Parquet file each.
fn seeds(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let pq = dir.join("seed.parquet");
    write_parquet(
        &pq,
        &[
            Col::IntLists("input_ids", vec![vec![1, 2, 3], vec![4, 5]]),
            Col::Strings("text", vec!["a".into(), "b".into()]),
        ],
    );
    vec![
        ("jsonl".into(), br#"{"instruction": "a", "input": "", "output": "b"}
{"messages": [{"role": "user", "content": "x"}]}"#.to_vec()),
        ("json".into(), br#"[{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]"#.to_vec()),
        ("csv".into(), b"prompt,completion\n\"a, b\",c\n".to_vec()),
        ("txt".into(), b"para one\n\npara two\n".to_vec()),
        ("parquet".into(), std::fs::read(&pq).unwrap()),
    ]
}

#[test]
fn readers_never_panic_on_arbitrary_bytes() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let seeds = seeds(dir.path());
    let exts = ["jsonl", "json", "csv", "txt", "parquet"];
    // Either raw bytes with a random extension, or a valid seed with a few
    // bytes overwritten / truncated.
    let strategy = prop_oneof![
        (
            0..exts.len(),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(move |(e, b)| (exts[e].to_string(), b)),
        (
            0..seeds.len(),
            proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
            any::<prop::sample::Index>(),
            any::<bool>(),
        )
            .prop_map({
                let seeds = seeds.clone();
                move |(s, edits, cut, truncate)| {
                    let (ext, mut b) = seeds[s].clone();
                    for (i, v) in edits {
                        let n = b.len();
                        b[i.index(n)] = v;
                    }
                    if truncate {
                        let n = b.len();
                        b.truncate(cut.index(n + 1));
                    }
                    (ext, b)
                }
            }),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 400,
        failure_persistence: None,
        ..Config::default()
    });
    let start = Instant::now();
    let counter = std::sync::atomic::AtomicUsize::new(0);
    let ok_count = std::sync::atomic::AtomicUsize::new(0);
    // The Parquet crate panics on some corrupt files; the reader catches
    // that. Keep such caught panics (inside dependencies) off stderr, print
    // every other panic as usual.
    let default_hook = std::sync::Arc::new(std::panic::take_hook());
    let inner = default_hook.clone();
    std::panic::set_hook(Box::new(move |info| {
        if !info
            .location()
            .is_some_and(|l| l.file().contains(".cargo/registry"))
        {
            inner(info);
        }
    }));
    let result = runner.run(&strategy, |(ext, bytes)| {
        let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = dir.path().join(format!("case{n}.{ext}"));
        std::fs::write(&p, &bytes).unwrap();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let cfg = DataConfig {
                max_length: 64,
                ..DataConfig::new(p.display().to_string())
            };
            match prepare_dataset(&cfg, &tok, 4) {
                Ok(prepared) => {
                    ok_count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    assert!(prepared.train.iter().all(|s| s.len() <= 64));
                }
                Err(e) => assert!(!e.to_string().is_empty()),
            }
        }));
        let _ = std::fs::remove_file(&p);
        prop_assert!(outcome.is_ok(), "panicked on {ext} input {:?}", bytes);
        Ok(())
    });
    // Back to the default hook.
    drop(std::panic::take_hook());
    drop(default_hook);
    result.unwrap();
    println!(
        "proptest readers: {} cases ({} prepared without error) in {:.2} s",
        counter.into_inner(),
        ok_count.into_inner(),
        start.elapsed().as_secs_f64()
    );
}
