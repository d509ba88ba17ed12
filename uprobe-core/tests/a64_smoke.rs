//! aarch64 smoke test (temporary).
#![cfg(target_arch = "aarch64")]

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

core::arch::global_asm!(
    ".text",
    ".globl s_add1",
    "s_add1:",
    "add x0, x0, #1",
    "ret",
    ".globl s_bl",
    "s_bl:",
    "stp x29, x30, [sp, #-16]!",
    "bl s_add1",
    "ldp x29, x30, [sp], #16",
    "ret",
);

unsafe extern "C" {
    fn s_add1(x: u64) -> u64;
    fn s_bl(x: u64) -> u64;
}

#[test]
fn smoke() {
    static SEEN: AtomicU64 = AtomicU64::new(0);
    static RET: AtomicU64 = AtomicU64::new(0);
    let p = unsafe { uprobe_core::Uprobe::address(s_add1 as *const () as usize) }
        .on_entry(|cx| SEEN.store(cx.arg(0).unwrap(), SeqCst))
        .on_return(|cx| RET.store(cx.return_value(), SeqCst))
        .attach()
        .unwrap();
    assert_eq!(unsafe { s_add1(41) }, 42);
    assert_eq!(SEEN.load(SeqCst), 41);
    assert_eq!(RET.load(SeqCst), 42);
    let q = unsafe { uprobe_core::Uprobe::address(s_bl as *const () as usize) }
        .on_return(|_| {})
        .attach()
        .unwrap();
    assert_eq!(unsafe { s_bl(1) }, 2);
    assert_eq!((p.hits(), p.returns(), q.returns()), (2, 2, 1));
}
