//! Attaching by symbol, by file offset and by checked address: functions
//! of the executable and of libc, an IFUNC resolved to what the program
//! calls, and the refusals (unknown names, mid-instruction addresses,
//! addresses no symbol covers).
#![cfg(target_arch = "x86_64")]

mod common;

use std::ffi::c_void;

use common::{call, fn_addr};
use uprobe_core::{AttachError, Uprobe};

core::arch::global_asm!(
    ".text",
    ".globl s_func",
    ".type s_func, @function",
    "s_func:",
    "nop",
    "lea rax, [rdi + 1]",
    "ret",
    ".size s_func, . - s_func",
    // A function symbol without a size (hand-written asm often has none).
    ".globl s_nosize",
    ".type s_nosize, @function",
    "s_nosize:",
    "nop",
    "lea rax, [rdi + 2]",
    "ret",
);

unsafe extern "C" {
    fn s_func(x: u64) -> u64;
    fn s_nosize(x: u64) -> u64;
}

fn tid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

#[test]
fn a_function_of_the_executable_by_name() {
    let probe = Uprobe::function("s_func").unwrap();
    assert_eq!(probe.addr(), fn_addr(s_func));
    let probe = probe.attach().unwrap();
    assert_eq!(call(s_func, 1), 2);
    assert_eq!(probe.hits(), 1);
}

#[test]
fn offsets_must_start_an_instruction() {
    // Its own process: another test probes and calls s_func (hits are exact
    // here and there).
    test_support::in_own_process("offsets_must_start_an_instruction", || {
        // nop (1 byte), lea rax,[rdi+1] (4 bytes), ret.
        let inside_lea = Uprobe::function("s_func").unwrap().offset(2).attach();
        assert_eq!(
            inside_lea.unwrap_err(),
            AttachError::NotInstructionBoundary {
                addr: fn_addr(s_func) + 2,
                function: "s_func".into()
            }
        );
        let on_ret = Uprobe::function("s_func")
            .unwrap()
            .offset(5)
            .attach()
            .unwrap();
        assert_eq!(call(s_func, 1), 2);
        assert_eq!(on_ret.hits(), 1);
    });
}

#[test]
fn offsets_outside_the_function_are_refused() {
    let past_end = Uprobe::function("s_func").unwrap().offset(6).attach();
    assert_eq!(
        past_end.unwrap_err(),
        AttachError::OffsetOutsideFunction {
            function: "s_func".into(),
            offset: 6,
            size: 6
        }
    );
    let huge = Uprobe::function("s_func")
        .unwrap()
        .offset(usize::MAX)
        .attach();
    assert!(matches!(
        huge.unwrap_err(),
        AttachError::OffsetOutsideFunction {
            offset: usize::MAX,
            ..
        }
    ));
    // SAFETY: refused before anything is written.
    let wraps = unsafe { Uprobe::address(usize::MAX - 1) }
        .offset(10)
        .attach();
    assert!(matches!(
        wraps.unwrap_err(),
        AttachError::OffsetOutsideFunction { offset: 10, .. }
    ));
    // No size: an offset could be anywhere, even in the next function.
    let probe = Uprobe::function("s_nosize").unwrap();
    assert_eq!(probe.addr(), fn_addr(s_nosize));
    assert_eq!(
        probe.offset(1).attach().unwrap_err(),
        AttachError::UnknownFunctionExtent {
            function: "s_nosize".into(),
            offset: 1
        }
    );
    // Its entry is still fine.
    let entry = Uprobe::function("s_nosize")
        .unwrap()
        .offset(0)
        .attach()
        .unwrap();
    assert_eq!(call(s_nosize, 1), 3);
    assert_eq!(entry.hits(), 1);
}

