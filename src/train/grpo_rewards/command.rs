//! A `command` reward: the user's program, started once per run and fed batches of JSON lines.
//!
//! Three threads serve the child: one writes each batch to its stdin (so a program that stops
//! reading cannot block the trainer past the timeout), one reads its stdout line by line into a
//! channel (`recv_timeout` is the timeout), one keeps the last bytes of its stderr for the
//! error messages. After any error the child is killed; dropping the reward kills it too.
//!
//! The protocol has no end-of-batch marker, so a program that writes too many lines is caught
//! when the extra line is already there after a batch, or else at the start of the next batch.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::reward_error::RewardError;
use super::spec::RewardSpec;
use super::RewardInput;

/// Bytes of stderr kept for the messages.
const STDERR_KEPT_BYTES: usize = 8 * 1024;
/// Lines of stderr a message shows.
const STDERR_SHOWN_LINES: usize = 20;
/// A score line longer than this is cut (it cannot be a number anyway).
const MAX_LINE_BYTES: u64 = 64 * 1024;
/// How long a program that closed its stdout is given to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// What the stdout reader saw.
enum Output {
    Line(String),
    Closed,
    Failed(std::io::Error),
}

/// Why a batch failed, before the process is stopped and the stderr tail read.
enum Failure {
    NotANumber { line: String, line_number: usize },
    Closed { scored: usize },
    Extra { line: String },
    Timeout { scored: usize },
    Io(std::io::Error),
}

/// A running program.
struct Running {
    child: Child,
    /// Batches for the stdin writer; dropped to close the child's stdin.
    to_stdin: Option<Sender<Vec<u8>>>,
    lines: Receiver<Output>,
    stderr: Arc<Mutex<VecDeque<u8>>>,
    stderr_reader: JoinHandle<()>,
}

/// A `command` reward function.
pub(super) struct CommandReward {
    name: String,
    /// The command line as the messages show it.
    shown: String,
    timeout_secs: f64,
    running: Option<Running>,
}

impl CommandReward {
    /// Starts the program of a validated spec in `work_dir`.
    pub(super) fn start(
        name: &str,
        spec: &RewardSpec,
        work_dir: &Path,
    ) -> Result<Self, RewardError> {
        let argv = spec.command.clone().unwrap_or_default();
        let shown = show_command(&argv);
        let start_error = |source| RewardError::Start {
            reward: name.to_string(),
            command: shown.clone(),
            work_dir: work_dir.to_path_buf(),
            source,
        };
        let (program, args) = argv
            .split_first()
            .ok_or_else(|| start_error(std::io::ErrorKind::NotFound.into()))?;
        let mut command = Command::new(resolve_program(program, work_dir));
        if !work_dir.as_os_str().is_empty() {
            // A config built in memory has no folder: the process's own is used.
            command.current_dir(work_dir);
        }
        let mut child = command
            .args(args)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(start_error)?;
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let running = serve(name, child, stdin, stdout, stderr).map_err(start_error)?;
        Ok(CommandReward {
            name: name.to_string(),
            shown,
            timeout_secs: spec.timeout_secs(),
            running: Some(running),
        })
    }

    /// Sends the batch and reads one score per completion.
    pub(super) fn score(&mut self, inputs: &[RewardInput]) -> Result<Vec<f32>, RewardError> {
        let expected = inputs.len();
        if expected == 0 {
            return Ok(Vec::new());
        }
        let Some(run) = self.running.as_mut() else {
            return Err(RewardError::Stopped {
                reward: self.name.clone(),
                command: self.shown.clone(),
            });
        };
        // Anything written since the last batch was not asked for.
        let pending = match run.lines.try_recv() {
            Ok(Output::Line(line)) => Some(Failure::Extra { line }),
            Ok(Output::Closed) | Err(TryRecvError::Disconnected) => {
                Some(Failure::Closed { scored: 0 })
            }
            Ok(Output::Failed(e)) => Some(Failure::Io(e)),
            Err(TryRecvError::Empty) => None,
        };
        if let Some(failure) = pending {
            return Err(self.fail(failure, expected));
        }
        if let Some(tx) = &run.to_stdin {
            // A closed writer means the child closed its stdin; its stdout says the rest.
            let _ = tx.send(encode(inputs));
        }
        match read_scores(&run.lines, expected, self.timeout_secs) {
            Ok(scores) => Ok(scores),
            Err(failure) => Err(self.fail(failure, expected)),
        }
    }

