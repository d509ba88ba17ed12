//! x86-64 USDT argument locations, in the AT&T syntax `<sys/sdt.h>`
//! emits: `%reg`, `$imm`, `disp(%base)`, `disp(%base,%index,scale)`.

use super::Reg;
use crate::arch::usdt::{UsdtLocation, parse_int};

/// Parses the part of an argument after `@`.
pub(crate) fn parse_location(text: &str) -> Result<UsdtLocation, &'static str> {
    if let Some(imm) = text.strip_prefix('$') {
        return parse_int(imm)
            .map(UsdtLocation::Constant)
            .ok_or("a constant that is not a number");
    }
    if let Some(reg) = text.strip_prefix('%') {
        return register(reg).map(UsdtLocation::Register);
    }
    let (disp, rest) = text
        .split_once('(')
        .ok_or("not a register, constant or memory operand")?;
    let inner = rest
        .strip_suffix(')')
        .ok_or("a memory operand without `)`")?;
    let offset = if disp.is_empty() {
        0
    } else {
        parse_int(disp).ok_or("a symbol-relative operand (only numeric displacements are known)")?
    };
    let mut parts = inner.split(',').map(str::trim);
    let base = parts.next().unwrap_or_default();
    let base = base
        .strip_prefix('%')
        .ok_or("a memory operand without a base register")?;
    if base == "rip" {
        return Err("a RIP-relative operand");
    }
    let base = register(base)?;
    let index = match (parts.next(), parts.next()) {
        (None, _) => None,
        (Some(index), scale) => {
            let index = register(
                index
                    .strip_prefix('%')
                    .ok_or("an index that is not a register")?,
            )?;
            let scale = match scale.map(str::parse::<u8>) {
                None => 1,
                Some(Ok(s @ (1 | 2 | 4 | 8))) => s,
                Some(_) => return Err("a scale that is not 1, 2, 4 or 8"),
            };
            Some((index, scale))
        }
    };
    Ok(UsdtLocation::Memory {
        base,
        offset,
        index,
    })
}

/// A general-purpose register by any of its names (64, 32, 16 or low
/// 8 bits: the argument's size says how much of it is read).
fn register(name: &str) -> Result<Reg, &'static str> {
    const NAMES: [(Reg, [&str; 4]); 16] = [
        (Reg::Rax, ["rax", "eax", "ax", "al"]),
        (Reg::Rbx, ["rbx", "ebx", "bx", "bl"]),
        (Reg::Rcx, ["rcx", "ecx", "cx", "cl"]),
        (Reg::Rdx, ["rdx", "edx", "dx", "dl"]),
        (Reg::Rsi, ["rsi", "esi", "si", "sil"]),
        (Reg::Rdi, ["rdi", "edi", "di", "dil"]),
        (Reg::Rbp, ["rbp", "ebp", "bp", "bpl"]),
        (Reg::Rsp, ["rsp", "esp", "sp", "spl"]),
        (Reg::R8, ["r8", "r8d", "r8w", "r8b"]),
        (Reg::R9, ["r9", "r9d", "r9w", "r9b"]),
        (Reg::R10, ["r10", "r10d", "r10w", "r10b"]),
        (Reg::R11, ["r11", "r11d", "r11w", "r11b"]),
        (Reg::R12, ["r12", "r12d", "r12w", "r12b"]),
        (Reg::R13, ["r13", "r13d", "r13w", "r13b"]),
        (Reg::R14, ["r14", "r14d", "r14w", "r14b"]),
        (Reg::R15, ["r15", "r15d", "r15w", "r15b"]),
    ];
    if matches!(name, "ah" | "bh" | "ch" | "dh") {
        return Err("a high-byte register");
    }
    NAMES
        .iter()
        .find(|(_, names)| names.contains(&name))
        .map(|&(reg, _)| reg)
        .ok_or("an unknown register")
}

#[cfg(test)]
mod tests {
    use super::super::Reg;
    use crate::arch::usdt::{UsdtArg, UsdtLocation};

    fn parse(s: &str) -> UsdtArg {
        UsdtArg::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn every_form_gcc_and_clang_emit() {
        assert_eq!(
            parse("-4@%eax"),
            UsdtArg {
                size: 4,
                signed: true,
                location: UsdtLocation::Register(Reg::Rax)
            }
        );
        assert_eq!(parse("8@%r12").location, UsdtLocation::Register(Reg::R12));
        assert_eq!(parse("1@%sil").location, UsdtLocation::Register(Reg::Rsi));
        assert_eq!(parse("4@$71").location, UsdtLocation::Constant(71));
        assert_eq!(parse("-4@$-1").location, UsdtLocation::Constant(-1));
        assert_eq!(
            parse("8@-8(%rbp)").location,
            UsdtLocation::Memory {
                base: Reg::Rbp,
                offset: -8,
                index: None
            }
        );
        assert_eq!(
            parse("8@(%rsp)").location,
            UsdtLocation::Memory {
                base: Reg::Rsp,
                offset: 0,
                index: None
            }
        );
        assert_eq!(
            parse("1@-96(%rbp,%rax,8)").location,
            UsdtLocation::Memory {
                base: Reg::Rbp,
                offset: -96,
                index: Some((Reg::Rax, 8))
            }
        );
        assert_eq!(
            parse("2@16(%rdi,%rcx)").location,
            UsdtLocation::Memory {
                base: Reg::Rdi,
                offset: 16,
                index: Some((Reg::Rcx, 1))
            }
        );
    }

    #[test]
    fn unknown_forms_say_why() {
        for (bad, why) in [
            ("8@counter(%rip)", "symbol"),
            ("8@16(%rip)", "RIP"),
            ("1@%ah", "high-byte"),
            ("8@%xmm0", "unknown register"),
            ("8@-8(%rbp,%rax,3)", "scale"),
        ] {
            let e = UsdtArg::parse(bad).unwrap_err();
            assert!(e.why().contains(why) && e.arg() == bad, "{bad}: {e}");
        }
    }
}
