//! Generation engine checks on the tiny fixture models: cached decoding equals full-sequence
//! decoding, adapters equal their merged model, seeds reproduce, bad input is refused
//! clearly, cancellation stops the stream and UTF-8 streams whole characters.
use crate::support::{fixture, max_diff};

use candle_core::{DType, Device, IndexOp, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tunestudio::data::{ChatMessage, TokenizerBundle};
use tunestudio::infer::{
    argmax, spawn_generation, GenEvent, GenerationRequest, Generator, IncrementalDecoder,
    InferError, InferModel, ModelSpec, Prompt, SamplingParams, StopReason,
};
use tunestudio::model::{CausalLm, ModelConfig};

const MODELS: [&str; 3] = ["tiny-llama", "tiny-mistral", "tiny-qwen2"];

/// Row `row` of the fixture batch, without padding.
fn reference_ids(model: &str, row: usize) -> Vec<u32> {
    let t =
        candle_core::safetensors::load(fixture(model).join("reference.safetensors"), &Device::Cpu)
            .expect("reference.safetensors");
    let ids = t["input_ids"]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    let mask = t["attention_mask"]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec2::<i64>()
        .unwrap();
    ids[row]
        .iter()
        .zip(&mask[row])
        .filter(|(_, &m)| m != 0)
        .map(|(&i, _)| i as u32)
        .collect()
}

fn no_cancel() -> AtomicBool {
    AtomicBool::new(false)
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        stop_on_eos: false,
        ..SamplingParams::greedy(n)
    }
}

/// Greedy decoding by re-running the training model on the whole sequence each step.
fn uncached_greedy(model: &CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut ids = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = model.logits(&input, None).unwrap();
        let last = logits
            .i((0, ids.len() - 1))
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let next = argmax(&last).unwrap();
        ids.push(next);
        out.push(next);
    }
    out
}

#[test]
fn prefill_and_chunked_logits_match_the_training_model() {
    for name in MODELS {
        let lm = CausalLm::load(&fixture(name), DType::F32, &Device::Cpu).unwrap();
        let engine = InferModel::from_causal_lm(&lm).unwrap();
        // 24 English tokens: past mistral's sliding window of 8.
        let ids = reference_ids(name, 0);
        assert!(
            ids.len() > 8,
            "{name}: the reference row must exceed the window"
        );
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let want = lm.logits(&input, None).unwrap().squeeze(0).unwrap();

        let mut cache = engine.new_cache(ids.len());
        let got = engine.forward_all(&ids, &mut cache).unwrap();
        let d = max_diff(&got, &want);
        assert!(d < 1e-4, "{name}: prefill logits differ by {d}");
        assert_eq!(cache.len(), ids.len());

        // The first step's logits (last prompt position) through `forward`.
        let mut cache = engine.new_cache(4);
        let last = engine.forward(&ids, &mut cache).unwrap();
        let last = Tensor::new(last.as_slice(), &Device::Cpu).unwrap();
        let d = max_diff(&last, &want.i(ids.len() - 1).unwrap());
        assert!(d < 1e-4, "{name}: first-step logits differ by {d}");

        // Uneven chunks through a small cache: blocks of queries after cached positions
        // (mask offsets, the window across chunk borders) and cache growth.
        let mut cache = engine.new_cache(2);
        let mut rows = Vec::new();
        for chunk in [&ids[..5], &ids[5..6], &ids[6..15], &ids[15..16], &ids[16..]] {
            rows.push(engine.forward_all(chunk, &mut cache).unwrap());
        }
        let got = Tensor::cat(&rows, 0).unwrap();
        let d = max_diff(&got, &want);
        assert!(d < 1e-4, "{name}: chunked logits differ by {d}");
    }
}

#[test]
fn cached_greedy_generation_equals_uncached() {
    for name in MODELS {
        let g = Generator::load(&ModelSpec::new(fixture(name).to_string_lossy())).unwrap();
        let lm = CausalLm::load(&fixture(name), DType::F32, &Device::Cpu).unwrap();
        let prompt = g
            .encode_prompt(&Prompt::Completion("The quick brown fox".into()))
            .unwrap();
        // Prompt + 20 tokens runs well past mistral's window of 8.
        let n = 20;
        let out = g
            .generate_ids(&prompt, &greedy(n), &no_cancel(), &mut |_| true)
            .unwrap();
        assert_eq!(out.stop_reason, StopReason::MaxTokens);
        assert_eq!(out.tokens, n);
        assert_eq!(out.prompt_tokens, prompt.len());
        let want = uncached_greedy(&lm, &prompt, n);
        assert_eq!(
            out.token_ids, want,
            "{name}: cached and uncached greedy differ"
        );
    }
}

