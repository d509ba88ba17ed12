//! What handlers see: [`EntryContext`] (the registers at a probe hit) and
//! [`ReturnContext`] (the return value registers at a probed function's
//! return), over the architecture's registers (`crate::arch`: `Reg`, the
//! frame and the return trampoline's saved registers).

use crate::arch::usdt::{UsdtArg, UsdtLocation};
use crate::arch::{Reg, SavedRegs, SavedVector};

/// What an entry handler sees: the registers of the thread that hit the
/// probe, as they were just before the probed instruction (writes take
/// effect when the handler returns), borrowed from the signal frame (a
/// trap) or from the registers the probe's trampoline saved (a jump: see
/// [`Mode`](crate::Mode)).
///
/// The handler runs **inside the SIGTRAP handler** or **called from the
/// trampoline**, on the interrupted thread's stack, in the middle of
/// whatever the thread was doing: it must be async-signal-safe (no
/// allocation, no locks the interrupted code may hold, no printing
/// through `std`'s locked stdout). A probe hit from inside a handler runs
/// no handler (it counts as missed). Every method is async-signal-safe.
pub struct EntryContext<'a> {
    /// The registers: the signal frame's (a trap) or the trampoline's
    /// saved ones (an optimized probe), in the same layout.
    pub(crate) frame: &'a mut crate::arch::Frame,
    pub(crate) addr: usize,
    pub(crate) ip_changed: bool,
    pub(crate) remove: bool,
    pub(crate) cookie: u64,
    pub(crate) skip_return: bool,
    /// The USDT probe's arguments, for a probe made on one.
    pub(crate) usdt: Option<&'a [UsdtArg]>,
}

impl<'a> EntryContext<'a> {
    pub(crate) fn new(frame: &'a mut crate::arch::Frame, addr: usize) -> Self {
        Self {
            frame,
            addr,
            ip_changed: false,
            remove: false,
            cookie: 0,
            skip_return: false,
            usdt: None,
        }
    }

    /// A register's value (for the instruction pointer, `Reg::Rip` or
    /// `Reg::Pc`: the probed address, where the instruction starts,
    /// unless a handler set it).
    #[must_use]
    pub fn reg(&self, reg: Reg) -> u64 {
        if reg == crate::arch::PC && !self.ip_changed {
            return self.addr as u64;
        }
        crate::arch::reg(self.frame, reg)
    }

    /// Sets a register. Setting the instruction pointer redirects the
    /// thread: the probed instruction is then **not** executed (as with
    /// kernel uprobes). On x86-64, for a probe that runs through a jump
    /// ([`Mode::Jump`](crate::Mode)), a new `Rsp` is honoured if it is
    /// above the probed one or at most 40 bytes below it (the
    /// trampoline's saved registers lie further down); for a lower one,
    /// keep the probe [`trap_only`](crate::Uprobe::trap_only).
    pub fn set_reg(&mut self, reg: Reg, value: u64) {
        if reg == crate::arch::PC {
            self.ip_changed = true;
        }
        crate::arch::set_reg(self.frame, reg, value);
    }

    /// The `n`th integer argument (0-based) of the calling convention
    /// (System V on x86-64: six registers; AAPCS64 on aarch64: eight),
    /// for a probe at a function's entry; `None` past the register
    /// arguments.
    #[must_use]
    pub fn arg(&self, n: usize) -> Option<u64> {
        crate::arch::ARGS.get(n).map(|&r| self.reg(r))
    }

    /// Argument `n` (0-based) of the USDT probe this probe was made on
    /// ([`Uprobe::usdt`](crate::Uprobe::usdt)), sign- or zero-extended
    /// from its size as the probe's spec says; `None` past the last
    /// argument or on a probe not made on a USDT probe. A string argument
    /// is its address (read it as a C string, as `bpftrace`'s `str()`
    /// does). Async-signal-safe; reads the process's memory where the
    /// spec says the argument lives (the compiler's promise for the
    /// probed instruction).
    #[must_use]
    pub fn usdt_arg(&self, n: usize) -> Option<i64> {
        let arg = self.usdt?.get(n)?;
        let raw = match arg.location {
            UsdtLocation::Constant(v) => v as u64,
            UsdtLocation::Register(r) => self.reg(r),
            UsdtLocation::Memory {
                base,
                offset,
                index,
            } => {
                let at = self
                    .reg(base)
                    .wrapping_add(offset as u64)
                    .wrapping_add(index.map_or(0, |(r, s)| self.reg(r).wrapping_mul(u64::from(s))));
                // SAFETY: the compiler's spec: at the probed instruction
                // the argument lives at this address.
                unsafe {
                    match arg.size {
                        1 => u64::from((at as *const u8).read_unaligned()),
                        2 => u64::from((at as *const u16).read_unaligned()),
                        4 => u64::from((at as *const u32).read_unaligned()),
                        _ => (at as *const u64).read_unaligned(),
                    }
                }
            }
        };
        Some(arg.extend(raw))
    }

