//! Choosing files and folders: the system dialog (rfd, through xdg-desktop-portal on Linux)
//! where there is one, and an in-app picker drawn with egui where there is none — an X11
//! session without the portal (i3, XFCE, `ssh -X`, the Xvfb the tests use), where rfd returns
//! nothing at all. Whether a portal is there is asked on the session bus, never guessed from
//! an empty answer (that is a user's cancel). The in-app picker lists folders through jobs
//! ([`list_folder`] on a job's thread), never inside a frame.

use std::path::{Path, PathBuf};

use eframe::egui::{self, RichText};

use crate::gui::disk;
use crate::gui::error::{ErrorKind, JobError};

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

/// The in-app picker: a folder listing, a path field and a few places. It reads no folder
/// itself: each listing is a job ([`FolderRequest`], taken by the app with
/// [`FilePicker::take_request`]), its answer ([`FolderListing`]) given back through
/// [`FilePicker::listed`] a few frames later; the last listing is kept meanwhile.
#[derive(Debug, Clone)]
pub struct FilePicker {
    title: String,
    kind: PickKind,
    dir: PathBuf,
    path_text: String,
    entries: Vec<(String, bool)>,
    /// The places offered; until the first listing says which exist, none are shown.
    places: Vec<(String, PathBuf)>,
    places_checked: bool,
    error: Option<String>,
    /// The latest listing asked for (older answers are dropped).
    seq: u64,
    /// A listing is in flight.
    pending: bool,
    /// A listing to hand to a job.
    request: Option<FolderRequest>,
}

/// Why a folder is listed: what the picker does with the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListFor {
    /// Go there: the path field shows the folder; an error is shown.
    Enter,
    /// Follow the path field as it is typed: the field keeps the text; a path that is not a
    /// folder lists its parent, and one that cannot be listed changes nothing.
    Typed,
}

/// A folder listing for a job to make: the first of `dirs` that can be listed.
#[derive(Debug, Clone)]
pub struct FolderRequest {
    /// The request's number.
    pub seq: u64,
    /// The folders to try, in order.
    pub dirs: Vec<PathBuf>,
    /// What to list besides folders.
    pub kind: PickKind,
    /// What the picker does with the answer.
    pub purpose: ListFor,
    /// Places to check for existence (the first request only).
    pub places: Vec<PathBuf>,
}

/// A job's answer to a [`FolderRequest`].
#[derive(Debug, Clone)]
pub struct FolderListing {
    /// The request's number.
    pub seq: u64,
    /// The folder listed (the first tried, when none could be).
    pub dir: PathBuf,
    /// Its entries (sub-folders, then the files the kind accepts), or why not.
    pub result: Result<Vec<(String, bool)>, JobError>,
    /// What the picker does with it.
    pub purpose: ListFor,
    /// The request's places that are folders.
    pub places: Vec<PathBuf>,
}

/// Makes a listing (on a job's thread: every look goes through [`crate::gui::disk`]).
pub fn list_folder(request: &FolderRequest) -> FolderListing {
    let mut first_error = None;
    let mut listed = None;
    for dir in &request.dirs {
        match list(dir, &request.kind) {
            Ok(entries) => {
                listed = Some((dir.clone(), Ok(entries)));
                break;
            }
            Err(e) => {
                first_error.get_or_insert_with(|| {
                    let msg = format!("cannot list {}: {e}", dir.display());
                    (dir.clone(), Err(JobError::of(ErrorKind::Io, msg)))
                });
            }
        }
    }
    let (dir, result) = listed
        .or(first_error)
        .unwrap_or_else(|| (PathBuf::new(), Err(JobError::other("no folder to list"))));
    let places = request
        .places
        .iter()
        .filter(|p| disk::is_dir(p))
        .cloned()
        .collect();
    FolderListing {
        seq: request.seq,
        dir,
        result,
        purpose: request.purpose,
        places,
    }
}

impl FilePicker {
    /// A picker titled `title`, starting in the first of `starts` that lists (else the home
    /// folder, else `/`), with `places` (name, folder) offered as shortcuts. Its first
    /// listing is a request ([`FilePicker::take_request`]).
    pub fn new(
        title: &str,
        kind: PickKind,
        starts: Vec<PathBuf>,
        places: Vec<(String, PathBuf)>,
    ) -> Self {
        let mut dirs = starts;
        dirs.extend(std::env::var_os("HOME").map(PathBuf::from));
        dirs.push(PathBuf::from("/"));
        let mut p = FilePicker {
            title: title.to_string(),
            kind,
            dir: PathBuf::new(),
            path_text: String::new(),
            entries: Vec::new(),
            places,
            places_checked: false,
            error: None,
            seq: 0,
            pending: false,
            request: None,
        };
        let check: Vec<PathBuf> = p.places.iter().map(|(_, d)| d.clone()).collect();
        p.ask(dirs, ListFor::Enter, check);
        p
    }

