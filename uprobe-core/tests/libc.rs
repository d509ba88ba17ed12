//! Probes on every exported function of libc, entry and return, while
//! the program starts and ends threads (detached ones too, enough to
//! overflow glibc's stack cache), spawns processes with
//! `std::process::Command` (pipes, a working directory, a `PATH` search)
//! and reads files: nothing dies. Before functions glibc runs with every
//! signal blocked were refused, the first thread start, thread exit or
//! spawn killed this process (or its children) with SIGTRAP; on x86-64
//! they now take one-byte jumps, never a breakpoint.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use std::collections::BTreeMap;
use std::ffi::{CStr, c_void};
use std::process::{Command, Stdio};

use common::{emulated, exported_functions};
use uprobe_core::{AttachError, BlockedPath, Mode, Probe, Tactic, Uprobe};

/// The path of the libc this process runs.
fn libc_path() -> String {
    // SAFETY: dladdr of a libc function fills `info`, whose file name
    // lives as long as libc stays loaded (for good).
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        assert!(libc::dladdr(libc::getpid as *const c_void, &raw mut info) != 0);
        CStr::from_ptr(info.dli_fname)
            .to_string_lossy()
            .into_owned()
    }
}

/// Functions refused on each path, kept in the emulated run's sample.
const BLOCKED_EXAMPLES: &[&str] = &["_setjmp", "madvise", "munmap", "execve"];

/// Threads joined, detached threads with large stacks (their exits
/// overflow glibc's 40 MiB stack cache, which then frees stacks with
/// signals blocked), processes spawned, a file read; what each returned.
fn workload() -> Vec<String> {
    let mut out = Vec::new();
    let joined: Vec<_> = (0..4)
        .map(|i| std::thread::spawn(move || format!("thread {i}")))
        .collect();
    out.extend(joined.into_iter().map(|h| h.join().unwrap()));
    let (tx, rx) = std::sync::mpsc::channel();
    for i in 0..12 {
        let tx = tx.clone();
        std::thread::Builder::new()
            .stack_size(8 << 20)
            .spawn(move || tx.send(i).unwrap())
            .unwrap();
    }
    drop(tx);
    let mut detached: Vec<i32> = rx.iter().collect();
    detached.sort_unstable();
    out.push(format!("{detached:?}"));
    // Give the detached threads time to finish exiting.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let echoed = Command::new("echo")
        .arg("spawned")
        .current_dir("/")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    out.push(format!(
        "{:?} {:?}",
        echoed.status,
        String::from_utf8_lossy(&echoed.stdout)
    ));
    let status = Command::new("/bin/true").status().unwrap();
    out.push(format!("{status:?}"));
    out.push(std::fs::read_to_string("/proc/self/comm").unwrap());
    out
}

#[test]
fn every_exported_function_of_libc_while_threads_come_and_go_and_processes_spawn() {
    let path = libc_path();
    // Under an emulator a trap costs tens of microseconds and the
    // engine's own attach work runs through probed libc: every eighth
    // function (the refused ones are refused by name either way).
    let step = if emulated() { 8 } else { 1 };
    let names: Vec<String> = exported_functions(&path)
        .into_iter()
        .enumerate()
        .filter(|(i, n)| i % step == 0 || BLOCKED_EXAMPLES.contains(&n.as_str()))
        .map(|(_, n)| n)
        .collect();
    let plain = workload();
    // Every timing probe times into the same cells.
    let cells: &'static [uprobe_core::LatencyCell] = Box::leak(
        (0..uprobe_core::latency_cells())
            .map(|_| uprobe_core::LatencyCell::new())
            .collect(),
    );
    for kind in ["entry", "return", "timing"] {
        // Which probes attach, one at a time (each detached at once, so
        // the engine's own use of libc meets few breakpoints meanwhile);
        // then all of those in one batch.
        let mut accepted = Vec::new();
        let mut refused: BTreeMap<String, usize> = BTreeMap::new();
        let mut blocked: BTreeMap<BlockedPath, Vec<&'static str>> = BTreeMap::new();
        let mut seen = std::collections::HashSet::new();
        let make = |name: &str| {
            let probe = Uprobe::in_object("libc.so.6", name).unwrap();
            match kind {
                "entry" => probe.on_entry(|_| {}),
                "return" => probe.on_return(|_| {}),
                _ => probe.time_into(cells),
            }
        };
        for name in &names {
            let Ok(probe) = Uprobe::in_object("libc.so.6", name) else {
                *refused.entry("not found".into()).or_default() += 1;
                continue;
            };
            if !seen.insert(probe.addr()) {
                continue;
            }
            match make(name).attach() {
                Ok(p) => {
                    p.detach().unwrap();
                    accepted.push(name);
                }
                Err(AttachError::SignalsBlocked { function, path, .. }) => {
                    blocked.entry(path).or_default().push(function);
                }
                Err(e) => {
                    if matches!(e, AttachError::Os { .. }) {
                        println!("  {name}: {e}");
                    }
                    let kind = format!("{e:?}");
                    let kind = kind.split([' ', '{', '(']).next().unwrap_or("?");
                    *refused.entry(kind.to_string()).or_default() += 1;
                }
            }
        }
        let probes = Uprobe::attach_all(accepted.iter().map(|name| make(name))).unwrap();
        let under_probes = workload();
        let hits: u64 = match kind {
            "entry" => probes.iter().map(Probe::hits).sum(),
            "return" => probes.iter().map(Probe::returns).sum(),
            _ => uprobe_core::LatencyCell::histogram(cells).iter().sum(),
        };
        println!(
            "libc ({} exported functions{}), {} probes: {} attached, {hits} hits; \
             refused for blocked signals: {blocked:?}; other refusals: {refused:?}",
            names.len(),
            if step > 1 {
                ", every 8th under emulation"
            } else {
                ""
            },
            kind,
            probes.len(),
        );
        let modes = common::modes(&probes);
        println!("  modes: {modes:?}");
        check_signal_blocked_code(&probes, &blocked);
        assert!(hits > 0, "the workload reached no probe");
        assert_eq!(under_probes, plain, "results changed under the probes");
        Probe::detach_all(probes).unwrap();
    }
}

