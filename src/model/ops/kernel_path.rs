//! Which kernel multiplies bf16 operands, picked per CPU by measurement.
//!
//! Three paths can run the products of a bf16 weight (and the fused head of a bf16 lm head):
//! - `f32`: widen the bf16 operand and multiply in f32 with gemm's kernels (exact products of
//!   the unrounded activations);
//! - `avx512-bf16`: the bf16 dot-product instruction ([`super::bf16_gemm`]'s
//!   [`Avx512Tile`] kernel);
//! - `amx`: the AMX tile unit ([`super::bf16_gemm`]'s [`AmxTile`] kernel).
//!
//! Having an instruction does not make it faster: on a 2-core Sapphire Rapids the dot-product
//! path ran a bf16-mixed step at 0.65× of fp32 (issue #42), where on Zen 4 it was 1.1–1.4×. So
//! at first use in a process every path the CPU has is timed on the products of one linear
//! layer (forward `x Wᵀ`, input gradient `dy W`, weight gradient `dyᵀ x` of a 576 → 1536
//! projection at 256 tokens, SmolLM2-135M's MLP), interleaved, best of three rounds after a
//! warm-up, and the fastest runs every bf16 product of the process. The f32 path is always a
//! candidate, so half precision is never slower than fp32's products.
//!
//! Measured on the 2-core Sapphire Rapids VM (release build, 2 threads, other builds running,
//! so absolute figures are low): the layer's products at f32 62, avx512-bf16 38, amx 122
//! GFLOP/s; the SmolLM2-135M step (256 tokens) at 71–75 tokens/s in fp32, 82–96 in bf16-mixed
//! on AMX against 41–53 on the dot-product path (interleaved runs).
//!
//! The result is cached per CPU model, thread count and kernel version in
//! `$XDG_CACHE_HOME/tunestudio/kernel-paths.json` (else `~/.cache/…`; `TUNESTUDIO_KERNEL_CACHE`
//! names another file, or `off`), written through a temporary file and a rename.
//! `TUNESTUDIO_BF16_KERNEL=f32|avx512-bf16|amx` forces a path (tests, users).

use super::bf16_gemm::{self, AmxTile, Avx512Tile, PackElem, TileKernel};
use super::matmul::{sgemm, sgemm_new, MatRef};
use candle_core::Result;
use half::bf16;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

/// Forces a path: `f32`, `avx512-bf16` or `amx`.
pub const KERNEL_ENV: &str = "TUNESTUDIO_BF16_KERNEL";
/// The cache file (`off` or `0`: no cache).
pub const CACHE_ENV: &str = "TUNESTUDIO_KERNEL_CACHE";
/// Bumped when a kernel changes enough to invalidate cached measurements.
const KERNELS_VERSION: u32 = 1;
/// The measured linear layer: tokens, inputs, outputs.
const SHAPE: (usize, usize, usize) = (256, 576, 1536);

/// A path for products with bf16 operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// Widen to f32, gemm's f32 kernels.
    F32,
    /// The bf16 dot-product instruction (AVX512-BF16).
    Avx512Bf16,
    /// The AMX tile unit (AMX-BF16).
    Amx,
}

impl Bf16Kernel {
    /// Every path, the ones this CPU lacks included.
    pub const ALL: [Self; 3] = [Self::F32, Self::Avx512Bf16, Self::Amx];

