//! Every shared dataset loads with the right format and row count, and is
//! labelled as its format demands; folders, hub caches, splits, packing.

use crate::data_support;

use data_support::{dataset, tiny_llama, write_parquet, Col};
use tunestudio::data::{
    open_data_with_cache, prepare_dataset, prepare_opened, preview_dataset, split_indices,
    DataConfig, Format, LintKind, PreviewOptions, RowSelection, Severity, TokenClass, IGNORE_INDEX,
};

fn cfg(path: &str) -> DataConfig {
    DataConfig {
        max_length: 4096,
        ..DataConfig::new(path)
    }
}

#[test]
fn shared_datasets_detect_format_and_count_rows() {
    let tok = tiny_llama();
    let cases = [
        ("alpaca_en_demo.json", Format::Alpaca, 999),
        ("alpaca_zh_demo.json", Format::Alpaca, 1000),
        ("identity.json", Format::Alpaca, 91),
        ("c4_demo.jsonl", Format::Text, 300),
        ("v1_sft_demo.jsonl", Format::LlamaFactoryV1, 500),
    ];
    for (name, format, rows) in cases {
        let p = prepare_dataset(&cfg(&dataset(name)), &tok, 8).unwrap();
        assert_eq!(p.format, format, "{name}");
        assert_eq!(p.num_source_rows, rows, "{name}");
        assert_eq!(p.train_stats.num_rows, rows, "{name}");
        assert_eq!(p.train.len() + p.train_stats.num_dropped, rows, "{name}");
        assert!(p.validation.is_empty());
        assert_eq!(p.completions_only, format != Format::Text, "{name}");
        assert!(
            !p.lints.iter().any(|l| l.severity == Severity::Error),
            "{name}: {:?}",
            p.lints
        );
    }
}

#[test]
fn c4_trains_every_token() {
    let tok = tiny_llama();
    let p = prepare_dataset(&cfg(&dataset("c4_demo.jsonl")), &tok, 8).unwrap();
    assert_eq!(p.train.len(), 300);
    for s in &p.train {
        let ids: Vec<i64> = s.input_ids.iter().map(|&i| i as i64).collect();
        assert_eq!(s.labels, ids, "row {}", s.row);
        // EOS closes every untruncated document (appended: the text has none).
        if s.len() < 4096 {
            assert_eq!(s.input_ids.last(), Some(&2));
        }
    }
    assert!((p.train_stats.trained_fraction - 1.0).abs() < 0.01);
    assert!(p.lints.iter().any(|l| l.kind == LintKind::EosAppended));
}

#[test]
fn alpaca_masks_the_prompt() {
    let tok = tiny_llama();
    let p = prepare_dataset(&cfg(&dataset("alpaca_en_demo.json")), &tok, 8).unwrap();
    assert_eq!(p.train.len(), 999);
    let header = tok.encode("<|im_start|>assistant\n", false).unwrap();
    for s in &p.train {
        let first = s.labels.iter().position(|&l| l != IGNORE_INDEX).unwrap();
        assert!(first > 10, "row {}: system+user prompt masked", s.row);
        // The masked prefix ends with the assistant header (the generation prompt).
        assert_eq!(
            &s.input_ids[first - header.len()..first],
            &header[..],
            "row {}",
            s.row
        );
        // Everything from there on is trained, including <|im_end|>\n.
        for i in first..s.len() {
            assert_eq!(s.labels[i], s.input_ids[i] as i64, "row {}", s.row);
        }
        assert_eq!(&s.input_ids[s.len() - 2..], &[2, 198]);
    }
}

#[test]
fn v1_honours_loss_weight() {
    let tok = tiny_llama();
    let p = prepare_dataset(&cfg(&dataset("v1_sft_demo.jsonl")), &tok, 8).unwrap();
    assert_eq!(p.train.len(), 500);
    let s = &p.train[0];
    let text = tok.decode(&s.input_ids);
    assert!(text.contains("<|im_start|>user\nhi<|im_end|>"), "{text}");
    let trained: Vec<u32> = s
        .input_ids
        .iter()
        .zip(&s.labels)
        .filter(|(_, &l)| l != IGNORE_INDEX)
        .map(|(&i, _)| i)
        .collect();
    assert_eq!(
        tok.decode(&trained),
        "Hello! I am {{name}}, an AI assistant developed by {{author}}. How can I assist you today?<|im_end|>\n"
    );
    assert!(s.weights.is_none(), "0/1 weights need no per-token weights");

    // Edit the weights: user 1.0 trains the user turn, assistant 0.5 gives
    // per-token weights, assistant 0 leaves nothing to train.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.jsonl");
    let row = |uw: f64, aw: f64| {
        serde_json::json!({"messages": [
            {"role": "user", "content": [{"type": "text", "value": "hi"}], "loss_weight": uw},
            {"role": "assistant", "content": [{"type": "text", "value": "hello"}], "loss_weight": aw}
        ]})
        .to_string()
    };
    std::fs::write(
        &path,
        [row(1.0, 1.0), row(0.0, 0.5), row(0.0, 0.0)].join("\n"),
    )
    .unwrap();
    let p = prepare_dataset(&cfg(&path.display().to_string()), &tok, 8).unwrap();
    assert_eq!(p.format, Format::LlamaFactoryV1);
    assert_eq!(p.train.len(), 2, "the all-zero row is dropped");
    assert_eq!(p.train_stats.num_dropped, 1);
    let both = &p.train[0];
    let user_trained: Vec<u32> = both
        .input_ids
        .iter()
        .zip(&both.labels)
        .filter(|(_, &l)| l != IGNORE_INDEX)
        .map(|(&i, _)| i)
        .collect();
    // The first user turn is trained, including the system prompt the
    // template injects before it (it renders as part of that turn).
    let user_text = tok.decode(&user_trained);
    assert!(
        user_text.ends_with("<|im_start|>user\nhi<|im_end|>\nhello<|im_end|>\n"),
        "{user_text}"
    );
    let half = &p.train[1];
    let w = half.weights.as_ref().expect("non-binary weights exposed");
    for (i, &l) in half.labels.iter().enumerate() {
        assert_eq!(w[i], if l == IGNORE_INDEX { 0.0 } else { 0.5 });
    }
    assert!(p
        .lints
        .iter()
        .any(|l| l.kind == LintKind::NonBinaryLossWeights));
    assert!(p
        .lints
        .iter()
        .any(|l| l.kind == LintKind::ZeroTrainedTokens && l.examples == [2]));
}

