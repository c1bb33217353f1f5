//! The hub path for real: a local server in the test speaks just enough of the Hugging Face
//! Hub's file API for hf-hub's blocking client (`/api/{models,datasets}/<id>/revision/<rev>`
//! lists a repository; `/<id>/resolve/<rev>/<file>` answers the `Range: bytes=0-0` probe with
//! `X-Repo-Commit`, `ETag` and `Content-Range`, and the download with a `206` from the asked
//! offset), checks the bearer token of a gated repository, and can break a download off
//! half-way. The real binary runs against it with `HF_ENDPOINT`, `HF_HOME` / `HF_HUB_CACHE`,
//! `HF_TOKEN` (or the login token file) and `HF_HUB_OFFLINE`, in an empty cache.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use tunestudio::hub_env::{HubEnv, TokenSource, DEFAULT_ENDPOINT};

use crate::support::fixture;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_right_token";
const PUBLIC: &str = "test-org/tiny-llama";
const GATED: &str = "test-org/gated-llama";
const DATASET: &str = "test-org/tiny-data";
const MODEL_FILES: [&str; 5] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
    "generation_config.json",
];

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    host: String,
    range: Option<String>,
    auth: Option<String>,
}

#[derive(Default)]
struct State {
    seen: Vec<Seen>,
    /// Downloads (`Range: bytes=N-`) of `<repo>/<file>` to break off half-way, how many more
    /// times.
    cut: HashMap<String, usize>,
    /// Downloads of `<repo>/<file>` to send half of without a `Content-Length` and close
    /// cleanly (the client cannot tell the body is short), how many more times.
    short: HashMap<String, usize>,
}

/// Counts one use of `key`'s breakage down; whether it applies.
fn take(map: &mut HashMap<String, usize>, key: &str) -> bool {
    match map.get_mut(key) {
        Some(n) if *n > 0 => {
            *n -= 1;
            true
        }
        _ => false,
    }
}

struct Repo {
    files: Vec<(String, Vec<u8>)>,
    gated: bool,
}

/// The fake hub: `<prefix>/<org>/<name>` → repository (`prefix` is `` for models, `datasets/`
/// for datasets, as in the Hub's URLs).
struct Hub {
    endpoint: String,
    state: Arc<Mutex<State>>,
}

impl Hub {
    fn start() -> Hub {
        let model: Vec<(String, Vec<u8>)> = MODEL_FILES
            .iter()
            .map(|f| {
                (
                    f.to_string(),
                    std::fs::read(fixture("tiny-llama").join(f)).unwrap(),
                )
            })
            .collect();
        let rows: String = (0..6)
            .map(|i| {
                format!("{{\"instruction\": \"Say the number {i}.\", \"input\": \"\", \"output\": \"The number is {i}.\"}}\n")
            })
            .collect();
        let mut repos = HashMap::new();
        repos.insert(
            PUBLIC.to_string(),
            Repo {
                files: model.clone(),
                gated: false,
            },
        );
        repos.insert(
            GATED.to_string(),
            Repo {
                files: model,
                gated: true,
            },
        );
        repos.insert(
            format!("datasets/{DATASET}"),
            Repo {
                files: vec![("train.jsonl".into(), rows.into_bytes())],
                gated: false,
            },
        );
        let repos = Arc::new(repos);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let st = Arc::clone(&state);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (repos, st) = (Arc::clone(&repos), Arc::clone(&st));
                std::thread::spawn(move || serve(stream, &repos, &st));
            }
        });
        Hub { endpoint, state }
    }

    fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    /// Breaks the next `times` downloads of `repo`'s `file` off half-way.
    fn cut(&self, repo: &str, file: &str, times: usize) {
        self.state
            .lock()
            .unwrap()
            .cut
            .insert(format!("{repo}/{file}"), times);
    }

    /// Sends the next `times` downloads of `repo`'s `file` half, with no `Content-Length`.
    fn short(&self, repo: &str, file: &str, times: usize) {
        self.state
            .lock()
            .unwrap()
            .short
            .insert(format!("{repo}/{file}"), times);
    }
}

fn serve(mut stream: TcpStream, repos: &HashMap<String, Repo>, state: &Mutex<State>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let seen = Seen {
        path: path.clone(),
        host: headers.get("host").cloned().unwrap_or_default(),
        range: headers.get("range").cloned(),
        auth: headers.get("authorization").cloned(),
    };
    state.lock().unwrap().seen.push(seen.clone());
    respond(&mut stream, &seen, repos, state);
    let _ = stream.flush();
    let _ = stream.shutdown(Shutdown::Both);
}

