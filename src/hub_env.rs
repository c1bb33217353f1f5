//! The Hugging Face hub as the environment sets it up, for models and datasets alike: which
//! server (`HF_ENDPOINT`), which token (`HF_TOKEN`, else the login token file), which cache
//! (`HF_HUB_CACHE`, else `$HF_HOME/hub`) and whether the network may be used at all
//! (`HF_HUB_OFFLINE`). [`HubEnv`] reads them with huggingface_hub's precedence, and
//! [`HubRepo`] is the one way the library talks to the hub (hf-hub's blocking client
//! underneath), so `model::hub` and `data::hub` cannot disagree about any of them.
//!
//! What hf-hub does and does not do, and what this module adds:
//! - a file is fetched into `blobs/<etag>.part` and renamed, and its snapshot link made, only
//!   when complete; a broken connection is retried [`DOWNLOAD_RETRIES`] times, each retry
//!   resuming with a `Range` request, and a later run resumes the `.part` file the same way.
//!   hf-hub never checks the final size: [`HubRepo::get`] does, and drops a short file;
//! - it has no offline mode: with `HF_HUB_OFFLINE` set [`HubEnv::repo`] refuses to build a
//!   client at all, so nothing can reach the network;
//! - it reads the token file next to the cache folder (wrong when `HF_HUB_CACHE` is set), so the
//!   token is always passed explicitly.
//!
//! Downloads report to the process's [`set_download_observer`] (the CLI draws them); the
//! library itself never prints.

use std::cell::Cell;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, RwLock};

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::api::Progress;
use hf_hub::{Cache, CacheRepo, Repo, RepoType};

mod progress;

use progress::*;
pub use progress::{set_download_observer, DownloadEvent};

/// The hub `HF_ENDPOINT` replaces.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// How many times a broken download is retried (each retry resumes from the bytes already on
/// disk) before the run gives up; the partial file is kept for the next run to resume.
pub const DOWNLOAD_RETRIES: usize = 3;

/// Which kind of hub repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepoKind {
    /// `models--org--name`.
    Model,
    /// `datasets--org--name`.
    Dataset,
}

impl RepoKind {
    /// The cache folder prefix: `models` or `datasets`.
    pub fn folder_prefix(self) -> &'static str {
        match self {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        }
    }

    fn repo_type(self) -> RepoType {
        match self {
            RepoKind::Model => RepoType::Model,
            RepoKind::Dataset => RepoType::Dataset,
        }
    }
}

impl fmt::Display for RepoKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RepoKind::Model => "model",
            RepoKind::Dataset => "dataset",
        })
    }
}

/// The repository's folder in a hub cache: `<cache>/models--org--name`.
pub fn repo_cache_folder(cache_dir: &Path, kind: RepoKind, id: &str) -> PathBuf {
    cache_dir.join(format!(
        "{}--{}",
        kind.folder_prefix(),
        id.replace('/', "--")
    ))
}

/// Where the token sent to the hub came from (said in the error when the hub refuses it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// The `HF_TOKEN` variable.
    Env,
    /// The login token file (`huggingface-cli login` writes it).
    File(PathBuf),
    /// No token: `HF_TOKEN` is unset and this token file is absent or empty.
    Missing(PathBuf),
}

impl fmt::Display for TokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenSource::Env => f.write_str("the token in HF_TOKEN has no access to it"),
            TokenSource::File(p) => write!(
                f,
                "the login token in {} has no access to it (HF_TOKEN is unset)",
                p.display()
            ),
            TokenSource::Missing(p) => write!(
                f,
                "no token was sent (HF_TOKEN is unset and there is no login token at {})",
                p.display()
            ),
        }
    }
}

/// Which file of which repository on which hub: what every download error names. (Boxed in
/// [`HubError`], so that a `Result` carrying one stays small.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubFile {
    /// Model or dataset.
    pub kind: RepoKind,
    /// The hub id.
    pub repo: String,
    /// The file in the repository (or `the file list`).
    pub file: String,
    /// The hub's address (`HF_ENDPOINT`).
    pub endpoint: String,
}