    /// Stops the program and turns the failure into the error the user reads.
    fn fail(&mut self, failure: Failure, expected: usize) -> RewardError {
        let reward = self.name.clone();
        let command = self.shown.clone();
        let Some(run) = self.running.take() else {
            return RewardError::Stopped { reward, command };
        };
        let (status, stderr_tail) = run.stop(matches!(failure, Failure::Closed { .. }));
        match failure {
            Failure::NotANumber { line, line_number } => RewardError::NotANumber {
                reward,
                command,
                line: clip(&line),
                line_number,
                expected,
                stderr_tail,
            },
            Failure::Closed { scored } => match status {
                Some(status) if !status.success() => RewardError::Exited {
                    reward,
                    command,
                    status: status.to_string(),
                    scored,
                    expected,
                    stderr_tail,
                },
                exited => RewardError::WrongCount {
                    reward,
                    command,
                    what: match exited {
                        Some(status) => format!("exited ({status}) after writing {scored} scores"),
                        None => format!("closed its stdout after {scored} scores but kept running"),
                    },
                    expected,
                    stderr_tail,
                },
            },
            Failure::Extra { line } => RewardError::WrongCount {
                reward,
                command,
                what: format!(
                    "wrote more lines than it was sent: {:?} was one too many",
                    clip(&line)
                ),
                expected,
                stderr_tail,
            },
            Failure::Timeout { scored } => RewardError::Timeout {
                reward,
                command,
                timeout_secs: self.timeout_secs,
                scored,
                expected,
                stderr_tail,
            },
            Failure::Io(source) => RewardError::Io {
                reward,
                command,
                source,
            },
        }
    }
}

impl Drop for CommandReward {
    fn drop(&mut self) {
        if let Some(run) = self.running.take() {
            run.stop(false);
        }
    }
}

