//! A probed aarch64 instruction run as a hit runs it, against the
//! original: simulated on the registers of the signal frame, or run out of
//! line in its slot, then compared with the instruction run in place,
//! from the same registers and memory (each run started and ended by a
//! signal, see `run`). On an aarch64 host the CPU runs both; elsewhere qemu-user does
//! (it executes the fuzz target whole). Every general register, SP, PC,
//! the flags (NZCV and BTYPE), the V registers, FPSR, the bytes of the
//! data area and the stack, where the code went on to, and the signal of
//! a run that faulted must be the same.
//!
//! A run ends at the first signal after it starts: the code is alone on
//! its page, which holds `udf #0` (zero words) around it, and nothing else
//! is mapped where it may branch except the literal's page (readable, not
//! executable), so the next instruction, a branch target or a fault ends
//! it. Not compared: the SVE predicate registers and the Z registers past
//! 128 bits (out-of-line SVE code sees the same ones in both runs: the
//! harness's own), and the other PSTATE bits (no instruction probed at
//! EL0 changes them).

mod run;

use uprobe_core::testing::code::{Analysis, analyze};

use run::Outcome;

/// Where the code goes (4-byte steps from here).
pub const CODE_AREA: u64 = 0x1000_0000_0000;
/// The data area the registers may point into (2 pages).
pub const DATA: u64 = 0x3000_0000_0000;
const DATA_SIZE: u64 = 0x2000;
/// The stack (4 pages; `sp` starts in the middle).
pub const STACK: u64 = 0x3000_0010_0000;
const STACK_SIZE: u64 = 0x4000;
/// PSTATE's bits that are compared: N, Z, C, V and BTYPE.
const STATUS: u64 = 0xf000_0000 | 0b11 << 10;

/// Registers at the start or the end of a run.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Regs {
    /// `x0` .. `x30`.
    pub x: [u64; 31],
    /// `sp`.
    pub sp: u64,
    /// `pc`.
    pub pc: u64,
    /// PSTATE's compared bits ([`STATUS`]).
    pub pstate: u64,
    /// `v0` .. `v31`.
    pub v: [u128; 32],
    /// FPSR.
    pub fpsr: u32,
}

impl Regs {
    const ZERO: Self = Self {
        x: [0; 31],
        sp: 0,
        pc: 0,
        pstate: 0,
        v: [0; 32],
        fpsr: 0,
    };
}

/// Why an input was not run (nothing wrong with the code under test).
#[derive(Debug)]
pub enum Skip {
    /// A page is taken, or two pieces of the layout overlap.
    Layout,
    /// The instruction cannot run the same twice: it reads a counter or a
    /// random number.
    Unrunnable,
    /// The engine refused the instruction (or the slot's place).
    Refused,
}

/// A 64-bit mix of `x` (splitmix64's finalizer).
fn mix(mut x: u64) -> u64 {
    x = (x ^ x >> 30).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ x >> 27).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ x >> 31
}

