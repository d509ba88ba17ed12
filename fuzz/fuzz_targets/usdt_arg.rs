//! USDT argument specs as `<sys/sdt.h>` writes them into an object's
//! notes (`-4@%eax`, `8@-8(%rbp)`, `-4@[sp, 96]`): any text is parsed
//! into an argument or a typed error that prints, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use uprobe_core::usdt::UsdtArg;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // A spec is several arguments, separated by spaces.
    for arg in text.split_ascii_whitespace() {
        match UsdtArg::parse(arg) {
            Ok(parsed) => assert!(matches!(parsed.size, 1 | 2 | 4 | 8), "{arg:?}: {parsed:?}"),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
});
