//! Which branches of a function may land inside a range of its first
//! instructions (what a jump over them would cut in two): a direct
//! branch by its target, an indirect jump by the stack depth it leaves
//! from (`super::stack_depth`: it lands only where the stack is as
//! deep, so a sibling call made once the frame is given back cannot
//! land inside a prologue that has pushed something).

use iced_x86::{FlowControl, Instruction, OpKind};

use crate::base::mode::NotOptimized;

/// Whether `insn` has a near branch target.
pub(super) fn is_near_branch(insn: &Instruction) -> bool {
    (0..insn.op_count()).any(|i| {
        matches!(
            insn.op_kind(i),
            OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
        )
    })
}

/// Checks that no branch of the function `all` (its instructions in
/// address order, its entry first) may land inside `range` (its first
/// instructions) past the range's first byte: no direct branch targets
/// those bytes, no transactional-memory instruction is there to abort
/// into them, and every indirect jump leaves from a stack depth that no
/// instruction of the range past the first has. Not async-signal-safe.
pub(super) fn none_lands_inside(
    all: &[Instruction],
    range: &[Instruction],
) -> Result<(), NotOptimized> {
    let (Some(first), Some(last)) = (range.first(), range.last()) else {
        return Ok(());
    };
    let (start, end) = (first.ip() as usize, last.next_ip() as usize);
    let depths = all
        .iter()
        .any(|i| i.flow_control() == FlowControl::IndirectBranch)
        .then(|| super::stack_depth::depths(all))
        .flatten();
    let lands_outside = |jump: &Instruction| {
        depths.as_ref().is_some_and(|d| {
            d.get(&(jump.ip() as usize)).is_some_and(|depth| {
                range[1..].iter().all(|i| {
                    d.get(&(i.ip() as usize))
                        .is_some_and(|inside| inside != depth)
                })
            })
        })
    };
    for insn in all {
        let indirect = match insn.flow_control() {
            FlowControl::IndirectBranch => !lands_outside(insn),
            FlowControl::XbeginXabortXend => true,
            _ => false,
        };
        if indirect {
            return Err(NotOptimized::IndirectJump {
                at: insn.ip() as usize,
            });
        }
        if is_near_branch(insn) {
            let target = insn.near_branch_target() as usize;
            if target > start && target < end {
                return Err(NotOptimized::BranchIntoRange {
                    from: insn.ip() as usize,
                    target,
                });
            }
        }
    }
    Ok(())
}
