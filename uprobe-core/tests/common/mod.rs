//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test binary uses some of them

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use uprobe_core::Uprobe;

/// The address of one of the tests' asm functions.
pub fn fn_addr(f: unsafe extern "C" fn(u64) -> u64) -> usize {
    f as *const () as usize
}

/// Calls one of the tests' asm functions.
pub fn call(f: unsafe extern "C" fn(u64) -> u64, x: u64) -> u64 {
    // SAFETY: the tests' asm functions follow the C ABI, take one integer
    // and touch nothing but registers and their own stack.
    unsafe { f(x) }
}

/// A probe at `addr`, an instruction boundary of the tests' asm (or a libc
/// function's entry).
pub fn probe_at(addr: usize) -> Uprobe {
    // SAFETY: every address the tests pass starts an instruction (or is
    // refused before anything is written: data, an existing int3).
    unsafe { Uprobe::address(addr) }
}

/// The code byte at `addr` (inside the tests' asm).
pub fn byte_at(addr: usize) -> u8 {
    // SAFETY: `addr` is inside a function of the tests' asm.
    unsafe { (addr as *const u8).read_volatile() }
}

/// `rounds` times, attaches a counting probe at `f`'s entry, checks that a
/// call made while it is attached is seen, detaches it and checks that its
/// handler does not run afterwards, all while `callers` threads call `f`
/// in a loop and check each result with `expect`.
pub fn churn_under_callers(
    f: unsafe extern "C" fn(u64) -> u64,
    expect: fn(u64) -> u64,
    callers: u64,
    rounds: usize,
) {
    churn_with(f, expect, callers, rounds, |_| probe_at(fn_addr(f)));
}

/// [`churn_under_callers`] with the probe of each round made by `make`
/// (given the round's number); returns how many rounds ran through a jump.
pub fn churn_with(
    f: unsafe extern "C" fn(u64) -> u64,
    expect: fn(u64) -> u64,
    callers: u64,
    rounds: usize,
    make: impl Fn(usize) -> Uprobe,
) -> usize {
    let runs = Arc::new(AtomicU64::new(0));
    let stop = AtomicBool::new(false);
    let mut jumps = 0;
    std::thread::scope(|s| {
        for t in 0..callers {
            let stop = &stop;
            s.spawn(move || {
                let mut x = t;
                while !stop.load(SeqCst) {
                    assert_eq!(call(f, x), expect(x));
                    x = (x + callers) % 1_000_000;
                }
            });
        }
        // Stops the callers however this thread leaves the scope: a failed
        // assertion below must fail the test, not leave it spinning.
        let _stop = StopOnDrop(&stop);
        for round in 0..rounds {
            let counter = Arc::clone(&runs);
            let probe = make(round)
                .on_entry(move |_| {
                    counter.fetch_add(1, SeqCst);
                })
                .attach()
                .unwrap();
            jumps += usize::from(probe.mode().is_jump());
            let before = probe.hits();
            assert_eq!(call(f, 1), expect(1));
            assert!(probe.hits() > before, "a hit while attached was lost");
            probe.detach().unwrap();
            let after_detach = runs.load(SeqCst);
            std::thread::yield_now();
            assert_eq!(
                runs.load(SeqCst),
                after_detach,
                "a handler ran after detach returned"
            );
        }
    });
    jumps
}

/// when an assertion fails, so the test fails instead of hanging.
pub struct StopOnDrop<'a>(pub &'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, SeqCst);
    }
}

/// How many hits a call of the function under test makes on its probe.
#[derive(Clone, Copy, Debug)]
pub enum HitsPerCall {
    /// One (the probe is on an instruction every call runs once).
    One,
    /// At least one (a probe inside a loop).
    AtLeastOne,
}

/// Runs `f(x)` for a few inputs without a probe, with a trap-only probe
/// at `at` (these tests are about the trap path), and after detaching it:
/// the same results every time, the breakpoint written while attached and
/// the original byte back afterwards.
pub fn same_with_probe(f: unsafe extern "C" fn(u64) -> u64, at: usize, hits: HitsPerCall) {
    let inputs = [0u64, 1, 7, 9, 10, 11, 1 << 40];
    let plain: Vec<u64> = inputs.iter().map(|&x| call(f, x)).collect();
    let original = byte_at(at);
    let probe = probe_at(at)
        .trap_only()
        .attach()
        .unwrap_or_else(|e| panic!("attach at {at:#x}: {e}"));
    assert_eq!(byte_at(at), 0xcc, "int3 written");
    let probed: Vec<u64> = inputs.iter().map(|&x| call(f, x)).collect();
    assert_eq!(probed, plain, "results changed under the probe at {at:#x}");
    let calls = inputs.len() as u64;
    match hits {
        HitsPerCall::One => assert_eq!(probe.hits(), calls),
        HitsPerCall::AtLeastOne => assert!(probe.hits() >= calls),
    }
    probe.detach().expect("detach");
    assert_eq!(byte_at(at), original, "byte restored");
    let after: Vec<u64> = inputs.iter().map(|&x| call(f, x)).collect();
    assert_eq!(after, plain);
}

