//! The `tunestudio` binary: the desktop studio (default) and the headless CLI.

mod cli;
#[cfg(feature = "gui")]
mod gui;

use clap::Parser;
use std::process::ExitCode;

/// mimalloc with purging off. Measured on 2 cores (SmolLM2-135M shape, fp32, seq 256):
/// glibc malloc 86 tokens/s, 3.30 GB peak RSS; mimalloc with its default 10 ms purge
/// delay 68 tokens/s (every step's large tensors are unmapped and faulted in again);
/// mimalloc without purging 97 tokens/s, 3.66 GB. Tokenising 50,000 Alpaca rows:
/// 8.3 s with glibc (40 % of it in malloc/free), 4.5 s with mimalloc.
///
/// Blocks of 1 MiB and more go to tunestudio's large-block pool on top of mimalloc: it keeps
/// the resident set at what the heap held at once, run after run, where mimalloc's arena left
/// a varying share of freed blocks resident (`tunestudio::mem::LargeBlockPool`).
#[global_allocator]
static GLOBAL: tunestudio::mem::LargeBlockPool<mimalloc::MiMalloc> =
    tunestudio::mem::LargeBlockPool::new(mimalloc::MiMalloc);

/// `mi_option_purge_delay` in mimalloc's `mi_option_e` (not exported by the bindings).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn main() -> ExitCode {
    // SAFETY: sets a process-wide allocator option; mimalloc allows it at any time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