/// GRPO decodes a group's completions as one batch after one shared prefill
/// (`KvCache::repeat_rows`, `InferModel::forward_rows`): each row's logits equal those of the
/// same tokens decoded alone, past mistral's sliding window of 8 too; and a greedy group is
/// the greedy generation, G times.
#[test]
fn a_group_decoded_as_one_batch_equals_each_row_decoded_alone() {
    for name in MODELS {
        let lm = CausalLm::load(&fixture(name), DType::F32, &Device::Cpu).unwrap();
        let model = InferModel::from_causal_lm(&lm).unwrap();
        let prompt: Vec<u32> = vec![1, 17, 42, 99, 5];
        let steps = 12;
        let mut shared = model.new_cache(prompt.len());
        model.forward(&prompt, &mut shared).unwrap();
        let mut rows = shared.repeat_rows(3, prompt.len() + steps).unwrap();
        assert_eq!(rows.rows(), 3);
        let mut alone: Vec<_> = (0..3)
            .map(|_| {
                let mut c = model.new_cache(prompt.len());
                model.forward(&prompt, &mut c).unwrap();
                c
            })
            .collect();
        for step in 0..steps as u32 {
            let ids = [3 + step, 50 + 2 * step, 120 - step];
            let batch = model.forward_rows(&ids, &mut rows).unwrap();
            for (r, cache) in alone.iter_mut().enumerate() {
                let one = model.forward(&ids[r..r + 1], cache).unwrap();
                let one = Tensor::new(one.as_slice(), &Device::Cpu).unwrap();
                let d = max_diff(&batch.i(r).unwrap(), &one);
                assert!(d < 1e-4, "{name}: step {step}, row {r}: {d}");
            }
        }
        let err = model.forward(&[1], &mut rows).unwrap_err();
        assert!(err.to_string().contains("forward_rows"), "{err}");

        let want = uncached_greedy(&lm, &prompt, 6);
        let group = tunestudio::infer::sample_group(&model, &prompt, &greedy(6), 4, &[]).unwrap();
        assert_eq!(group.completions.len(), 4);
        for c in &group.completions {
            assert_eq!(c.ids, want, "{name}: a greedy completion of the group");
            assert!(c.truncated);
        }
    }
}

#[test]
fn adapter_generation_equals_merged_model() {
    let spec = ModelSpec::new(fixture("tiny-llama").to_string_lossy())
        .with_adapter(fixture("tiny-llama-lora"));
    let unmerged = Generator::load(&spec).unwrap();
    assert!(unmerged.adapter().is_some());

    let mut merged_lm = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    merged_lm.load_adapter(&fixture("tiny-llama-lora")).unwrap();
    merged_lm.merge_lora().unwrap();
    let tok = TokenizerBundle::load(&fixture("tiny-llama")).unwrap();
    let merged = Generator::from_model(&merged_lm, tok, "merged").unwrap();

    let ids = reference_ids("tiny-llama", 0);
    let input = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let want = merged_lm.logits(&input, None).unwrap().squeeze(0).unwrap();
    let mut cache = unmerged.model().expect("native").new_cache(ids.len());
    let got = unmerged
        .model()
        .expect("native")
        .forward_all(&ids, &mut cache)
        .unwrap();
    let d = max_diff(&got, &want);
    assert!(
        d < 1e-4,
        "unmerged adapter logits differ from merged by {d}"
    );

    // The adapter must change the model, or the comparison proves nothing.
    let base = Generator::load(&ModelSpec::new(fixture("tiny-llama").to_string_lossy())).unwrap();
    let prompt = Prompt::Completion("Once upon a time".into());
    let run = |g: &Generator| {
        g.generate(&prompt, &greedy(16), &no_cancel(), &mut |_| true)
            .unwrap()
            .token_ids
    };
    let a = run(&unmerged);
    assert_eq!(
        a,
        run(&merged),
        "base + adapter and merged model generate differently"
    );
    let mut cache = base.model().expect("native").new_cache(ids.len());
    let base_logits = base
        .model()
        .expect("native")
        .forward_all(&ids, &mut cache)
        .unwrap();
    assert!(
        max_diff(&base_logits, &want) > 1e-3,
        "the adapter had no effect"
    );
}

