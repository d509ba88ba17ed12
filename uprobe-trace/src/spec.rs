//! What to probe: functions (`malloc`, `libz.so.1:deflate`, patterns such
//! as `libsqlite3.so.0:sqlite3_*`, with argument types for `--print`:
//! `open(str,int)`) and USDT probes (`python:function__entry(str,str,int)`),
//! plus the value a `--hist` draws, as the command line says them and as
//! the tool hands them to the agent.

pub use crate::by::{By, parse_by};
use crate::filter::Filter;

/// How `--print` shows an argument (and `--hist` reads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgType {
    /// A signed 32-bit integer (`int`): the register's low half.
    I32,
    /// A signed 64-bit integer (`long`, `ssize_t`, `off_t`).
    I64,
    /// An unsigned 32-bit integer (`unsigned`).
    U32,
    /// An unsigned 64-bit integer (`size_t`, `unsigned long`).
    U64,
    /// A pointer or flags, in hexadecimal (`ptr`, `void*`, `hex`).
    Hex,
    /// A C string the argument points at (`str`, `char*`).
    Str,
}

impl ArgType {
    /// The type a C-like name stands for.
    pub fn parse(name: &str) -> Result<Self, String> {
        let squeezed: String = name.split_whitespace().collect::<Vec<_>>().join(" ");
        let plain = squeezed.strip_prefix("const ").unwrap_or(&squeezed);
        Ok(match plain.replace(" *", "*").as_str() {
            "int" | "i32" | "int32_t" | "pid_t" => Self::I32,
            "long" | "i64" | "int64_t" | "ssize_t" | "off_t" | "long long" => Self::I64,
            "unsigned" | "u32" | "uint" | "unsigned int" | "uint32_t" => Self::U32,
            "size_t" | "u64" | "uint64_t" | "unsigned long" | "unsigned long long" => Self::U64,
            "str" | "char*" | "string" => Self::Str,
            "ptr" | "hex" | "void*" => Self::Hex,
            other if other.ends_with('*') => Self::Hex,
            other => {
                return Err(format!(
                    "argument type {other:?} is none of int, long, unsigned, size_t, str, ptr (or a pointer type)"
                ));
            }
        })
    }

    /// The value of a register holding an argument of this type, as a
    /// signed number where the type is signed.
    #[must_use]
    pub fn value(self, raw: u64) -> Value {
        match self {
            Self::I32 => Value::Signed(i64::from(raw as i32)),
            Self::I64 => Value::Signed(raw as i64),
            Self::U32 => Value::Unsigned(u64::from(raw as u32)),
            Self::U64 | Self::Hex | Self::Str => Value::Unsigned(raw),
        }
    }

    fn code(self) -> char {
        match self {
            Self::I32 => 'i',
            Self::I64 => 'l',
            Self::U32 => 'u',
            Self::U64 => 'q',
            Self::Hex => 'x',
            Self::Str => 's',
        }
    }

    fn from_code(c: char) -> Option<Self> {
        Some(match c {
            'i' => Self::I32,
            'l' => Self::I64,
            'u' => Self::U32,
            'q' => Self::U64,
            'x' => Self::Hex,
            's' => Self::Str,
            _ => return None,
        })
    }
}

/// A number as its type reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Value {
    /// Of a signed type.
    Signed(i64),
    /// Of an unsigned type.
    Unsigned(u64),
}

/// What a `--hist` draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drawn {
    /// Argument `n` (from 0) at entry.
    Arg(u8),
    /// The return value (as a signed number).
    Ret,
}

/// Where a probe goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A function's entry; with a pattern (`*`, `?`), every function
    /// whose name matches.
    Function {
        /// The object (`libz.so.1`), or `None`: the executable, then every
        /// loaded library.
        object: Option<String>,
        /// The function, or a pattern.
        name: String,
    },
    /// Every site of a USDT probe.
    Usdt {
        /// The object, or `None`: every loaded object that has the probe.
        object: Option<String>,
        /// The provider.
        provider: String,
        /// The probe's name.
        name: String,
    },
}

impl Target {
    /// Whether this names many functions (a pattern).
    #[must_use]
    pub fn is_pattern(&self) -> bool {
        matches!(self, Self::Function { name, .. } if is_pattern(name))
    }
}

