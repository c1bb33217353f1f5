//! Preference pairs: the formats users have (TRL, LLaMA-Factory sharegpt/alpaca ranking and
//! v1) from JSON, JSONL, CSV and Parquet; tokenisation and labels equal to what
//! transformers computed for `fixtures/tiny-llama-dpo`; the pair lints.

use crate::data_support::{dataset, tiny_llama, write_parquet, Col};
use crate::support::fixture;
use candle_core::Device;
use serde_json::{json, Value};
use tunestudio::data::preference::{
    collate_pairs, lint_pairs, PairLimits, PairSide, PreferenceFormat, PreferencePair,
    PreferencePipeline,
};
use tunestudio::data::{
    ChatTemplate, CollateOptions, ColumnMapping, Dataset, LintKind, Severity, TemplateTokens,
    TokenizerBundle, TxtSplit, IGNORE_INDEX,
};

fn reference() -> std::collections::HashMap<String, candle_core::Tensor> {
    candle_core::safetensors::load(
        fixture("tiny-llama-dpo").join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
}

fn reference_json() -> Value {
    let text = std::fs::read_to_string(fixture("tiny-llama-dpo").join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn pipeline<'a>(
    tok: &'a TokenizerBundle,
    ds: &Dataset,
    limits: PairLimits,
) -> PreferencePipeline<'a> {
    PreferencePipeline::for_dataset(tok, ds, None, ColumnMapping::default(), limits).unwrap()
}

/// The fixture's three pairs: the first single-turn rows of `dpo_en_demo.json` whose prompt
/// is at most 40 tokens, completions cut to 16 tokens.
pub fn fixture_pairs(tok: &TokenizerBundle) -> Vec<PreferencePair> {
    let ds = Dataset::open(&dataset("dpo_en_demo.json"), TxtSplit::Auto).unwrap();
    let limits = PairLimits {
        max_prompt_length: None,
        max_completion_length: Some(16),
    };
    let pipe = pipeline(tok, &ds, limits);
    assert_eq!(pipe.format, PreferenceFormat::ShareGptRanking);
    let mut out = Vec::new();
    for i in 0..ds.len() {
        let row = ds.row(i).unwrap();
        if row["conversations"].as_array().unwrap().len() != 1 {
            continue;
        }
        let pair = pipe.pair(i, &row, &|| ds.location(i)).unwrap();
        if pair.prompt_ids.len() <= 40 {
            out.push(pair);
        }
        if out.len() == 3 {
            break;
        }
    }
    out
}

/// A `[3, T]` i64 tensor of the fixture as rows.
fn rows(r: &std::collections::HashMap<String, candle_core::Tensor>, key: &str) -> Vec<Vec<i64>> {
    r[key].to_vec2::<i64>().unwrap()
}

#[test]
fn fixture_pairs_match_transformers_ids_and_labels() {
    let tok = tiny_llama();
    let pairs = fixture_pairs(&tok);
    let want = reference_json();
    let ds = Dataset::open(&dataset("dpo_en_demo.json"), TxtSplit::Auto).unwrap();
    for (p, w) in pairs.iter().zip(want["rows"].as_array().unwrap()) {
        // The template's default system prompt is in the prompt, and it ends with the
        // generation prompt.
        assert_eq!(tok.decode(&p.prompt_ids), w["prompt"].as_str().unwrap());
        assert_eq!(
            p.prompt_ids.len() as u64,
            w["prompt_tokens"].as_u64().unwrap()
        );
        let row = ds.row(p.row).unwrap();
        assert_eq!(row["chosen"]["value"], w["chosen_text"]);
        assert_eq!(row["rejected"]["value"], w["rejected_text"]);
        for side in [PairSide::Chosen, PairSide::Rejected] {
            let c = p.completion(side);
            assert_eq!(c.ids.len(), 16);
            assert!(c.full_len > 16 && c.is_truncated());
            assert!(!c.prompt_differs && !c.eos_appended);
            assert_eq!(p.scored_tokens(side), 16);
        }
        assert_eq!(p.prompt_cut(), 0);
    }
    let opts = CollateOptions {
        pad_id: tok.pad().id,
        max_length: usize::MAX,
        pad_to_multiple_of: 1,
    };
    let refs: Vec<&PreferencePair> = pairs.iter().collect();
    let batch = collate_pairs(&refs, &opts);
    let r = reference();
    let t = batch.seq_len;
    assert_eq!(
        (batch.batch_size, t),
        (6, r["chosen.input_ids"].dim(1).unwrap())
    );
    for (half, side) in ["chosen", "rejected"].into_iter().enumerate() {
        let ids = rows(&r, &format!("{side}.input_ids"));
        let mask = rows(&r, &format!("{side}.attention_mask"));
        let labels = rows(&r, &format!("{side}.labels"));
        for i in 0..3 {
            let b = (half * 3 + i) * t;
            let got_ids: Vec<i64> = batch.input_ids[b..b + t]
                .iter()
                .map(|&x| x.into())
                .collect();
            let got_mask: Vec<i64> = batch.attention_mask[b..b + t]
                .iter()
                .map(|&x| x.into())
                .collect();
            assert_eq!(got_ids, ids[i], "{side} row {i} input_ids");
            assert_eq!(got_mask, mask[i], "{side} row {i} attention_mask");
            assert_eq!(batch.labels[b..b + t], labels[i], "{side} row {i} labels");
        }
    }
    assert_eq!(batch.num_trained_tokens, 6 * 16);
}

#[test]
fn every_pair_of_the_demo_files_tokenises() {
    let tok = tiny_llama();
    for (file, format) in [
        ("dpo_en_demo.json", PreferenceFormat::ShareGptRanking),
        ("v1_dpo_demo.jsonl", PreferenceFormat::LlamaFactoryV1),
    ] {
        let ds = Dataset::open(&dataset(file), TxtSplit::Auto).unwrap();
        let pipe = pipeline(&tok, &ds, PairLimits::default());
        assert_eq!(pipe.format, format, "{file}");
        let idx: Vec<usize> = (0..ds.len()).collect();
        let pairs = pipe.pairs(&ds, &idx).unwrap();
        assert_eq!(pairs.len(), ds.len());
        for p in &pairs {
            // Every prompt ends with the generation prompt, and no pair has a template or
            // masking problem.
            assert!(tok
                .decode(&p.prompt_ids)
                .ends_with("<|im_start|>assistant\n"));
            assert!(p.trainable(), "{file} row {}", p.row);
            assert!(!p.chosen.prompt_differs && !p.rejected.prompt_differs);
        }
        let lints = lint_pairs(&pairs, &pipe.lint_context());
        assert!(
            lints.iter().all(|l| l.severity != Severity::Error),
            "{file}: {lints:?}"
        );
    }
    // v1: the system and user turns are the prompt; the answer closes with <|im_end|>.
    let ds = Dataset::open(&dataset("v1_dpo_demo.jsonl"), TxtSplit::Auto).unwrap();
    let pipe = pipeline(&tok, &ds, PairLimits::default());
    let p = pipe
        .pair(0, &ds.row(0).unwrap(), &|| ds.location(0))
        .unwrap();
    let prompt = tok.decode(&p.prompt_ids);
    assert!(
        prompt.starts_with("<|im_start|>system\nYou are an AI assistant."),
        "{prompt}"
    );
    let chosen = tok.decode(&p.chosen.ids);
    assert!(
        chosen.starts_with("Abdulah Hasanagic is the proud owner"),
        "{chosen}"
    );
    assert!(chosen.ends_with("<|im_end|>\n"), "{chosen:?}");
}

#[test]
fn trl_formats_from_jsonl_csv_and_parquet() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    // Conversational with an explicit prompt, and implicit (shared leading turns).
    let jsonl = dir.path().join("trl.jsonl");
    let conv = json!({
        "prompt": [{"role": "user", "content": "Sky colour?"}],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Green."}],
    });
    let implicit = json!({
        "chosen": [{"role": "user", "content": "Sky colour?"}, {"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "user", "content": "Sky colour?"}, {"role": "assistant", "content": "Green."}],
    });
    std::fs::write(&jsonl, format!("{conv}\n{implicit}\n")).unwrap();
    let ds = Dataset::open(jsonl.to_str().unwrap(), TxtSplit::Auto).unwrap();
    let pipe = pipeline(&tok, &ds, PairLimits::default());
    assert_eq!(pipe.format, PreferenceFormat::Trl);
    let pairs = pipe.pairs(&ds, &[0, 1]).unwrap();
    assert_eq!(
        pairs[0],
        PreferencePair {
            row: 0,
            ..pairs[1].clone()
        }
    );
    assert_eq!(tok.decode(&pairs[0].chosen.ids), "Blue.<|im_end|>\n");
    assert_eq!(tok.decode(&pairs[0].rejected.ids), "Green.<|im_end|>\n");

    // Plain text in CSV: no template; the prompt as the tokenizer encodes it, each completion
    // on its own and closed with EOS.
    let csv = dir.path().join("trl.csv");
    std::fs::write(
        &csv,
        "prompt,chosen,rejected\n\"Q: sky?\",\" A: blue\",\" A: green\"\n",
    )
    .unwrap();
    let ds = Dataset::open(csv.to_str().unwrap(), TxtSplit::Auto).unwrap();
    let pipe = pipeline(&tok, &ds, PairLimits::default());
    let p = pipe
        .pair(0, &ds.row(0).unwrap(), &|| ds.location(0))
        .unwrap();
    assert!(!p.is_chat);
    assert_eq!(p.prompt_ids, tok.encode("Q: sky?", true).unwrap());
    let mut want = tok.encode(" A: blue", false).unwrap();
    want.push(tok.eos_token_id.unwrap());
    assert_eq!(p.chosen.ids, want);
    assert!(p.chosen.eos_appended);

    // Parquet, with conversations stored as JSON text (how CSV and some Parquet exports keep
    // nested columns).
    let pq = dir.path().join("trl.parquet");
    write_parquet(
        &pq,
        &[
            Col::Strings("prompt", vec![conv["prompt"].to_string()]),
            Col::Strings("chosen", vec![conv["chosen"].to_string()]),
            Col::Strings("rejected", vec![conv["rejected"].to_string()]),
        ],
    );
    let ds = Dataset::open(pq.to_str().unwrap(), TxtSplit::Auto).unwrap();
    let pipe = pipeline(&tok, &ds, PairLimits::default());
    let p = pipe
        .pair(0, &ds.row(0).unwrap(), &|| ds.location(0))
        .unwrap();
    assert_eq!(p, pairs[0]);

    // Alpaca ranking: instruction + input as the user turn.
    let alpaca =
        json!({"instruction": "Sky colour?", "input": "", "chosen": "Blue.", "rejected": "Green."});
    let p = pipe_for(&tok, &alpaca)
        .pair(0, &alpaca, &|| "x".into())
        .unwrap();
    assert_eq!(p.prompt_ids, pairs[0].prompt_ids);
    assert_eq!(p.chosen, pairs[0].chosen);
}

fn pipe_for<'a>(tok: &'a TokenizerBundle, first: &Value) -> PreferencePipeline<'a> {
    PreferencePipeline::new(
        tok,
        None,
        ColumnMapping::default(),
        PairLimits::default(),
        first,
        "first row",
    )
    .unwrap()
}

