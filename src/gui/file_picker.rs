//! Choosing files and folders: the system dialog (rfd, through xdg-desktop-portal on Linux)
//! where there is one, and an in-app picker drawn with egui where there is none — an X11
//! session without the portal (i3, XFCE, `ssh -X`, the Xvfb the tests use), where rfd returns
//! nothing at all. Whether a portal is there is asked on the session bus, never guessed from
//! an empty answer (that is a user's cancel).

use std::path::{Path, PathBuf};

use eframe::egui::{self, RichText};

/// Whether the system file dialog can open, and why not.
pub fn system_dialog() -> Result<(), String> {
    if cfg!(any(target_os = "windows", target_os = "macos")) {
        return Ok(());
    }
    portal_on_session_bus()
}

#[cfg(not(any(target_os = "windows", target_os = "macos")))]
fn portal_on_session_bus() -> Result<(), String> {
    const PORTAL: &str = "org.freedesktop.portal.Desktop";
    let no_portal = |why: String| format!("no xdg-desktop-portal ({why})");
    let conn = zbus::blocking::Connection::session()
        .map_err(|e| no_portal(format!("no D-Bus session bus: {e}")))?;
    let bus = zbus::blocking::fdo::DBusProxy::new(&conn).map_err(|e| no_portal(e.to_string()))?;
    let name = zbus::names::BusName::try_from(PORTAL).map_err(|e| no_portal(e.to_string()))?;
    if bus.name_has_owner(name).unwrap_or(false) {
        return Ok(());
    }
    let activatable = bus
        .list_activatable_names()
        .map_err(|e| no_portal(e.to_string()))?;
    if activatable.iter().any(|n| n.as_str() == PORTAL) {
        Ok(())
    } else {
        Err(no_portal("it is not on the session bus".into()))
    }
}

#[cfg(any(target_os = "windows", target_os = "macos"))]
fn portal_on_session_bus() -> Result<(), String> {
    Ok(())
}

/// What the picker chooses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickKind {
    /// A folder.
    Folder,
    /// An existing file with one of these extensions (any when empty).
    File(Vec<&'static str>),
    /// A file to write (it may not exist yet).
    Save(Vec<&'static str>),
}

/// What a frame of the picker decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickerOutcome {
    /// Still open.
    Open,
    /// The user chose this path.
    Chosen(PathBuf),
    /// The user cancelled.
    Cancelled,
}

/// The in-app picker: a folder listing, a path field and a few places.
#[derive(Debug, Clone)]
pub struct FilePicker {
    title: String,
    kind: PickKind,
    dir: PathBuf,
    path_text: String,
    entries: Vec<(String, bool)>,
    places: Vec<(String, PathBuf)>,
    error: Option<String>,
}

impl FilePicker {
    /// A picker titled `title`, starting in `start` (else the home folder), with `places`
    /// (name, folder) offered as shortcuts.
    pub fn new(
        title: &str,
        kind: PickKind,
        start: Option<PathBuf>,
        places: Vec<(String, PathBuf)>,
    ) -> Self {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let dir = start
            .filter(|d| d.is_dir())
            .or(home)
            .unwrap_or_else(|| PathBuf::from("/"));
        let mut p = FilePicker {
            title: title.to_string(),
            kind,
            dir: PathBuf::new(),
            path_text: String::new(),
            entries: Vec::new(),
            places: places.into_iter().filter(|(_, d)| d.is_dir()).collect(),
            error: None,
        };
        p.enter(dir);
        p
    }

    /// The folder being listed.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Lists `dir` and goes there, the path field showing it.
    fn enter(&mut self, dir: PathBuf) {
        if self.list_dir(&dir) {
            self.path_text = dir.display().to_string();
        }
    }

    /// Lists `dir` and makes it the folder shown (the path field left alone); false, with the
    /// error shown, when it cannot be read.
    fn list_dir(&mut self, dir: &Path) -> bool {
        match list(dir, &self.kind) {
            Ok(entries) => {
                self.entries = entries;
                self.dir = dir.to_path_buf();
                self.error = None;
                true
            }
            Err(e) => {
                self.error = Some(format!("cannot list {}: {e}", dir.display()));
                false
            }
        }
    }

    /// Called when the path field's text changed: a folder other than the one shown is
    /// listed as it is typed (one `read_dir`, only on a change), the text left as typed.
    fn follow_typed(&mut self) {
        let typed = PathBuf::from(self.path_text.trim());
        if typed.as_os_str().is_empty() || typed == self.dir || !typed.is_dir() {
            return;
        }
        self.list_dir(&typed);
    }