/// One probe to attach.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(clippy::struct_excessive_bools)] // independent switches of the command line
pub struct ProbeSpec {
    /// Where.
    pub target: Target,
    /// How `--print` shows each argument (the others: not shown for a
    /// function with types, numbers for a USDT probe).
    pub args: Vec<ArgType>,
    /// With a return probe and a latency histogram (functions).
    pub latency: bool,
    /// A line per hit (and per return, for functions).
    pub print: bool,
    /// A histogram of an argument or the return value.
    pub hist: Option<Drawn>,
    /// The user stack of each hit, counted (`--stacks`).
    pub stacks: bool,
    /// On breakpoints only, never jumps (`--breakpoints`).
    pub trap_only: bool,
    /// Only the calls for which it holds count (`if ...`).
    pub filter: Option<Filter>,
    /// `--flow`: each call and return recorded.
    pub flow: bool,
}

impl ProbeSpec {
    /// A probe on `target` that only counts.
    #[must_use]
    pub fn counting(target: Target) -> Self {
        Self {
            target,
            args: Vec::new(),
            latency: false,
            print: false,
            hist: None,
            stacks: false,
            trap_only: false,
            filter: None,
            flow: false,
        }
    }

    /// How the report names the probe.
    #[must_use]
    pub fn label(&self) -> String {
        match &self.target {
            Target::Function { object, name } => function_label(object.as_deref(), name),
            Target::Usdt {
                object,
                provider,
                name,
            } => match object {
                Some(o) => format!("{o}:{provider}:{name}"),
                None => format!("{provider}:{name}"),
            },
        }
    }

    /// Whether a hit of this probe needs its return too.
    #[must_use]
    pub fn wants_return(&self) -> bool {
        matches!(self.target, Target::Function { .. })
            && (self.latency
                || self.flow
                || self.print
                || self.hist == Some(Drawn::Ret)
                || self.filter.as_ref().is_some_and(Filter::uses_ret))
    }

    /// Whether the probe only counts calls: no handler needed, the
    /// engine's counting probes count for it.
    #[must_use]
    pub fn only_counts(&self) -> bool {
        !self.latency
            && !self.print
            && self.hist.is_none()
            && !self.stacks
            && self.filter.is_none()
            && !self.flow
    }

    /// Whether the probe only counts calls and times their returns: no
    /// handler needed, the engine's timing probes do it.
    #[must_use]
    pub fn only_times(&self) -> bool {
        matches!(self.target, Target::Function { .. })
            && self.latency
            && !self.print
            && self.hist.is_none()
            && !self.stacks
            && self.filter.is_none()
            && !self.flow
    }
}

/// How the report names function `name` of `object`.
#[must_use]
pub fn function_label(object: Option<&str>, name: &str) -> String {
    match object {
        Some(o) => format!("{o}:{name}"),
        None => name.to_string(),
    }
}

/// Whether `name` is a pattern (has `*` or `?`).
#[must_use]
pub fn is_pattern(name: &str) -> bool {
    name.contains(['*', '?'])
}

/// Whether `name` matches `pattern`, where `*` stands for any run of
/// characters and `?` for one, as in the shell.
#[must_use]
pub fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // The classic two-pointer match, backtracking to the last `*`.
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// Splits `text` into its head and the types in parentheses after it.
fn split_types(text: &str) -> Result<(&str, Vec<ArgType>), String> {
    match text.split_once('(') {
        Some((head, rest)) => {
            let inner = rest
                .strip_suffix(')')
                .ok_or_else(|| format!("{text:?}: unclosed argument types"))?;
            let types = if inner.trim().is_empty() {
                Vec::new()
            } else {
                inner
                    .split(',')
                    .map(|t| ArgType::parse(t.trim()).map_err(|e| format!("{text:?}: {e}")))
                    .collect::<Result<_, _>>()?
            };
            Ok((head, types))
        }
        None => Ok((text, Vec::new())),
    }
}

/// Refuses a spec with a control character: no name has one, and the
/// plan's encoding separates its fields with two.
fn printable(text: &str) -> Result<(), String> {
    if text.contains(char::is_control) {
        return Err(format!("{text:?}: a control character in a name"));
    }
    Ok(())
}

/// Parses a `-x` item: a pattern of function names to leave out.
pub fn parse_exclude(text: &str) -> Result<String, String> {
    printable(text)?;
    Ok(text.to_string())
}

