//! Running one test of this binary again in a child process with a changed
//! environment (process-wide state such as rseq registration is decided at
//! start-up, so a fallback can only be tested in a fresh process).

use std::process::{Command, Output};

/// Runs test `name` of the current test binary in a child process with
/// `env` added. Under a cross runner (qemu-user, exported by the aarch64
/// cross environment as `CARGO_TARGET_<TRIPLE>_RUNNER`), the child is
/// started through that runner too.
pub fn rerun_in_child(name: &str, env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("current test binary");
    let runner = std::env::var("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER")
        .ok()
        .filter(|_| cfg!(target_arch = "aarch64"));
    let mut cmd = match runner.as_deref().map(str::split_whitespace) {
        Some(mut parts) => {
            let mut c = Command::new(parts.next().expect("empty runner"));
            c.args(parts).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
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
pub fn printed(out: &Output, line: &str) -> bool {
    String::from_utf8_lossy(&out.stdout).contains(line)
}