/// Registers to start from: each general register drawn by its `pick`
/// byte (into the data area, a small signed number, or any value), `sp`
/// 16-aligned in the stack, NZCV from `flags`, the V registers from
/// `seed`, FPSR clear.
#[must_use]
pub fn registers(pick: &[u8], values: &[u8], flags: u8, seed: u64) -> Regs {
    let mut regs = Regs::ZERO;
    for (i, r) in regs.x.iter_mut().enumerate() {
        let p = pick.get(i).copied().unwrap_or(0);
        let v = values
            .get(8 * i..8 * i + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
        *r = match p % 4 {
            0 | 1 => DATA + v % (DATA_SIZE - 64),
            2 => v as i8 as i64 as u64,
            _ => v,
        };
    }
    regs.sp = STACK + STACK_SIZE / 2 - 16 * (u64::from(pick.get(31).copied().unwrap_or(0)) % 32);
    regs.pstate = u64::from(flags >> 4) << 28;
    for (i, v) in regs.v.iter_mut().enumerate() {
        let lo = mix(seed ^ (2 * i as u64 + 1));
        let hi = mix(seed ^ (2 * i as u64 + 2));
        *v = u128::from(lo) | u128::from(hi) << 64;
    }
    regs
}

/// Whether the instruction cannot run the same twice: `mrs` of the
/// generic timer's registers (op1 3, CRn 14) or of RNDR/RNDRRS.
#[must_use]
pub fn unrunnable(insn: u32) -> bool {
    let mrs = insn & 0xfff0_0000 == 0xd530_0000;
    let op1_crn = insn >> 12 & 0x7f;
    let sysreg = insn >> 5 & 0x7fff;
    mrs && (op1_crn == 0x3e || sysreg == 0x5920 || sysreg == 0x5921)
}

/// The pages of one input, mapped at fixed addresses until dropped.
pub struct Layout {
    page: u64,
    mapped: Vec<(u64, u64)>,
}

impl Layout {
    /// An empty layout (the data area and the stack come with it).
    ///
    /// # Errors
    /// Where a page is taken.
    pub fn new() -> Result<Self, Skip> {
        // SAFETY: sysconf reads a constant.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        let mut layout = Self {
            page,
            mapped: Vec::new(),
        };
        layout.map(DATA, DATA_SIZE, libc::PROT_READ | libc::PROT_WRITE, |_| 0)?;
        layout.map(STACK, STACK_SIZE, libc::PROT_READ | libc::PROT_WRITE, |_| 0)?;
        Ok(layout)
    }

    /// Fills the data area from `seed` and clears the stack: each run
    /// starts from the same memory (both run in this process).
    pub fn reset(&mut self, seed: u64) {
        for a in (DATA..DATA + DATA_SIZE).step_by(8) {
            // SAFETY: the data area, mapped by `new`.
            unsafe { (a as *mut u64).write(mix(seed ^ a)) };
        }
        // SAFETY: the stack, mapped by `new`.
        unsafe { core::ptr::write_bytes(STACK as *mut u8, 0, STACK_SIZE as usize) };
    }

    /// Maps `len` bytes from `at` (rounded out to pages) filled with
    /// `fill(address)` for each 8 bytes, then gives them `prot`.
    fn map(&mut self, at: u64, len: u64, prot: i32, fill: impl Fn(u64) -> u64) -> Result<(), Skip> {
        let start = at & !(self.page - 1);
        let end = (at + len).next_multiple_of(self.page);
        if self.mapped.iter().any(|&(s, e)| start < e && s < end) {
            return Err(Skip::Layout);
        }
        // SAFETY: a fresh anonymous mapping at a fixed address nothing else
        // holds (NOREPLACE refuses a taken one).
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                (end - start) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED || p as u64 != start {
            if p != libc::MAP_FAILED {
                // SAFETY: what we just mapped (elsewhere: an old kernel).
                unsafe { libc::munmap(p, (end - start) as usize) };
            }
            return Err(Skip::Layout);
        }
        self.mapped.push((start, end));
        for a in (start..end).step_by(8) {
            // SAFETY: inside the mapping just made.
            unsafe { (a as *mut u64).write(fill(a)) };
        }
        // SAFETY: our mapping.
        unsafe { libc::mprotect(p, (end - start) as usize, prot) };
        Ok(())
    }

    /// Places code at `at` on a page of its own (the rest `udf #0`).
    ///
    /// # Errors
    /// Where its page is taken.
    pub fn code(&mut self, at: u64, code: &[u8]) -> Result<(), Skip> {
        let words: Vec<u32> = code
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("whole words")))
            .collect();
        let n = words.len() as u64;
        self.map(at, 4 * n, libc::PROT_READ | libc::PROT_EXEC, |a| {
            let word = |w: u64| {
                w.checked_sub(at)
                    .filter(|d| d % 4 == 0 && d / 4 < n)
                    .map_or(0, |d| u64::from(words[(d / 4) as usize]))
            };
            word(a) | word(a + 4) << 32
        })
    }

    /// Maps the page(s) of the 16 bytes from `at` readable, filled from
    /// `seed`, unless they already are.
    ///
    /// # Errors
    /// Where a page is taken by something else.
    pub fn literal(&mut self, at: u64, seed: u64) -> Result<(), Skip> {
        let mut page = at & !(self.page - 1);
        while page < at + 16 {
            if !self.mapped.iter().any(|&(s, e)| s <= page && page < e) {
                self.map(page, self.page, libc::PROT_READ, |a| mix(seed ^ a ^ 0x11))?;
            }
            page += self.page;
        }
        Ok(())
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        for &(s, e) in &self.mapped {
            // SAFETY: our own mappings.
            unsafe { libc::munmap(s as *mut libc::c_void, (e - s) as usize) };
        }
    }
}

