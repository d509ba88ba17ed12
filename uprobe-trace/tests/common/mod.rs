//! What the tests share: whether an emulator runs them, and building the
//! programs they trace.
// Each test binary uses what it needs of this module.
#![allow(dead_code)]

use std::process::Command;

/// Whether an emulator (qemu-user) runs this test: it answers
/// `/proc/self/exe` for the program, but not the per-task entries. The
/// programs the tests build are the host's then, not the target's.
pub fn emulated() -> bool {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    std::fs::read_link("/proc/self/exe").ok()
        != std::fs::read_link(format!("/proc/self/task/{tid}/exe")).ok()
}

/// Runs `compiler args`; `None` (the reason printed: the test skips)
/// where it is missing or fails, or under an emulator.
pub fn compile(compiler: &str, args: &[&str]) -> Option<()> {
    if emulated() {
        println!("skipped: under an emulator, the program would be the host's");
        return None;
    }
    match Command::new(compiler).args(args).output() {
        Ok(o) if o.status.success() => Some(()),
        Ok(o) => {
            println!(
                "skipped: {compiler} failed: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            None
        }
        Err(e) => {
            println!("skipped: no {compiler}: {e}");
            None
        }
    }
}
