//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test binary uses some of them

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