/// Every defined, exported function of the ELF file at `path`, sorted.
pub fn exported_functions(path: &str) -> Vec<String> {
    use object::{Object as _, ObjectSymbol as _};
    let data = std::fs::read(path).unwrap();
    let file = object::File::parse(&*data).unwrap();
    let mut names: Vec<String> = file
        .dynamic_symbols()
        .filter(|s| s.kind() == object::SymbolKind::Text && !s.is_undefined() && s.is_global())
        .filter_map(|s| s.name().ok().map(str::to_string))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Whether an emulator (qemu-user) runs this test: it answers
/// `/proc/self/exe` for the program, but not the per-task entries.
pub fn emulated() -> bool {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    std::fs::read_link("/proc/self/exe").ok()
        != std::fs::read_link(format!("/proc/self/task/{tid}/exe")).ok()
}

/// A function made of `code` on a fresh page mapped executable and
/// BTI-guarded (`PROT_BTI`); never unmapped (the engine may keep a slot or
/// a trampoline for it).
#[cfg(target_arch = "aarch64")]
pub fn bti_guarded_function(code: &[u32]) -> unsafe extern "C" fn(u64) -> u64 {
    const PROT_BTI: i32 = 0x10;
    assert!(code.len() * 4 <= 4096);
    // SAFETY: a fresh anonymous page, written, its caches synced, then
    // made executable and guarded.
    unsafe {
        let p = libc::mmap(
            core::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        core::ptr::copy_nonoverlapping(code.as_ptr(), p.cast(), code.len());
        core::arch::asm!("dc cvau, {0}", "dsb ish", "ic ivau, {0}", "dsb ish", "isb", in(reg) p);
        assert_eq!(
            libc::mprotect(p, 4096, libc::PROT_READ | libc::PROT_EXEC | PROT_BTI),
            0
        );
        core::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(u64) -> u64>(p)
    }
}

/// Whether a probe runs through a jump that changed one byte (a `jmp`
/// opcode over the probed instruction's first byte, nothing more).
pub fn one_byte_jump(mode: &uprobe_core::Mode) -> bool {
    matches!(
        mode,
        uprobe_core::Mode::Jump(uprobe_core::Tactic::Pun {
            written: 1,
            prefixes: 0
        })
    )
}

/// How a probe runs, as a key to count by: `jump: <tactic>`, or `trap:`
/// and the kind of reason.
pub fn mode_key(mode: &uprobe_core::Mode) -> String {
    match mode {
        uprobe_core::Mode::Jump(t) => format!("jump: {t}"),
        uprobe_core::Mode::Trap(why) => format!("trap: {why:?}")
            .split([' ', '{', '('])
            .take(2)
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// The probes counted by how they run ([`mode_key`]).
pub fn modes(probes: &[uprobe_core::Probe]) -> std::collections::BTreeMap<String, usize> {
    let mut modes = std::collections::BTreeMap::new();
    for p in probes {
        *modes.entry(mode_key(&p.mode())).or_insert(0) += 1;
    }
    modes
}

type Compress =
    unsafe extern "C" fn(*mut u8, *mut libc::c_ulong, *const u8, libc::c_ulong, i32) -> i32;
type Uncompress =
    unsafe extern "C" fn(*mut u8, *mut libc::c_ulong, *const u8, libc::c_ulong) -> i32;

/// Compresses (at `level`) and decompresses a generated buffer of `size`
/// bytes with libz (`handle`); the compressed bytes.
pub fn libz_round_trip(handle: *mut std::ffi::c_void, size: u32, level: i32) -> Vec<u8> {
    let get = |name: &str| {
        let c = std::ffi::CString::new(name).unwrap();
        // SAFETY: a symbol lookup on a live handle.
        unsafe { libc::dlsym(handle, c.as_ptr()) }
    };
    // SAFETY: zlib's compress2 and uncompress signatures.
    let (compress, uncompress) = unsafe {
        (
            std::mem::transmute::<*mut std::ffi::c_void, Compress>(get("compress2")),
            std::mem::transmute::<*mut std::ffi::c_void, Uncompress>(get("uncompress")),
        )
    };
    let input: Vec<u8> = (0..size)
        .map(|i| ((i * 7 % 251) ^ (i / 1000)) as u8)
        .collect();
    let mut packed = vec![0u8; input.len() + 1024];
    let mut packed_len = packed.len() as libc::c_ulong;
    // SAFETY: buffers of the sizes given.
    let rc = unsafe {
        compress(
            packed.as_mut_ptr(),
            &raw mut packed_len,
            input.as_ptr(),
            input.len() as _,
            level,
        )
    };
    assert_eq!(rc, 0, "compress2");
    packed.truncate(packed_len as usize);
    let mut back = vec![0u8; input.len()];
    let mut back_len = back.len() as libc::c_ulong;
    // SAFETY: as above.
    let rc = unsafe {
        uncompress(
            back.as_mut_ptr(),
            &raw mut back_len,
            packed.as_ptr(),
            packed_len,
        )
    };
    assert_eq!(rc, 0, "uncompress");
    assert_eq!(back, input, "the round trip");
    packed
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { core::mem::zeroed() };
    // SAFETY: our own set, of its own size.
    let rc = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &raw mut set) };
    assert_eq!(rc, 0);
    // SAFETY: reading a filled set.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Pins the calling thread to `cpu` (an emulator may refuse: then the
/// thread just stays where it is).
pub fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid.
    let mut set: libc::cpu_set_t = unsafe { core::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (from `allowed_cpus`).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: the calling thread, a set of its own size.
    unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const set) };
}

/// Calls `f` `calls` times from each of `threads` threads, each moved to
/// another CPU every thousand calls (a per-CPU count moves between CPU
/// slots mid-run), checking each result (`x + 1`); returns the calls made.
pub fn calls_from_migrating_threads(
    f: unsafe extern "C" fn(u64) -> u64,
    threads: u64,
    calls: u64,
) -> u64 {
    let cpus = allowed_cpus();
    std::thread::scope(|s| {
        for t in 0..threads {
            let cpus = &cpus;
            s.spawn(move || {
                for i in 0..calls {
                    if i % 1_000 == 0 {
                        pin_to(cpus[(t as usize + (i / 1_000) as usize) % cpus.len()]);
                    }
                    assert_eq!(call(f, i), i + 1);
                }
            });
        }
    });
    threads * calls
}

/// Installs `handler` for `sig` with `flags` (an empty mask); it must be
/// async-signal-safe.
pub fn install(sig: libc::c_int, handler: extern "C" fn(libc::c_int), flags: libc::c_int) {
    // SAFETY: a plain handler that only touches atomics and probed code.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as libc::sighandler_t;
        sa.sa_flags = flags;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(libc::sigaction(sig, &raw const sa, std::ptr::null_mut()), 0);
    }
}

