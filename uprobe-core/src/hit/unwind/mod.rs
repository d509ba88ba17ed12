//! User stacks at a probe hit: [`EntryContext::user_stack`] walks the
//! calling frames from the probed instruction with the loaded objects'
//! call-frame information (`.eh_frame`, through `.eh_frame_hdr`), so code
//! built without frame pointers unwinds too, and through the engine's own
//! code: a return address hijacked by a return probe is read back from its
//! stub, a frame running a trampoline's or an out-of-line slot's copy of
//! an instruction is looked up at the original instruction.
//!
//! **On the hit path** nothing allocates and nothing locks: the objects'
//! unwind sections are read from copies made in ordinary context
//! ([`refresh`]: call it once before attaching probes that unwind; every
//! attach after that keeps it current) and never freed; `gimli` evaluates the frame
//! description with its rules on the stack, and remembers the rules of
//! frames of the common shape by address; the thread's stack is read with
//! loads the engine's fault handler recovers from (or, where a fault would
//! not reach that handler, with `process_vm_readv`), so a corrupt frame
//! ends the walk instead of the program.
//!
//! The walk ends at the outermost frame (no return address), at code no
//! loaded object describes (JIT code, an object loaded after the last
//! [`refresh`]), at a rule it does not evaluate (DWARF expressions:
//! signal frames, PLT entries), when a frame would move down the stack,
//! or after as many frames as the caller has room for.

mod objects;
mod regs;
mod rules;
mod stack;

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, NativeEndian, Register, RegisterRule,
    UnwindContext, UnwindContextStorage, UnwindSection as _, UnwindTableRow,
};

pub(crate) use objects::keep_current;
pub use objects::{LoadedObject, loaded_objects, refresh};

use crate::EntryContext;
use regs::{RA, Regs, SP};

/// Unwind rules kept per row (x86-64 describes 17 registers, aarch64 up to
/// 96 with its vector registers; more and the walk ends there).
struct StoreOnStack;

impl<T: gimli::ReaderOffset> UnwindContextStorage<T> for StoreOnStack {
    type Rules = [(Register, RegisterRule<T>); 48];
    type Stack = [UnwindTableRow<T, Self>; 2];
}

impl EntryContext<'_> {
    /// The stack of the thread at this hit, innermost first: the probed
    /// address, then the return address of each calling frame (the
    /// instruction after its call), into `out`; returns how many were
    /// written. See the [module](crate::hit::unwind)'s docs for how frames are
    /// found and where the walk ends. Async-signal-safe: no allocation,
    /// no lock; memory is read with `process_vm_readv`.
    ///
    /// ```no_run
    /// # fn f() -> Result<(), uprobe_core::AttachError> {
    /// let probe = uprobe_core::Uprobe::function("malloc")?
    ///     .on_entry(|cx| {
    ///         let mut frames = [0usize; 32];
    ///         let n = cx.user_stack(&mut frames);
    ///         // Aggregate frames[..n] (no allocation here).
    /// #       let _ = n;
    ///     })
    ///     .attach()?;
    /// # drop(probe);
    /// # Ok(())
    /// # }
    /// ```
    pub fn user_stack(&self, out: &mut [usize]) -> usize {
        let Some(table) = objects::current() else {
            return 0;
        };
        let mut regs = regs::at_hit(self);
        let mut pc = self.addr;
        let mut reader = stack::Reader::new();
        // Made on the first frame the rule cache does not know.
        let mut ctx: Option<UnwindContext<usize, StoreOnStack>> = None;
        let mut n = 0;
        while n < out.len() {
            out[n] = pc;
            n += 1;
            // A return address is past its call: look the call up.
            let at = original_pc(if n == 1 { pc } else { pc.wrapping_sub(1) });
            let caller = match rules::get(at) {
                Some(rules::Cached::Step(rule)) => cached_step(&mut reader, &regs, rule),
                Some(rules::Cached::End) => break,
                None => step(
                    table,
                    ctx.get_or_insert_with(UnwindContext::new_in),
                    &mut reader,
                    &regs,
                    at,
                ),
            };
            let Some(caller) = caller else {
                break;
            };
            let (next, ra) = caller;
            let (Some(old_sp), Some(new_sp)) = (regs.get(SP), next.get(SP)) else {
                break;
            };
            // Up the stack, or (a frame that allocated none: aarch64's
            // leaf functions, any function at its entry) at the same
            // place with another return address.
            if ra == 0 || new_sp < old_sp || (new_sp == old_sp && ra == pc) {
                break;
            }
            regs = next;
            pc = ra;
        }
        n
    }
}

