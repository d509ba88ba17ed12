//! Every scenario `bench` knows, one module per primitive.

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod calls;
mod counter;
mod cpu_id;
mod freelist;
#[cfg(target_arch = "x86_64")]
mod hand;
mod rwsem;
mod sigpending;
mod srcu;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod tally;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod uprobe;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod uretprobe;

use crate::harness::Scenario;

/// All scenarios, in the order `bench --list` prints them.
#[must_use]
pub fn all() -> Vec<Scenario> {
    vec![
        cpu_id::SCENARIO,
        counter::SCENARIO,
        rwsem::READ,
        rwsem::MIXED,
        rwsem::WRITE,
        srcu::READ,
        srcu::SYNC,
        srcu::LEASE,
        freelist::POP_EMPTY,
        freelist::PUSHPOP,
        freelist::STEAL,
        freelist::OVERSUB,
        sigpending::SIGNAL1,
        sigpending::TASKFLAG,
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        uprobe::NOP,
        #[cfg(target_arch = "x86_64")]
        uprobe::PUSH,
        #[cfg(target_arch = "x86_64")]
        uprobe::RET,
        #[cfg(target_arch = "x86_64")]
        uprobe::RIPREL,
        #[cfg(target_arch = "x86_64")]
        uprobe::NOP5,
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        uprobe::ENTRY,
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        uprobe::COUNT,
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        uretprobe::NOP,
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        uretprobe::LIFETIME,
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        uretprobe::ENTRY,
    ]
}

/// The scenario called `name`.
#[must_use]
pub fn find(name: &str) -> Option<Scenario> {
    all().into_iter().find(|s| s.name == name)
}
