//! What to probe: functions (`malloc`, `libz.so.1:deflate`) and USDT
//! probes (`python:function__entry`, with argument types for `--print`),
//! as the command line says them and as the tool hands them to the agent
//! (in the environment).

/// How `--print` shows a USDT argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgType {
    /// A number.
    Int,
    /// A C string the argument points at.
    Str,
}

/// Where a probe goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A function's entry.
    Function {
        /// The object (`libz.so.1`), or `None`: the executable, then every
        /// loaded library.
        object: Option<String>,
        /// The function.
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
        /// How `--print` shows each argument (the rest: numbers).
        types: Vec<ArgType>,
    },
}

/// One probe to attach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSpec {
    /// Where.
    pub target: Target,
    /// With a return probe and a latency histogram (functions).
    pub latency: bool,
    /// A line per hit.
    pub print: bool,
}

impl ProbeSpec {
    /// How the report names the probe.
    #[must_use]
    pub fn label(&self) -> String {
        match &self.target {
            Target::Function { object: None, name } => name.clone(),
            Target::Function {
                object: Some(o),
                name,
            } => format!("{o}:{name}"),
            Target::Usdt {
                object,
                provider,
                name,
                ..
            } => match object {
                Some(o) => format!("{o}:{provider}:{name}"),
                None => format!("{provider}:{name}"),
            },
        }
    }
}

/// Parses a `-f` item: `name` or `object:name`.
pub fn parse_function(text: &str) -> Result<Target, String> {
    let (object, name) = match text.rsplit_once(':') {
        Some((o, n)) => (Some(o.to_string()), n),
        None => (None, text),
    };
    if name.is_empty() || name.contains(char::is_whitespace) {
        return Err(format!("{text:?}: not a function name"));
    }
    Ok(Target::Function {
        object,
        name: name.to_string(),
    })
}

/// Parses a `-u` item: `[object:]provider:name[(type,...)]` with types
/// `int` and `str`.
pub fn parse_usdt(text: &str) -> Result<Target, String> {
    let (head, types) = match text.split_once('(') {
        Some((h, rest)) => {
            let inner = rest
                .strip_suffix(')')
                .ok_or_else(|| format!("{text:?}: unclosed argument types"))?;
            let types = inner
                .split(',')
                .map(|t| match t.trim() {
                    "int" => Ok(ArgType::Int),
                    "str" => Ok(ArgType::Str),
                    other => Err(format!(
                        "{text:?}: argument type {other:?} is not int or str"
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            (h, types)
        }
        None => (text, Vec::new()),
    };
    let parts: Vec<&str> = head.rsplitn(3, ':').collect();
    let (object, provider, name) = match parts.as_slice() {
        [name, provider] => (None, *provider, *name),
        [name, provider, object] => (Some((*object).to_string()), *provider, *name),
        _ => return Err(format!("{text:?}: not provider:name")),
    };
    if provider.is_empty() || name.is_empty() {
        return Err(format!("{text:?}: not provider:name"));
    }
    Ok(Target::Usdt {
        object,
        provider: provider.to_string(),
        name: name.to_string(),
        types,
    })
}

/// Separates fields and probes in the environment encoding (ASCII unit and
/// record separators: never in a name).
const FIELD: char = '\u{1f}';
const RECORD: char = '\u{1e}';

/// The probes, for the agent's environment.
#[must_use]
pub fn encode(probes: &[ProbeSpec]) -> String {
    let flags = |p: &ProbeSpec| {
        format!(
            "{}{}",
            if p.latency { "l" } else { "" },
            if p.print { "p" } else { "" }
        )
    };
    probes
        .iter()
        .map(|p| match &p.target {
            Target::Function { object, name } => {
                format!(
                    "f{FIELD}{}{FIELD}{name}{FIELD}{}",
                    object.as_deref().unwrap_or(""),
                    flags(p)
                )
            }
            Target::Usdt {
                object,
                provider,
                name,
                types,
            } => {
                let types: String = types
                    .iter()
                    .map(|t| if *t == ArgType::Str { 's' } else { 'i' })
                    .collect();
                format!(
                    "u{FIELD}{}{FIELD}{provider}{FIELD}{name}{FIELD}{types}{FIELD}{}",
                    object.as_deref().unwrap_or(""),
                    flags(p)
                )
            }
        })
        .collect::<Vec<_>>()
        .join(&RECORD.to_string())
}

/// The probes the tool encoded.
pub fn decode(text: &str) -> Result<Vec<ProbeSpec>, String> {
    if text.is_empty() {
        return Ok(Vec::new());
    }
    text.split(RECORD)
        .map(|record| {
            let f: Vec<&str> = record.split(FIELD).collect();
            let object = |o: &str| (!o.is_empty()).then(|| o.to_string());
            let (target, flags) = match f.as_slice() {
                ["f", o, name, flags] => (
                    Target::Function {
                        object: object(o),
                        name: (*name).to_string(),
                    },
                    *flags,
                ),
                ["u", o, provider, name, types, flags] => (
                    Target::Usdt {
                        object: object(o),
                        provider: (*provider).to_string(),
                        name: (*name).to_string(),
                        types: types
                            .chars()
                            .map(|c| if c == 's' { ArgType::Str } else { ArgType::Int })
                            .collect(),
                    },
                    *flags,
                ),
                _ => return Err(format!("a probe the agent cannot read: {record:?}")),
            };
            Ok(ProbeSpec {
                target,
                latency: flags.contains('l'),
                print: flags.contains('p'),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_through_the_environment() {
        let probes = vec![
            ProbeSpec {
                target: parse_function("malloc").unwrap(),
                latency: true,
                print: false,
            },
            ProbeSpec {
                target: parse_function("libz.so.1:deflate").unwrap(),
                latency: false,
                print: true,
            },
            ProbeSpec {
                target: parse_usdt("python:function__entry(str,str,int)").unwrap(),
                latency: false,
                print: true,
            },
            ProbeSpec {
                target: parse_usdt("libstdc++.so.6:libstdcxx:throw").unwrap(),
                latency: false,
                print: false,
            },
        ];
        assert_eq!(decode(&encode(&probes)).unwrap(), probes);
        assert_eq!(probes[1].label(), "libz.so.1:deflate");
        assert_eq!(probes[3].label(), "libstdc++.so.6:libstdcxx:throw");
    }

    #[test]
    fn bad_specs_say_why() {
        assert!(parse_function("").is_err());
        assert!(parse_usdt("justaname").is_err());
        assert!(parse_usdt("p:n(float)").unwrap_err().contains("float"));
        assert!(parse_usdt("p:n(int").is_err());
    }
}
