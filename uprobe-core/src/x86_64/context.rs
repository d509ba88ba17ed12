//! `EntryContext`: the interrupted thread's registers, as a handler sees
//! them.

/// A general-purpose register, the instruction pointer or the flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // the register names are their documentation
pub enum Reg {
    Rax,
    Rbx,
    Rcx,
    Rdx,
    Rsi,
    Rdi,
    Rbp,
    Rsp,
    R8,
    R9,
    R10,
    R11,
    R12,
    R13,
    R14,
    R15,
    Rip,
    Rflags,
}

impl Reg {
    fn greg(self) -> usize {
        (match self {
            Self::Rax => libc::REG_RAX,
            Self::Rbx => libc::REG_RBX,
            Self::Rcx => libc::REG_RCX,
            Self::Rdx => libc::REG_RDX,
            Self::Rsi => libc::REG_RSI,
            Self::Rdi => libc::REG_RDI,
            Self::Rbp => libc::REG_RBP,
            Self::Rsp => libc::REG_RSP,
            Self::R8 => libc::REG_R8,
            Self::R9 => libc::REG_R9,
            Self::R10 => libc::REG_R10,
            Self::R11 => libc::REG_R11,
            Self::R12 => libc::REG_R12,
            Self::R13 => libc::REG_R13,
            Self::R14 => libc::REG_R14,
            Self::R15 => libc::REG_R15,
            Self::Rip => libc::REG_RIP,
            Self::Rflags => libc::REG_EFL,
        }) as usize
    }
}

/// The System V integer argument registers, in order.
const ARGS: [Reg; 6] = [Reg::Rdi, Reg::Rsi, Reg::Rdx, Reg::Rcx, Reg::R8, Reg::R9];

/// What an entry handler sees: the registers of the thread that hit the
/// probe, as they were just before the probed instruction, borrowed from
/// the signal frame (writes take effect when the handler returns).
///
/// The handler runs **inside the SIGTRAP handler**, on the interrupted
/// thread's stack, with that thread's signal mask plus nothing blocked
/// (`SA_NODEFER`): it must be async-signal-safe (no allocation, no locks the
/// interrupted code may hold, no printing through `std`'s locked stdout).
/// A probe hit from inside a handler runs no handler (it counts as missed).
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

    /// A register's value (for `Rip`: the probed address, where the
    /// instruction starts).
    #[must_use]
    pub fn reg(&self, reg: Reg) -> u64 {
        if reg == Reg::Rip && !self.ip_changed {
            return self.addr as u64;
        }
        self.uc.uc_mcontext.gregs[reg.greg()] as u64
    }

    /// Sets a register. Setting `Rip` redirects the thread: the probed
    /// instruction is then **not** executed (as with kernel uprobes).
    pub fn set_reg(&mut self, reg: Reg, value: u64) {
        if reg == Reg::Rip {
            self.ip_changed = true;
        }
        self.uc.uc_mcontext.gregs[reg.greg()] = value as i64;
    }

    /// The `n`th integer argument (0-based) of the System V calling
    /// convention, for a probe at a function's entry; `None` past the six
    /// register arguments.
    #[must_use]
    pub fn arg(&self, n: usize) -> Option<u64> {
        ARGS.get(n).map(|&r| self.reg(r))
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
            .field("rsp", &format_args!("{:#x}", self.reg(Reg::Rsp)))
            .finish_non_exhaustive()
    }
}

/// Where the function just entered keeps its return address: the stack
/// pointer (the slot's address, which orders frames) and the slot.
pub(crate) fn return_address_at(uc: &mut libc::ucontext_t) -> (usize, *mut usize) {
    let sp = uc.uc_mcontext.gregs[libc::REG_RSP as usize] as usize;
    (sp, sp as *mut usize)
}

/// What a return handler sees: the function's return value registers as it
/// returned them (writes take effect when the handler returns: the caller
/// sees them), and where the call came from.
///
/// Runs in the return trampoline, on the thread's stack, in the middle of
/// whatever the thread was doing: the same rules as for entry handlers
/// apply (async-signal-safe code only; a probed function called from here
/// runs no handler).
pub struct ReturnContext<'a> {
    regs: &'a mut super::trampoline::SavedRegs,
    xmm: &'a mut super::trampoline::SavedXmm,
    func: usize,
    ret: usize,
    cookie: u64,
}

impl<'a> ReturnContext<'a> {
    pub(crate) fn new(
        regs: &'a mut super::trampoline::SavedRegs,
        xmm: &'a mut super::trampoline::SavedXmm,
        func: usize,
        ret: usize,
        cookie: u64,
    ) -> Self {
        Self {
            regs,
            xmm,
            func,
            ret,
            cookie,
        }
    }

    /// The integer return value (`rax`).
    #[must_use]
    pub fn return_value(&self) -> u64 {
        self.regs.rax
    }

    /// The second integer return register (`rdx`: the high half of a
    /// 128-bit value, the second word of a small struct).
    #[must_use]
    pub fn return_value2(&self) -> u64 {
        self.regs.rdx
    }

    /// Replaces the integer return value the caller sees.
    pub fn set_return_value(&mut self, value: u64) {
        self.regs.rax = value;
    }

    /// The floating-point return value (`xmm0` as an `f64`; for an `f32`
    /// return use [`float_return_bits`](Self::float_return_bits)).
    #[must_use]
    pub fn float_return(&self) -> f64 {
        f64::from_bits(self.float_return_bits() as u64)
    }

    /// All 128 bits of `xmm0`.
    #[must_use]
    pub fn float_return_bits(&self) -> u128 {
        self.xmm[0]
    }

    /// Replaces the floating-point return value (`xmm0`'s low 64 bits).
    pub fn set_float_return(&mut self, value: f64) {
        self.xmm[0] = (self.xmm[0] & !u128::from(u64::MAX)) | u128::from(value.to_bits());
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
            .field("rax", &format_args!("{:#x}", self.regs.rax))
            .finish_non_exhaustive()
    }
}