/// Where a literal load (LDR/LDRSW/PRFM literal, general or SIMD) reads.
#[must_use]
pub fn literal_address(insn: u32, at: u64) -> Option<u64> {
    if insn & 0x3b00_0000 != 0x1800_0000 {
        return None;
    }
    let imm19 = i64::from((insn << 8) as i32 >> 13);
    Some(at.wrapping_add((imm19 * 4) as u64))
}

/// How a run ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// The code went on to `to` (the next instruction or a branch target),
    /// where a signal stopped it: the registers and memory then.
    Went {
        to: u64,
        signal: i32,
        regs: Regs,
        memory: u64,
    },
    /// The instruction faulted (in place: the slot's address read as the
    /// original's), with `si_addr`, the registers and memory.
    Fault {
        signal: i32,
        addr: u64,
        regs: Regs,
        memory: u64,
    },
    /// It ran out of time (a branch to itself).
    Looped,
}

/// What a run came to, with the slot's addresses read as the original's.
fn end_of(o: Outcome, at: u64, slot: Option<u64>) -> End {
    let mut regs = o.regs;
    // Where a branch to a tagged address goes, as the CPU's exception
    // return takes it (AArch64.BranchAddr: with top-byte-ignore, bits
    // 63:56 become copies of bit 55, for a register branch and an
    // exception return alike, so a simulated `br` that leaves the tag to
    // `sigreturn` goes where the real one does). qemu-user's `sigreturn`
    // keeps the tag, its `br` does not: both are read as the CPU's, and
    // so is the fault address the tag reaches.
    let branch_addr = |a: u64| ((a << 8) as i64 >> 8) as u64;
    let pc = branch_addr(regs.pc);
    regs.pc = pc;
    let addr = branch_addr(o.addr);
    let in_place = pc == at || Some(pc) == slot;
    if o.signal == libc::SIGVTALRM {
        return End::Looped;
    }
    let fetch = matches!(o.signal, libc::SIGSEGV | libc::SIGBUS) && addr == pc;
    if !in_place && (o.signal == libc::SIGILL || fetch) {
        return End::Went {
            to: pc,
            signal: o.signal,
            regs,
            memory: o.memory,
        };
    }
    if in_place {
        regs.pc = at;
    }
    End::Fault {
        signal: o.signal,
        addr: if Some(addr) == slot { at } else { addr },
        regs,
        memory: o.memory,
    }
}

/// The instruction `insn` probed at `at`, its slot (if it runs out of
/// line) at `slot`: a hit's run compared with the original's, from
/// `start`. Panics on a difference.
///
/// # Errors
/// Where the input cannot be run ([`Skip`]).
pub fn check(insn: u32, at: u64, slot: u64, start: &Regs, seed: u64) -> Result<(), Skip> {
    if unrunnable(insn) {
        return Err(Skip::Unrunnable);
    }
    let bytes = insn.to_le_bytes();
    let analysis: Analysis =
        analyze(at as usize, &bytes, slot as usize).map_err(|_| Skip::Refused)?;
    let mut layout = Layout::new()?;
    layout.code(at, &bytes)?;
    let slot = match analysis.slot_code() {
        Some(code) => {
            // The original must end at the next word, `udf`: not on the
            // slot's copy.
            if slot < at + 8 && at < slot + code.len() as u64 {
                return Err(Skip::Layout);
            }
            layout.code(slot, code)?;
            Some(slot)
        }
        None => None,
    };
    if let Some(lit) = literal_address(insn, at) {
        layout.literal(lit, seed)?;
    }
    let writable = [(DATA, DATA_SIZE as usize), (STACK, STACK_SIZE as usize)];
    layout.reset(seed);
    let original = end_of(run::run(start, at, None, writable), at, None);
    layout.reset(seed);
    let hit = end_of(run::run(start, at, Some(&analysis), writable), at, slot);
    assert!(
        original == hit,
        "{insn:#010x} at {at:#x} (slot {slot:x?}) ran differently as a hit:\n\
         original: {original:x?}\nhit:      {hit:x?}\n{analysis:x?}"
    );
    Ok(())
}
