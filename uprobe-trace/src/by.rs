//! `--by KEY`: what every count breaks down by. The process's keys (`pid`,
//! `comm`) cost nothing a call: each process counts into slots of its own
//! key (a fork child that does not exec counts under its parent's). The
//! others (`tid`, `caller`, `argN`, `ret`) are read in the hit, by a
//! handler, and counted per slot and key in the report's key table.

/// What the counts break down by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum By {
    /// The process id.
    Pid,
    /// The process's name (`/proc/self/comm`, as an exec set it).
    Comm,
    /// The thread id.
    Tid,
    /// The calling function.
    Caller,
    /// Argument `n` (0 to 5).
    Arg(u8),
    /// The return value.
    Ret,
}

impl By {
    /// The key's name, as `--by` takes it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Pid => "pid",
            Self::Comm => "comm",
            Self::Tid => "tid",
            Self::Caller => "caller",
            Self::Arg(n) => ["arg0", "arg1", "arg2", "arg3", "arg4", "arg5"][usize::from(n.min(5))],
            Self::Ret => "ret",
        }
    }

    /// Whether the key is known only in the hit (a handler reads it):
    /// not the process's.
    #[must_use]
    pub fn in_hit(self) -> bool {
        !matches!(self, Self::Pid | Self::Comm)
    }
}

/// Parses `--by`'s key.
pub fn parse_by(text: &str) -> Result<By, String> {
    match text {
        "pid" => Ok(By::Pid),
        "comm" => Ok(By::Comm),
        "tid" => Ok(By::Tid),
        "caller" => Ok(By::Caller),
        "ret" | "retval" => Ok(By::Ret),
        _ => match text.strip_prefix("arg").map(str::parse::<u8>) {
            Some(Ok(n)) if n < 6 => Ok(By::Arg(n)),
            _ => Err(format!(
                "--by {text:?}: pid, comm, tid, caller, arg0 to arg5 or ret"
            )),
        },
    }
}