    /// How many arguments the USDT probe this probe was made on has (0 for
    /// a probe not made on one).
    #[must_use]
    pub fn usdt_arg_count(&self) -> usize {
        self.usdt.map_or(0, <[_]>::len)
    }

    /// The probed address.
    #[must_use]
    pub fn probe_addr(&self) -> usize {
        self.addr
    }

    /// The thread that hit the probe (its kernel thread id).
    #[must_use]
    pub fn tid(&self) -> i32 {
        crate::base::thread::current_tid()
    }

    /// Stores `cookie` for this call's return handler (a session: a probe
    /// with both handlers), which reads it with
    /// [`ReturnContext::cookie`]; 0 if never set.
    pub fn set_cookie(&mut self, cookie: u64) {
        self.cookie = cookie;
    }

    /// Does not track this call's return: the return handler will not run
    /// for it (the kernel's session entry handler returning 1).
    pub fn skip_return(&mut self) {
        self.skip_return = true;
    }

    /// Stops this handler from running on later hits (its probe stays
    /// attached until detached or dropped).
    pub fn remove_me(&mut self) {
        self.remove = true;
    }
}

impl core::fmt::Debug for EntryContext<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("EntryContext")
            .field("probe_addr", &format_args!("{:#x}", self.addr))
            .field(
                "pc",
                &format_args!("{:#x}", crate::arch::frame_pc(self.frame)),
            )
            .finish_non_exhaustive()
    }
}

/// What a return handler sees: the function's return value registers as it
/// returned them (writes take effect when the handler returns: the caller
/// sees them), and where the call came from.
///
/// Runs in the return trampoline, on the thread's stack, in the middle of
/// whatever the thread was doing: the same rules as for entry handlers
/// apply (async-signal-safe code only; a probed function called from here
/// runs no handler). Every method is async-signal-safe.
pub struct ReturnContext<'a> {
    pub(crate) regs: &'a mut SavedRegs,
    pub(crate) vector: &'a mut SavedVector,
    func: usize,
    ret: usize,
    cookie: u64,
}

impl<'a> ReturnContext<'a> {
    pub(crate) fn new(
        regs: &'a mut SavedRegs,
        vector: &'a mut SavedVector,
        func: usize,
        ret: usize,
        cookie: u64,
    ) -> Self {
        Self {
            regs,
            vector,
            func,
            ret,
            cookie,
        }
    }

    /// The integer return value (`rax`, `x0`).
    #[must_use]
    pub fn return_value(&self) -> u64 {
        self.regs.return_value()
    }

    /// The second integer return register (`rdx`, `x1`: the high half of
    /// a 128-bit value, the second word of a small struct).
    #[must_use]
    pub fn return_value2(&self) -> u64 {
        self.regs.return_value2()
    }

    /// Replaces the integer return value the caller sees.
    pub fn set_return_value(&mut self, value: u64) {
        self.regs.set_return_value(value);
    }

    /// All 128 bits of the first vector register (`xmm0`, `v0`).
    #[must_use]
    pub fn float_return_bits(&self) -> u128 {
        crate::arch::float_return_bits(self.vector)
    }

    /// Replaces the floating-point return value (the first vector
    /// register's low 64 bits; on aarch64 the rest of `v0` is zeroed, as
    /// a scalar write does).
    pub fn set_float_return(&mut self, value: f64) {
        crate::arch::set_float_return(self.vector, value);
    }

    /// The floating-point return value (the first vector register's low
    /// 64 bits as an `f64`; for an `f32` return use
    /// [`float_return_bits`](Self::float_return_bits)).
    #[must_use]
    pub fn float_return(&self) -> f64 {
        f64::from_bits(self.float_return_bits() as u64)
    }

    /// The probed function's entry address.
    #[must_use]
    pub fn func_addr(&self) -> usize {
        self.func
    }

    /// The address the function returns to (in its caller).
    #[must_use]
    pub fn return_addr(&self) -> usize {
        self.ret
    }

    /// The caller's stack pointer once the function has returned.
    #[must_use]
    pub fn sp(&self) -> usize {
        self.regs.caller_sp()
    }

    /// What this call's entry handler stored with
    /// [`EntryContext::set_cookie`] (0 if nothing).
    #[must_use]
    pub fn cookie(&self) -> u64 {
        self.cookie
    }

    /// The thread that returned (its kernel thread id).
    #[must_use]
    pub fn tid(&self) -> i32 {
        crate::base::thread::current_tid()
    }
}

impl core::fmt::Debug for ReturnContext<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ReturnContext")
            .field("func", &format_args!("{:#x}", self.func))
            .field("return_addr", &format_args!("{:#x}", self.ret))
            .field("return_value", &format_args!("{:#x}", self.return_value()))
            .finish_non_exhaustive()
    }
}
