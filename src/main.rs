//! The `tunestudio` binary: the desktop studio (default) and the headless CLI.

mod cli;
#[cfg(feature = "gui")]
mod gui;

use clap::Parser;
use std::process::ExitCode;

/// mimalloc, with blocks of 128 KiB and more in tunestudio's large-block pool on top of it
/// (`tunestudio::mem::LargeBlockPool`): the pool keeps freed tensors mapped and refits them,
/// so a step's large tensors are not faulted in again, and mimalloc purges the small objects'
/// freed pages after 10 ms. Measured on 2 cores: mimalloc alone with its default purge ran
/// SmolLM2-135M (fp32, seq 256) at 68 tokens/s (every step's large tensors unmapped and
/// faulted in again), without purging at 97 tokens/s but its arena kept a varying share of
/// freed blocks resident (the demo's whole run 259 or 287 MiB); glibc malloc 86 tokens/s,
/// and 40 % of a 50,000-row tokenisation in malloc/free.
/// With the pool, leaving mimalloc's purge on stops the small objects' growth over a run: the
/// demo (longest batch first) peaks at 146–147 MiB in 2 steps and 159–160 MiB in 60
/// (`/usr/bin/time -v`), against 157–158 and 182–183 MiB with purging off. Against the
/// previous setting (purging off, huge pages allowed, the pool from 1 MiB), `farm-bench` of
/// `tunestudio bench` (SmolLM2-135M, 5 pairs): full fine-tuning 0.98× the wall time and
/// 2,145 vs 2,286 MiB peak, LoRA r 16 0.94× and 946 vs 1,015 MiB.
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