fn send(stream: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]) {
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
}

fn not_found(stream: &mut TcpStream, code: &str) {
    send(
        stream,
        "404 Not Found",
        &[
            ("X-Error-Code", code.to_string()),
            ("Content-Length", "9".into()),
        ],
        b"not found",
    );
}

/// A stable stand-in for the Hub's ETag (the blob's hash).
fn etag(bytes: &[u8]) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    format!("{:016x}{:08x}", h.finish(), bytes.len())
}

/// Where a request goes.
enum Route {
    /// `/api/models/<org>/<name>/revision/<rev>` or `/api/datasets/...`: the file list.
    List(String),
    /// `[/datasets]/<org>/<name>/resolve/<rev>/<file>`.
    Resolve(String, String),
    /// `/cdn/<org>/<name>/<file>`: where the Hub redirects LFS files (weights) to.
    Cdn(String, String),
}

fn route(path: &str) -> Option<Route> {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    Some(match parts.as_slice() {
        ["api", "models", org, name, "revision", _] => Route::List(format!("{org}/{name}")),
        ["api", "datasets", org, name, "revision", _] => {
            Route::List(format!("datasets/{org}/{name}"))
        }
        ["cdn", org, name, file @ ..] => Route::Cdn(format!("{org}/{name}"), file.join("/")),
        ["datasets", org, name, "resolve", _, file @ ..] => {
            Route::Resolve(format!("datasets/{org}/{name}"), file.join("/"))
        }
        [org, name, "resolve", _, file @ ..] => {
            Route::Resolve(format!("{org}/{name}"), file.join("/"))
        }
        _ => return None,
    })
}

fn respond(
    stream: &mut TcpStream,
    req: &Seen,
    repos: &HashMap<String, Repo>,
    state: &Mutex<State>,
) {
    let Some(route) = route(&req.path) else {
        return not_found(stream, "RepoNotFound");
    };
    let (Route::List(key) | Route::Resolve(key, _) | Route::Cdn(key, _)) = &route;
    let Some(repo) = repos.get(key) else {
        return not_found(stream, "RepoNotFound");
    };
    // The CDN's addresses are signed: no token there.
    let cdn = matches!(route, Route::Cdn(..));
    if repo.gated && !cdn && req.auth.as_deref() != Some(&format!("Bearer {TOKEN}")) {
        return denied(stream, req, key);
    }
    let (Route::Resolve(_, file) | Route::Cdn(_, file)) = &route else {
        return list(stream, repo);
    };
    let Some((_, bytes)) = repo.files.iter().find(|(f, _)| f == file) else {
        return not_found(stream, "EntryNotFound");
    };
    if !cdn && file.ends_with(".safetensors") {
        // Weights are LFS files: the Hub answers with the commit and the blob's hash, and sends
        // the client to its CDN (another host in real life) for the bytes.
        let headers = [
            ("X-Repo-Commit", COMMIT.to_string()),
            ("X-Linked-Etag", format!("\"{}\"", etag(bytes))),
            ("X-Linked-Size", bytes.len().to_string()),
            ("Location", format!("http://{}/cdn/{key}/{file}", req.host)),
            ("Content-Length", "0".into()),
        ];
        return send(stream, "302 Found", &headers, b"");
    }
    serve_file(stream, req, bytes, &format!("{key}/{file}"), state);
}

fn denied(stream: &mut TcpStream, req: &Seen, key: &str) {
    let status = if req.auth.is_some() {
        "403 Forbidden"
    } else {
        "401 Unauthorized"
    };
    let message = format!("Access to model {key} is restricted. You must have access to it and be authenticated to access it.");
    send(
        stream,
        status,
        &[
            ("X-Error-Code", "GatedRepo".into()),
            ("X-Error-Message", message),
            ("Content-Length", "5".into()),
        ],
        b"gated",
    );
}

fn list(stream: &mut TcpStream, repo: &Repo) {
    let siblings: Vec<String> = repo
        .files
        .iter()
        .map(|(f, _)| format!("{{\"rfilename\": \"{f}\"}}"))
        .collect();
    let body = format!(
        "{{\"sha\": \"{COMMIT}\", \"siblings\": [{}]}}",
        siblings.join(", ")
    );
    send(
        stream,
        "200 OK",
        &[
            ("Content-Type", "application/json".into()),
            ("Content-Length", body.len().to_string()),
        ],
        body.as_bytes(),
    );
}