/// Parses a `-f` item: `[object:]name[(type,...)]`, the name maybe a
/// pattern. Returns the target and the argument types.
pub fn parse_function(text: &str) -> Result<(Target, Vec<ArgType>), String> {
    printable(text)?;
    let (text, _) = split_filter(text)?;
    let (head, types) = split_types(text)?;
    let (object, name) = match split_object(head) {
        Some((o, n)) => (Some(o.to_string()), n),
        None => (None, head),
    };
    if name.is_empty() || name.contains(char::is_whitespace) || object.as_deref() == Some("") {
        return Err(format!("{text:?}: not a function name"));
    }
    Ok((
        Target::Function {
            object,
            name: name.to_string(),
        },
        types,
    ))
}

/// A spec and the filter after its ` if ` (`malloc(size_t) if arg0 >
/// 4096`), parsed.
///
/// # Errors
/// A filter that does not parse.
pub fn split_filter(text: &str) -> Result<(&str, Option<Filter>), String> {
    match text.split_once(" if ") {
        Some((head, filter)) => Ok((head.trim_end(), Some(Filter::parse(filter)?))),
        None => Ok((text, None)),
    }
}

/// `object:name` split at its last lone `:` (one that is not half of a
/// `::`, which C++ and Rust names have); `None` without one.
#[must_use]
pub fn split_object(head: &str) -> Option<(&str, &str)> {
    let b = head.as_bytes();
    let lone = (0..b.len())
        .rev()
        .find(|&i| b[i] == b':' && b.get(i + 1) != Some(&b':') && (i == 0 || b[i - 1] != b':'))?;
    Some((&head[..lone], &head[lone + 1..]))
}

/// Parses a `-u` item: `[object:]provider:name[(type,...)]`.
pub fn parse_usdt(text: &str) -> Result<(Target, Vec<ArgType>), String> {
    printable(text)?;
    let (text, _) = split_filter(text)?;
    let (head, types) = split_types(text)?;
    let parts: Vec<&str> = head.rsplitn(3, ':').collect();
    let (object, provider, name) = match parts.as_slice() {
        [name, provider] => (None, *provider, *name),
        [name, provider, object] => (Some((*object).to_string()), *provider, *name),
        _ => return Err(format!("{text:?}: not provider:name")),
    };
    if provider.is_empty() || name.is_empty() || object.as_deref() == Some("") {
        return Err(format!("{text:?}: not provider:name"));
    }
    Ok((
        Target::Usdt {
            object,
            provider: provider.to_string(),
            name: name.to_string(),
        },
        types,
    ))
}

/// Parses a `--hist` item: `[object:]function:argN` or
/// `[object:]function:ret`.
pub fn parse_hist(text: &str) -> Result<(Target, Drawn), String> {
    let (function, what) = text
        .rsplit_once(':')
        .ok_or_else(|| format!("{text:?}: not function:argN or function:ret"))?;
    let drawn = match what {
        "ret" | "retval" => Drawn::Ret,
        _ => match what.strip_prefix("arg").map(str::parse::<u8>) {
            Some(Ok(n)) if n < 6 => Drawn::Arg(n),
            _ => {
                return Err(format!(
                    "{text:?}: {what:?} is not arg0..arg5 or ret (function:argN, function:ret)"
                ));
            }
        },
    };
    let (target, types) = parse_function(function)?;
    if !types.is_empty() || target.is_pattern() {
        return Err(format!(
            "{text:?}: a histogram is of one function, named without types"
        ));
    }
    Ok((target, drawn))
}

/// What the agent is asked to do: the probes, and the names patterns
/// leave out (`-x`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The probes; probe `i` owns the report's slot `i`.
    pub probes: Vec<ProbeSpec>,
    /// Patterns of function names no pattern probe attaches to.
    pub exclude: Vec<String>,
    /// `--list`: the agent lists what each probe would attach (a slot per
    /// function or USDT site under it) and attaches nothing.
    pub list: bool,
    /// `--by`: the key each process counts under.
    pub by: Option<By>,
}

impl Plan {
    /// Whether pattern probes leave function `name` out.
    #[must_use]
    pub fn excludes(&self, name: &str) -> bool {
        self.exclude.iter().any(|x| glob(x, name))
    }
}