/// What went wrong talking to the hub. Every message names the repository and what to do.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// `HF_HUB_OFFLINE` is set and the cache does not hold what is needed.
    #[error("{kind} `{repo}` is not (completely) in the Hugging Face cache at {cache} and HF_HUB_OFFLINE is set: download it once online, or unset HF_HUB_OFFLINE")]
    Offline {
        /// Model or dataset.
        kind: RepoKind,
        /// The hub id.
        repo: String,
        /// The cache folder that was searched.
        cache: PathBuf,
    },
    /// The hub answered 401 or 403: the repository is gated or private and the token sent (if
    /// any) has no access.
    #[error("the Hugging Face hub at {endpoint} refused {kind} `{repo}` ({file}: HTTP {status}{said}): it is gated or private, and {token}; set HF_TOKEN to a token that has access (or log in with `huggingface-cli login`) after accepting its terms on the {kind}'s page", endpoint = .at.endpoint, kind = .at.kind, repo = .at.repo, file = .at.file, said = said(.server_message.as_deref()))]
    Denied {
        /// The file that was refused.
        at: Box<HubFile>,
        /// The HTTP status, 401 or 403.
        status: u16,
        /// Where the token came from, if one was sent.
        token: TokenSource,
        /// The hub's `X-Error-Message`, if it sent one.
        server_message: Option<String>,
    },
    /// The hub answered 404: no such repository, revision or file.
    #[error("{kind} `{repo}` has no {file} at revision {revision} on {endpoint} (HTTP 404{said}): check the id and the revision", endpoint = .at.endpoint, kind = .at.kind, repo = .at.repo, file = .at.file, said = said(.server_message.as_deref()))]
    NotFound {
        /// The file asked for.
        at: Box<HubFile>,
        /// The revision asked for.
        revision: String,
        /// The hub's `X-Error-Message`, if it sent one.
        server_message: Option<String>,
    },
    /// No answer from the hub (DNS, refused connection, TLS, proxy).
    #[error("cannot reach the Hugging Face hub at {endpoint} for {kind} `{repo}` ({file}): {message}; check your network and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the cache only", endpoint = .at.endpoint, kind = .at.kind, repo = .at.repo, file = .at.file)]
    Unreachable {
        /// The file being fetched.
        at: Box<HubFile>,
        /// The client's message.
        message: String,
    },
    /// The download itself failed (a broken connection after the retries, a server error, a
    /// short file, the disk).
    #[error("downloading {file} of {kind} `{repo}` from {endpoint} failed: {message}", endpoint = .at.endpoint, kind = .at.kind, repo = .at.repo, file = .at.file)]
    Download {
        /// The file being fetched.
        at: Box<HubFile>,
        /// What failed, and what the next run does about it.
        message: String,
    },
}

fn said(server_message: Option<&str>) -> String {
    server_message
        .map(|m| format!(", the hub says: {m:?}"))
        .unwrap_or_default()
}

/// The hub settings of the environment.
#[derive(Clone, PartialEq, Eq)]
pub struct HubEnv {
    /// `HF_ENDPOINT` without a trailing slash, else [`DEFAULT_ENDPOINT`].
    pub endpoint: String,
    /// `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub` (`HF_HOME` itself
    /// defaults to `$XDG_CACHE_HOME/huggingface`).
    pub cache_dir: PathBuf,
    /// `HF_HUB_OFFLINE` is 1, true, yes or on: the cache only, never the network.
    pub offline: bool,
    /// The login token file: `HF_TOKEN_PATH`, else `$HF_HOME/token`.
    pub token_path: PathBuf,
    /// `HF_TOKEN`, when set and not blank.
    token_env: Option<String>,
}