#[test]
fn checked_addresses_and_file_offsets() {
    assert_eq!(
        Uprobe::at(fn_addr(s_func) + 1).unwrap().addr(),
        fn_addr(s_func) + 1
    );
    let heap = Box::new(0u64);
    let heap = (&raw const *heap) as usize;
    assert_eq!(
        Uprobe::at(heap).unwrap_err(),
        AttachError::NoSymbol { addr: heap }
    );
    // The executable's file offset of `s_func`, from /proc/self/maps.
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let addr = fn_addr(s_func);
    let offset = maps
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (s, e) = f[0].split_once('-')?;
            let (s, e) = (
                usize::from_str_radix(s, 16).ok()?,
                usize::from_str_radix(e, 16).ok()?,
            );
            ((s..e).contains(&addr))
                .then(|| u64::from_str_radix(f[2], 16).unwrap() + (addr - s) as u64)
        })
        .unwrap();
    assert_eq!(Uprobe::file_offset(&exe, offset).unwrap().addr(), addr);
    assert!(matches!(
        Uprobe::file_offset(&exe, u64::MAX / 2),
        Err(AttachError::FileOffsetNotMapped { .. })
    ));
}

#[test]
fn libc_functions_and_ifuncs() {
    let malloc = Uprobe::in_object("libc.so.6", "malloc").unwrap();
    assert_eq!(malloc.addr(), libc::malloc as *const () as usize);
    // memcpy is an IFUNC: the probe goes where calls go, which is what
    // the dynamic linker resolved (dlsym gives the same).
    let memcpy = Uprobe::in_object("libc.so.6", "memcpy").unwrap();
    // SAFETY: dlsym with a NUL-terminated name.
    let resolved = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"memcpy".as_ptr()) } as usize;
    assert_eq!(memcpy.addr(), resolved);
    // memcpy is on the posix_spawn child's path (ENOEXEC): refused unless
    // asked for; this test spawns no process.
    let probe = match memcpy
        .allow_blocked_signal_paths()
        .only_thread(tid())
        .attach()
    {
        Ok(p) => p,
        Err(AttachError::Unsupported { insn, why, .. }) => {
            println!("this libc's memcpy starts with `{insn}` ({why}); not probed");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let (src, mut dst) = ([7u8; 64], [0u8; 64]);
    // Through a pointer the compiler cannot see through, so the call
    // really reaches libc's memcpy.
    let f: unsafe extern "C" fn(*mut c_void, *const c_void, usize) -> *mut c_void =
        std::hint::black_box(libc::memcpy);
    // SAFETY: two distinct 64-byte buffers.
    unsafe { f(dst.as_mut_ptr().cast(), src.as_ptr().cast(), 64) };
    assert_eq!(dst, src);
    assert!(probe.hits() >= 1);
}

#[test]
fn unknown_names_and_objects() {
    assert_eq!(
        Uprobe::in_object("libnothere.so", "f").unwrap_err(),
        AttachError::NoSuchObject {
            object: "libnothere.so".into()
        }
    );
    assert!(matches!(
        Uprobe::function("no_such_function_anywhere"),
        Err(AttachError::SymbolNotFound { .. })
    ));
}

#[test]
fn functions_listed_by_pattern() {
    use uprobe_core::functions;

    let mine = functions::matching(None, |n| n == "s_func" || n == "s_nosize").unwrap();
    let mut names: Vec<&str> = mine.iter().map(|f| f.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["s_func", "s_nosize"]);
    let f = mine.iter().find(|f| f.name == "s_func").unwrap();
    assert_eq!(f.addr, fn_addr(s_func));
    assert_eq!(f.size, 6); // nop; lea rax, [rdi + 1]; ret

    // An IFUNC is listed as the implementation the program calls, and
    // the same code under two names once, by its plain name.
    let libc = functions::matching(Some("libc.so.6"), |n| {
        n == "strlen" || n == "malloc" || n == "__libc_malloc"
    })
    .unwrap();
    let strlen = libc.iter().find(|f| f.name == "strlen").unwrap();
    assert_eq!(
        strlen.addr,
        Uprobe::in_object("libc.so.6", "strlen").unwrap().addr()
    );
    assert!(libc.iter().any(|f| f.name == "malloc"));
    assert!(!libc.iter().any(|f| f.name == "__libc_malloc"));

    // A probe made from the listing counts calls (in a process of its
    // own: another test probes and calls s_func, and hits are exact).
    test_support::in_own_process("functions_listed_by_pattern", || {
        let probe = f.uprobe().attach().unwrap();
        assert_eq!(call(s_func, 1), 2);
        assert_eq!(probe.hits(), 1);
    });

    assert!(matches!(
        functions::matching(Some("libnothere.so.9"), |_| true),
        Err(AttachError::NoSuchObject { .. })
    ));
}