    /// The name the environment override and the cache use.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Avx512Bf16 => "avx512-bf16",
            Self::Amx => "amx",
        }
    }

    /// The path of a name ([`Self::name`]).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
    }

    /// Whether this CPU (and OS) can run the path.
    pub fn available(self) -> bool {
        match self {
            Self::F32 => true,
            Self::Avx512Bf16 => Avx512Tile::available(),
            Self::Amx => AmxTile::available(),
        }
    }

    /// `lhs @ rhs` as a new row-major buffer on this path (the bf16 paths round both operands
    /// to bf16; the f32 path widens bf16 operands and keeps f32 ones).
    pub(crate) fn gemm_new<A: PackElem, B: PackElem>(
        self,
        lhs: MatRef<'_, A>,
        rhs: MatRef<'_, B>,
    ) -> Result<Vec<f32>> {
        match self {
            Self::Amx => bf16_gemm::gemm_new::<AmxTile, _, _>(lhs, rhs),
            Self::Avx512Bf16 => bf16_gemm::gemm_new::<Avx512Tile, _, _>(lhs, rhs),
            Self::F32 => {
                let (a, b) = (A::as_f32(lhs.data), B::as_f32(rhs.data));
                sgemm_new(
                    MatRef {
                        data: &a,
                        ..as_f32_view(lhs)
                    },
                    MatRef {
                        data: &b,
                        ..as_f32_view(rhs)
                    },
                )
            }
        }
    }

    /// `dst (+)= lhs @ rhs` on this path, `dst` row-major with `ldc` between rows.
    pub(crate) fn gemm<A: PackElem, B: PackElem>(
        self,
        dst: &mut [f32],
        ldc: usize,
        accumulate: bool,
        lhs: MatRef<'_, A>,
        rhs: MatRef<'_, B>,
    ) -> Result<()> {
        match self {
            Self::Amx => bf16_gemm::gemm::<AmxTile, _, _>(dst, ldc, accumulate, lhs, rhs),
            Self::Avx512Bf16 => bf16_gemm::gemm::<Avx512Tile, _, _>(dst, ldc, accumulate, lhs, rhs),
            Self::F32 => {
                let (a, b) = (A::as_f32(lhs.data), B::as_f32(rhs.data));
                let (lhs, rhs) = (as_f32_view(lhs), as_f32_view(rhs));
                sgemm(
                    dst,
                    ldc,
                    1,
                    accumulate,
                    MatRef { data: &a, ..lhs },
                    MatRef { data: &b, ..rhs },
                )
            }
        }
    }

    /// Bytes one `m × k × n` product holds besides its operands and output on this path (over
    /// all threads): the bf16 paths' packing buffers, or the f32 path's widened copy of its
    /// right operand (the bf16 weight, in every product that has one).
    pub fn product_pack_bytes(self, m: usize, k: usize, n: usize) -> usize {
        match self {
            Self::Amx => bf16_gemm::product_pack_bytes::<AmxTile>(m, k, n),
            Self::Avx512Bf16 => bf16_gemm::product_pack_bytes::<Avx512Tile>(m, k, n),
            Self::F32 => k * n * 4,
        }
    }
}

/// The shape and strides of a view, over an empty `f32` slice (the caller puts the data in).
fn as_f32_view<T>(m: MatRef<'_, T>) -> MatRef<'static, f32> {
    MatRef {
        data: &[],
        rows: m.rows,
        cols: m.cols,
        row_stride: m.row_stride,
        col_stride: m.col_stride,
    }
}

/// Where the choice came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// [`KERNEL_ENV`].
    Override,
    /// Measured by an earlier process on this CPU model (the file).
    Cached(PathBuf),
    /// Measured now.
    Measured,
}

/// The path this process runs bf16 products on, and why.
#[derive(Clone, Debug)]
pub struct KernelChoice {
    pub kernel: Bf16Kernel,
    /// GFLOP/s of each candidate on the measured layer (empty when forced).
    pub gflops: Vec<(Bf16Kernel, f64)>,
    pub source: Source,
    /// A remark (an override that could not be honoured).
    pub note: Option<String>,
}

impl KernelChoice {
    /// One line: the path and why it was picked.
    pub fn why(&self) -> String {
        let figures = self
            .gflops
            .iter()
            .map(|(k, g)| format!("{} {g:.1}", k.name()))
            .collect::<Vec<_>>()
            .join(", ");
        let (t, i, o) = SHAPE;
        let mut s = match &self.source {
            Source::Override => format!("{KERNEL_ENV}={}", self.kernel.name()),
            Source::Measured => format!("fastest on a {t}×{i}→{o} layer's products, GFLOP/s: {figures}"),
            Source::Cached(p) => format!(
                "fastest on a {t}×{i}→{o} layer's products, GFLOP/s: {figures} (measured earlier, cached in {})",
                p.display()
            ),
        };
        let missing: Vec<&str> = Bf16Kernel::ALL
            .iter()
            .filter(|k| !k.available())
            .map(|k| k.name())
            .collect();
        if !missing.is_empty() {
            s.push_str(&format!("; not on this CPU: {}", missing.join(", ")));
        }
        if let Some(n) = &self.note {
            s.push_str(&format!("; {n}"));
        }
        s
    }
}

