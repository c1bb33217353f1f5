//! The `tunestudio` binary: the desktop studio (default) and the headless CLI.

mod cli;
#[cfg(feature = "gui")]
mod gui;

use clap::Parser;
use std::process::ExitCode;

/// mimalloc, with blocks of 128 KiB and more in tunestudio's large-block pool on top of it
/// (`tunestudio::mem::LargeBlockPool`): the pool keeps freed tensors mapped and refits them,
/// so a step's large tensors are not faulted in again, and mimalloc purges the small objects'
/// freed pages after 10 ms. Measured on 2 cores:
/// mimalloc alone with its default purge ran SmolLM2-135M (fp32, seq 256) at 68 tokens/s
/// (every step's large tensors unmapped and faulted in again), without purging at 97 tokens/s
/// but its arena kept a varying share of freed blocks resident (the demo's whole run 259 or
/// 287 MiB); glibc malloc 86 tokens/s, and 40 % of a 50,000-row tokenisation in malloc/free.
/// With the pool, leaving mimalloc's purge on costs no speed beyond this machine's noise and
/// stops the small objects' growth over a run: the demo's 2-step run peaks at 143–145 MiB and
/// its 60-step run at 152–158 MiB, against 157 and 182 MiB with purging off.
#[global_allocator]
static GLOBAL: tunestudio::mem::LargeBlockPool<mimalloc::MiMalloc> =
    tunestudio::mem::LargeBlockPool::new(mimalloc::MiMalloc);

/// `mi_option_purge_delay` in mimalloc's `mi_option_e` (not exported by the bindings).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc's documented default, set explicitly: left unset, this build kept freed pages as
/// if purging were off (the demo's 2-step run 160–162 MiB, against 146–147 MiB set; measured
/// with `/usr/bin/time -v`, as with `MIMALLOC_PURGE_DELAY=-1` and `=10`).
const PURGE_DELAY_MS: std::os::raw::c_long = 10;

fn main() -> ExitCode {
    // SAFETY: sets a process-wide allocator option; mimalloc allows it at any time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
    // Before the model and data fault their pages in (see `mem::disable_transparent_huge_pages`
    // for why and what it measured); a kernel that refuses keeps its default, which costs
    // memory, not correctness.
    tunestudio::mem::disable_transparent_huge_pages();
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