fn serve_file(
    stream: &mut TcpStream,
    req: &Seen,
    bytes: &[u8],
    cut_key: &str,
    state: &Mutex<State>,
) {
    let size = bytes.len();
    // `bytes=A-B` or `bytes=A-`.
    let (start, end) = match req.range.as_deref().and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) => {
            let (a, b) = r.split_once('-').unwrap();
            let a: usize = a.parse().unwrap();
            let b = if b.is_empty() {
                size - 1
            } else {
                b.parse::<usize>().unwrap().min(size - 1)
            };
            (a, b)
        }
        None => (0, size - 1),
    };
    if start >= size {
        return send(
            stream,
            "416 Range Not Satisfiable",
            &[
                ("Content-Range", format!("bytes */{size}")),
                ("Content-Length", "0".into()),
            ],
            b"",
        );
    }
    let body = &bytes[start..=end];
    let mut headers = vec![
        ("X-Repo-Commit", COMMIT.to_string()),
        ("ETag", format!("\"{}\"", etag(bytes))),
        ("Content-Range", format!("bytes {start}-{end}/{size}")),
        ("Accept-Ranges", "bytes".into()),
    ];
    // A download (not the one-byte probe) of a file set to break: half the rest, then close.
    let open_ended = req.range.as_deref().is_some_and(|r| r.ends_with('-'));
    let (cut, short) = if open_ended {
        let mut st = state.lock().unwrap();
        (take(&mut st.cut, cut_key), take(&mut st.short, cut_key))
    } else {
        (false, false)
    };
    if !short {
        headers.push(("Content-Length", body.len().to_string()));
    }
    let sent = if cut || short {
        &body[..body.len() / 2]
    } else {
        body
    };
    send(stream, "206 Partial Content", &headers, sent);
}

