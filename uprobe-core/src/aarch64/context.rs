//! `EntryContext` and `ReturnContext` on aarch64: the interrupted thread's
//! registers, as a handler sees them.

/// A general-purpose register (`X(0)` to `X(30)`; `X(31)` reads as zero
/// and ignores writes, as `xzr`), the stack pointer, the program counter
/// or PSTATE (NZCV flags, BTYPE, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reg {
    /// `x0` to `x30` (`X(29)` is the frame pointer, `X(30)` the link
    /// register).
    X(u8),
    /// `sp`.
    Sp,
    /// `pc`.
    Pc,
    /// PSTATE as saved in the signal frame.
    Pstate,
}

impl Reg {
    /// The frame pointer, `x29`.
    pub const FP: Self = Self::X(29);
    /// The link register, `x30`.
    pub const LR: Self = Self::X(30);
}

/// The AAPCS64 integer argument registers: `x0` to `x7`.
const ARGS: usize = 8;

fn get(m: &libc::mcontext_t, reg: Reg) -> u64 {
    match reg {
        Reg::X(n) if n < 31 => m.regs[n as usize],
        Reg::X(_) => 0,
        Reg::Sp => m.sp,
        Reg::Pc => m.pc,
        Reg::Pstate => m.pstate,
    }
}

fn set(m: &mut libc::mcontext_t, reg: Reg, value: u64) {
    match reg {
        Reg::X(n) if n < 31 => m.regs[n as usize] = value,
        Reg::X(_) => {}
        Reg::Sp => m.sp = value,
        Reg::Pc => m.pc = value,
        Reg::Pstate => m.pstate = value,
    }
}

/// What an entry handler sees: the registers of the thread that hit the
/// probe, as they were just before the probed instruction, borrowed from
/// the signal frame (writes take effect when the handler returns).
///
/// The handler runs **inside the SIGTRAP handler**, on the interrupted
/// thread's stack: it must be async-signal-safe (no allocation, no locks
/// the interrupted code may hold, no printing through `std`'s locked
/// stdout). A probe hit from inside a handler runs no handler (it counts
/// as missed).
pub struct EntryContext<'a> {
    uc: &'a mut libc::ucontext_t,
    addr: usize,
    pub(crate) ip_changed: bool,
    pub(crate) remove: bool,
    pub(crate) cookie: u64,
    pub(crate) skip_return: bool,
}

impl<'a> EntryContext<'a> {
    pub(crate) fn new(uc: &'a mut libc::ucontext_t, addr: usize) -> Self {
        Self {
            uc,
            addr,
            ip_changed: false,
            remove: false,
            cookie: 0,
            skip_return: false,
        }
    }

    /// The probed address.
    #[must_use]
    pub fn probe_addr(&self) -> usize {
        self.addr
    }

    /// A register's value (for `Pc`: the probed address).
    #[must_use]
    pub fn reg(&self, reg: Reg) -> u64 {
        get(&self.uc.uc_mcontext, reg)
    }

    /// Sets a register. Setting `Pc` redirects the thread: the probed
    /// instruction is then **not** executed (as with kernel uprobes).
    pub fn set_reg(&mut self, reg: Reg, value: u64) {
        if reg == Reg::Pc {
            self.ip_changed = true;
        }
        set(&mut self.uc.uc_mcontext, reg, value);
    }

    /// The `n`th integer argument (0-based) of the AAPCS64 calling
    /// convention, for a probe at a function's entry; `None` past the
    /// eight register arguments.
    #[must_use]
    pub fn arg(&self, n: usize) -> Option<u64> {
        (n < ARGS).then(|| self.uc.uc_mcontext.regs[n])
    }

    /// The thread that hit the probe (its kernel thread id).
    #[must_use]
    pub fn tid(&self) -> i32 {
        crate::engine::current_tid()
    }

    /// Stores `cookie` for this call's return handler (a session: a probe
    /// with both handlers), which reads it with
    /// [`ReturnContext::cookie`]; 0 if never set.
    pub fn set_cookie(&mut self, cookie: u64) {
        self.cookie = cookie;
    }

    /// Does not track this call's return: the return handler will not run
    /// for it.
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
            .field("sp", &format_args!("{:#x}", self.reg(Reg::Sp)))
            .finish_non_exhaustive()
    }
}

/// Where the function just entered keeps its return address: the stack
/// pointer at entry (which orders frames) and the link register in the
/// signal frame.
pub(crate) fn return_address_at(uc: &mut libc::ucontext_t) -> (usize, *mut usize) {
    let sp = uc.uc_mcontext.sp as usize;
    (sp, (&raw mut uc.uc_mcontext.regs[30]).cast())
}