impl Running {
    /// Ends the program — waiting up to [`EXIT_GRACE`] for it to exit by itself when
    /// `let_exit` (it closed its stdout), else killing it — and returns its exit status (None:
    /// still running when killed) and the end of its stderr.
    fn stop(mut self, let_exit: bool) -> (Option<std::process::ExitStatus>, String) {
        drop(self.to_stdin.take());
        let mut status = None;
        if let_exit {
            let deadline = Instant::now() + EXIT_GRACE;
            while status.is_none() && Instant::now() < deadline {
                status = self.child.try_wait().ok().flatten();
                if status.is_none() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        if status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // The child is gone, so its stderr ends unless a grandchild holds it: wait a little.
        let deadline = Instant::now() + Duration::from_millis(500);
        while !self.stderr_reader.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let tail = match self.stderr.lock() {
            Ok(bytes) => stderr_tail(bytes.iter().copied().collect::<Vec<u8>>().as_slice()),
            Err(_) => String::new(),
        };
        (status, tail)
    }
}

/// Reads `expected` scores, each within the timeout.
fn read_scores(
    lines: &Receiver<Output>,
    expected: usize,
    timeout_secs: f64,
) -> Result<Vec<f32>, Failure> {
    let timeout = Duration::from_secs_f64(timeout_secs);
    let mut scores = Vec::with_capacity(expected);
    while scores.len() < expected {
        let scored = scores.len();
        match lines.recv_timeout(timeout) {
            Ok(Output::Line(line)) => match parse_score(&line) {
                Some(score) => scores.push(score),
                None => {
                    return Err(Failure::NotANumber {
                        line,
                        line_number: scored + 1,
                    })
                }
            },
            Ok(Output::Closed) | Err(RecvTimeoutError::Disconnected) => {
                return Err(Failure::Closed { scored })
            }
            Ok(Output::Failed(e)) => return Err(Failure::Io(e)),
            Err(RecvTimeoutError::Timeout) => return Err(Failure::Timeout { scored }),
        }
    }
    // A line already there is one too many (one that comes later is caught by the next batch).
    match lines.try_recv() {
        Ok(Output::Line(line)) => Err(Failure::Extra { line }),
        _ => Ok(scores),
    }
}

/// A finite number, surrounding spaces allowed.
fn parse_score(line: &str) -> Option<f32> {
    let v: f64 = line.trim().parse().ok()?;
    let v32 = v as f32;
    (v.is_finite() && v32.is_finite()).then_some(v32)
}

/// One JSON object per completion, one per line: the row's columns, `prompt` and `completion`.
fn encode(inputs: &[RewardInput]) -> Vec<u8> {
    let mut out = Vec::new();
    for input in inputs {
        let mut object = input.row.clone();
        object.insert("prompt".into(), input.prompt.into());
        object.insert("completion".into(), input.completion.into());
        serde_json::to_writer(&mut out, &object).expect("a map of JSON values serialises");
        out.push(b'\n');
    }
    out
}

/// The threads that serve the child; the child is killed if one cannot be started.
fn serve(
    name: &str,
    mut child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
    stderr: ChildStderr,
) -> std::io::Result<Running> {
    let (to_stdin, batches) = mpsc::channel::<Vec<u8>>();
    let (line_tx, lines) = mpsc::channel();
    let kept = Arc::new(Mutex::new(VecDeque::new()));
    let kept_by_reader = Arc::clone(&kept);
    let spawned = (|| {
        let thread = |role: &str| std::thread::Builder::new().name(format!("reward {name} {role}"));
        thread("stdin").spawn(move || write_batches(stdin, batches))?;
        thread("stdout").spawn(move || read_lines(stdout, line_tx))?;
        thread("stderr").spawn(move || keep_stderr(stderr, kept_by_reader))
    })();
    match spawned {
        Ok(stderr_reader) => Ok(Running {
            child,
            to_stdin: Some(to_stdin),
            lines,
            stderr: kept,
            stderr_reader,
        }),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

fn write_batches(mut stdin: ChildStdin, batches: Receiver<Vec<u8>>) {
    for batch in batches {
        if stdin
            .write_all(&batch)
            .and_then(|()| stdin.flush())
            .is_err()
        {
            return;
        }
    }
}

fn read_lines(stdout: ChildStdout, lines: Sender<Output>) {
    let mut reader = BufReader::new(stdout);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let event = match (&mut reader)
            .take(MAX_LINE_BYTES)
            .read_until(b'\n', &mut buf)
        {
            Ok(0) => Output::Closed,
            Ok(_) => Output::Line(
                String::from_utf8_lossy(&buf)
                    .trim_end_matches(['\n', '\r'])
                    .to_string(),
            ),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => Output::Failed(e),
        };
        let last = !matches!(event, Output::Line(_));
        if lines.send(event).is_err() || last {
            return;
        }
    }
}

fn keep_stderr(mut stderr: ChildStderr, kept: Arc<Mutex<VecDeque<u8>>>) {
    let mut chunk = [0u8; 4096];
    loop {
        match stderr.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => {
                let Ok(mut bytes) = kept.lock() else { return };
                bytes.extend(&chunk[..n]);
                let excess = bytes.len().saturating_sub(STDERR_KEPT_BYTES);
                bytes.drain(..excess);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// The last lines of stderr, as text.
fn stderr_tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.trim_end().lines().collect();
    lines[lines.len().saturating_sub(STDERR_SHOWN_LINES)..].join("\n")
}

/// A line as a message shows it: at most 200 characters.
fn clip(line: &str) -> String {
    match line.char_indices().nth(200) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line.to_string(),
    }
}

/// A program given as a relative path (with a `/`) starts at the run config's folder; a bare
/// name is looked up on `PATH`.
fn resolve_program(program: &str, work_dir: &Path) -> PathBuf {
    let path = Path::new(program);
    if path.is_relative() && path.components().count() > 1 {
        work_dir.join(path)
    } else {
        path.to_path_buf()
    }
}

fn show_command(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if a.is_empty() || a.contains(char::is_whitespace) {
                format!("'{a}'")
            } else {
                a.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
