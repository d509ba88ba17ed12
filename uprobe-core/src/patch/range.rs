//! Which range a jump covers: whole instructions from the probed one
//! (the architecture's `plan`: a long instruction, or a function's first
//! instructions relocated together), or the probed instruction alone, to
//! be punned over the bytes that follow it (`plan`'s `single`), with the
//! tail its trampoline copies. `super::jump::prepare` asks.

use super::original::code_as_original;
use crate::arch::JUMP_LEN;
use crate::arch::jump::{self as arch_jump, Plan};
use crate::base::mode::NotOptimized;
use crate::process::symbols::Extent;
use crate::site::jump::Function;
use crate::table::site_at;

/// The range a jump at `addr` covers (`here`: the original code from
/// there, to at most `code_end`), and, for a jump punned over the probed
/// instruction alone, why not over whole instructions (`None`: it goes
/// over whole instructions, straight to its trampoline). `punned_only`:
/// the bytes the jump writes must pass a test, so a jump over the probed
/// instruction alone goes through a stub placed where they do (punned
/// over nothing: `pun::choose` writes it whole). `WRITER` is held.
pub(crate) fn choose(
    addr: usize,
    here: &[u8],
    code_end: usize,
    function: Option<Extent>,
    direct: bool,
    punned_only: bool,
) -> Result<(Plan, Option<NotOptimized>), NotOptimized> {
    let function_code = function.and_then(|f| {
        (f.size > 0 && f.start == addr).then(|| {
            (
                code_as_original(f.start, (f.start + f.size).min(code_end) - f.start),
                f.sole_entry,
            )
        })
    });
    let whole = if direct {
        Err(NotOptimized::TooShort {
            len: 0,
            why: "where signals are blocked only a one-byte patch may be written",
        })
    } else {
        arch_jump::plan(
            addr,
            here,
            function_code.as_ref().map(|(code, sole_entry)| Function {
                start: addr,
                code,
                sole_entry: *sole_entry,
            }),
        )
    }
    .and_then(
        |plan| match (addr + 1..plan.start + plan.len).find(|&a| site_at(a).is_some()) {
            Some(at) => Err(NotOptimized::OtherProbeInRange { at }),
            None => Ok(plan),
        },
    );
    // Where whole instructions cannot take the jump, the probed one alone
    // may, punned over the bytes that follow it.
    match whole {
        // Over the probed instruction alone, the whole jump through a
        // stub: what fails then is room for the stub.
        Ok(plan)
            if punned_only
                && crate::arch::PUNNING.is_some()
                && plan.start == addr
                && !plan.has_interior() =>
        {
            Ok((plan, Some(NotOptimized::NoTrampolineRoom)))
        }
        Ok(plan) => Ok((plan, None)),
        // (If the probed instruction itself cannot run relocated, that is
        // the reason.)
        Err(why) if crate::arch::PUNNING.is_some() => {
            Ok((arch_jump::single(addr, here, tail_limit(addr))?, Some(why)))
        }
        Err(why) => Err(why),
    }
}

/// How far a punned jump's trampoline may copy the code after the probed
/// instruction at `addr` (`arch::jump::single`): not past twice a jump's
/// length (what a later attach looks back over to find the jumps that
/// cover it), nor over another site. `WRITER` is held.
fn tail_limit(addr: usize) -> usize {
    let limit = addr + 2 * JUMP_LEN;
    (addr + 1..limit)
        .find(|&a| site_at(a).is_some())
        .unwrap_or(limit)
}