/// Runs the binary against `hub` with `HF_HOME=home` and nothing else of the caller's HF, proxy
/// or token environment, plus `env`.
fn tunestudio(hub: &Hub, home: &Path, env: &[(&str, &OsString)], args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tunestudio"));
    cmd.args(args)
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HOME", home)
        .env("HOME", home)
        .env("RAYON_NUM_THREADS", "2");
    for v in [
        "HF_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "XDG_CACHE_HOME",
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ] {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn generate(model: &str) -> Vec<&str> {
    vec![
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
        "--temperature",
        "0",
    ]
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

fn snapshot(cache: &Path, repo: &str) -> PathBuf {
    cache
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("snapshots")
        .join(COMMIT)
}

fn os(s: impl Into<OsString>) -> OsString {
    s.into()
}

#[test]
fn environment_rules_follow_huggingface_hub() {
    let vars = |pairs: &[(&str, &str)]| {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        HubEnv::from_vars(move |k| map.get(k).cloned())
    };
    let bare = vars(&[("HOME", "/home/u")]);
    assert_eq!(bare.endpoint, DEFAULT_ENDPOINT);
    assert_eq!(bare.cache_dir, Path::new("/home/u/.cache/huggingface/hub"));
    assert_eq!(
        bare.token_path,
        Path::new("/home/u/.cache/huggingface/token")
    );
    assert!(!bare.offline);
    let xdg = vars(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/x")]);
    assert_eq!(xdg.cache_dir, Path::new("/x/huggingface/hub"));
    let home = vars(&[
        ("HF_HOME", "/hf"),
        ("XDG_CACHE_HOME", "/x"),
        ("HF_HUB_OFFLINE", "true"),
    ]);
    assert_eq!(home.cache_dir, Path::new("/hf/hub"));
    assert_eq!(home.token_path, Path::new("/hf/token"));
    assert!(home.offline);
    // HF_HUB_CACHE moves the cache, not the token file; a blank variable is unset.
    let cache = vars(&[
        ("HF_HOME", "/hf"),
        ("HF_HUB_CACHE", "/c"),
        ("HF_ENDPOINT", "http://mirror:8080/"),
        ("HF_TOKEN", "  "),
        ("HF_HUB_OFFLINE", "0"),
    ]);
    assert_eq!(cache.cache_dir, Path::new("/c"));
    assert_eq!(cache.token_path, Path::new("/hf/token"));
    assert_eq!(cache.endpoint, "http://mirror:8080");
    assert!(!cache.offline);
    assert_eq!(
        cache.token(),
        (None, TokenSource::Missing("/hf/token".into()))
    );
    // HF_TOKEN before the token file; HF_TOKEN_PATH moves the file; the token is never printed.
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("tok");
    std::fs::write(&file, "hf_from_file\n").unwrap();
    let path = file.to_str().unwrap();
    let from_file = vars(&[("HF_TOKEN_PATH", path)]);
    assert_eq!(
        from_file.token(),
        (Some("hf_from_file".into()), TokenSource::File(file.clone()))
    );
    let from_env = vars(&[("HF_TOKEN_PATH", path), ("HF_TOKEN", "hf_secret")]);
    assert_eq!(
        from_env.token(),
        (Some("hf_secret".into()), TokenSource::Env)
    );
    assert!(!format!("{from_env:?}").contains("hf_secret"));
}

#[test]
fn downloads_a_model_with_progress_then_loads_it_offline() {
    let hub = Hub::start();
    let home = tempfile::tempdir().unwrap();
    let out = tunestudio(&hub, home.path(), &[], &generate(PUBLIC));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for f in MODEL_FILES {
        assert!(
            stderr.contains(&format!("downloading {PUBLIC}/{f}")),
            "no progress for {f}: {stderr}"
        );
        assert!(
            stderr.contains(&format!("downloaded {PUBLIC}/{f}")),
            "{stderr}"
        );
        let got = std::fs::read(snapshot(&home.path().join("hub"), PUBLIC).join(f)).unwrap();
        assert_eq!(
            got,
            std::fs::read(fixture("tiny-llama").join(f)).unwrap(),
            "{f}"
        );
    }
    let seen = hub.seen();
    assert!(seen
        .iter()
        .any(|s| s.path == format!("/{PUBLIC}/resolve/main/model.safetensors")));
    // No token configured: none sent.
    assert!(seen.iter().all(|s| s.auth.is_none()), "{seen:?}");

    // Offline: from the cache, and not one request.
    let before = hub.seen().len();
    let offline = tunestudio(
        &hub,
        home.path(),
        &[("HF_HUB_OFFLINE", &os("1"))],
        &generate(PUBLIC),
    );
    let (offline_stdout, offline_stderr) = text(&offline);
    assert!(offline.status.success(), "{offline_stderr}");
    assert_eq!(offline_stdout, stdout);
    assert!(!offline_stderr.contains("downloading"), "{offline_stderr}");
    assert_eq!(hub.seen().len(), before, "offline mode made requests");
    // A model not in the cache, offline: the error names HF_HUB_OFFLINE; still no request.
    let missing = tunestudio(
        &hub,
        home.path(),
        &[("HF_HUB_OFFLINE", &os("1"))],
        &generate(GATED),
    );
    let (_, missing_stderr) = text(&missing);
    assert!(!missing.status.success());
    assert!(
        missing_stderr.contains("HF_HUB_OFFLINE"),
        "{missing_stderr}"
    );
    assert!(missing_stderr.contains(GATED), "{missing_stderr}");
    assert_eq!(hub.seen().len(), before, "offline mode made requests");
}

#[test]
fn a_gated_model_needs_a_token_with_access() {
    let hub = Hub::start();
    let home = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let cache_env = os(cache.path());
    let with_cache = [("HF_HUB_CACHE", &cache_env)];

    // No token at all.
    let out = tunestudio(&hub, home.path(), &with_cache, &generate(GATED));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    for word in ["HF_TOKEN", GATED, "gated", "401", "no token was sent"] {
        assert!(stderr.contains(word), "{word:?} missing: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");

    // The right token in the login file ($HF_HOME/token, though the cache is elsewhere), but
    // a wrong HF_TOKEN, which wins.
    std::fs::write(home.path().join("token"), format!("{TOKEN}\n")).unwrap();
    let wrong = os("hf_wrong");
    let out = tunestudio(
        &hub,
        home.path(),
        &[with_cache[0], ("HF_TOKEN", &wrong)],
        &generate(GATED),
    );
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    for word in [
        "HF_TOKEN",
        GATED,
        "403",
        "the token in HF_TOKEN has no access",
    ] {
        assert!(stderr.contains(word), "{word:?} missing: {stderr}");
    }
    assert!(hub
        .seen()
        .iter()
        .any(|s| s.auth.as_deref() == Some("Bearer hf_wrong")));
    assert!(!snapshot(cache.path(), GATED)
        .join("model.safetensors")
        .exists());

    // The login file alone: downloads into HF_HUB_CACHE, not $HF_HOME/hub.
    let out = tunestudio(&hub, home.path(), &with_cache, &generate(GATED));
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(snapshot(cache.path(), GATED)
        .join("model.safetensors")
        .is_file());
    assert!(!home.path().join("hub").exists());
    let right = format!("Bearer {TOKEN}");
    let file_requests = hub
        .seen()
        .iter()
        .filter(|s| s.path.starts_with(&format!("/{GATED}/resolve/")))
        .filter(|s| s.auth.as_deref() == Some(right.as_str()))
        .count();
    assert!(file_requests >= MODEL_FILES.len() * 2, "{:?}", hub.seen());

    // HF_TOKEN alone (no login file), into a fresh cache.
    std::fs::remove_file(home.path().join("token")).unwrap();
    let fresh = tempfile::tempdir().unwrap();
    let (fresh_env, token) = (os(fresh.path()), os(TOKEN));
    let out = tunestudio(
        &hub,
        home.path(),
        &[("HF_HUB_CACHE", &fresh_env), ("HF_TOKEN", &token)],
        &generate(GATED),
    );
    assert!(out.status.success(), "{}", text(&out).1);
    assert!(snapshot(fresh.path(), GATED)
        .join("model.safetensors")
        .is_file());
}

/// The one `.part` file in the repository's blobs, and its length.
fn partial_file(cache: &Path, repo: &str) -> (PathBuf, usize) {
    let blobs = cache
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("blobs");
    let part = std::fs::read_dir(blobs)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "part"))
        .expect("a partial file");
    let len = std::fs::metadata(&part).unwrap().len() as usize;
    (part, len)
}

#[test]
fn a_broken_download_fails_cleanly_and_the_next_run_resumes_it() {
    let hub = Hub::start();
    let home = tempfile::tempdir().unwrap();
    let cache = home.path().join("hub");
    let full = std::fs::read(fixture("tiny-llama").join("model.safetensors")).unwrap();

    // Every try breaks off: the run gives up with a clear error and trusts no half file.
    hub.cut(PUBLIC, "model.safetensors", 100);
    let out = tunestudio(&hub, home.path(), &[], &generate(PUBLIC));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    for word in [
        "model.safetensors",
        PUBLIC,
        "retries",
        "the next run resumes it",
    ] {
        assert!(stderr.contains(word), "{word:?} missing: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
    let snap = snapshot(&cache, PUBLIC);
    assert!(snap.join("config.json").is_file());
    assert!(!snap.join("model.safetensors").exists());
    let (part, kept) = partial_file(&cache, PUBLIC);
    assert!(kept > 0 && kept < full.len(), "{kept}");
    // Offline now: the half model is not taken for a model.
    let offline = tunestudio(
        &hub,
        home.path(),
        &[("HF_HUB_OFFLINE", &os("1"))],
        &generate(PUBLIC),
    );
    assert!(!offline.status.success());
    let offline_stderr = text(&offline).1;
    assert!(
        offline_stderr.contains("HF_HUB_OFFLINE"),
        "{offline_stderr}"
    );

    // The server recovers: the next run asks the CDN (through the Hub's redirect) for the rest
    // only, and the file is whole.
    hub.cut(PUBLIC, "model.safetensors", 0);
    let out = tunestudio(&hub, home.path(), &[], &generate(PUBLIC));
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("resuming {PUBLIC}/model.safetensors")),
        "{stderr}"
    );
    let resumed = format!("bytes={kept}-");
    let cdn = format!("/cdn/{PUBLIC}/model.safetensors");
    assert!(
        hub.seen()
            .iter()
            .any(|s| s.path == cdn && s.range.as_deref() == Some(resumed.as_str())),
        "no request from byte {kept}: {:?}",
        hub.seen()
    );
    assert_eq!(std::fs::read(snap.join("model.safetensors")).unwrap(), full);
    assert!(!part.exists());

    // In a fresh cache, one broken connection is retried from where it broke, in the same run;
    // a tokenizer that never arrives fails the run, although the weights are all there...
    let again = tempfile::tempdir().unwrap();
    let again_snap = snapshot(&again.path().join("hub"), PUBLIC);
    hub.cut(PUBLIC, "model.safetensors", 1);
    hub.cut(PUBLIC, "tokenizer.json", 100);
    let out = tunestudio(&hub, again.path(), &[], &generate(PUBLIC));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("resuming"), "{stderr}");
    assert!(stderr.contains("tokenizer.json"), "{stderr}");
    assert_eq!(
        std::fs::read(again_snap.join("model.safetensors")).unwrap(),
        full
    );
    assert!(!again_snap.join("tokenizer.json").exists());
    // ...and the next run completes the snapshot instead of loading the model without it.
    hub.cut(PUBLIC, "tokenizer.json", 0);
    let out = tunestudio(&hub, again.path(), &[], &generate(PUBLIC));
    assert!(out.status.success(), "{}", text(&out).1);
    assert_eq!(
        std::fs::read(again_snap.join("tokenizer.json")).unwrap(),
        std::fs::read(fixture("tiny-llama").join("tokenizer.json")).unwrap()
    );
}

#[test]
fn a_short_file_the_client_cannot_tell_from_a_whole_one_is_not_kept() {
    let hub = Hub::start();
    let home = tempfile::tempdir().unwrap();
    let snap = snapshot(&home.path().join("hub"), PUBLIC);
    let full = std::fs::read(fixture("tiny-llama").join("model.safetensors")).unwrap();
    // Half the weights and a clean close, no Content-Length: hf-hub takes it as complete.
    hub.short(PUBLIC, "model.safetensors", 1);
    let out = tunestudio(&hub, home.path(), &[], &generate(PUBLIC));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    let said = format!(
        "the hub announced {} bytes but {} arrived",
        full.len(),
        full.len() / 2
    );
    assert!(stderr.contains(&said), "{stderr}");
    assert!(!snap.join("model.safetensors").exists());
    let blobs = home.path().join("hub/models--test-org--tiny-llama/blobs");
    let kept: Vec<u64> = std::fs::read_dir(blobs)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_none())
        .map(|e| e.metadata().unwrap().len())
        .collect();
    assert!(!kept.contains(&(full.len() as u64 / 2)), "{kept:?}");
    // The next run downloads it whole.
    let out = tunestudio(&hub, home.path(), &[], &generate(PUBLIC));
    assert!(out.status.success(), "{}", text(&out).1);
    assert_eq!(std::fs::read(snap.join("model.safetensors")).unwrap(), full);
}

#[test]
fn a_hub_dataset_and_a_hub_tokenizer_come_through_the_same_server() {
    let hub = Hub::start();
    let home = tempfile::tempdir().unwrap();
    // A model download cut off after config.json: its snapshot exists but holds no tokenizer,
    // so the tokenizer is fetched rather than looked for in it.
    hub.cut(PUBLIC, "model.safetensors", 100);
    let out = tunestudio(&hub, home.path(), &[], &generate(PUBLIC));
    assert!(!out.status.success());
    assert!(snapshot(&home.path().join("hub"), PUBLIC)
        .join("config.json")
        .is_file());
    let before = hub.seen().len();

    let args = [
        "preview", "--model", PUBLIC, "--data", DATASET, "--format", "alpaca", "--rows", "1",
    ];
    let out = tunestudio(&hub, home.path(), &[], &args);
    let (stdout, stderr) = text(&out);
    assert!(out.status.code() == Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("rows: 6 (6 train"), "{stdout}");
    assert!(stdout.contains("train.jsonl line 1"), "{stdout}");
    assert!(
        stderr.contains(&format!("downloading {DATASET}/train.jsonl")),
        "{stderr}"
    );
    let seen = hub.seen().split_off(before);
    assert!(seen
        .iter()
        .any(|s| s.path == format!("/api/datasets/{DATASET}/revision/main")));
    assert!(seen
        .iter()
        .any(|s| s.path == format!("/datasets/{DATASET}/resolve/main/train.jsonl")));
    // Only the tokenizer's files of the model, not its weights.
    assert!(
        !seen.iter().any(|s| s.path.ends_with("model.safetensors")),
        "{seen:?}"
    );
    let data = home
        .path()
        .join("hub")
        .join("datasets--test-org--tiny-data")
        .join("snapshots")
        .join(COMMIT)
        .join("train.jsonl");
    assert!(data.is_file());

    // Offline from the cache, no request.
    let before = hub.seen().len();
    let out = tunestudio(&hub, home.path(), &[("HF_HUB_OFFLINE", &os("yes"))], &args);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    assert_eq!(text(&out).0, stdout);
    assert_eq!(hub.seen().len(), before);
}
