//! Starting the binary where the studio cannot open: one clear line, never a winit panic.
#![cfg(feature = "gui")]

use std::process::Command;

#[test]
fn without_a_display_the_studio_says_so_and_points_to_the_headless_commands() {
    let out = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .env_remove("DISPLAY")
        .env_remove("WAYLAND_DISPLAY")
        .output()
        .expect("start tunestudio");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.starts_with("no display:"), "{stderr}");
    assert!(stderr.contains("tunestudio train"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}