/// The token is never printed.
impl fmt::Debug for HubEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubEnv")
            .field("endpoint", &self.endpoint)
            .field("cache_dir", &self.cache_dir)
            .field("offline", &self.offline)
            .field("token_path", &self.token_path)
            .field("token_env", &self.token_env.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// Whether an `HF_HUB_OFFLINE`-style value asks for offline mode.
pub fn truthy(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

impl HubEnv {
    /// The settings of this process's environment.
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var_os(name))
    }

    /// The settings `var` gives (a blank variable counts as unset), with huggingface_hub's
    /// precedence; reads no file.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Self {
        let set = |name: &str| var(name).filter(|v| !v.to_string_lossy().trim().is_empty());
        let home = set("HOME")
            .or_else(|| set("USERPROFILE"))
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."));
        let hf_home = set("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            set("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| home.join(".cache"))
                .join("huggingface")
        });
        let cache_dir = set("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token_path = set("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("token"));
        let endpoint = set("HF_ENDPOINT")
            .map(|e| e.to_string_lossy().trim().trim_end_matches('/').to_string())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        Self {
            endpoint,
            cache_dir,
            offline: var("HF_HUB_OFFLINE").is_some_and(|v| truthy(&v.to_string_lossy())),
            token_path,
            token_env: set("HF_TOKEN").map(|t| t.to_string_lossy().trim().to_string()),
        }
    }

    /// The same endpoint and token with another cache folder and offline mode (a caller's own
    /// choice of cache, as `model::HubOptions` carries it).
    pub fn with_cache(self, cache_dir: PathBuf, offline: bool) -> Self {
        Self {
            cache_dir,
            offline,
            ..self
        }
    }

    /// The token to send and where it came from: `HF_TOKEN`, else the login token file.
    pub fn token(&self) -> (Option<String>, TokenSource) {
        if let Some(t) = &self.token_env {
            return (Some(t.clone()), TokenSource::Env);
        }
        match std::fs::read_to_string(&self.token_path) {
            Ok(t) if !t.trim().is_empty() => (
                Some(t.trim().to_string()),
                TokenSource::File(self.token_path.clone()),
            ),
            _ => (None, TokenSource::Missing(self.token_path.clone())),
        }
    }

    /// A client for one repository at `revision`; refuses (naming `HF_HUB_OFFLINE`) when
    /// offline, so nothing built from these settings touches the network then.
    pub fn repo(&self, kind: RepoKind, id: &str, revision: &str) -> Result<HubRepo, HubError> {
        if self.offline {
            return Err(HubError::Offline {
                kind,
                repo: id.to_string(),
                cache: self.cache_dir.clone(),
            });
        }
        let (token, token_source) = self.token();
        let cache = Cache::new(self.cache_dir.clone());
        let repo = Repo::with_revision(id.to_string(), kind.repo_type(), revision.to_string());
        let api = ApiBuilder::from_cache(cache.clone())
            .with_endpoint(self.endpoint.clone())
            .with_token(token)
            .with_progress(false)
            .with_retries(DOWNLOAD_RETRIES)
            .with_user_agent("tunestudio", env!("CARGO_PKG_VERSION"))
            .build()
            .map_err(|e| HubError::Download {
                at: Box::new(HubFile {
                    kind,
                    repo: id.to_string(),
                    file: "(client)".into(),
                    endpoint: self.endpoint.clone(),
                }),
                message: format!("cannot start the hub client: {e}"),
            })?;
        Ok(HubRepo {
            kind,
            id: id.to_string(),
            revision: revision.to_string(),
            endpoint: self.endpoint.clone(),
            token: token_source,
            api: api.repo(repo.clone()),
            cache: cache.repo(repo),
        })
    }
}

/// One hub repository at one revision, through the cache.
pub struct HubRepo {
    kind: RepoKind,
    id: String,
    revision: String,
    endpoint: String,
    token: TokenSource,
    api: ApiRepo,
    cache: CacheRepo,
}

