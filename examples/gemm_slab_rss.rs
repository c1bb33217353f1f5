//! How much of gemm's per-thread L2 slab a product touches (resident pages), by shape.
//!
//! `cargo run --release --example gemm_slab_rss -- 800x64x49152 2048x576x1536` (one fresh process
//! per shape gives each its own figure; `GemmGeometry::resident_workspace_bytes` cites them).
fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("Linux's /proc/self/status");
    let l = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("a VmRSS line");
    l.split_whitespace()
        .nth(1)
        .and_then(|kib| kib.parse().ok())
        .expect("VmRSS in KiB")
}
fn main() {
    let slab = gemm_common::cache::CACHE_INFO[1].cache_bytes;
    println!("slab {} KiB", slab / 1024);
    let shapes: Vec<(usize, usize, usize)> = std::env::args()
        .skip(1)
        .map(|a| {
            let v: Vec<usize> = a
                .split('x')
                .map(|x| x.parse().expect("shapes as MxKxN, e.g. 800x64x49152"))
                .collect();
            (v[0], v[1], v[2])
        })
        .collect();
    for (m, k, n) in shapes {
        let a = vec![1.0f32; m * k];
        let b = vec![1.0f32; k * n];
        let mut c = vec![2.0f32; m * n];
        let before = rss_kib();
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                k as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        let after = rss_kib();
        println!("{m}x{k}x{n}: +{} KiB", after as i64 - before as i64);
        std::hint::black_box(&c);
    }
}
