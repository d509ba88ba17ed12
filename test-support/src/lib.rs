//! Helpers for the workspace's tests.
//!
//! Process-wide state (rseq registration, membarrier mode, signal handlers)
//! is decided at start-up or shared by every test of a process, so some
//! tests run again in a child process with a changed environment. When the
//! tests themselves run under a cross runner (qemu-user for aarch64, which
//! the cross environment exports as
//! `CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER`), children must be
//! started through that runner too: this crate does that.

use std::ffi::OsStr;
use std::process::{Command, Output};

/// A `Command` that runs the executable `exe` of this build, through the
/// cross runner when there is one.
///
/// # Panics
/// If the runner variable is set but empty.
#[must_use]
pub fn command(exe: impl AsRef<OsStr>) -> Command {
    let runner = std::env::var("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER")
        .ok()
        .filter(|_| cfg!(target_arch = "aarch64"));
    match runner.as_deref().map(str::split_whitespace) {
        Some(mut parts) => {
            let mut c = Command::new(parts.next().expect("empty runner"));
            c.args(parts).arg(exe);
            c
        }
        None => Command::new(exe),
    }
}

/// Runs test `name` of the current test binary in a child process with
/// `env` added, and asserts that it passed.
///
/// # Panics
/// If the child cannot be started or fails.
#[must_use]
pub fn rerun_in_child(name: &str, env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("current test binary");
    let mut cmd = command(exe);
    cmd.args(["--exact", name, "--nocapture", "--test-threads=1"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawn child test process");
    assert!(
        out.status.success(),
        "child {name} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Whether the child's standard output contains `line`.
#[must_use]
pub fn printed(out: &Output, line: &str) -> bool {
    String::from_utf8_lossy(&out.stdout).contains(line)
}