#[test]
fn bad_rows_name_the_file_and_row() {
    let tok = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pairs.jsonl");
    std::fs::write(
        &path,
        "{\"prompt\": \"p\", \"chosen\": \"a\", \"rejected\": \"b\"}\n{\"prompt\": \"p\", \"chosen\": [{\"role\": \"assistant\", \"content\": \"a\"}], \"rejected\": \"b\"}\n",
    )
    .unwrap();
    let ds = Dataset::open(path.to_str().unwrap(), TxtSplit::Auto).unwrap();
    let pipe = pipeline(&tok, &ds, PairLimits::default());
    let err = pipe.pairs(&ds, &[0, 1]).unwrap_err().to_string();
    assert!(
        err.contains("pairs.jsonl") && err.contains("line 2"),
        "{err}"
    );
    assert!(err.contains("both be text or both be lists"), "{err}");

    std::fs::write(&path, "{\"instruction\": \"a\", \"output\": \"b\"}\n").unwrap();
    let ds = Dataset::open(path.to_str().unwrap(), TxtSplit::Auto).unwrap();
    let err = PreferencePipeline::for_dataset(
        &tok,
        &ds,
        None,
        ColumnMapping::default(),
        PairLimits::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("pairs.jsonl line 1") && err.contains("preference pair"),
        "{err}"
    );
}