    /// The folder being listed.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a listing is in flight.
    pub fn is_listing(&self) -> bool {
        self.pending
    }

    /// The listing to hand to a job, once.
    pub fn take_request(&mut self) -> Option<FolderRequest> {
        self.request.take()
    }

    fn ask(&mut self, dirs: Vec<PathBuf>, purpose: ListFor, places: Vec<PathBuf>) {
        self.seq += 1;
        self.pending = true;
        self.request = Some(FolderRequest {
            seq: self.seq,
            dirs,
            kind: self.kind.clone(),
            purpose,
            places,
        });
    }

    /// Goes to `dir` once a job has listed it, the path field then showing it.
    fn enter(&mut self, dir: PathBuf) {
        self.ask(vec![dir], ListFor::Enter, Vec::new());
    }

    /// Takes a job's listing (a stale one, answering an older request, is dropped).
    pub fn listed(&mut self, listing: FolderListing) {
        if listing.seq != self.seq {
            return;
        }
        self.pending = false;
        if !self.places_checked && listing.purpose == ListFor::Enter {
            let present = &listing.places;
            self.places.retain(|(_, d)| present.contains(d));
            self.places_checked = true;
        }
        match (listing.result, listing.purpose) {
            (Ok(entries), purpose) => {
                self.entries = entries;
                if purpose == ListFor::Enter {
                    self.path_text = listing.dir.display().to_string();
                }
                self.dir = listing.dir;
                self.error = None;
            }
            (Err(e), ListFor::Enter) => self.error = Some(e.message),
            (Err(_), ListFor::Typed) => {}
        }
    }

    /// Called when the path field's text changed: a folder other than the one shown is
    /// listed as it is typed (a job, only on a change; a file's or a new name's folder when
    /// the path is not a folder), the text left as typed.
    fn follow_typed(&mut self) {
        let typed = PathBuf::from(self.path_text.trim());
        if typed.as_os_str().is_empty() || typed == self.dir {
            return;
        }
        let mut dirs = vec![typed.clone()];
        dirs.extend(
            typed
                .parent()
                .filter(|p| *p != self.dir)
                .map(Path::to_path_buf),
        );
        self.ask(dirs, ListFor::Typed, Vec::new());
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
            if self.pending {
                ui.horizontal(|ui| {
                    ui.add(egui::Spinner::new().size(12.0));
                    ui.label(RichText::new("listing…").weak());
                });
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
            if !typed.as_os_str().is_empty() {
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

    /// The path to return for the current field, or an error shown in the window. Checked
    /// against the last listing (no look at the disk): the folder shown or one of its
    /// entries, a file of the kind in it, or a new name in it to save as.
    fn choice(&mut self) -> PickerOutcome {
        let path = PathBuf::from(self.path_text.trim());
        let in_listing = |is_dir: bool| {
            path.parent() == Some(self.dir.as_path())
                && path.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    self.entries.iter().any(|(e, d)| *e == n && *d == is_dir)
                })
        };
        let ok = !self.pending
            && match &self.kind {
                PickKind::Folder => path == self.dir || in_listing(true),
                PickKind::File(_) => in_listing(false),
                PickKind::Save(_) => {
                    path.parent() == Some(self.dir.as_path())
                        && path.file_name().is_some()
                        && !in_listing(true)
                }
            };
        if ok {
            PickerOutcome::Chosen(path)
        } else {
            self.error = Some(if self.pending {
                "still listing the folder: choose again in a moment".to_string()
            } else {
                match self.kind {
                    PickKind::Folder => format!("{} is not a folder", path.display()),
                    PickKind::File(_) => {
                        format!("{} is not a file: pick one in the list", path.display())
                    }
                    PickKind::Save(_) => format!("cannot save as {}", path.display()),
                }
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
    for e in disk::read_dir(dir)?.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with('.') {
            continue;
        }
        // The entry's type comes with the listing; only a link is followed (one more look).
        let is_dir = match e.file_type() {
            Ok(t) if t.is_symlink() => disk::is_dir(&e.path()),
            Ok(t) => t.is_dir(),
            Err(_) => false,
        };
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