    /// Draws the picker as a modal dialog: while it is open nothing behind it takes clicks or
    /// keys. Returns what the user decided this frame (Escape cancels).
    pub fn show(&mut self, ctx: &egui::Context) -> PickerOutcome {
        let mut outcome = PickerOutcome::Open;
        let mut go: Option<PathBuf> = None;
        let width = (ctx.content_rect().width() - 40.0).clamp(240.0, 560.0);
        let modal = egui::Modal::new(egui::Id::unique("in-app-file-picker")).show(ctx, |ui| {
            ui.set_width(width);
            ui.heading(&self.title);
            self.places_row(ui, &mut go);
            self.path_field(ui, &mut go);
            if let Some(e) = &self.error {
                ui.colored_label(crate::gui::theme::ERROR, e);
            }
            self.listing(ui, &mut go);
            ui.separator();
            ui.horizontal(|ui| {
                let choose = match self.kind {
                    PickKind::Folder => "Choose this folder",
                    PickKind::File(_) => "Open",
                    PickKind::Save(_) => "Save here",
                };
                if ui.button(choose).clicked() {
                    outcome = self.choice();
                }
                if ui.button("Cancel").clicked() {
                    outcome = PickerOutcome::Cancelled;
                }
            });
        });
        let escape = || ctx.input_mut(|i| i.consume_key(egui::Modifiers::NONE, egui::Key::Escape));
        if outcome == PickerOutcome::Open && modal.is_top_modal && escape() {
            outcome = PickerOutcome::Cancelled;
        }
        if let Some(dir) = go {
            self.enter(dir);
        }
        outcome
    }

    /// The places, and the parent folder.
    fn places_row(&self, ui: &mut egui::Ui, go: &mut Option<PathBuf>) {
        ui.horizontal_wrapped(|ui| {
            ui.label(RichText::new("Places:").weak());
            for (name, dir) in &self.places {
                if ui.button(name).clicked() {
                    *go = Some(dir.clone());
                }
            }
            if let Some(parent) = self.dir.parent() {
                if ui.button("⬆ Up").clicked() {
                    *go = Some(parent.to_path_buf());
                }
            }
        });
    }

    /// The path field: a folder typed there is listed as it is typed; Enter goes there.
    fn path_field(&mut self, ui: &mut egui::Ui, go: &mut Option<PathBuf>) {
        let field = ui
            .horizontal(|ui| {
                let l = ui.label("Path");
                ui.add(
                    egui::TextEdit::singleline(&mut self.path_text)
                        .desired_width(f32::INFINITY)
                        .hint_text("a path"),
                )
                .labelled_by(l.id)
            })
            .inner;
        if field.changed() {
            self.follow_typed();
        }
        if field.lost_focus() && ui.input(|i| i.key_pressed(egui::Key::Enter)) {
            let typed = PathBuf::from(self.path_text.trim());
            if typed.is_dir() {
                *go = Some(typed);
            }
        }
    }

    /// The folder's entries: a click on a folder goes there, on a file puts it in the field.
    fn listing(&mut self, ui: &mut egui::Ui, go: &mut Option<PathBuf>) {
        egui::ScrollArea::vertical()
            .max_height(260.0)
            .auto_shrink([false, true])
            .show(ui, |ui| {
                for (name, is_dir) in &self.entries {
                    // A trailing slash marks folders (emoji icons are tofu in the default
                    // fonts).
                    let label = if *is_dir {
                        format!("{name}/")
                    } else {
                        name.clone()
                    };
                    if ui.selectable_label(false, label).clicked() {
                        let path = self.dir.join(name);
                        if *is_dir {
                            *go = Some(path);
                        } else {
                            self.path_text = path.display().to_string();
                        }
                    }
                }
            });
    }

    /// The path to return for the current field, or an error shown in the window.
    fn choice(&mut self) -> PickerOutcome {
        let path = PathBuf::from(self.path_text.trim());
        let ok = match &self.kind {
            PickKind::Folder => path.is_dir(),
            PickKind::File(_) => path.is_file(),
            PickKind::Save(_) => path.parent().is_some_and(Path::is_dir) && !path.is_dir(),
        };
        if ok {
            PickerOutcome::Chosen(path)
        } else {
            self.error = Some(match self.kind {
                PickKind::Folder => format!("{} is not a folder", path.display()),
                PickKind::File(_) => {
                    format!("{} is not a file: pick one in the list", path.display())
                }
                PickKind::Save(_) => format!("cannot save as {}", path.display()),
            });
            PickerOutcome::Open
        }
    }
}

/// The folder's sub-folders, then the files the kind accepts, each sorted by name (hidden
/// entries left out).
fn list(dir: &Path, kind: &PickKind) -> std::io::Result<Vec<(String, bool)>> {
    let mut dirs = Vec::new();
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir)?.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with('.') {
            continue;
        }
        let is_dir = e.path().is_dir();
        if is_dir {
            dirs.push(name);
        } else if let PickKind::File(ext) | PickKind::Save(ext) = kind {
            let wanted = ext.is_empty()
                || Path::new(&name)
                    .extension()
                    .is_some_and(|x| ext.iter().any(|w| x.eq_ignore_ascii_case(w)));
            if wanted {
                files.push(name);
            }
        }
    }
    dirs.sort();
    files.sort();
    Ok(dirs
        .into_iter()
        .map(|d| (d, true))
        .chain(files.into_iter().map(|f| (f, false)))
        .collect())
}