fn lint_kinds(
    pairs: &[PreferencePair],
    pipe: &PreferencePipeline<'_>,
) -> Vec<(LintKind, Severity, Vec<usize>)> {
    lint_pairs(pairs, &pipe.lint_context())
        .into_iter()
        .map(|l| (l.kind, l.severity, l.examples))
        .collect()
}

#[test]
fn pair_lints_find_each_mistake() {
    let tok = tiny_llama();
    let msgs = |q: &str, a: &str| json!([{"role": "user", "content": q}, {"role": "assistant", "content": a}]);
    let rows = [
        json!({"chosen": msgs("q", "fine answer"), "rejected": msgs("q", "bad answer")}),
        json!({"chosen": msgs("q", "same"), "rejected": msgs("q", "same")}),
        json!({"chosen": msgs("q", "long answer ".repeat(20).as_str()), "rejected": msgs("q", "ok")}),
    ];
    let limits = PairLimits {
        max_prompt_length: Some(8),
        max_completion_length: Some(12),
    };
    let mut pipe = pipe_for(&tok, &rows[0]);
    pipe.limits = limits;
    let pairs: Vec<PreferencePair> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| pipe.pair(i, r, &|| format!("row {i}")).unwrap())
        .collect();
    let kinds = lint_kinds(&pairs, &pipe);
    assert!(
        kinds.contains(&(LintKind::PairIdentical, Severity::Error, vec![1])),
        "{kinds:?}"
    );
    assert!(kinds.contains(&(
        LintKind::PairCompletionTruncated,
        Severity::Warning,
        vec![2]
    )));
    // The default system prompt makes every prompt longer than 8 tokens: its end is kept.
    assert!(kinds.contains(&(
        LintKind::PairPromptTruncated,
        Severity::Warning,
        vec![0, 1, 2]
    )));
    assert_eq!(pairs[0].prompt_ids.len(), 8);
    assert!(tok
        .decode(&pairs[0].prompt_ids)
        .ends_with("<|im_start|>assistant\n"));
    let share = lint_pairs(&pairs, &pipe.lint_context())
        .into_iter()
        .find(|l| l.kind == LintKind::PairCompletionTruncated)
        .unwrap()
        .message;
    assert!(share.contains("33.3%"), "{share}");
    assert!(kinds.iter().all(|k| k.0 != LintKind::PairCompletionEmpty
        && k.0 != LintKind::PairPromptMismatch
        && k.0 != LintKind::PairCompletionMasked));

    // A completion cut to nothing; an answer whose loss weight is 0 (v1).
    pipe.limits.max_completion_length = Some(0);
    let empty = pipe.pair(0, &rows[0], &|| "row 0".into()).unwrap();
    let v1 = json!({
        "chosen_messages": [{"role": "user", "content": "q", "loss_weight": 0.0}, {"role": "assistant", "content": "a", "loss_weight": 0.0}],
        "rejected_messages": [{"role": "user", "content": "q", "loss_weight": 0.0}, {"role": "assistant", "content": "b", "loss_weight": 1.0}],
    });
    let mut v1_pipe = pipe_for(&tok, &v1);
    v1_pipe.limits = PairLimits::default();
    let masked = v1_pipe.pair(5, &v1, &|| "row 5".into()).unwrap();
    assert!(masked.chosen.labels.iter().all(|&l| l == IGNORE_INDEX));
    assert!(masked.rejected.labels.iter().all(|&l| l != IGNORE_INDEX));
    assert!(!masked.trainable());
    let kinds = lint_kinds(&[empty, masked], &pipe);
    assert!(
        kinds.contains(&(LintKind::PairCompletionEmpty, Severity::Error, vec![0])),
        "{kinds:?}"
    );
    assert!(kinds.contains(&(LintKind::PairCompletionMasked, Severity::Error, vec![5])));

    // A template that renders the prompt differently once an answer follows.
    let src = "{% if messages[-1]['role'] == 'assistant' %}[answered]{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    pipe.template = ChatTemplate::new(src, TemplateTokens::default()).unwrap();
    pipe.limits = PairLimits::default();
    let p = pipe.pair(3, &rows[0], &|| "row 3".into()).unwrap();
    assert!(p.chosen.prompt_differs && p.rejected.prompt_differs);
    let kinds = lint_kinds(&[p], &pipe);
    assert!(
        kinds.contains(&(LintKind::PairPromptMismatch, Severity::Error, vec![3])),
        "{kinds:?}"
    );
}
