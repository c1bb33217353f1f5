//! System fonts for scripts egui's built-in fonts lack (Hebrew, Arabic, CJK),
//! so dataset text renders as written. Fonts are found by scanning the usual
//! font folders once and loaded lazily, the first time a character needs one;
//! with none installed, text falls back to egui's replacement glyph — no crash —
//! and the [`FontNotice`] names the package to install (the status bar shows it).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use eframe::egui::{
    self, FallbackRequest, FontData, FontFamily, FontInsert, FontPriority, InsertFontFamily,
};

/// A script family we look for a font for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Script {
    /// Hebrew, Arabic, Greek, extended Latin, symbols: DejaVu / Noto cover them.
    Alphabetic,
    /// Chinese, Japanese, Korean.
    Cjk,
}

/// Hebrew, Arabic and their presentation forms: the right-to-left scripts datasets carry.
fn is_hebrew_or_arabic(c: char) -> bool {
    matches!(c as u32, 0x0590..=0x08FF | 0xFB1D..=0xFDFF | 0xFE70..=0xFEFF)
}

fn script_of(c: char) -> Script {
    let u = c as u32;
    let cjk = matches!(u,
        0x1100..=0x11FF      // Hangul Jamo
        | 0x2E80..=0x2FDF    // CJK radicals
        | 0x3000..=0x30FF    // CJK punctuation, kana
        | 0x3100..=0x31FF
        | 0x3400..=0x4DBF    // Extension A
        | 0x4E00..=0x9FFF    // Unified ideographs
        | 0xAC00..=0xD7AF    // Hangul syllables
        | 0xF900..=0xFAFF
        | 0xFF00..=0xFFEF    // Full-width forms
        | 0x20000..=0x2FA1F);
    if cjk {
        Script::Cjk
    } else {
        Script::Alphabetic
    }
}

/// Font files by preference for each script (file-name fragments, lower case).
const ALPHABETIC_NAMES: &[&str] = &[
    "dejavusans.ttf",
    "notosans-regular.ttf",
    "notosanshebrew-regular.ttf",
    "freesans.ttf",
    "liberationsans-regular.ttf",
];
const CJK_NAMES: &[&str] = &[
    "notosanscjk-regular.ttc",
    "notosanscjksc-regular.otf",
    "notosanssc-regular",
    "droidsansfallbackfull.ttf",
    "droidsansfallback.ttf",
    "wqy-microhei.ttc",
    "wqy-zenhei.ttc",
    "notosansjp-regular",
    "ukai.ttc",
    "uming.ttc",
];

/// Folders searched for fonts.
fn font_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![
        PathBuf::from("/usr/share/fonts"),
        PathBuf::from("/usr/local/share/fonts"),
        PathBuf::from("/Library/Fonts"),
        PathBuf::from("/System/Library/Fonts"),
        PathBuf::from("C:\\Windows\\Fonts"),
    ];
    if let Some(home) = std::env::var_os("HOME") {
        let home = PathBuf::from(home);
        dirs.push(home.join(".local/share/fonts"));
        dirs.push(home.join(".fonts"));
    }
    dirs
}

/// Every font file under `dir` (depth-limited).
fn collect_fonts(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    if depth == 0 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_fonts(&p, depth - 1, out);
        } else if let Some(ext) = p.extension().and_then(|e| e.to_str()) {
            if matches!(ext.to_ascii_lowercase().as_str(), "ttf" | "otf" | "ttc") {
                out.push(p);
            }
        }
    }
}

/// The best font file for each script among `files`.
fn pick(files: &[PathBuf], names: &[&str]) -> Option<PathBuf> {
    names.iter().find_map(|want| {
        files
            .iter()
            .find(|p| {
                p.file_name()
                    .map(|n| n.to_string_lossy().to_ascii_lowercase().starts_with(want))
                    .unwrap_or(false)
            })
            .cloned()
    })
}

/// The fonts found on this system.
#[derive(Debug, Clone, Default)]
pub struct SystemFonts {
    /// For Hebrew, Arabic and other alphabets.
    pub alphabetic: Option<PathBuf>,
    /// For Chinese, Japanese and Korean.
    pub cjk: Option<PathBuf>,
}

impl SystemFonts {
    /// Scans the system font folders.
    pub fn scan() -> Self {
        let mut files = Vec::new();
        for d in font_dirs() {
            collect_fonts(&d, 5, &mut files);
        }
        files.sort();
        SystemFonts {
            alphabetic: pick(&files, ALPHABETIC_NAMES),
            cjk: pick(&files, CJK_NAMES),
        }
    }
}

/// The fonts text needed but this system lacks: set by the font fallback the first time
/// such a character is drawn, read by the status bar.
#[derive(Debug, Clone, Default)]
pub struct FontNotice {
    missing: Arc<Mutex<Vec<&'static str>>>,
}

