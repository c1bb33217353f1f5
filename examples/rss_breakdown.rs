//! Where a CPU run's resident set goes, stage by stage: the process as the binary runs it
//! (the large-block pool over mimalloc, transparent huge pages off, as `src/main.rs` sets
//! it), with the heap counted on top.
//!
//! cargo run --example rss_breakdown -- assets/demo.toml [steps]
//!
//! Prints, after each stage (start, tokenizer + data + model loaded, each step, evaluation,
//! checkpoint), the resident set (`VmRSS`, `VmHWM`), the heap in use and its peak (bytes
//! handed out by the allocator), so the non-heap baseline (binary, libraries, thread stacks)
//! and the allocator's retention (RSS above the non-heap baseline + heap peak) can be read
//! off. The planner's process-baseline terms (`plan::process`) were measured with it.

// A developer's measuring tool: a panic stops a measurement, it never reaches a user.
#![allow(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// The binary's allocator, counted.
struct Counted;

static INNER: tunestudio::mem::LargeBlockPool<mimalloc::MiMalloc> =
    tunestudio::mem::LargeBlockPool::new(mimalloc::MiMalloc);

// SAFETY: every method forwards to the binary's allocator with the caller's arguments unchanged.
unsafe impl GlobalAlloc for Counted {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded verbatim.
        let p = unsafe { INNER.alloc(l) };
        if !p.is_null() {
            added(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded verbatim.
        let p = unsafe { INNER.alloc_zeroed(l) };
        if !p.is_null() {
            added(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded verbatim.
        unsafe { INNER.dealloc(p, l) };
        CURRENT.fetch_sub(l.size() as u64, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        // SAFETY: forwarded verbatim.
        let q = unsafe { INNER.realloc(p, l, n) };
        if !q.is_null() {
            added(n);
            CURRENT.fetch_sub(l.size() as u64, Ordering::Relaxed);
        }
        q
    }
}

fn added(n: usize) {
    let now = CURRENT.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

#[global_allocator]
static GLOBAL: Counted = Counted;

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn report(stage: &str) {
    let rss = tunestudio::mem::process_rss_bytes().unwrap_or(0);
    let hwm = tunestudio::mem::peak_rss_bytes().unwrap_or(0);
    let heap = CURRENT.load(Ordering::Relaxed);
    let peak = PEAK.load(Ordering::Relaxed);
    // Freed large blocks the pool keeps mapped: resident, and taken by the next large tensors.
    let pooled = tunestudio::mem::free_block_bytes();
    println!(
        "{stage:<28} rss {:>8.1}  hwm {:>8.1}  heap {:>8.1}  heap peak {:>8.1}  hwm - heap peak {:>7.1}  pool free {:>7.1} MiB",
        mib(rss),
        mib(hwm),
        mib(heap),
        mib(peak),
        mib(hwm) - mib(peak),
        mib(pooled)
    );
}

fn main() {
    // As the binary: mimalloc's purge delay 10 ms (`mi_option_purge_delay` = 15), transparent
    // huge pages off.
    // SAFETY: a process-wide option; mimalloc allows setting it at any time.
    unsafe { libmimalloc_sys::mi_option_set(15, 10) };
    tunestudio::mem::disable_transparent_huge_pages();
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| "assets/demo.toml".into());
    let steps: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(2);
    if std::env::var_os("PROBE").is_some() {
        probe();
        return;
    }
    report("start");
    let mut config = tunestudio::train::RunConfig::load(std::path::Path::new(&path)).unwrap();
    let out = std::env::temp_dir().join("rss_breakdown_out");
    let _ = std::fs::remove_dir_all(&out);
    config.output_dir = out;
    config.training.max_steps = Some(steps);
    let tok =
        tunestudio::train::samples::load_tokenizer(&config.base_dir.join(&config.model.source));
    report("tokenizer alone");
    drop(tok);
    let mut run = tunestudio::train::TrainingRun::new(config).unwrap();
    report("loaded (tok + data + model)");
    for s in 0..steps {
        run.step().unwrap();
        report(&format!("step {}", s + 1));
    }
    if std::env::var_os("PROBE_EVAL").is_some() {
        use candle_core::{Device, Tensor};
        let ids = Tensor::zeros((4, 128), candle_core::DType::U32, &Device::Cpu).unwrap();
        let labels = Tensor::ones((4, 128), candle_core::DType::I64, &Device::Cpu).unwrap();
        let mask = Tensor::ones((4, 128), candle_core::DType::U32, &Device::Cpu).unwrap();
        let base = CURRENT.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        let l = run
            .model()
            .token_losses(&ids, Some(&mask), &labels)
            .unwrap();
        println!(
            "token_losses peak above base: {:.1} MiB",
            mib(PEAK.load(Ordering::Relaxed) - base)
        );
        drop(l);
    }
    run.evaluate().unwrap();
    report("evaluation");
    run.save_checkpoint().unwrap();
    report("checkpoint");
}

#[allow(dead_code)]
fn probe() {
    use candle_core::{Device, Tensor};
    let w = Tensor::randn(0f32, 1.0, (49152, 64), &Device::Cpu).unwrap();
    let h = Tensor::randn(0f32, 1.0, (508, 64), &Device::Cpu).unwrap();
    let base = CURRENT.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let l = h.matmul(&w.t().unwrap()).unwrap();
    println!(
        "matmul peak above base: {:.1} MiB",
        mib(PEAK.load(Ordering::Relaxed) - base)
    );
    drop(l);
    let wv = candle_core::Var::from_tensor(&w).unwrap();
    PEAK.store(base, Ordering::Relaxed);
    let l = h.matmul(&wv.as_tensor().t().unwrap()).unwrap();
    println!(
        "matmul(var) peak above base: {:.1} MiB",
        mib(PEAK.load(Ordering::Relaxed) - base)
    );
    drop(l);
}