/// The path of this process, chosen at first use (measured on rayon's current pool).
pub fn choice() -> &'static KernelChoice {
    static CHOICE: OnceLock<KernelChoice> = OnceLock::new();
    CHOICE.get_or_init(choose)
}

/// Whether bf16 products run on a bf16 kernel (otherwise bf16 weights are widened to f32).
pub(crate) fn bf16_products() -> bool {
    choice().kernel != Bf16Kernel::F32
}

/// `lhs @ rhs` on the chosen path.
pub(crate) fn gemm_new<A: PackElem, B: PackElem>(
    lhs: MatRef<'_, A>,
    rhs: MatRef<'_, B>,
) -> Result<Vec<f32>> {
    choice().kernel.gemm_new(lhs, rhs)
}

/// `dst (+)= lhs @ rhs` on the chosen path.
pub(crate) fn gemm<A: PackElem, B: PackElem>(
    dst: &mut [f32],
    ldc: usize,
    accumulate: bool,
    lhs: MatRef<'_, A>,
    rhs: MatRef<'_, B>,
) -> Result<()> {
    choice().kernel.gemm(dst, ldc, accumulate, lhs, rhs)
}

/// [`Bf16Kernel::product_pack_bytes`] of the chosen path (what the planner counts).
pub fn product_pack_bytes(m: usize, k: usize, n: usize) -> usize {
    choice().kernel.product_pack_bytes(m, k, n)
}

fn choose() -> KernelChoice {
    let mut note = None;
    if let Ok(v) = std::env::var(KERNEL_ENV) {
        match Bf16Kernel::parse(&v) {
            Some(k) if k.available() => {
                return KernelChoice {
                    kernel: k,
                    gflops: Vec::new(),
                    source: Source::Override,
                    note: None,
                }
            }
            Some(k) => {
                note = Some(format!(
                    "{KERNEL_ENV}={} ignored: not on this CPU",
                    k.name()
                ))
            }
            None => {
                note = Some(format!(
                    "{KERNEL_ENV}={v:?} ignored: use f32, avx512-bf16 or amx"
                ))
            }
        }
    }
    let key = cache_key();
    let file = cache_file();
    if let Some(c) = file.as_ref().and_then(|f| cache::read(f, &key)) {
        return KernelChoice { note, ..c };
    }
    let gflops = measure();
    let kernel = gflops
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(Bf16Kernel::F32, |g| g.0);
    if let Some(f) = &file {
        // A cache that cannot be written only means measuring again next time.
        let _ = cache::write(f, &key, kernel, &gflops);
    }
    KernelChoice {
        kernel,
        gflops,
        source: Source::Measured,
        note,
    }
}

/// GFLOP/s of every available path on [`SHAPE`]'s three products: one warm-up round, then
/// three interleaved rounds, best of each.
fn measure() -> Vec<(Bf16Kernel, f64)> {
    let (t, i, o) = SHAPE;
    let value =
        |idx: usize, salt: usize| ((idx * 2_654_435_761 + salt) % 2001) as f32 / 1000.0 - 1.0;
    let x: Vec<f32> = (0..t * i).map(|j| value(j, 1)).collect();
    let dy: Vec<f32> = (0..t * o).map(|j| value(j, 7) * 0.01).collect();
    let w: Vec<bf16> = (0..o * i)
        .map(|j| bf16::from_f32(value(j, 3) * 0.05))
        .collect();
    let candidates: Vec<Bf16Kernel> = Bf16Kernel::ALL
        .into_iter()
        .filter(|k| k.available())
        .collect();
    let mut best = vec![f64::INFINITY; candidates.len()];
    for round in 0..4 {
        for (c, &k) in candidates.iter().enumerate() {
            let start = Instant::now();
            if layer_products(k, (&x, &w, &dy), SHAPE).is_err() {
                continue;
            }
            if round > 0 {
                best[c] = best[c].min(start.elapsed().as_secs_f64());
            }
        }
    }
    let flops = 3.0 * 2.0 * (t * i * o) as f64;
    candidates
        .into_iter()
        .zip(best)
        .filter(|(_, s)| s.is_finite())
        .map(|(k, s)| (k, flops / s / 1e9))
        .collect()
}