#[test]
fn chat_sharegpt_prompt_completion_and_single_column() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let w = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    // Multi-turn chat: both assistant turns trained, users and system masked.
    let chat = w(
        "chat.jsonl",
        r#"{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}"#,
    );
    let p = prepare_dataset(&cfg(&chat), &tok, 8).unwrap();
    assert_eq!(p.format, Format::Chat);
    let s = &p.train[0];
    let trained: Vec<u32> = s
        .input_ids
        .iter()
        .zip(&s.labels)
        .filter(|(_, &l)| l != IGNORE_INDEX)
        .map(|(&i, _)| i)
        .collect();
    assert_eq!(tok.decode(&trained), "a1<|im_end|>\na2<|im_end|>\n");

    let sg = w(
        "sg.json",
        r#"[{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "system": "Sys"}]"#,
    );
    let p = prepare_dataset(&cfg(&sg), &tok, 8).unwrap();
    assert_eq!(p.format, Format::ShareGpt);
    let text = tok.decode(&p.train[0].input_ids);
    assert_eq!(
        text,
        "<|im_start|>system\nSys<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
    );

    // Prompt/completion: no template, prompt masked, EOS appended.
    let pc = w("pc.jsonl", r#"{"prompt": "2+2=", "completion": " 4"}"#);
    let p = prepare_dataset(&cfg(&pc), &tok, 8).unwrap();
    assert_eq!(p.format, Format::PromptCompletion);
    let s = &p.train[0];
    let n_prompt = tok.encode("2+2=", true).unwrap().len();
    assert!(s.labels[..n_prompt].iter().all(|&l| l == IGNORE_INDEX));
    assert!(s.labels[n_prompt..].iter().all(|&l| l != IGNORE_INDEX));
    assert_eq!(s.input_ids.last(), Some(&2));

    // A CSV with a single `Prompt` column is plain text.
    let csv = w("p.csv", "Prompt\nhello world\n\"multi, comma\"\n");
    let p = prepare_dataset(&cfg(&csv), &tok, 8).unwrap();
    assert_eq!(p.format, Format::Text);
    assert_eq!(p.train.len(), 2);

    // Explicit format + column mapping override detection.
    let mapped = w(
        "m.jsonl",
        r#"{"q": "Why?", "a": "Because.", "text": "ignored"}"#,
    );
    let mut c = cfg(&mapped);
    c.format = Format::PromptCompletion;
    c.columns.prompt = Some("q".into());
    c.columns.completion = Some("a".into());
    let p = prepare_dataset(&c, &tok, 8).unwrap();
    assert_eq!(tok.decode(&p.train[0].input_ids), "Why?Because.<|im_end|>");

    // train_on_completions_only = false trains the prompt too.
    let mut c = cfg(&chat);
    c.train_on_completions_only = Some(false);
    let p = prepare_dataset(&c, &tok, 8).unwrap();
    assert!(p.train[0].labels.iter().all(|&l| l != IGNORE_INDEX));
}

#[test]
fn truncation_and_prompt_too_long() {
    let tok = tiny_llama();
    let mut c = DataConfig::new(dataset("alpaca_en_demo.json"));
    c.max_length = 64;
    let p = prepare_dataset(&c, &tok, 8).unwrap();
    assert!(p.train.iter().all(|s| s.len() <= 64));
    assert!(p.train_stats.num_truncated > 100);
    let trunc = p
        .lints
        .iter()
        .find(|l| l.kind == LintKind::CompletionTruncated)
        .unwrap();
    assert!(trunc.count > 100);
    // Rows whose prompt alone fills 64 tokens are dropped and reported.
    let too_long = p
        .lints
        .iter()
        .find(|l| l.kind == LintKind::PromptTooLong)
        .unwrap();
    assert_eq!(too_long.count, p.train_stats.num_dropped);
    assert!(p.train.iter().all(|s| s.num_trained() > 0));
}

