//! Loading and saving: configs of every supported style, sharded and bf16 checkpoints,
//! the HF cache layout, and typed errors for bad folders.
use crate::support::{fixture, max_diff};

use candle_core::{DType, Device, Tensor};
use std::path::Path;
use tunestudio::model::{
    resolve_model_in, rope_inv_freq, Architecture, CausalLm, HubOptions, ModelConfig, ModelError,
};

fn shared_config(name: &str) -> ModelConfig {
    ModelConfig::from_file(
        &tunestudio::paths::shared_dir()
            .join("model-configs")
            .join(name),
    )
    .unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn fixture_configs_parse() {
    let l = ModelConfig::from_file(&fixture("tiny-llama").join("config.json")).unwrap();
    assert_eq!(l.architecture, Architecture::Llama);
    assert_eq!(
        (l.head_dim, l.num_key_value_heads, l.vocab_size),
        (16, 2, 49152)
    );
    assert_eq!(l.rope_theta, 1e5);
    assert!(l.tie_word_embeddings && l.sliding_window.is_none() && !l.attention_bias);
    assert_eq!(
        (l.bos_token_id, l.eos_token_ids.clone(), l.pad_token_id),
        (Some(1), vec![2], Some(2))
    );
    let m = ModelConfig::from_file(&fixture("tiny-mistral").join("config.json")).unwrap();
    assert_eq!(m.architecture, Architecture::Mistral);
    assert_eq!(m.sliding_window, Some(8));
    assert!(!m.tie_word_embeddings);
    let q = ModelConfig::from_file(&fixture("tiny-qwen2").join("config.json")).unwrap();
    assert_eq!(q.architecture, Architecture::Qwen2);
    assert!(q.attention_bias && q.sliding_window.is_none());
    assert_eq!(q.rope_theta, 1e6);
    assert_eq!(q.head_dim, 16);
}

#[test]
fn real_model_configs_count_parameters_like_transformers() {
    assert_eq!(
        shared_config("smollm2-135m.json").num_parameters(),
        134_515_008
    );
    assert_eq!(
        shared_config("llama-3.1-8b.json").num_parameters(),
        8_030_261_248
    );
    assert_eq!(
        shared_config("qwen2.5-7b.json").num_parameters(),
        7_615_616_512
    );
    assert_eq!(
        shared_config("dictalm2-7b.json").num_parameters(),
        7_251_169_280
    );
    let shapes = shared_config("smollm2-135m.json").parameter_shapes();
    assert_eq!(shapes[0].0, "model.embed_tokens.weight");
    assert_eq!(shapes[1].0, "model.layers.0.self_attn.q_proj.weight");
}

#[test]
fn old_style_and_llama3_rope_configs() {
    let json = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "rope_theta": 500000.0,
        "eos_token_id": [7, 9], "attention_bias": true,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
    let c = ModelConfig::from_json_str(json, "inline").unwrap();
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(c.head_dim, 16);
    assert_eq!(c.num_key_value_heads, 4);
    assert_eq!(c.eos_token_ids, vec![7, 9]);
    assert!(c.attention_bias && !c.tie_word_embeddings);
    let s = c.rope_scaling.clone().unwrap();
    assert_eq!((s.factor, s.original_max_position_embeddings), (8.0, 8192));
    // transformers' _compute_llama3_parameters, in f64.
    let inv = rope_inv_freq(&c);
    for (i, got) in inv.iter().enumerate() {
        let f = 1.0 / 500000f64.powf((2 * i) as f64 / 16.0);
        let wavelen = 2.0 * std::f64::consts::PI / f;
        let (lo_w, hi_w) = (8192.0 / 1.0, 8192.0 / 4.0);
        let want = if wavelen < hi_w {
            f
        } else if wavelen > lo_w {
            f / 8.0
        } else {
            let smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
            (1.0 - smooth) * f / 8.0 + smooth * f
        };
        assert!(
            ((*got as f64) - want).abs() <= 1e-6 * want,
            "inv_freq[{i}] {got} vs {want}"
        );
    }
    // Qwen2 with use_sliding_window true honours the window.
    let q = r#"{"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "sliding_window": 4, "use_sliding_window": true}"#;
    assert_eq!(
        ModelConfig::from_json_str(q, "q").unwrap().sliding_window,
        Some(4)
    );
}

#[test]
fn bad_configs_are_typed_errors() {
    let e = ModelConfig::from_json_str(r#"{"model_type": "gpt2", "vocab_size": 1}"#, "x.json")
        .unwrap_err();
    assert!(
        matches!(e, ModelError::UnsupportedArchitecture { ref model_type, .. } if model_type == "gpt2")
    );
    assert!(e.to_string().contains("x.json"));
    let e = ModelConfig::from_json_str(r#"{"model_type": "llama"}"#, "y.json").unwrap_err();
    assert!(matches!(e, ModelError::Config { .. }));
    assert!(e.to_string().contains("vocab_size"));
    assert!(matches!(
        ModelConfig::from_json_str("{not json", "z"),
        Err(ModelError::Config { .. })
    ));

    let tmp = tempfile::tempdir().unwrap();
    let e = CausalLm::load(tmp.path(), DType::F32, &Device::Cpu)
        .err()
        .unwrap();
    match e {
        ModelError::MissingFile { path, .. } => assert!(path.ends_with("config.json")),
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn missing_or_misshaped_tensors_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let src = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let write = |dir: &Path, skip: &str, reshape: &str| {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::copy(
            fixture("tiny-llama").join("config.json"),
            dir.join("config.json"),
        )
        .unwrap();
        let mut map = std::collections::HashMap::new();
        for p in src.params() {
            if p.name == skip {
                continue;
            }
            let t = if p.name == reshape {
                Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap()
            } else {
                p.var.as_tensor().clone()
            };
            map.insert(p.name.clone(), t);
        }
        candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    };
    let missing = tmp.path().join("missing");
    write(&missing, "model.layers.1.mlp.up_proj.weight", "");
    match CausalLm::load(&missing, DType::F32, &Device::Cpu)
        .err()
        .unwrap()
    {
        ModelError::MissingTensor { name, file } => {
            assert_eq!(name, "model.layers.1.mlp.up_proj.weight");
            assert!(file.contains("model.safetensors"));
        }
        other => panic!("unexpected {other}"),
    }
    let shaped = tmp.path().join("shaped");
    write(&shaped, "", "model.norm.weight");
    match CausalLm::load(&shaped, DType::F32, &Device::Cpu)
        .err()
        .unwrap()
    {
        ModelError::ShapeMismatch {
            name,
            expected,
            found,
            ..
        } => {
            assert_eq!(name, "model.norm.weight");
            assert_eq!((expected, found), (vec![64], vec![3]));
        }
        other => panic!("unexpected {other}"),
    }
    // No weights at all.
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(
        fixture("tiny-llama").join("config.json"),
        empty.join("config.json"),
    )
    .unwrap();
    assert!(matches!(
        CausalLm::load(&empty, DType::F32, &Device::Cpu),
        Err(ModelError::MissingFile { .. })
    ));
    // A truncated file.
    let broken = tmp.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::copy(
        fixture("tiny-llama").join("config.json"),
        broken.join("config.json"),
    )
    .unwrap();
    std::fs::write(
        broken.join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":",
    )
    .unwrap();
    assert!(matches!(
        CausalLm::load(&broken, DType::F32, &Device::Cpu),
        Err(ModelError::Safetensors { .. })
    ));
}

#[test]
fn sharded_and_bf16_saves_reload() {
    let tmp = tempfile::tempdir().unwrap();
    let model = CausalLm::load(&fixture("tiny-mistral"), DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[1u32, 50, 300, 7, 9000, 12, 4, 4, 88, 2]], &Device::Cpu).unwrap();
    let want = model.logits(&ids, None).unwrap();

    // Sharded f32: shards of at most 4 MB (embeddings and head are 12.6 MB each, alone in a shard).
    let sharded = tmp.path().join("sharded");
    model
        .save_pretrained(&sharded, DType::F32, 4_000_000)
        .unwrap();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(sharded.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let total: u64 = model
        .params()
        .iter()
        .map(|p| p.var.elem_count() as u64 * 4)
        .sum();
    assert_eq!(index["metadata"]["total_size"].as_u64().unwrap(), total);
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), model.params().len());
    let shards: std::collections::BTreeSet<_> = map
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert!(shards.len() >= 3, "{shards:?}");
    assert!(shards
        .iter()
        .all(|s| s.starts_with("model-") && s.contains("-of-")));
    assert!(!sharded.join("model.safetensors").exists());
    let back = CausalLm::load(&sharded, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(max_diff(&back.logits(&ids, None).unwrap(), &want), 0.0);

    // bf16 single file, tied model: no lm_head saved; config dtype updated.
    let tied = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let bf = tmp.path().join("bf16");
    tied.save_pretrained(&bf, DType::BF16, 0).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bf.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["dtype"], "bfloat16");
    let raw = candle_core::safetensors::load(bf.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(!raw.contains_key("lm_head.weight"));
    assert!(raw.values().all(|t| t.dtype() == DType::BF16));
    let back = CausalLm::load(&bf, DType::F32, &Device::Cpu).unwrap();
    for p in tied.params() {
        let rounded = p.var.as_tensor().to_dtype(DType::BF16).unwrap();
        assert_eq!(
            max_diff(back.param(&p.name).unwrap().var.as_tensor(), &rounded),
            0.0,
            "{}",
            p.name
        );
    }
    // Saving again into the same folder unsharded removes the old shards' index.
    model.save_pretrained(&sharded, DType::F32, 0).unwrap();
    assert!(sharded.join("model.safetensors").exists());
    assert!(!sharded.join("model.safetensors.index.json").exists());
    let back = CausalLm::load(&sharded, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(max_diff(&back.logits(&ids, None).unwrap(), &want), 0.0);
}

#[test]
fn f16_checkpoint_written_directly_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let src = CausalLm::load(&fixture("tiny-qwen2"), DType::F32, &Device::Cpu).unwrap();
    let dir = tmp.path().join("f16");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture("tiny-qwen2").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let map: std::collections::HashMap<String, Tensor> = src
        .params()
        .iter()
        .map(|p| {
            (
                p.name.clone(),
                p.var.as_tensor().to_dtype(DType::F16).unwrap(),
            )
        })
        .collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    let bf = CausalLm::load(&dir, DType::BF16, &Device::Cpu).unwrap();
    let f32m = CausalLm::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let name = "model.layers.0.self_attn.q_proj.bias";
    let want = map[name].to_dtype(DType::F32).unwrap();
    assert_eq!(
        max_diff(f32m.param(name).unwrap().var.as_tensor(), &want),
        0.0
    );
    assert_eq!(bf.param(name).unwrap().var.dtype(), DType::BF16);
}

#[test]
fn hub_ids_resolve_through_a_cache_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let snap = cache
        .join("models--acme--tiny")
        .join("snapshots")
        .join("abc123");
    copy_dir(&fixture("tiny-llama"), &snap);
    std::fs::create_dir_all(cache.join("models--acme--tiny").join("refs")).unwrap();
    std::fs::write(
        cache.join("models--acme--tiny").join("refs").join("main"),
        "abc123\n",
    )
    .unwrap();
    let opts = HubOptions {
        cache_dir: cache.clone(),
        offline: true,
    };
    let files = resolve_model_in("acme/tiny", &opts).unwrap();
    assert_eq!(files.dir, snap);
    assert_eq!(files.weights, vec![snap.join("model.safetensors")]);
    assert_eq!(files.tokenizer, Some(snap.join("tokenizer.json")));
    assert_eq!(files.chat_template, Some(snap.join("chat_template.jinja")));
    let model = CausalLm::load_files(&files, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(model.config().vocab_size, 49152);

    // A local folder wins.
    let local = resolve_model_in(fixture("tiny-qwen2").to_str().unwrap(), &opts).unwrap();
    assert_eq!(local.dir, fixture("tiny-qwen2"));

    // Offline and not cached: a clear error naming the cache.
    match resolve_model_in("acme/other", &opts).unwrap_err() {
        ModelError::HubOffline { model, cache: c } => {
            assert_eq!(model, "acme/other");
            assert_eq!(c, cache);
        }
        other => panic!("unexpected {other}"),
    }
    // Neither a folder nor an id.
    assert!(matches!(
        resolve_model_in("/no/such/dir/x", &opts),
        Err(ModelError::MissingFile { .. })
    ));
}

#[test]
fn sliding_window_layers_follow_transformers() {
    let m = ModelConfig::from_file(&fixture("tiny-mistral").join("config.json")).unwrap();
    assert_eq!(
        (m.layer_sliding_window(0), m.layer_sliding_window(1)),
        (Some(8), Some(8))
    );
    let q = r#"{"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 4, "num_attention_heads": 2, "sliding_window": 4, "use_sliding_window": true,
        "max_window_layers": 2}"#;
    let q = ModelConfig::from_json_str(q, "q").unwrap();
    let w: Vec<_> = (0..4).map(|l| q.layer_sliding_window(l)).collect();
    assert_eq!(w, [None, None, Some(4), Some(4)]);
    let t = r#"{"model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "sliding_window": 4,
        "layer_types": ["full_attention", "sliding_attention"]}"#;
    let t = ModelConfig::from_json_str(t, "t").unwrap();
    assert_eq!(
        (t.layer_sliding_window(0), t.layer_sliding_window(1)),
        (None, Some(4))
    );
    let qwen = ModelConfig::from_file(&fixture("tiny-qwen2").join("config.json")).unwrap();
    assert_eq!(qwen.layer_sliding_window(1), None);
}