/// Signal frame records holding the SIMD registers: `FPSIMD_MAGIC` (the
/// 128-bit V registers, always present) and `SVE_MAGIC` (the Z registers,
/// with data when the thread's SVE state is live, which qemu-user always
/// makes it; `sigreturn` then restores the Z registers from it).
const FPSIMD_MAGIC: u32 = 0x4650_8001;
const SVE_MAGIC: u32 = 0x5356_4501;
/// Where `__reserved` starts in the kernel's `struct sigcontext`
/// (`fault_address`, `regs[31]`, `sp`, `pc`, `pstate`, then 16-aligned).
const RESERVED_OFFSET: usize = 288;
const RESERVED_SIZE: usize = 4096;

/// Sets SIMD register `n` to `value` in the signal frame, as a load into
/// `Vn` does (the rest of `Zn`, if SVE state is in the frame, becomes
/// zero). Async-signal-safe: plain loads and stores, index loops.
pub(crate) fn set_vreg(uc: &mut libc::ucontext_t, n: u8, value: u128) {
    if n >= 32 {
        return;
    }
    let reserved = (&raw mut uc.uc_mcontext)
        .cast::<u8>()
        .wrapping_add(RESERVED_OFFSET);
    let mut at = 0;
    while at + 16 <= RESERVED_SIZE {
        // SAFETY: records lie inside `__reserved`, each starting with
        // (magic, size) u32s; the walk stops at its end or a zero record.
        let (magic, size) = unsafe {
            (
                reserved.add(at).cast::<u32>().read(),
                reserved.add(at + 4).cast::<u32>().read() as usize,
            )
        };
        if magic == 0 || size == 0 || at + size > RESERVED_SIZE {
            return;
        }
        if magic == FPSIMD_MAGIC {
            // fpsimd_context: head (8), fpsr (4), fpcr (4), vregs[32].
            // SAFETY: inside the record, 16-aligned (records are).
            unsafe {
                reserved
                    .add(at + 16 + 16 * n as usize)
                    .cast::<u128>()
                    .write(value)
            };
        } else if magic == SVE_MAGIC && size > 16 {
            // sve_context: head (8), vl (2), flags (2), reserved (4); then
            // Z0..Z31 of vl bytes each.
            // SAFETY: inside the record.
            let vl = usize::from(unsafe { reserved.add(at + 8).cast::<u16>().read() });
            let z = at + 16 + vl * n as usize;
            if vl >= 16 && z + vl <= at + size {
                // SAFETY: Zn lies inside the record (checked above).
                unsafe {
                    reserved.add(z).cast::<u128>().write_unaligned(value);
                    for i in 16..vl {
                        reserved.add(z + i).write(0);
                    }
                }
            }
        }
        at += size;
    }
}

/// What a return handler sees: the function's return value registers as it
/// returned them (writes take effect when the handler returns: the caller
/// sees them), and where the call came from. Same rules as entry handlers
/// (async-signal-safe code only).
pub struct ReturnContext<'a> {
    regs: &'a mut super::trampoline::SavedRegs,
    simd: &'a mut super::trampoline::SavedSimd,
    func: usize,
    ret: usize,
    cookie: u64,
}

impl<'a> ReturnContext<'a> {
    pub(crate) fn new(
        regs: &'a mut super::trampoline::SavedRegs,
        simd: &'a mut super::trampoline::SavedSimd,
        func: usize,
        ret: usize,
        cookie: u64,
    ) -> Self {
        Self {
            regs,
            simd,
            func,
            ret,
            cookie,
        }
    }

    /// The integer return value (`x0`).
    #[must_use]
    pub fn return_value(&self) -> u64 {
        self.regs.x[0]
    }

    /// The second integer return register (`x1`).
    #[must_use]
    pub fn return_value2(&self) -> u64 {
        self.regs.x[1]
    }

    /// Replaces the integer return value the caller sees.
    pub fn set_return_value(&mut self, value: u64) {
        self.regs.x[0] = value;
    }

    /// The floating-point return value (`d0`, as an `f64`).
    #[must_use]
    pub fn float_return(&self) -> f64 {
        f64::from_bits(self.float_return_bits() as u64)
    }

    /// All 128 bits of `v0`.
    #[must_use]
    pub fn float_return_bits(&self) -> u128 {
        self.simd.low[0]
    }

    /// Replaces the floating-point return value (`d0`; the rest of `v0`
    /// is zeroed, as a scalar write does).
    pub fn set_float_return(&mut self, value: f64) {
        self.simd.low[0] = u128::from(value.to_bits());
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
        crate::engine::current_tid()
    }
}

impl core::fmt::Debug for ReturnContext<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ReturnContext")
            .field("func", &format_args!("{:#x}", self.func))
            .field("return_addr", &format_args!("{:#x}", self.ret))
            .field("x0", &format_args!("{:#x}", self.regs.x[0]))
            .finish_non_exhaustive()
    }
}
