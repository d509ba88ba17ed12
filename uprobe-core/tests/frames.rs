//! Functions no symbol covers, found through their object's unwind
//! information: glibc's IFUNC implementations (`memcpy`, `strlen`,
//! `memset` resolve to `__memmove_avx_unaligned_erms`, `__strlen_avx2`...,
//! which a stripped libc has no symbol for) attach by name with a known
//! extent, are checked addresses for [`Uprobe::at`], and count exact hits.
#![cfg(target_arch = "x86_64")]

use std::ffi::{c_char, c_int, c_void};

use uprobe_core::{AttachError, Uprobe};

fn tid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

type Copy = unsafe extern "C" fn(*mut c_void, *const c_void, usize) -> *mut c_void;
type Len = unsafe extern "C" fn(*const c_char) -> usize;
type Set = unsafe extern "C" fn(*mut c_void, c_int, usize) -> *mut c_void;

/// Calls of each function while probed.
const CALLS: u64 = 10;

#[test]
fn string_functions_attach_by_name_with_their_extent() {
    // Its own process: the probes are on functions every thread calls.
    test_support::in_own_process("string_functions_attach_by_name_with_their_extent", || {
        let names = ["memcpy", "strlen", "memset"];
        for name in names {
            let probe = Uprobe::in_object("libc.so.6", name).unwrap();
            // A checked address: something covers it (a symbol, or the
            // FDE where there is none).
            let at = Uprobe::at(probe.addr());
            assert!(at.is_ok(), "{name}: {at:?}");
            // The extent is known: an offset past it is refused as
            // outside, not as unknown.
            let far = probe.offset(1 << 24).attach().unwrap_err();
            assert!(
                matches!(far, AttachError::OffsetOutsideFunction { size, .. } if size > 0),
                "{name}: {far:?}"
            );
        }
        let (src, mut dst) = ([7u8; 64], [0u8; 64]);
        let text = c"hello, frames";
        let memcpy: Copy = std::hint::black_box(libc::memcpy);
        let strlen: Len = std::hint::black_box(libc::strlen);
        let memset: Set = std::hint::black_box(libc::memset);
        let copy_to_end: Copy = std::hint::black_box(libc::mempcpy);
        let probes = Uprobe::attach_all(names.iter().map(|name| {
            Uprobe::in_object("libc.so.6", name)
                .unwrap()
                .allow_blocked_signal_paths()
                .only_thread(tid())
        }))
        .unwrap();
        for (name, p) in names.iter().zip(&probes) {
            println!("{name} at {:#x}: {:?}", p.addr(), p.mode());
        }
        let before: Vec<u64> = probes.iter().map(uprobe_core::Probe::hits).collect();
        for _ in 0..CALLS {
            // SAFETY: two distinct 64-byte buffers; a C string.
            unsafe {
                memcpy(dst.as_mut_ptr().cast(), src.as_ptr().cast(), 64);
                assert_eq!(strlen(text.as_ptr()), 13);
                memset(dst.as_mut_ptr().cast(), 1, 32);
            }
        }
        let after: Vec<u64> = probes.iter().map(uprobe_core::Probe::hits).collect();
        for ((name, b), a) in names.iter().zip(&before).zip(&after) {
            assert_eq!(a - b, CALLS, "{name}");
        }
        assert_eq!(&dst[..32], &[1u8; 32]);
        assert_eq!(&dst[32..], &[7u8; 32]);
        // glibc's AVX2 `mempcpy` jumps into `memcpy`'s second
        // instruction: whatever the probe on `memcpy` wrote there, it
        // still copies (and adds no hit: it enters past the probe).
        let mut out = [0u8; 64];
        // SAFETY: two distinct 64-byte buffers.
        let end = unsafe { copy_to_end(out.as_mut_ptr().cast(), src.as_ptr().cast(), 64) };
        assert_eq!(end as usize, out.as_ptr() as usize + 64);
        assert_eq!(out, src);
        uprobe_core::Probe::detach_all(probes).unwrap();
    });
}