#[test]
fn seeded_generation_is_reproducible() {
    let g = Generator::load(&ModelSpec::new(fixture("tiny-qwen2").to_string_lossy())).unwrap();
    let prompt = Prompt::Completion("Hello there".into());
    let run = |p: &SamplingParams| {
        g.generate(&prompt, p, &no_cancel(), &mut |_| true)
            .unwrap()
            .token_ids
    };
    assert_eq!(run(&greedy(12)), run(&greedy(12)));
    let sample = |seed| SamplingParams {
        max_new_tokens: 24,
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        repetition_penalty: 1.1,
        seed,
        stop_strings: vec![],
        stop_on_eos: false,
        forced_tokens: vec![],
    };
    let a = run(&sample(7));
    assert_eq!(a.len(), 24);
    assert_eq!(a, run(&sample(7)), "same seed, different samples");
    assert_ne!(a, run(&sample(8)), "the seed has no effect");
    // top-k / top-p restrict the candidates, still reproducibly.
    let narrow = SamplingParams {
        top_k: 5,
        top_p: 0.9,
        temperature: 0.8,
        ..sample(3)
    };
    assert_eq!(run(&narrow), run(&narrow));
}

#[test]
fn chat_prompt_uses_the_model_template() {
    let g = Generator::load(&ModelSpec::new(fixture("tiny-llama").to_string_lossy())).unwrap();
    assert!(g.has_chat_template());
    // The SFT fixture: the prompt part of a rendered conversation, as transformers made it.
    let text = std::fs::read_to_string(fixture("sft_chat_template_alpaca_en.json")).unwrap();
    let rows: serde_json::Value = serde_json::from_str(&text).unwrap();
    let row = &rows[0];
    let user = row["row"]["instruction"].as_str().unwrap();
    let prompt = Prompt::chat(None, user);
    let rendered = g.render_prompt(&prompt).unwrap().unwrap();
    assert!(rendered.ends_with("<|im_start|>assistant\n"));
    assert!(row["rendered"].as_str().unwrap().starts_with(&rendered));
    let ids = g.encode_prompt(&prompt).unwrap();
    let labels = row["labels"].as_array().unwrap();
    let prompt_len = labels
        .iter()
        .take_while(|l| l.as_i64() == Some(-100))
        .count();
    let want: Vec<u32> = row["input_ids"].as_array().unwrap()[..prompt_len]
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, want);

    // A system prompt and multi-turn history.
    let prompt = Prompt::Chat {
        system: Some("Be brief.".into()),
        messages: vec![
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", "שלום"),
        ],
    };
    assert_eq!(
        g.render_prompt(&prompt).unwrap().unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nשלום<|im_end|>\n<|im_start|>assistant\n"
    );
    // Plain completion: the text as is.
    assert_eq!(
        g.render_prompt(&Prompt::Completion("abc".into()))
            .unwrap()
            .unwrap(),
        "abc"
    );
    // EOS of chat models: the template's end-of-turn token.
    assert!(g
        .eos_token_ids()
        .contains(&g.tokenizer().token_to_id("<|im_end|>").unwrap()));
}