/// One frame up from `regs` by a rule of the common shape (see
/// [`rules`]): the caller's registers and the return address.
fn cached_step(
    reader: &mut stack::Reader,
    regs: &Regs,
    rule: rules::Rule,
) -> Option<(Regs, usize)> {
    let cfa = regs
        .get(rule.cfa_reg)?
        .wrapping_add_signed(rule.cfa_off as isize);
    let mut next = Regs::unknown();
    let at = |reader: &mut stack::Reader, saved: rules::Saved, reg: u16| match saved {
        rules::Saved::Kept => regs.get(reg),
        rules::Saved::At(o) => reader.read(cfa.wrapping_add_signed(o as isize)),
    };
    let ra = at(reader, rule.ra, RA);
    let fp = at(reader, rule.fp, regs::FP);
    next.set(RA, ra);
    next.set(regs::FP, fp);
    let ra = regs::strip_return_address(ra?);
    let ra = crate::code::return_stubs::target_of(ra).unwrap_or(ra);
    next.set(SP, Some(cfa));
    Some((next, ra))
}

/// The address whose unwind rules apply at `pc`: the original instruction
/// of a trampoline's or slot's copy, else `pc`.
fn original_pc(pc: usize) -> usize {
    if let Some((orig, copy)) = crate::code::trampolines::relocated_origin(pc) {
        return orig + (pc - copy);
    }
    crate::code::slots::origin_of(pc).unwrap_or(pc)
}

/// One frame up from `regs` at `pc`: the caller's registers and the
/// return address (a stub's original target where a return probe
/// hijacked it).
fn step(
    table: &objects::Table,
    ctx: &mut UnwindContext<usize, StoreOnStack>,
    reader: &mut stack::Reader,
    regs: &Regs,
    pc: usize,
) -> Option<(Regs, usize)> {
    let object = table.find(pc)?;
    let (hdr, eh_frame) = object.sections();
    let bases = BaseAddresses::default()
        .set_eh_frame_hdr(object.eh_frame_hdr as u64)
        .set_eh_frame(object.eh_frame as u64);
    let parsed = EhFrameHdr::new(hdr, NativeEndian).parse(&bases, 8).ok()?;
    let eh_frame = EhFrame::new(eh_frame, NativeEndian);
    let row = parsed.table()?.unwind_info_for_address(
        &eh_frame,
        &bases,
        ctx,
        pc as u64,
        EhFrame::cie_from_offset,
    );
    let row = row.ok()?;
    if let Some(rule) = rules::of_row(row) {
        rules::put(pc, rule);
        return cached_step(reader, regs, rule);
    }
    let cfa = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            regs.get(register.0)?.wrapping_add_signed(*offset as isize)
        }
        CfaRule::Expression(_) => return None,
    };
    let mut next = regs.clone();
    for (register, rule) in row.registers() {
        let value = match rule {
            RegisterRule::SameValue => regs.get(register.0),
            RegisterRule::Offset(o) => reader.read(cfa.wrapping_add_signed(*o as isize)),
            RegisterRule::ValOffset(o) => Some(cfa.wrapping_add_signed(*o as isize)),
            RegisterRule::Register(r) => regs.get(r.0),
            // Undefined, or a rule the walk does not evaluate.
            _ => None,
        };
        next.set(register.0, value);
    }
    // A register without a rule keeps its value (the clone above), but a
    // return address column without one ends the walk where the
    // architecture says so (x86-64's outermost frames undefine it).
    if !regs::RA_WITHOUT_RULE_IS_KEPT
        && matches!(row.register(Register(RA)), RegisterRule::Undefined)
    {
        rules::put_end(pc);
        return None;
    }
    let ra = next.get(RA).map(regs::strip_return_address)?;
    let ra = crate::code::return_stubs::target_of(ra).unwrap_or(ra);
    next.set(SP, Some(cfa));
    Some((next, ra))
}
