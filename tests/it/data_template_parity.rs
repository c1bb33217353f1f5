//! Tokenizer + chat template parity with transformers (fixtures computed by
//! HF: /work/shared/fixtures/sft_chat_template_alpaca_en.json).

use serde_json::Value;
use tunestudio::data::{
    label_example, to_example, ChatTemplate, ColumnMapping, Format, LabelContext, TemplateTokens,
    TokenizerBundle, IGNORE_INDEX,
};
use tunestudio::paths::shared_dir;

fn tiny_llama() -> TokenizerBundle {
    TokenizerBundle::load(&shared_dir().join("fixtures/tiny-llama")).expect("load tokenizer")
}

fn fixture() -> Vec<Value> {
    let p = shared_dir().join("fixtures/sft_chat_template_alpaca_en.json");
    let text = std::fs::read_to_string(&p).expect("fixture");
    serde_json::from_str::<Vec<Value>>(&text).expect("fixture json")
}

#[test]
fn tokenizer_bundle_reads_special_tokens() {
    let tok = tiny_llama();
    assert_eq!(tok.bos_token.as_deref(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.bos_token_id, Some(1));
    assert_eq!(tok.eos_token_id, Some(2));
    assert_eq!(tok.pad_token_id, Some(2));
    assert_eq!(tok.unk_token_id, Some(0));
    assert_eq!(tok.vocab_size(), 49152);
    let pad = tok.pad();
    assert_eq!((pad.id, pad.is_fallback), (2, false));
    assert!(tok.is_special(2));
    assert!(tok.chat_template.as_deref().unwrap().contains("im_start"));
    // tiny-qwen2's tokenizer.json bakes in truncation/padding at 24; it must be off.
    let q = TokenizerBundle::load(&shared_dir().join("fixtures/tiny-qwen2")).unwrap();
    let long = "word ".repeat(100);
    assert!(q.encode(&long, false).unwrap().len() > 24);
    assert_eq!(q.encode("hi", false).unwrap().len(), 1);
}

#[test]
fn rendered_ids_and_labels_match_transformers_for_all_rows() {
    let tok = tiny_llama();
    let tmpl = ChatTemplate::new(
        tok.chat_template.as_deref().unwrap(),
        TemplateTokens {
            bos_token: tok.bos_token.clone(),
            eos_token: tok.eos_token.clone(),
            pad_token: tok.pad_token.clone(),
            unk_token: tok.unk_token.clone(),
        },
    )
    .unwrap();
    let ctx = LabelContext {
        tok: &tok,
        template: Some(&tmpl),
        completions_only: true,
        max_length: 4096,
        keep_text: true,
    };
    let rows = fixture();
    assert_eq!(rows.len(), 8);
    for (i, fx) in rows.iter().enumerate() {
        let ex = to_example(
            &fx["row"],
            Format::Alpaca,
            &ColumnMapping::default(),
            &|| format!("fixture row {i}"),
        )
        .unwrap();
        let out = label_example(i, &ex, &ctx, &|| format!("fixture row {i}")).unwrap();
        assert_eq!(
            out.text.as_deref(),
            fx["rendered"].as_str(),
            "row {i}: rendered text differs"
        );
        let want_ids: Vec<u32> = fx["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let want_labels: Vec<i64> = fx["labels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(out.sample.input_ids, want_ids, "row {i}: input_ids differ");
        assert_eq!(out.sample.labels, want_labels, "row {i}: labels differ");
        assert!(!out.eos_appended, "row {i}: the template closes the turn");
        assert!(!out.prefix_unstable);
        assert!(out.sample.labels.contains(&IGNORE_INDEX));
    }
}

#[test]
fn chat_template_from_config_list_and_jinja_precedence() {
    let dir = tempfile::tempdir().unwrap();
    let src = shared_dir().join("fixtures/tiny-llama/tokenizer.json");
    std::fs::copy(&src, dir.path().join("tokenizer.json")).unwrap();
    let cfg = serde_json::json!({
        "bos_token": {"content": "<|im_start|>", "__type": "AddedToken"},
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT {{ messages[0].content }}"}
        ],
        "add_bos_token": true
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let tok = TokenizerBundle::load(dir.path()).unwrap();
    assert_eq!(
        tok.chat_template.as_deref(),
        Some("DEFAULT {{ messages[0].content }}")
    );
    assert_eq!(tok.bos_token_id, Some(1));
    assert_eq!(tok.pad_token_id, None);
    let pad = tok.pad();
    assert_eq!((pad.id, pad.is_fallback), (2, true));
    // add_bos_token prepends BOS when encoding with special tokens.
    assert_eq!(tok.encode("hi", true).unwrap()[0], 1);
    assert_ne!(tok.encode("hi", false).unwrap()[0], 1);

    std::fs::write(dir.path().join("chat_template.jinja"), "JINJA\n").unwrap();
    let tok = TokenizerBundle::load(dir.path()).unwrap();
    assert_eq!(tok.chat_template.as_deref(), Some("JINJA\n"));

    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    let err = TokenizerBundle::load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
}

#[test]
fn real_world_template_features_render() {
    // A Llama-3-style template: namespace, strftime_now fallback, raise_exception,
    // loop.last, string methods through pycompat, tojson for tools.
    let src = r#"{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Today Date: " + date_string + "\n\n" if false else "" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + message.role) }}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'].strip() + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"#;
    let t = ChatTemplate::new(
        src,
        TemplateTokens {
            bos_token: Some("<|begin_of_text|>".into()),
            ..Default::default()
        },
    )
    .unwrap();
    use tunestudio::data::ChatMessage;
    let msgs = vec![
        ChatMessage::new("system", " Be brief. "),
        ChatMessage::new("user", " Hi "),
        ChatMessage::new("assistant", "Hello"),
    ];
    let out = t.render(&msgs, false).unwrap();
    assert_eq!(
        out,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
    );
    let gen = t.render(&msgs[..2], true).unwrap();
    assert!(gen.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"));
    let err = t
        .render(&[ChatMessage::new("tool", "x")], false)
        .unwrap_err();
    assert!(err.contains("bad role tool"), "{err}");
}

/// The prefix-count shortcut (reusing the full conversation's tokens) gives
/// exactly the labels of tokenising every prefix on its own.
#[test]
fn prefix_shortcut_matches_tokenising_each_prefix() {
    use tunestudio::data::{prepare_dataset, DataConfig};
    let fast = tiny_llama();
    assert!(fast.prefix_shortcut(), "byte-level BPE allows the shortcut");
    let mut slow = tiny_llama();
    slow.set_prefix_shortcut(false);
    assert!(!slow.prefix_shortcut());

    let dir = tempfile::tempdir().unwrap();
    let nasty = [
        "\n\nleading newlines",
        "  leading spaces",
        " ",
        "",
        "ends with newlines\n\n",
        "literal <|im_end|> and <|im_start|>assistant\n inside",
        "שלום! 你好。 emoji 🎉",
        "\n",
    ];
    let mut lines = Vec::new();
    for (i, a) in nasty.iter().enumerate() {
        for b in nasty.iter().skip(i % 3) {
            let row = serde_json::json!({"messages": [
                {"role": "system", "content": *b},
                {"role": "user", "content": *a},
                {"role": "assistant", "content": *b},
                {"role": "user", "content": *b},
                {"role": "assistant", "content": *a},
            ]});
            lines.push(row.to_string());
        }
    }
    let chat = dir.path().join("nasty.jsonl");
    std::fs::write(&chat, lines.join("\n")).unwrap();
    let shared = tunestudio::paths::shared_dir().join("datasets");
    let mut paths: Vec<String> = [
        "alpaca_en_demo.json",
        "alpaca_zh_demo.json",
        "v1_sft_demo.jsonl",
    ]
    .iter()
    .map(|n| shared.join(n).display().to_string())
    .collect();
    paths.push(chat.display().to_string());
    for path in paths {
        let cfg = DataConfig {
            max_length: 100_000,
            ..DataConfig::new(path.clone())
        };
        let a = prepare_dataset(&cfg, &fast, 8).unwrap();
        let b = prepare_dataset(&cfg, &slow, 8).unwrap();
        assert_eq!(a.train.len(), b.train.len(), "{path}");
        for (x, y) in a.train.iter().zip(&b.train) {
            assert_eq!(x, y, "{path} row {}", x.row);
        }
    }
}
