//! How a hit comes in: through a breakpoint's trap ([`trap`], with
//! [`faults`] for what relocated instructions raise) or through a jump
//! into a trampoline ([`jump`]); a return probe's return comes in through
//! the return trampoline ([`returns`]). All end in `crate::hit`. The
//! architecture's assembly routines (`arch::jump_entry`,
//! `arch::return_entry`) call the functions [`jump`] and [`returns`] bind
//! to their symbols.

pub(crate) mod deferral;
pub(crate) mod faults;
pub(crate) mod jump;
pub(crate) mod returns;
pub(crate) mod trap;