#[test]
fn folder_hub_cache_and_splits() {
    let tok = tiny_llama();
    let cache = tempfile::tempdir().unwrap();
    let sha = "3f2b0c8d9e1a4b5c6d7e8f90a1b2c3d4e5f60718";
    let repo = cache.path().join("datasets--someone--tiny-text");
    let snap = repo.join("snapshots").join(sha).join("data");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), sha).unwrap();
    let texts: Vec<String> = (0..20).map(|i| format!("document number {i}")).collect();
    write_parquet(
        &snap.join("train-00000-of-00001.parquet"),
        &[Col::Strings("text", texts.clone())],
    );
    write_parquet(
        &snap.join("validation-00000-of-00001.parquet"),
        &[Col::Strings("text", texts[..5].to_vec())],
    );
    std::fs::write(repo.join("snapshots").join(sha).join("README.md"), "# card").unwrap();
    let c = cfg("someone/tiny-text");
    let data = open_data_with_cache(&c, cache.path(), true).unwrap();
    assert_eq!(data.main.len(), 20);
    assert_eq!(data.separate_validation.as_ref().unwrap().len(), 5);
    let p = prepare_opened(&c, &tok, &data, 4).unwrap();
    assert_eq!(p.format, Format::Text);
    assert_eq!((p.train.len(), p.validation.len()), (20, 5));
    assert_eq!(
        tok.decode(&p.train[3].input_ids),
        "document number 3<|im_end|>"
    );

    // Not cached + offline: a clear error.
    let err = open_data_with_cache(&cfg("someone/other"), cache.path(), true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("HF_HUB_OFFLINE") && err.contains("someone/other"),
        "{err}"
    );

    // A ratio split is seeded and deterministic.
    let mut c = cfg(&dataset("identity.json"));
    c.validation_ratio = 0.1;
    let a = prepare_dataset(&c, &tok, 8).unwrap();
    let b = prepare_dataset(&c, &tok, 8).unwrap();
    assert_eq!(a.validation.len(), 9);
    assert_eq!(a.train.len(), 82);
    assert_eq!(
        a.validation.iter().map(|s| s.row).collect::<Vec<_>>(),
        b.validation.iter().map(|s| s.row).collect::<Vec<_>>()
    );
    let (t, v) = split_indices(91, 0.1, 42);
    assert_eq!(v, a.validation.iter().map(|s| s.row).collect::<Vec<_>>());
    assert_eq!(t.len() + v.len(), 91);
    assert_ne!(split_indices(91, 0.1, 43).1, v);
}

#[test]
fn packing_fills_sequences() {
    let tok = tiny_llama();
    let mut c = DataConfig::new(dataset("identity.json"));
    c.max_length = 256;
    let plain = prepare_dataset(&c, &tok, 8).unwrap();
    c.packing = true;
    let packed = prepare_dataset(&c, &tok, 8).unwrap();
    assert!(packed.train.len() * 2 < plain.train.len());
    let t =
        |v: &[tunestudio::data::TokenizedSample]| v.iter().map(|s| s.num_trained()).sum::<usize>();
    assert_eq!(t(&plain.train), t(&packed.train));
    assert!(packed.train.iter().all(|s| s.len() <= 256));
    assert!(packed.train_stats.packing_efficiency > 0.8);
}

#[test]
fn preview_rows_classes_and_padding() {
    let tok = tiny_llama();
    let c = DataConfig::new(dataset("alpaca_en_demo.json"));
    let opts = PreviewOptions {
        rows: RowSelection::Indices(vec![1, 0, 5]),
        batch_size: 2,
        full_scan: false,
    };
    let p = preview_dataset(&c, &tok, &opts).unwrap();
    assert_eq!(p.rows.len(), 3);
    assert!(!p.full_scan);
    assert_eq!(p.stats.num_rows, 3);
    let r1 = &p.rows[0];
    assert_eq!(r1.index, 1);
    // Rows 1 and 0 share a batch: row 1 (51 tokens) is padded to row 0's 442 → 448.
    assert_eq!(r1.num_tokens, 51);
    assert_eq!(r1.tokens.len(), 448);
    assert_eq!(p.rows[1].tokens.len(), 448);
    assert_eq!(r1.tokens[0].class, TokenClass::Masked);
    assert_eq!(r1.tokens[50].class, TokenClass::Trained);
    assert_eq!(r1.tokens[51].class, TokenClass::Padding);
    assert_eq!(r1.tokens[51].label, IGNORE_INDEX);
    let text: String = r1.tokens[..51].iter().map(|t| t.text.as_str()).collect();
    assert_eq!(Some(text.as_str()), r1.text.as_deref());
    assert!(r1
        .text
        .as_deref()
        .unwrap()
        .contains("The car accelerated rapidly."));
    let err = preview_dataset(
        &c,
        &tok,
        &PreviewOptions {
            rows: RowSelection::Indices(vec![5000]),
            ..PreviewOptions::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("5000") && err.contains("999"), "{err}");
}