/// Signal-blocked code: on x86-64 it takes one-byte jumps (a few
/// functions of each path attach that way); elsewhere (no punned jumps)
/// every signal-blocked path has a function refused.
fn check_signal_blocked_code(probes: &[Probe], blocked: &BTreeMap<BlockedPath, Vec<&'static str>>) {
    let one_byte = probes
        .iter()
        .filter(|p| common::one_byte_jump(&p.mode()))
        .count();
    println!("  {one_byte} probes run through a one-byte jump");
    if cfg!(target_arch = "x86_64") {
        // Signal-blocked code takes one-byte jumps: a few functions of
        // each path attached that way.
        assert!(one_byte > 0, "no one-byte jump");
    } else {
        // No punned jumps: every signal-blocked function is refused.
        for path in [
            BlockedPath::ThreadStart,
            BlockedPath::ThreadExit,
            BlockedPath::SpawnParent,
            BlockedPath::SpawnChild,
        ] {
            assert!(blocked.contains_key(&path), "nothing refused for {path}");
        }
    }
}

/// The functions people probe first that glibc also runs with every
/// signal blocked (`free` on thread exit, `memcpy`, `strlen` and `getenv`
/// in the `posix_spawn` child) attach by default: through a one-byte jump
/// where the address its displacement chooses is free (never a
/// breakpoint), or refused with the reason; nothing dies while threads
/// come and go and processes spawn.
#[cfg(target_arch = "x86_64")]
#[test]
fn free_memcpy_strlen_memset_and_getenv_attach_by_default() {
    // Its own process: its probes see every call of the process.
    test_support::in_own_process(
        "free_memcpy_strlen_memset_and_getenv_attach_by_default",
        || {
            let plain = workload();
            let mut probes = Vec::new();
            for name in ["free", "memcpy", "strlen", "memset", "getenv"] {
                match Uprobe::in_object("libc.so.6", name).unwrap().attach() {
                    Ok(p) => {
                        assert!(p.mode().is_jump(), "{name}: {:?}", p.mode());
                        probes.push((name, p));
                    }
                    Err(e @ AttachError::SignalsBlocked { .. }) => println!("{name}: {e}"),
                    Err(e) => panic!("{name}: {e}"),
                }
            }
            let under_probes = workload();
            for (name, p) in &probes {
                println!("{name}: {:?}, {} hits", p.mode(), p.hits());
            }
            assert_eq!(under_probes, plain, "results changed under the probes");
            assert!(!probes.is_empty(), "none of them attached");
        },
    );
}

/// A one-byte jump written and taken out 500 times over `free`
/// (which glibc runs with every signal blocked) while two threads
/// allocate and free: nothing dies, every round sees its own calls.
#[cfg(target_arch = "x86_64")]
#[test]
fn one_byte_jumps_on_free_under_callers() {
    // Its own process: its probes see every call of the process.
    test_support::in_own_process("one_byte_jumps_on_free_under_callers", || {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        type Free = unsafe extern "C" fn(*mut c_void);
        let probe = || Uprobe::in_object("libc.so.6", "free").unwrap();
        let Ok(first) = probe().attach() else {
            println!("skipped: free takes no one-byte jump here");
            return;
        };
        drop(first);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    while !stop.load(Relaxed) {
                        let v: Vec<u64> = std::hint::black_box(vec![7; 64]);
                        drop(v);
                    }
                });
            }
            let free: Free = std::hint::black_box(libc::free);
            for _ in 0..500 {
                let p = probe().attach().unwrap();
                assert!(
                    matches!(p.mode(), Mode::Jump(Tactic::Pun { written: 1, .. })),
                    "{:?}",
                    p.mode()
                );
                // SAFETY: free(NULL) does nothing.
                unsafe { free(core::ptr::null_mut()) };
                assert!(p.hits() >= 1);
                p.detach().unwrap();
            }
            stop.store(true, Relaxed);
        });
    });
}