/// Whether a call of [`waits`] is inside it, and whether it may return.
static WAIT_INSIDE: AtomicBool = AtomicBool::new(false);
static WAIT_RELEASE: AtomicBool = AtomicBool::new(false);

/// Stays inside until [`release_waiting`] (returns `x + 1`): a call a
/// test keeps pending while it detaches a probe of the function.
#[inline(never)]
pub extern "C" fn waits(x: u64) -> u64 {
    WAIT_INSIDE.store(true, SeqCst);
    while !WAIT_RELEASE.load(SeqCst) {
        std::thread::yield_now();
    }
    std::hint::black_box(x + 1)
}

/// Starts a thread calling [`waits`]`(x)` and returns once it is inside.
/// One at a time per test binary (the callers' tests are serialised).
pub fn call_waiting(x: u64) -> std::thread::JoinHandle<u64> {
    WAIT_INSIDE.store(false, SeqCst);
    WAIT_RELEASE.store(false, SeqCst);
    let caller = std::thread::spawn(move || waits(x));
    while !WAIT_INSIDE.load(SeqCst) {
        std::thread::yield_now();
    }
    caller
}

/// Lets the call [`call_waiting`] started (and every later call of
/// [`waits`]) return.
pub fn release_waiting() {
    WAIT_RELEASE.store(true, SeqCst);
}
