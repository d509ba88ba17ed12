//! User stacks at a hit (`EntryContext::user_stack`): the calling frames
//! of Rust code built without frame pointers, found through `.eh_frame`,
//! on the jump path and the trap path, and through a return probe's stub.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

use std::sync::Mutex;

use uprobe_core::{Uprobe, functions};

// A chain of calls the compiler keeps (no inlining, no tail calls), each
// test with its own.
macro_rules! chain {
    ($outer:ident, $middle:ident, $leaf:ident) => {
        #[unsafe(no_mangle)]
        #[inline(never)]
        extern "C" fn $leaf(x: u64) -> u64 {
            core::hint::black_box(x) * 3 + 1
        }
        #[unsafe(no_mangle)]
        #[inline(never)]
        extern "C" fn $middle(x: u64) -> u64 {
            core::hint::black_box($leaf(core::hint::black_box(x))) + 7
        }
        #[unsafe(no_mangle)]
        #[inline(never)]
        extern "C" fn $outer(x: u64) -> u64 {
            core::hint::black_box($middle(core::hint::black_box(x))) ^ 5
        }
    };
}

chain!(st_outer_jump, st_middle_jump, st_leaf_jump);
chain!(st_outer_trap, st_middle_trap, st_leaf_trap);
chain!(st_outer_ret, st_middle_ret, st_leaf_ret);

/// `(start, end)` of function `name` in the test binary.
fn extent(name: &str) -> (usize, usize) {
    let f = functions::matching(None, |n| n == name).unwrap();
    let f = f.first().unwrap_or_else(|| panic!("{name} not found"));
    assert!(f.size > 0, "{name} has no size");
    (f.addr, f.addr + f.size)
}

/// The stack one hit of a probe on `leaf` sees, calling `outer`; the
/// probe built by `make`.
fn stack_at(
    leaf: &str,
    outer: extern "C" fn(u64) -> u64,
    make: impl FnOnce(Uprobe) -> Uprobe,
) -> Vec<usize> {
    uprobe_core::unwind::refresh();
    let seen: &'static Mutex<Vec<usize>> = Box::leak(Box::new(Mutex::new(Vec::new())));
    let probe = make(Uprobe::function(leaf).unwrap())
        .on_entry(move |cx| {
            let mut frames = [0usize; 16];
            let n = cx.user_stack(&mut frames);
            // Test code: the lock is uncontended and nothing it guards
            // is probed.
            if let Ok(mut s) = seen.try_lock() {
                s.clear();
                s.extend_from_slice(&frames[..n]);
            }
        })
        .attach()
        .unwrap();
    outer(1);
    drop(probe);
    seen.lock().unwrap().clone()
}

/// Whether this process can read its memory with `process_vm_readv`, as
/// the walk does (qemu-user does not implement it: there every walk ends
/// at the first frame whose caller is read from the stack).
fn can_read_memory() -> bool {
    let word = 42u64;
    let mut out = 0u64;
    let local = libc::iovec {
        iov_base: (&raw mut out).cast(),
        iov_len: 8,
    };
    let remote = libc::iovec {
        iov_base: (&raw const word).cast_mut().cast(),
        iov_len: 8,
    };
    // SAFETY: reads our own word into our own word.
    let n = unsafe {
        libc::process_vm_readv(libc::getpid(), &raw const local, 1, &raw const remote, 1, 0)
    };
    n == 8 && out == 42
}

/// Whether the frames, after the leaf's own address, name a return
/// address in `middle` and then one in `outer`.
fn check(frames: &[usize], leaf: &str, middle: &str, outer: &str) {
    let (leaf, middle, outer) = (extent(leaf), extent(middle), extent(outer));
    assert_eq!(frames.first(), Some(&leaf.0), "{frames:x?}");
    if !can_read_memory() {
        println!("skipped past the first frames: no process_vm_readv here (an emulator?)");
        return;
    }
    let inside = |f: &usize, (s, e): (usize, usize)| (s..e).contains(f);
    assert!(frames.len() >= 3, "{frames:x?}");
    assert!(inside(&frames[1], middle), "{frames:x?} middle {middle:x?}");
    assert!(inside(&frames[2], outer), "{frames:x?} outer {outer:x?}");
    // And on past the test's own frames (the test harness calls it).
    assert!(frames.len() > 4, "{frames:x?}");
}

#[test]
fn the_calling_frames_through_a_jump() {
    let frames = stack_at("st_leaf_jump", st_outer_jump, |u| u);
    check(&frames, "st_leaf_jump", "st_middle_jump", "st_outer_jump");
}

#[test]
fn the_calling_frames_from_a_breakpoint() {
    let frames = stack_at("st_leaf_trap", st_outer_trap, Uprobe::trap_only);
    check(&frames, "st_leaf_trap", "st_middle_trap", "st_outer_trap");
}

/// A return probe on `middle` hijacks its return address (a stub of the
/// return trampoline): the walk reads the original caller from the stub.
#[test]
fn the_calling_frames_through_a_return_stub() {
    let ret = Uprobe::function("st_middle_ret")
        .unwrap()
        .on_return(|_| {})
        .attach()
        .unwrap();
    let frames = stack_at("st_leaf_ret", st_outer_ret, |u| u);
    drop(ret);
    check(&frames, "st_leaf_ret", "st_middle_ret", "st_outer_ret");
}

/// The loaded objects, as stacks are symbolized later: the test binary's
/// own covers its functions, with the bias its symbols are off by.
#[test]
fn loaded_objects_cover_the_frames() {
    let objects = uprobe_core::unwind::loaded_objects();
    let (leaf, _) = extent("st_leaf_jump");
    let own = objects
        .iter()
        .find(|o| (o.start..o.end).contains(&leaf))
        .expect("an object covers the test's code");
    assert_eq!(
        std::fs::canonicalize(&own.path).ok(),
        std::env::current_exe()
            .ok()
            .and_then(|e| std::fs::canonicalize(e).ok())
    );
    assert!(own.bias <= leaf);
}