/// A linear layer's three products on one path, as the native layer runs them.
fn layer_products(
    k: Bf16Kernel,
    (x, w, dy): (&[f32], &[bf16], &[f32]),
    (t, i, o): (usize, usize, usize),
) -> Result<()> {
    let (x, w, dy) = (
        MatRef::row_major(x, t, i),
        MatRef::row_major(w, o, i),
        MatRef::row_major(dy, t, o),
    );
    std::hint::black_box(k.gemm_new(x, w.t())?);
    std::hint::black_box(k.gemm_new(dy.t(), x)?);
    std::hint::black_box(k.gemm_new(dy, w)?);
    Ok(())
}

/// The cache key: CPU model, rayon threads, kernel version, build.
fn cache_key() -> String {
    // Test builds optimise the crate less: their figures are not the release binary's.
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    format!(
        "{} | {} threads | kernels v{KERNELS_VERSION} | {build} build",
        cpu_model(),
        rayon::current_num_threads()
    )
}

/// The CPU's brand string (CPUID), or `/proc/cpuinfo`'s model name, or "unknown CPU".
fn cpu_model() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // SAFETY: CPUID exists on every x86-64 CPU (safe to call from Rust 1.94 on).
        #[allow(unused_unsafe)]
        let max = unsafe { __cpuid(0x8000_0000) }.eax;
        if max >= 0x8000_0004 {
            let mut bytes = Vec::with_capacity(48);
            for leaf in 0x8000_0002u32..=0x8000_0004 {
                // SAFETY: as above; the leaf exists (`max`).
                #[allow(unused_unsafe)]
                let r = unsafe { __cpuid(leaf) };
                for v in [r.eax, r.ebx, r.ecx, r.edx] {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
            }
            let s = String::from_utf8_lossy(&bytes)
                .trim_matches(['\0', ' '])
                .to_string();
            if !s.is_empty() {
                return s;
            }
        }
    }
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// The cache file: [`CACHE_ENV`], else `$XDG_CACHE_HOME` or `~/.cache`, `tunestudio/kernel-paths.json`.
fn cache_file() -> Option<PathBuf> {
    crate::paths::user_cache_path(CACHE_ENV, "kernel-paths.json")
}

/// The cache file: a JSON object of keys to `{"kernel": name, "gflops": {name: value}}`.
mod cache {
    use super::{Bf16Kernel, KernelChoice, Source};
    use serde_json::{json, Map, Value};
    use std::path::Path;

    /// The cached choice for `key`, when there is one and its path still runs here.
    pub(super) fn read(file: &Path, key: &str) -> Option<KernelChoice> {
        let text = std::fs::read_to_string(file).ok()?;
        let all: Value = serde_json::from_str(&text).ok()?;
        let entry = all.get(key)?;
        let kernel = Bf16Kernel::parse(entry.get("kernel")?.as_str()?)?;
        let mut gflops: Vec<(Bf16Kernel, f64)> = entry
            .get("gflops")?
            .as_object()?
            .iter()
            .filter_map(|(k, v)| Some((Bf16Kernel::parse(k)?, v.as_f64()?)))
            .collect();
        gflops.sort_by(|a, b| b.1.total_cmp(&a.1));
        kernel.available().then(|| KernelChoice {
            kernel,
            gflops,
            source: Source::Cached(file.to_path_buf()),
            note: None,
        })
    }

    /// Adds (or replaces) `key`'s entry: the file is rewritten through a temporary file and a
    /// rename, so a reader never sees half of it.
    pub(super) fn write(
        file: &Path,
        key: &str,
        kernel: Bf16Kernel,
        gflops: &[(Bf16Kernel, f64)],
    ) -> std::io::Result<()> {
        let mut all = std::fs::read_to_string(file)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v.as_object().cloned())
            .unwrap_or_default();
        let figures: Map<String, Value> = gflops
            .iter()
            .map(|(k, g)| (k.name().to_string(), json!((g * 10.0).round() / 10.0)))
            .collect();
        all.insert(
            key.to_string(),
            json!({"kernel": kernel.name(), "gflops": figures}),
        );
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = file.with_extension(format!("json.tmp.{}", std::process::id()));
        let text = serde_json::to_string_pretty(&Value::Object(all))?;
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, file)
    }
}

#[cfg(test)]
pub(crate) mod tests;
