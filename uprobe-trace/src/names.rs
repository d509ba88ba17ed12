//! Function names as people write them: Rust's manglings (legacy and
//! v0, by `rustc-demangle`) and C++'s (Itanium, by `cpp_demangle`)
//! demangled for reports and stacks, and patterns matched against either
//! form.
//!
//! A pattern matches a function when it matches its symbol (`_ZN...`),
//! its demangled name (`ns::Widget::draw(int) const`, Rust's without the
//! hash: `myapp::parse::header`), or that name without its parameter list
//! (`ns::Widget::draw`), so `-f 'std::vector<*>::push_back'` finds every
//! instantiation and `-f 'myapp::parse*'` every function of a module.
//!
//! Nothing here is async-signal-safe (it allocates): the agent matches
//! and labels at attach, the tool at report time.

use crate::spec::glob;

/// The demangled name of `symbol`, if it is a mangled Rust or C++ name;
/// `None` for a C name (or one no demangler accepts).
#[must_use]
pub fn demangle(symbol: &str) -> Option<String> {
    if let Ok(d) = rustc_demangle::try_demangle(symbol) {
        // `{:#}`: without the hash suffix.
        return Some(format!("{d:#}"));
    }
    if symbol.starts_with("_Z") {
        let parsed = cpp_demangle::Symbol::new(symbol).ok()?;
        return parsed
            .demangle(&cpp_demangle::DemangleOptions::default())
            .ok();
    }
    None
}

/// How a report shows `symbol`: demangled where it is mangled.
#[must_use]
pub fn display(symbol: &str) -> String {
    demangle(symbol).unwrap_or_else(|| symbol.to_string())
}

/// `name` without a trailing parameter list and what follows it (a C++
/// name's `(int) const`); the whole name if it has none.
#[must_use]
pub fn without_params(name: &str) -> &str {
    if !name.ends_with(')') && !name.ends_with("const") && !name.ends_with('&') {
        return name;
    }
    // The parameter list is the last top-level `( ... )`: scan back,
    // balancing parentheses (a parameter may itself be a function
    // pointer type).
    let b = name.as_bytes();
    let Some(close) = b.iter().rposition(|&c| c == b')') else {
        return name;
    };
    let mut depth = 0usize;
    for i in (0..=close).rev() {
        match b[i] {
            b')' => depth += 1,
            b'(' => {
                depth -= 1;
                if depth == 0 {
                    return &name[..i];
                }
            }
            _ => {}
        }
    }
    name
}

/// A function name, in every form a pattern may match.
#[derive(Clone, Debug)]
pub struct Name {
    /// As the symbol table has it.
    pub symbol: String,
    /// Demangled (`None`: not a mangled name).
    pub demangled: Option<String>,
}

impl Name {
    /// `symbol`, demangled once.
    #[must_use]
    pub fn new(symbol: &str) -> Self {
        Self {
            symbol: symbol.to_string(),
            demangled: demangle(symbol),
        }
    }

    /// How reports show it.
    #[must_use]
    pub fn display(&self) -> &str {
        self.demangled.as_deref().unwrap_or(&self.symbol)
    }

    /// Whether `pattern` (a glob) matches the symbol, the demangled name,
    /// or the demangled name without its parameter list.
    #[must_use]
    pub fn matches(&self, pattern: &str) -> bool {
        glob(pattern, &self.symbol)
            || self
                .demangled
                .as_deref()
                .is_some_and(|d| glob(pattern, d) || glob(pattern, without_params(d)))
    }
}

/// Whether `name` can only be a demangled name (so a symbol lookup by it
/// cannot succeed): it has `::`, `<` or a space.
#[must_use]
pub fn is_demangled_form(name: &str) -> bool {
    name.contains("::") || name.contains('<') || name.contains(' ')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_and_cpp_names_demangle() {
        // Rust, legacy mangling: the hash is left out.
        assert_eq!(
            demangle("_ZN5myapp5parse6header17h0123456789abcdefE").as_deref(),
            Some("myapp::parse::header")
        );
        // Rust, v0 mangling.
        assert_eq!(
            demangle("_RNvNtCs1234_5myapp5parse6header").as_deref(),
            Some("myapp::parse::header")
        );
        // C++.
        assert_eq!(
            demangle("_ZNSt6vectorIiSaIiEE9push_backERKi").as_deref(),
            Some("std::vector<int, std::allocator<int> >::push_back(int const&)")
        );
        assert_eq!(
            demangle("_ZNK2ns6Widget4drawEi").as_deref(),
            Some("ns::Widget::draw(int) const")
        );
        assert_eq!(demangle("malloc"), None);
        assert_eq!(display("malloc"), "malloc");
    }

    #[test]
    fn patterns_match_every_form() {
        let push = Name::new("_ZNSt6vectorIiSaIiEE9push_backERKi");
        assert!(push.matches("std::vector<*>::push_back"));
        assert!(push.matches("std::vector<*>::push_back(int const&)"));
        assert!(push.matches("_ZNSt6vector*"));
        assert!(push.matches("*push_back*"));
        assert!(!push.matches("std::vector<*>::pop_back"));
        let draw = Name::new("_ZNK2ns6Widget4drawEi");
        assert!(draw.matches("ns::Widget::draw"));
        assert!(draw.matches("ns::*"));
        let parse = Name::new("_ZN5myapp5parse6header17h0123456789abcdefE");
        assert!(parse.matches("myapp::parse*"));
        assert!(parse.matches("myapp::parse::header"));
        assert!(!parse.matches("other::*"));
        let c = Name::new("malloc");
        assert!(c.matches("mall*") && c.matches("malloc") && !c.matches("free"));
    }

    #[test]
    fn parameter_lists_come_off_balanced() {
        assert_eq!(without_params("f(int)"), "f");
        assert_eq!(without_params("ns::f(void (*)(int)) const"), "ns::f");
        assert_eq!(
            without_params("std::vector<int>::push_back(int const&)"),
            "std::vector<int>::push_back"
        );
        assert_eq!(without_params("plain"), "plain");
    }
}
