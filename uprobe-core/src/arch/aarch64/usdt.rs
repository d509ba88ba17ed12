//! aarch64 USDT argument locations, as `<sys/sdt.h>` emits them: `xN`,
//! `wN`, `sp`, a constant, `[xN]`, `[xN, offset]`.

use super::Reg;
use crate::arch::usdt::{UsdtLocation, parse_int};

/// Parses the part of an argument after `@`.
pub(crate) fn parse_location(text: &str) -> Result<UsdtLocation, &'static str> {
    if let Some(inner) = text.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or("a memory operand without `]`")?;
        let mut parts = inner.split(',').map(str::trim);
        let base = register(parts.next().unwrap_or_default())?;
        let (offset, index) = match parts.next() {
            None => (0, None),
            Some(off) => match parse_int(off.trim_start_matches('#')) {
                Some(offset) => (offset, None),
                None => (0, Some((register(off)?, 1))),
            },
        };
        return Ok(UsdtLocation::Memory {
            base,
            offset,
            index,
        });
    }
    if let Some(value) = parse_int(text.trim_start_matches('#')) {
        return Ok(UsdtLocation::Constant(value));
    }
    register(text).map(UsdtLocation::Register)
}

/// `xN`, `wN` (the argument's size says how much is read) or `sp`.
fn register(name: &str) -> Result<Reg, &'static str> {
    if name == "sp" {
        return Ok(Reg::Sp);
    }
    let n = name
        .strip_prefix('x')
        .or_else(|| name.strip_prefix('w'))
        .and_then(|n| n.parse::<u8>().ok())
        .filter(|&n| n < 31)
        .ok_or("an unknown register")?;
    Ok(Reg::X(n))
}

#[cfg(test)]
mod tests {
    use super::super::Reg;
    use crate::arch::usdt::{UsdtArg, UsdtLocation};

    #[test]
    fn every_form_gcc_and_clang_emit() {
        let parse = |s: &str| UsdtArg::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(
            parse("-4@[sp, 96]"),
            UsdtArg {
                size: 4,
                signed: true,
                location: UsdtLocation::Memory {
                    base: Reg::Sp,
                    offset: 96,
                    index: None
                }
            }
        );
        assert_eq!(parse("-8@x4").location, UsdtLocation::Register(Reg::X(4)));
        assert_eq!(parse("4@w19").location, UsdtLocation::Register(Reg::X(19)));
        assert_eq!(parse("4@5").location, UsdtLocation::Constant(5));
        assert_eq!(
            parse("8@[x29, -12]").location,
            UsdtLocation::Memory {
                base: Reg::X(29),
                offset: -12,
                index: None
            }
        );
        assert_eq!(
            parse("8@[x0]").location,
            UsdtLocation::Memory {
                base: Reg::X(0),
                offset: 0,
                index: None
            }
        );
        assert!(UsdtArg::parse("8@v0").is_err());
    }
}
