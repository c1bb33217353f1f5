//! Hub downloads on stderr, for every command that may fetch a model or a dataset: a bar per
//! file on a terminal, one line when a file starts, resumes and ends otherwise (logs, CI).

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Mutex;
use tunestudio::hub_env::{set_download_observer, DownloadEvent};
use tunestudio::units::format_bytes;

/// Reports this process's hub downloads on stderr.
pub fn install() {
    let interactive = std::io::stderr().is_terminal();
    let bar: Mutex<Option<ProgressBar>> = Mutex::new(None);
    set_download_observer(move |event| {
        let Ok(mut bar) = bar.lock() else { return };
        match *event {
            DownloadEvent::Started { repo, file, total } => {
                if interactive {
                    *bar = Some(file_bar(repo, file, total));
                } else {
                    eprintln!("downloading {repo}/{file} ({})", format_bytes(total));
                }
            }
            DownloadEvent::Resumed {
                repo,
                file,
                offset,
                total,
            } => {
                let line = format!(
                    "resuming {repo}/{file} at {:.0}% ({} of {})",
                    offset as f64 * 100.0 / total.max(1) as f64,
                    format_bytes(offset),
                    format_bytes(total)
                );
                match bar.as_ref() {
                    Some(b) => b.println(line),
                    None => eprintln!("{line}"),
                }
            }
            DownloadEvent::Progress { done, total, .. } => {
                if let Some(b) = bar.as_ref() {
                    b.set_length(total);
                    b.set_position(done);
                }
            }
            DownloadEvent::Finished { repo, file, total } => {
                if let Some(b) = bar.take() {
                    b.finish_and_clear();
                }
                eprintln!("downloaded {repo}/{file} ({})", format_bytes(total));
            }
            DownloadEvent::Failed { .. } => {
                if let Some(b) = bar.take() {
                    b.abandon();
                }
            }
        }
    });
}

fn file_bar(repo: &str, file: &str, total: u64) -> ProgressBar {
    let b = ProgressBar::new(total);
    b.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b.set_message(format!("{repo}/{file}"));
    b
}
