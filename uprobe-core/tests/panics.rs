//! A handler that panics aborts the process with a message, whichever
//! way the hit came in (a jump, a breakpoint, a return): unwinding
//! through a trampoline or a signal frame is undefined behaviour. Each
//! case runs in a child process of its own (this binary again), whose
//! death by `SIGABRT` and whose message the test checks.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use std::os::unix::process::ExitStatusExt;

use common::{call, fn_addr, probe_at};

#[inline(never)]
extern "C" fn panics_in_probe(x: u64) -> u64 {
    std::hint::black_box(x) + 1
}

/// Which case the child runs: the name of the variable, and its values.
const CASE: &str = "UPROBE_PANIC_CASE";

/// In the child: attach a panicking handler as `case` says and hit it
/// (which must not return).
fn run_case(case: &str) {
    let probe = probe_at(fn_addr(panics_in_probe));
    let probe = match case {
        "jump" => probe.on_entry(|_| panic!("entry handler")),
        "trap" => probe.trap_only().on_entry(|_| panic!("entry handler")),
        "return" => probe.on_return(|_| panic!("return handler")),
        _ => unreachable!("unknown case {case}"),
    };
    let _probe = probe.attach().expect("attach");
    call(panics_in_probe, 1);
    // Not reached: the process has aborted.
    std::process::exit(3);
}

#[test]
fn a_panicking_handler_aborts_the_process_with_a_message() {
    if let Ok(case) = std::env::var(CASE) {
        run_case(&case);
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    for case in ["jump", "trap", "return"] {
        let out = test_support::command(&exe)
            .args([
                "--exact",
                "a_panicking_handler_aborts_the_process_with_a_message",
                "--nocapture",
            ])
            .env(CASE, case)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run the child");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGABRT),
            "{case}: the child was not aborted: {:?}\n{stderr}",
            out.status
        );
        assert!(
            stderr.contains("uprobe-core: a probe handler panicked; aborting"),
            "{case}: {stderr}"
        );
    }
}
