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
}

impl<'a> EntryContext<'a> {
    pub(crate) fn new(uc: &'a mut libc::ucontext_t, addr: usize) -> Self {
        Self {
            uc,
            addr,
            ip_changed: false,
            remove: false,
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
