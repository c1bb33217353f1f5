//! The data layer's error type: every message names the file, row or setting
//! at fault and says how to fix it.

use std::path::PathBuf;

/// Everything that can go wrong while reading, formatting, templating or
/// tokenising a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or folder could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The dataset path is neither a local file/folder nor a hub dataset id.
    #[error("dataset {path:?} not found: {hint}")]
    NotFound {
        /// The path or id as given.
        path: String,
        /// What was tried and how to fix it.
        hint: String,
    },
    /// A data file holds no bytes (or only whitespace).
    #[error(
        "{path} is empty: there are no rows to train on; point `data.path` at a file with data"
    )]
    EmptyFile {
        /// The file.
        path: PathBuf,
    },
    /// A folder holds no file with a supported extension.
    #[error("{path} holds no data files (.json, .jsonl, .csv, .parquet, .txt); point `data.path` at a data file or a folder of them")]
    NoDataFiles {
        /// The folder.
        path: PathBuf,
    },
    /// A file's extension is not one the readers know.
    #[error("{path}: unsupported file type; use .json, .jsonl, .csv, .parquet or .txt")]
    UnsupportedFile {
        /// The file.
        path: PathBuf,
    },
    /// A text file is not valid UTF-8.
    #[error("{path} line {line}: invalid UTF-8 (byte {byte_offset} of the file); re-save the file as UTF-8")]
    InvalidUtf8 {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Byte offset of the first invalid byte.
        byte_offset: u64,
    },
    /// A JSON or JSONL document could not be parsed.
    #[error("{path}{}: invalid JSON: {message}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
    Json {
        /// The file.
        path: PathBuf,
        /// 1-based line (JSONL: the row's line; JSON: the parser's line).
        line: Option<usize>,
        /// The parser's message.
        message: String,
    },
    /// A CSV file could not be parsed.
    #[error("{path}: invalid CSV: {message}")]
    Csv {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A Parquet file could not be read.
    #[error("{path}: cannot read Parquet: {message}")]
    Parquet {
        /// The file.
        path: PathBuf,
        /// The reader's message.
        message: String,
    },
    /// A row is not a JSON object, or a field has the wrong shape.
    #[error("{location}: {message}")]
    BadRow {
        /// "file line N" or "file row N".
        location: String,
        /// What is wrong and what was expected.
        message: String,
    },
    /// A mapped (or required) column is absent.
    #[error("{location}: column {column:?} (from {setting}) not found; columns that exist: {}; set {setting} to one of them", available.join(", "))]
    MissingColumn {
        /// Where the row came from.
        location: String,
        /// The missing column.
        column: String,
        /// The setting that named it, e.g. `data.columns.prompt`.
        setting: String,
        /// The columns the row has.
        available: Vec<String>,
    },
    /// The format could not be detected from the columns.
    #[error("{location}: cannot tell the dataset format from columns [{}]; set `data.format` (text, alpaca, prompt_completion, chat, sharegpt, llamafactory_v1, pretokenized) and map columns under `[data.columns]`", columns.join(", "))]
    UnknownFormat {
        /// Where the first row came from.
        location: String,
        /// The first row's columns.
        columns: Vec<String>,
    },
    /// A row holds no preference pair in any known format.
    #[error("{location}: cannot find a preference pair in columns [{}]; use TRL's prompt/chosen/rejected (or chosen/rejected conversations), LLaMA-Factory's conversations + chosen + rejected (sharegpt ranking), instruction + input + chosen + rejected (alpaca ranking), or chosen_messages + rejected_messages (v1)", columns.join(", "))]
    UnknownPreferenceFormat {
        /// Where the row came from.
        location: String,
        /// The row's columns.
        columns: Vec<String>,
    },
    /// `tokenizer.json` could not be loaded.
    #[error("cannot load tokenizer {path}: {message}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The library's message.
        message: String,
    },
    /// Tokenisation itself failed.
    #[error("tokenising row {row} failed: {message}")]
    Encode {
        /// Row index.
        row: usize,
        /// The library's message.
        message: String,
    },
    /// `tokenizer_config.json` or `chat_template.jinja` is malformed.
    #[error("{path}: {message}")]
    TokenizerConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The chat template does not compile.
    #[error("the chat template does not compile: {message}; fix the template or set one in chat_template.jinja")]
    TemplateSyntax {
        /// minijinja's message (with line).
        message: String,
    },
    /// Rendering the chat template failed for a row (e.g. `raise_exception`).
    #[error("{location}: the chat template failed: {message}")]
    TemplateRender {
        /// Where the row came from.
        location: String,
        /// minijinja's message (a template's `raise_exception` text included).
        message: String,
    },
    /// A hub dataset or model could not be resolved.
    #[error("hub repository {id:?}: {message}")]
    Hub {
        /// The repository id.
        id: String,
        /// What failed and how to fix it.
        message: String,
    },
    /// A setting is invalid.
    #[error("invalid setting {setting}: {message}")]
    Config {
        /// The setting, e.g. `data.validation_ratio`.
        setting: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// Every row was dropped (empty, or nothing left to train).
    #[error("no trainable samples in {what}: {message}")]
    NothingToTrain {
        /// The split.
        what: String,
        /// Why (counts of dropped rows).
        message: String,
    },
}

impl DataError {
    /// Shorthand for an I/O error on `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io {
            path: path.into(),
            source,
        }
    }
}