/// Separates fields and records in the encoding (ASCII unit and record
/// separators: never in a name).
const FIELD: char = '\u{1f}';
const RECORD: char = '\u{1e}';

/// The plan, as one string (for the agent's environment, or a file).
#[must_use]
pub fn encode(plan: &Plan) -> String {
    let flags = |p: &ProbeSpec| {
        let mut f = String::new();
        if p.latency {
            f.push('l');
        }
        if p.print {
            f.push('p');
        }
        if p.stacks {
            f.push('k');
        }
        if p.trap_only {
            f.push('b');
        }
        if p.flow {
            f.push('w');
        }
        match p.hist {
            Some(Drawn::Ret) => f.push('r'),
            Some(Drawn::Arg(n)) => {
                f.push('a');
                f.push(char::from(b'0' + n));
            }
            None => {}
        }
        f
    };
    let types = |p: &ProbeSpec| p.args.iter().map(|t| t.code()).collect::<String>();
    let filter = |p: &ProbeSpec| {
        p.filter
            .as_ref()
            .map_or("", |f| f.text.as_str())
            .to_string()
    };
    plan.probes
        .iter()
        .map(|p| match &p.target {
            Target::Function { object, name } => format!(
                "f{FIELD}{}{FIELD}{name}{FIELD}{}{FIELD}{}{FIELD}{}",
                object.as_deref().unwrap_or(""),
                types(p),
                flags(p),
                filter(p)
            ),
            Target::Usdt {
                object,
                provider,
                name,
            } => format!(
                "u{FIELD}{}{FIELD}{provider}{FIELD}{name}{FIELD}{}{FIELD}{}{FIELD}{}",
                object.as_deref().unwrap_or(""),
                types(p),
                flags(p),
                filter(p)
            ),
        })
        .chain(plan.exclude.iter().map(|x| format!("x{FIELD}{x}")))
        .chain(plan.list.then(|| "L".to_string()))
        .chain(plan.by.map(|b| format!("B{FIELD}{}", b.name())))
        .collect::<Vec<_>>()
        .join(&RECORD.to_string())
}

/// The plan [`encode`] wrote.
pub fn decode(text: &str) -> Result<Plan, String> {
    let mut plan = Plan::default();
    if text.is_empty() {
        return Ok(plan);
    }
    for record in text.split(RECORD) {
        let f: Vec<&str> = record.split(FIELD).collect();
        let object = |o: &str| (!o.is_empty()).then(|| o.to_string());
        let bad = || format!("a probe the agent cannot read: {record:?}");
        let (target, types, flags, filter) = match f.as_slice() {
            ["x", pattern] => {
                plan.exclude.push((*pattern).to_string());
                continue;
            }
            ["L"] => {
                plan.list = true;
                continue;
            }
            ["B", key] => {
                plan.by = Some(parse_by(key)?);
                continue;
            }
            ["f", o, name, types, flags, filter] => (
                Target::Function {
                    object: object(o),
                    name: (*name).to_string(),
                },
                *types,
                *flags,
                *filter,
            ),
            ["u", o, provider, name, types, flags, filter] => (
                Target::Usdt {
                    object: object(o),
                    provider: (*provider).to_string(),
                    name: (*name).to_string(),
                },
                *types,
                *flags,
                *filter,
            ),
            _ => return Err(bad()),
        };
        let args = types
            .chars()
            .map(ArgType::from_code)
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad)?;
        let hist = if flags.contains('r') {
            Some(Drawn::Ret)
        } else if let Some((_, n)) = flags.split_once('a') {
            Some(Drawn::Arg(n.parse().map_err(|_| bad())?))
        } else {
            None
        };
        plan.probes.push(ProbeSpec {
            target,
            args,
            latency: flags.contains('l'),
            print: flags.contains('p'),
            hist,
            stacks: flags.contains('k'),
            trap_only: flags.contains('b'),
            flow: flags.contains('w'),
            filter: (!filter.is_empty())
                .then(|| Filter::parse(filter))
                .transpose()?,
        });
    }
    Ok(plan)
}

// Its path said (relative to this file), so that it resolves where this
// file is included by path (the `trace_spec` fuzz target).
#[cfg(test)]
#[path = "spec/tests.rs"]
mod tests;