#[test]
fn bad_input_gives_clear_errors() {
    let llama = fixture("tiny-llama").to_string_lossy().to_string();
    // An adapter made for tiny-llama on tiny-qwen2 (same shapes, other model).
    let spec = ModelSpec::new(fixture("tiny-qwen2").to_string_lossy())
        .with_adapter(fixture("tiny-llama-lora"));
    let err = Generator::load(&spec).unwrap_err();
    assert!(
        matches!(err, InferError::AdapterBaseMismatch { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("tiny-llama"), "{err}");

    // A model named like the base but with other shapes: the shape check catches it.
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("tiny-llama");
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-llama").join("config.json")).unwrap(),
    )
    .unwrap();
    cfg["hidden_size"] = 32.into();
    cfg["head_dim"] = 8.into();
    let cfg = ModelConfig::from_json_str(&cfg.to_string(), "test").unwrap();
    let lm = CausalLm::random_init(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
    lm.save_pretrained(&fake, DType::F32, u64::MAX).unwrap();
    let spec = ModelSpec::new(fake.to_string_lossy()).with_adapter(fixture("tiny-llama-lora"));
    let err = Generator::load(&spec).unwrap_err();
    assert!(
        matches!(err, InferError::AdapterShapeMismatch { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("different base model"), "{err}");

    let g = Generator::load(&ModelSpec::new(&llama)).unwrap();
    let cancel = no_cancel();
    #[allow(clippy::result_large_err)]
    let run = |p: &Prompt, s: &SamplingParams| g.generate(p, s, &cancel, &mut |_| true);
    let ok = Prompt::Completion("Hi".into());
    let err = run(&Prompt::Completion("  ".into()), &greedy(4)).unwrap_err();
    assert!(matches!(err, InferError::EmptyPrompt), "{err}");
    let err = run(&Prompt::chat(None, ""), &greedy(4)).unwrap_err();
    assert!(matches!(err, InferError::EmptyPrompt), "{err}");
    let err = run(&Prompt::Tokens(vec![]), &greedy(4)).unwrap_err();
    assert!(matches!(err, InferError::EmptyPrompt), "{err}");
    let err = run(&ok, &greedy(0)).unwrap_err();
    assert!(
        matches!(
            err,
            InferError::InvalidSetting {
                setting: "max_new_tokens",
                ..
            }
        ),
        "{err}"
    );
    let err = run(&Prompt::Tokens(vec![5; 300]), &greedy(4)).unwrap_err();
    assert!(matches!(err, InferError::PromptTooLong { .. }), "{err}");
    let err = run(&Prompt::Tokens(vec![49_152]), &greedy(4)).unwrap_err();
    assert!(err.to_string().contains("vocab_size"), "{err}");

    // Chat mode without a template.
    let mut tok = g.tokenizer().clone();
    tok.chat_template = None;
    let lm = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let plain = Generator::from_model(&lm, tok, "tiny-llama (no template)").unwrap();
    let err = plain
        .generate(&Prompt::chat(None, "Hi"), &greedy(2), &cancel, &mut |_| {
            true
        })
        .unwrap_err();
    assert!(matches!(err, InferError::NoChatTemplate { .. }), "{err}");

    // Streaming reports errors as events.
    let h = spawn_generation(GenerationRequest {
        generator: Arc::new(g),
        prompt: Prompt::Completion(String::new()),
        params: greedy(4),
    });
    let events: Vec<GenEvent> = h.events.iter().collect();
    assert!(
        matches!(events.as_slice(), [GenEvent::Error { message }] if message.contains("empty")),
        "{events:?}"
    );
}

#[test]
fn cancel_stops_generation() {
    let g = Arc::new(
        Generator::load(&ModelSpec::new(fixture("tiny-mistral").to_string_lossy())).unwrap(),
    );
    // Blocking API: cancel from the token callback after 3 tokens.
    let cancel = AtomicBool::new(false);
    let mut seen = 0;
    let out = g
        .generate(
            &Prompt::Completion("Count with me".into()),
            &greedy(100),
            &cancel,
            &mut |_| {
                seen += 1;
                if seen == 3 {
                    cancel.store(true, Ordering::Relaxed);
                }
                true
            },
        )
        .unwrap();
    assert_eq!(out.stop_reason, StopReason::Cancelled);
    assert_eq!(out.tokens, 3);

    // Streaming: cancel after the first token; the stream ends with Done and closes.
    let max = 200;
    let h = spawn_generation(GenerationRequest {
        generator: g.clone(),
        prompt: Prompt::Completion("Count with me".into()),
        params: greedy(max),
    });
    let mut tokens = 0;
    let mut text = String::new();
    let mut done = None;
    for ev in h.events.iter() {
        match ev {
            GenEvent::Started { prompt_tokens } => assert!(prompt_tokens > 0),
            GenEvent::Token { text: t, .. } => {
                tokens += 1;
                text.push_str(&t);
                h.cancel();
            }
            GenEvent::Done(out) => done = Some(out),
            GenEvent::Error { message } => panic!("{message}"),
        }
    }
    let out = done.expect("no Done event");
    assert_eq!(out.tokens, tokens);
    assert_eq!(out.text, text);
    assert!(
        out.stop_reason == StopReason::Cancelled && tokens < max,
        "not cancelled: {:?} after {tokens} tokens",
        out.stop_reason
    );

    // Dropping the handle cancels too (the thread ends on its own).
    let h = spawn_generation(GenerationRequest {
        generator: g,
        prompt: Prompt::Completion("Count with me".into()),
        params: greedy(max),
    });
    let flag = h.cancel_flag();
    assert!(!flag.load(std::sync::atomic::Ordering::Relaxed));
    drop(h);
    assert!(
        flag.load(std::sync::atomic::Ordering::Relaxed),
        "dropping the handle did not ask the generation to stop"
    );
}

#[test]
fn streamed_text_is_whole_utf8_and_matches_full_decode() {
    let tok = TokenizerBundle::load(&fixture("tiny-llama")).unwrap();
    let text = "שלום עולם! 你好，世界。 Hello 👋";
    let ids = tok.encode(text, false).unwrap();
    let decode = |ids: &[u32]| tok.tokenizer.decode(ids, true).unwrap();
    let mut d = IncrementalDecoder::new(decode, &[]);
    let mut out = String::new();
    let mut empty = 0;
    for &id in &ids {
        let delta = d.push(id);
        assert!(
            !delta.contains('\u{FFFD}'),
            "a partial character was streamed"
        );
        if delta.is_empty() {
            empty += 1;
        }
        out.push_str(&delta);
    }
    out.push_str(&d.flush());
    assert_eq!(out, text);
    assert!(
        empty > 0,
        "no character spans several tokens; the test proves nothing"
    );

    // Through the generator: the streamed texts add up to the final text.
    let g = Generator::load(&ModelSpec::new(fixture("tiny-llama").to_string_lossy())).unwrap();
    let mut streamed = String::new();
    let params = SamplingParams {
        max_new_tokens: 40,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: 11,
        stop_on_eos: false,
        ..SamplingParams::default()
    };
    let out = g
        .generate(
            &Prompt::Completion("שלום".into()),
            &params,
            &no_cancel(),
            &mut |t| {
                streamed.push_str(&t.text);
                true
            },
        )
        .unwrap();
    assert_eq!(streamed, out.text);
    // A character cut by max_new_tokens is left out, not shown as U+FFFD.
    let full = tok.tokenizer.decode(&out.token_ids, true).unwrap();
    assert_eq!(out.text, full.trim_end_matches('\u{FFFD}'));
    assert_eq!(out.cut_character, full.ends_with('\u{FFFD}'));
}

#[test]
fn stop_strings_end_generation_without_showing_them() {
    let g = Generator::load(&ModelSpec::new(fixture("tiny-llama").to_string_lossy())).unwrap();
    let prompt = Prompt::Completion("The quick brown fox".into());
    let full = g
        .generate(&prompt, &greedy(20), &no_cancel(), &mut |_| true)
        .unwrap();
    // Stop at a piece of what greedy decoding produces anyway.
    let chars: Vec<char> = full.text.chars().collect();
    assert!(chars.len() >= 6, "too little text: {:?}", full.text);
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let params = SamplingParams {
        stop_strings: vec![stop.clone()],
        ..greedy(20)
    };
    let mut streamed = String::new();
    let out = g
        .generate(&prompt, &params, &no_cancel(), &mut |t| {
            streamed.push_str(&t.text);
            true
        })
        .unwrap();
    assert_eq!(out.stop_reason, StopReason::StopString(stop.clone()));
    let cut = full.text.find(&stop).unwrap();
    assert_eq!(out.text, full.text[..cut]);
    assert_eq!(streamed, out.text);
}

/// `tunestudio generate` streaming a Chinese answer forced through single-byte tokens (each
/// character split over three) and cut inside its last character: no chunk and no output
/// holds U+FFFD.
#[test]
fn generate_streams_byte_split_chinese_without_replacement_characters() {
    let tok = TokenizerBundle::load(&fixture("tiny-llama")).unwrap();
    let all: Vec<u32> = (0..tok.vocab_size() as u32).collect();
    let mut byte_token = [None; 256];
    for (id, bytes) in all.iter().zip(tok.token_bytes(&all)) {
        if let [b] = bytes[..] {
            byte_token[b as usize].get_or_insert(*id);
        }
    }
    let answer = "你好，世界。";
    let ids: Vec<u32> = answer
        .bytes()
        .map(|b| byte_token[b as usize].expect("a token for every byte"))
        .collect();
    let cut = ids.len() - 1;
    let expected = "你好，世界";

    // The stream itself: every chunk is whole characters.
    let g = Arc::new(
        Generator::load(&ModelSpec::new(fixture("tiny-llama").to_string_lossy())).unwrap(),
    );
    let h = spawn_generation(GenerationRequest {
        generator: g,
        prompt: Prompt::Completion("Say hello:".into()),
        params: SamplingParams {
            forced_tokens: ids.clone(),
            ..greedy(cut)
        },
    });
    let (mut streamed, mut held) = (String::new(), 0);
    for ev in h.events.iter() {
        match ev {
            GenEvent::Token { text, .. } => {
                assert!(
                    !text.contains('\u{FFFD}'),
                    "a partial character was streamed"
                );
                held += usize::from(text.is_empty());
                streamed.push_str(&text);
            }
            GenEvent::Done(out) => {
                assert_eq!(out.token_ids, ids[..cut]);
                assert_eq!(out.text, expected);
                assert!(out.cut_character);
            }
            GenEvent::Error { message } => panic!("{message}"),
            GenEvent::Started { .. } => {}
        }
    }
    assert_eq!(streamed, expected);
    assert!(held >= 2 * 5, "byte tokens were not held back ({held})");

    // Through the binary.
    let csv: Vec<String> = ids.iter().map(u32::to_string).collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args([
            "generate",
            "--prompt",
            "Say hello:",
            "--temperature",
            "0",
            "--model",
        ])
        .arg(fixture("tiny-llama"))
        .args([
            "--max-new-tokens",
            &cut.to_string(),
            "--force-tokens",
            &csv.join(","),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
    assert!(!stdout.contains('\u{FFFD}'), "{stdout:?}");
    assert_eq!(stdout.trim_end(), expected);
    assert!(stderr.contains("inside a character"), "{stderr}");
}

/// The group decode's speed, not a check (`cargo test --test it -- --ignored
/// a_group_decodes_faster --nocapture`): G 8 completions of 64 tokens after a 64-token prompt
/// on the SmolLM2-135M shape (random weights, f32, this machine's threads), decoded one row
/// at a time (what GRPO's rollouts did before) and as one batch.
#[test]
#[ignore = "a measurement: run it by name"]
fn a_group_decodes_faster_as_one_batch() {
    let cfg = ModelConfig::from_file(
        &tunestudio::paths::shared_dir().join("model-configs/smollm2-135m.json"),
    )
    .unwrap();
    let lm = CausalLm::random_init(&cfg, 0, DType::F32, &Device::Cpu).unwrap();
    let model = InferModel::from_causal_lm(&lm).unwrap();
    let prompt: Vec<u32> = (0..64).map(|i| 100 + 7 * i).collect();
    let (g, steps) = (8usize, 64usize);
    let mut prefill = model.new_cache(prompt.len());
    model.forward(&prompt, &mut prefill).unwrap();
    let ids = |step: usize| -> Vec<u32> { (0..g).map(|r| (500 + 31 * r + step) as u32).collect() };
    let t = std::time::Instant::now();
    for r in 0..g {
        let mut cache = prefill.repeat_rows(1, prompt.len() + steps).unwrap();
        for step in 0..steps {
            model.forward(&ids(step)[r..r + 1], &mut cache).unwrap();
        }
    }
    let one_by_one = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    let mut cache = prefill.repeat_rows(g, prompt.len() + steps).unwrap();
    for step in 0..steps {
        model.forward_rows(&ids(step), &mut cache).unwrap();
    }
    let batched = t.elapsed().as_secs_f64();
    println!(
        "G {g} × {steps} tokens: one row at a time {one_by_one:.2} s, one batch {batched:.2} s ({:.1}×)",
        one_by_one / batched
    );
}
