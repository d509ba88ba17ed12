//! Filters on a probe (`-f 'malloc if arg0 >= 4096'`, `-f 'read if ret <
//! 0'`, `if tid == 1234`): comparisons of an argument, the return value,
//! the process or thread id and integers, joined by `&&` and `||` (`&&`
//! binds tighter), evaluated in the hit. Values compare as signed 64-bit
//! integers (`arg0 >= 4096` is true of a size up to 2^63 - 1).
//!
//! Parsing allocates; [`Filter::holds`] does not (async-signal-safe): the
//! filter is an `||` of `&&`s of comparisons, walked in place.

/// A value a comparison reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    /// Argument `n` (0 to 5).
    Arg(u8),
    /// The return value.
    Ret,
    /// The process id.
    Pid,
    /// The thread id.
    Tid,
    /// An integer.
    Int(i64),
}

/// A comparison operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

/// One comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cmp {
    /// The left side.
    pub lhs: Operand,
    /// The operator.
    pub op: Op,
    /// The right side.
    pub rhs: Operand,
}

/// A filter: true when every comparison of one of its groups is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    /// The groups (`||`), each of comparisons (`&&`).
    pub any: Vec<Vec<Cmp>>,
    /// As the user wrote it.
    pub text: String,
}

/// What a hit knows when the filter runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Values {
    /// The arguments (those the probe has; 0 beyond).
    pub args: [i64; 6],
    /// The return value (at a return).
    pub ret: i64,
    /// The process id.
    pub pid: i64,
    /// The thread id.
    pub tid: i64,
}

fn operand(word: &str) -> Result<Operand, String> {
    match word {
        "ret" | "retval" => return Ok(Operand::Ret),
        "pid" => return Ok(Operand::Pid),
        "tid" => return Ok(Operand::Tid),
        _ => {}
    }
    if let Some(n) = word.strip_prefix("arg") {
        return match n.parse::<u8>() {
            Ok(n) if n < 6 => Ok(Operand::Arg(n)),
            _ => Err(format!("{word:?}: arguments are arg0 to arg5")),
        };
    }
    let (negative, digits) = match word.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, word),
    };
    let value = match digits.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).map(|v| v as i64),
        None => digits.parse::<i64>(),
    }
    .map_err(|_| format!("{word:?}: not argN, ret, pid, tid or an integer"))?;
    Ok(Operand::Int(if negative {
        value.wrapping_neg()
    } else {
        value
    }))
}

/// Splits a comparison at its operator.
fn comparison(text: &str) -> Result<Cmp, String> {
    // Two-character operators first (`<=` before `<`).
    for (sym, op) in [
        ("==", Op::Eq),
        ("!=", Op::Ne),
        ("<=", Op::Le),
        (">=", Op::Ge),
        ("<", Op::Lt),
        (">", Op::Gt),
    ] {
        if let Some((l, r)) = text.split_once(sym) {
            let (l, r) = (l.trim(), r.trim());
            if l.is_empty() || r.is_empty() {
                break;
            }
            return Ok(Cmp {
                lhs: operand(l)?,
                op,
                rhs: operand(r)?,
            });
        }
    }
    Err(format!(
        "{:?}: not a comparison (A OP B, OP one of == != < <= > >=)",
        text.trim()
    ))
}

impl Filter {
    /// Parses what follows `if`.
    ///
    /// # Errors
    /// What does not parse, and why.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Err("`if` with nothing after it".into());
        }
        let any = text
            .split("||")
            .map(|group| group.split("&&").map(comparison).collect())
            .collect::<Result<Vec<Vec<Cmp>>, String>>()?;
        Ok(Self {
            any,
            text: text.trim().to_string(),
        })
    }

    fn operands(&self) -> impl Iterator<Item = Operand> + '_ {
        self.any.iter().flatten().flat_map(|c| [c.lhs, c.rhs])
    }

    /// Whether it reads the return value.
    #[must_use]
    pub fn uses_ret(&self) -> bool {
        self.operands().any(|o| o == Operand::Ret)
    }

    /// The highest argument it reads.
    #[must_use]
    pub fn max_arg(&self) -> Option<u8> {
        self.operands()
            .filter_map(|o| match o {
                Operand::Arg(n) => Some(n),
                _ => None,
            })
            .max()
    }

    /// Whether it reads the process id.
    #[must_use]
    pub fn uses_pid(&self) -> bool {
        self.operands().any(|o| o == Operand::Pid)
    }

    /// Whether it holds for `v`. Async-signal-safe: no allocation, no
    /// lock, no call.
    #[must_use]
    pub fn holds(&self, v: &Values) -> bool {
        let get = |o: Operand| match o {
            Operand::Arg(n) => v.args[usize::from(n)],
            Operand::Ret => v.ret,
            Operand::Pid => v.pid,
            Operand::Tid => v.tid,
            Operand::Int(i) => i,
        };
        self.any.iter().any(|group| {
            group.iter().all(|c| {
                let (a, b) = (get(c.lhs), get(c.rhs));
                match c.op {
                    Op::Eq => a == b,
                    Op::Ne => a != b,
                    Op::Lt => a < b,
                    Op::Le => a <= b,
                    Op::Gt => a > b,
                    Op::Ge => a >= b,
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_parse_and_hold() {
        let f = Filter::parse("arg0 >= 4096").unwrap();
        let mut v = Values::default();
        v.args[0] = 4096;
        assert!(f.holds(&v));
        v.args[0] = 4095;
        assert!(!f.holds(&v));
        assert_eq!(f.max_arg(), Some(0));
        let f = Filter::parse("ret < 0").unwrap();
        assert!(f.uses_ret());
        v.ret = -1;
        assert!(f.holds(&v));
        let f = Filter::parse("tid == 7 || arg1 != 0x10 && pid > -3").unwrap();
        let v = Values {
            args: [0, 0x10, 0, 0, 0, 0],
            ret: 0,
            pid: 1,
            tid: 8,
        };
        // (tid == 7) || (arg1 != 16 && pid > -3): false || (false && true).
        assert!(!f.holds(&v));
        assert!(f.holds(&Values { tid: 7, ..v }));
        assert!(f.holds(&Values {
            args: [0, 3, 0, 0, 0, 0],
            ..v
        }));
    }

    #[test]
    fn bad_filters_say_why() {
        for (text, why) in [
            ("", "nothing after it"),
            ("arg6 > 1", "arg0 to arg5"),
            ("arg0 >", "not a comparison"),
            ("size > 3", "not argN"),
            ("arg0 = 3", "not a comparison"),
        ] {
            let e = Filter::parse(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }
}
