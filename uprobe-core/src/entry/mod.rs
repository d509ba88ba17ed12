//! How a hit comes in: through a breakpoint's trap ([`trap`], with
//! [`faults`] for what relocated instructions raise) or through a jump
//! into a trampoline ([`jump`]). Both end in `crate::hit`. The
//! architecture's assembly entry routines (`arch::jump_entry`,
//! `arch::return_entry`) call in here and into `crate::hit::returns`.

pub(crate) mod faults;
pub(crate) mod jump;
pub(crate) mod trap;
