//! `resolve_model` reads HF_HUB_CACHE / HF_HUB_OFFLINE from the environment. This binary
//! holds a single test because it changes process-wide environment variables.

use std::path::PathBuf;
use tunestudio::model::{resolve_model, HubOptions, ModelError};

fn fixture(case: &str) -> PathBuf {
    tunestudio::paths::shared_dir().join("fixtures").join(case)
}

#[test]
fn environment_selects_cache_and_offline_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let repo = cache.join("models--org--name");
    let snap = repo.join("snapshots").join("rev1");
    std::fs::create_dir_all(&snap).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture("tiny-mistral").join(f), snap.join(f)).unwrap();
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "rev1").unwrap();
    std::env::set_var("HF_HUB_CACHE", &cache);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let opts = HubOptions::from_env();
    assert_eq!(
        opts,
        HubOptions {
            cache_dir: cache.clone(),
            offline: true
        }
    );
    let files = resolve_model("org/name").unwrap();
    assert_eq!(files.dir, snap);
    assert_eq!(files.tokenizer_config, None);
    let err = resolve_model("org/absent").unwrap_err();
    assert!(matches!(err, ModelError::HubOffline { .. }));
    assert!(err.to_string().contains(&cache.display().to_string()));
    // HF_HOME/hub is the fallback when HF_HUB_CACHE is unset.
    std::env::remove_var("HF_HUB_CACHE");
    std::env::set_var("HF_HOME", tmp.path());
    assert_eq!(HubOptions::from_env().cache_dir, cache);
}