impl FontNotice {
    fn report(&self, what: &'static str) {
        if let Ok(mut m) = self.missing.lock() {
            if !m.contains(&what) {
                m.push(what);
            }
        }
    }

    /// One line naming each missing font and its package, `None` while nothing is missing.
    pub fn message(&self) -> Option<String> {
        let m = self.missing.lock().ok()?;
        (!m.is_empty()).then(|| m.join(" · "))
    }
}

/// What the notice says when Hebrew or Arabic text has no font.
const NO_ALPHABETIC_FONT: &str =
    "no font for Hebrew/Arabic text: install fonts-dejavu-core (Debian/Ubuntu) or dejavu-sans-fonts (Fedora)";
/// What the notice says when Chinese, Japanese or Korean text has no font.
const NO_CJK_FONT: &str =
    "no font for Chinese/Japanese/Korean text: install fonts-noto-cjk (Debian/Ubuntu) or google-noto-sans-cjk-fonts (Fedora)";

/// Where the notice lives in the context's memory.
fn notice_id() -> egui::Id {
    egui::Id::unique("tunestudio-font-notice")
}

/// The line for the status bar when text was drawn without a font for its script: which
/// font is missing and the package to install.
pub fn missing_font_message(ctx: &egui::Context) -> Option<String> {
    ctx.data(|d| d.get_temp::<FontNotice>(notice_id()))?
        .message()
}

/// Installs the system-font fallback on `ctx`. Returns what was found; scripts drawn
/// without a font are reported through [`missing_font_message`].
pub fn install(ctx: &egui::Context) -> SystemFonts {
    let found = SystemFonts::scan();
    let notice = FontNotice::default();
    ctx.data_mut(|d| d.insert_temp(notice_id(), notice.clone()));
    // Hebrew and friends appear in most datasets: install that font up front (it is small)
    // so the first frame already has it.
    if let Some(path) = &found.alphabetic {
        if let Ok(bytes) = std::fs::read(path) {
            ctx.add_font(FontInsert::new(
                "system-alphabetic",
                FontData::from_owned(bytes),
                fallback_families(),
            ));
        }
    }
    // CJK fonts are large (10–20 MB): load one only when a CJK character shows up. egui asks
    // once per character no installed font has, which is also when a missing font shows.
    let cjk = found.cjk.clone();
    let has_alphabetic = found.alphabetic.is_some();
    let loaded: Arc<Mutex<bool>> = Arc::new(Mutex::new(false));
    let reporter = notice.clone();
    ctx.add_font_provider(Arc::new(
        move |req: &FallbackRequest<'_>| -> Option<FontInsert> {
            let c = req.cluster.chars().next()?;
            if is_hebrew_or_arabic(c) && !has_alphabetic {
                reporter.report(NO_ALPHABETIC_FONT);
            }
            if script_of(c) != Script::Cjk {
                return None;
            }
            let Some(path) = &cjk else {
                reporter.report(NO_CJK_FONT);
                return None;
            };
            let mut done = loaded.lock().ok()?;
            if *done {
                return None;
            }
            let bytes = std::fs::read(path).ok()?;
            *done = true;
            Some(FontInsert::new(
                "system-cjk",
                FontData::from_owned(bytes),
                fallback_families(),
            ))
        },
    ));
    found
}

fn fallback_families() -> Vec<InsertFontFamily> {
    vec![
        InsertFontFamily {
            family: FontFamily::Proportional,
            priority: FontPriority::Lowest,
        },
        InsertFontFamily {
            family: FontFamily::Monospace,
            priority: FontPriority::Lowest,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_scripts() {
        assert_eq!(script_of('中'), Script::Cjk);
        assert_eq!(script_of('の'), Script::Cjk);
        assert_eq!(script_of('한'), Script::Cjk);
        assert_eq!(script_of('ש'), Script::Alphabetic);
        assert_eq!(script_of('a'), Script::Alphabetic);
    }

    #[test]
    fn picks_fonts_by_preference() {
        let files = vec![
            PathBuf::from("/f/truetype/freefont/FreeSans.ttf"),
            PathBuf::from("/f/truetype/dejavu/DejaVuSans.ttf"),
            PathBuf::from("/f/truetype/dejavu/DejaVuSans-Bold.ttf"),
        ];
        assert_eq!(
            pick(&files, ALPHABETIC_NAMES),
            Some(PathBuf::from("/f/truetype/dejavu/DejaVuSans.ttf"))
        );
        assert_eq!(pick(&files, CJK_NAMES), None);
    }

    #[test]
    fn notice_names_each_missing_font_once() {
        let n = FontNotice::default();
        assert_eq!(n.message(), None);
        n.report(NO_CJK_FONT);
        n.report(NO_CJK_FONT);
        let m = n.message().unwrap_or_default();
        assert_eq!(m.matches("fonts-noto-cjk").count(), 1, "{m}");
        assert!(is_hebrew_or_arabic('ש') && is_hebrew_or_arabic('م') && !is_hebrew_or_arabic('a'));
    }
}