/// Without the client, whose headers hold the token.
impl fmt::Debug for HubRepo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubRepo")
            .field("kind", &self.kind)
            .field("id", &self.id)
            .field("revision", &self.revision)
            .field("endpoint", &self.endpoint)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl HubRepo {
    /// The repository's files (`/api/{models,datasets}/<id>/revision/<rev>`).
    pub fn files(&self) -> Result<Vec<String>, HubError> {
        let info = self
            .api
            .info()
            .map_err(|e| self.error("the file list", e))?;
        Ok(info.siblings.into_iter().map(|s| s.rfilename).collect())
    }

    /// The cached file, if the cache has it at this revision.
    pub fn cached(&self, file: &str) -> Option<PathBuf> {
        self.cache.get(file)
    }

    /// The file from the cache, else downloaded into it (resuming a partial download).
    pub fn get(&self, file: &str) -> Result<PathBuf, HubError> {
        if let Some(path) = self.cached(file) {
            return Ok(path);
        }
        let total = Rc::new(Cell::new(0u64));
        let progress = Reporter::new(&self.id, file, Rc::clone(&total));
        let result = self
            .api
            .download_with_progress(file, progress)
            .map_err(|e| self.error(file, e))
            .and_then(|path| self.check_size(file, path, total.get()));
        emit(&match &result {
            Ok(_) => DownloadEvent::Finished {
                repo: &self.id,
                file,
                total: total.get(),
            },
            Err(_) => DownloadEvent::Failed {
                repo: &self.id,
                file,
            },
        });
        result
    }

    /// The file as [`HubRepo::get`], or `None` when the hub has no such file (HTTP 404).
    pub fn get_optional(&self, file: &str) -> Result<Option<PathBuf>, HubError> {
        match self.get(file) {
            Ok(p) => Ok(Some(p)),
            Err(HubError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// hf-hub trusts whatever the connection delivered: a file shorter than the hub said is
    /// removed (blob and snapshot link), so no later run takes it for the whole file.
    fn check_size(&self, file: &str, path: PathBuf, total: u64) -> Result<PathBuf, HubError> {
        let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        if len == total {
            return Ok(path);
        }
        if let Ok(blob) = std::fs::canonicalize(&path) {
            let _ = std::fs::remove_file(blob);
        }
        let _ = std::fs::remove_file(&path);
        Err(self.download_error(
            file,
            format!("the hub announced {total} bytes but {len} arrived; the file was removed, run again to download it anew"),
        ))
    }

    fn at(&self, file: &str) -> Box<HubFile> {
        Box::new(HubFile {
            kind: self.kind,
            repo: self.id.clone(),
            file: file.to_string(),
            endpoint: self.endpoint.clone(),
        })
    }

    fn download_error(&self, file: &str, message: String) -> HubError {
        HubError::Download {
            at: self.at(file),
            message,
        }
    }

    /// hf-hub's error as one of [`HubError`]'s kinds.
    fn error(&self, file: &str, err: ApiError) -> HubError {
        match err {
            ApiError::RequestError(e) => self.request_error(file, *e),
            ApiError::TooManyRetries(last) => {
                let last = match *last {
                    ApiError::RequestError(e) => self.request_error(file, *e).to_string(),
                    ApiError::IoError(e) => format!("the connection broke off: {e}"),
                    other => other.to_string(),
                };
                self.download_error(
                    file,
                    format!("gave up after {DOWNLOAD_RETRIES} retries ({last}); the partial file is kept in the cache and the next run resumes it"),
                )
            }
            ApiError::IoError(e) => self.download_error(
                file,
                format!("{e}; a partial file is kept in the cache and the next run resumes it"),
            ),
            ApiError::InvalidResume => self.download_error(
                file,
                "the partial file in the cache is longer than the file on the hub; delete the `.part` file in the repository's blobs folder and run again".into(),
            ),
            other => self.download_error(file, other.to_string()),
        }
    }

    fn request_error(&self, file: &str, err: ureq::Error) -> HubError {
        let at = self.at(file);
        match err {
            ureq::Error::Status(status @ (401 | 403), response) => HubError::Denied {
                at,
                status,
                token: self.token.clone(),
                server_message: response.header("x-error-message").map(str::to_string),
            },
            ureq::Error::Status(404, response) => HubError::NotFound {
                at,
                revision: self.revision.clone(),
                server_message: response.header("x-error-message").map(str::to_string),
            },
            ureq::Error::Status(status, response) => HubError::Download {
                at,
                message: format!("HTTP {status} {}", response.status_text()),
            },
            ureq::Error::Transport(t) => HubError::Unreachable {
                at,
                message: t.to_string(),
            },
        }
    }
}
