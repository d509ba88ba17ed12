//! Every crate of the workspace keeps its modules in layers: no module
//! reaches, directly or through others, back up to a module that uses
//! it. Read from the sources, as a newcomer reads them.
//!
//! A module is a file under `src/` (`foo.rs` or `foo/mod.rs`; nested files
//! are modules of their own, named by path; `lib.rs`, `main.rs` and
//! `bin/` are the crate's roots and not counted). An edge `A -> B` is a
//! path in A's code (comments left out) that names module B:
//! `crate::b::...`, `super::b` (resolved against A's parent), the items of
//! a `use crate::{b, c::d}` group, and, for paths through a module alias
//! the crate root declares (`use x86_64 as arch;`), the module the alias
//! stands for, once for each alternative (each architecture is a graph of
//! its own). A name a module re-exports from one of its children (`pub
//! use child::Item;`) resolves to that child. References between a module
//! and its own children are structure, not edges.
//!
//! The test prints each crate's modules in layer order (every module after
//! the modules it uses) and fails on any cycle, naming its modules.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// One crate's modules: name (`a::b`) -> file.
type Modules = BTreeMap<String, PathBuf>;
/// Module -> the modules it names.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("test-support lives in the workspace")
        .to_path_buf()
}

/// The workspace's crates: folders with a `Cargo.toml` and a `src/`.
fn crates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(workspace_root())
        .expect("read the workspace root")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .collect();
    out.sort();
    out
}

fn modules(src: &Path) -> Modules {
    let mut mods = Modules::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).expect("read a source folder").flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = rel
                .with_extension("")
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            let root = parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main");
            if root || parts.is_empty() || parts[0] == "bin" {
                continue;
            }
            mods.insert(parts.join("::"), path);
        }
    }
    mods
}

/// The code of a file without its comments (line comments, doc comments
/// and block comments; string contents are kept, which is harmless here).
fn code_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |end| &after[end + 2..]);
        } else if rest.starts_with("//") {
            rest = rest.find('\n').map_or("", |end| &rest[end..]);
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths in `code` that start with `keyword` (`crate`, `super`) as a
/// whole word, each as its segments after the keyword; `use` groups
/// (`crate::a::{b, c::{d, e}}`) are expanded.
fn paths_after(code: &str, keyword: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut from = 0;
    while let Some(found) = code[from..].find(keyword) {
        let at = from + found;
        from = at + keyword.len();
        let before_ok = at == 0 || !is_ident(char::from(bytes[at - 1]));
        let after = &code[from..];
        if !before_ok || !after.starts_with("::") {
            continue;
        }
        expand(&after[2..], &mut Vec::new(), &mut out);
    }
    out
}

/// Reads one path (with groups) from the start of `text`, with `prefix`
/// before it, into `out`.
fn expand(text: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let text = text.trim_start();
    if let Some(group) = text.strip_prefix('{') {
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    expand(&group[start..i], &mut prefix.clone(), out);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&group[start..i], &mut prefix.clone(), out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        return;
    }
    let end = text.find(|c: char| !is_ident(c)).unwrap_or(text.len());
    if end == 0 {
        out.push(prefix.clone());
        return;
    }
    prefix.push(text[..end].to_string());
    match text[end..].strip_prefix("::") {
        Some(rest) => expand(rest, prefix, out),
        None => out.push(prefix.clone()),
    }
}

/// Module aliases the crate root declares: alias -> the modules it may
/// stand for (`use x86_64 as arch;` under one cfg, `use aarch64 as arch;`
/// under another).
fn aliases(src: &Path, mods: &Modules) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let Ok(text) = fs::read_to_string(src.join("lib.rs")) else {
        return out;
    };
    for line in code_of(&text).lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("use ") else {
            continue;
        };
        let Some((target, alias)) = rest.trim_end_matches(';').split_once(" as ") else {
            continue;
        };
        let target = target
            .trim()
            .trim_start_matches("self::")
            .trim_start_matches("crate::");
        if mods.contains_key(target) {
            out.entry(alias.trim().to_string())
                .or_default()
                .push(target.to_string());
        }
    }
    out
}

/// For each module, the names it re-exports from its own children:
/// `pub use child::Item;` / `pub(crate) use child::{A, B};`.
fn reexports(mods: &Modules) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (m, path) in mods {
        let code = code_of(&fs::read_to_string(path).expect("read a module"));
        let mut names = BTreeMap::new();
        for stmt in code.split(';') {
            let stmt = stmt.trim();
            let Some(rest) = stmt
                .strip_prefix("pub use ")
                .or_else(|| stmt.strip_prefix("pub(crate) use "))
            else {
                continue;
            };
            let mut paths = Vec::new();
            expand(
                rest.trim_start_matches("self::"),
                &mut Vec::new(),
                &mut paths,
            );
            for p in paths {
                let (Some(child), Some(item)) = (p.first(), p.last()) else {
                    continue;
                };
                let child = format!("{m}::{child}");
                if p.len() > 1 && mods.contains_key(&child) {
                    let item = item.split(" as ").last().unwrap_or(item).to_string();
                    names.insert(item, child);
                }
            }
        }
        out.insert(m.clone(), names);
    }
    out
}

/// The module a path names: the longest module prefix, or the child a
/// re-exported name comes from.
fn resolve(
    segs: &[String],
    mods: &Modules,
    reexports: &BTreeMap<String, BTreeMap<String, String>>,
) -> Option<String> {
    for n in (1..=segs.len()).rev() {
        let m = segs[..n].join("::");
        if mods.contains_key(&m) {
            if let Some(child) = segs.get(n).and_then(|item| reexports[&m].get(item)) {
                return Some(child.clone());
            }
            return Some(m);
        }
    }
    None
}

/// The graph of one crate with each alias bound to one of its targets
/// (the alternatives not bound, another architecture's modules, left
/// out: they are not built with this one).
fn graph(
    all: &Modules,
    aliases: &BTreeMap<String, Vec<String>>,
    binding: &BTreeMap<String, String>,
) -> Graph {
    let unbound: Vec<&String> = aliases
        .iter()
        .flat_map(|(alias, targets)| {
            targets
                .iter()
                .filter(move |t| binding.get(alias) != Some(t))
        })
        .collect();
    let mods: Modules = all
        .iter()
        .filter(|(m, _)| {
            !unbound
                .iter()
                .any(|u| *m == *u || m.starts_with(&format!("{u}::")))
        })
        .map(|(m, p)| (m.clone(), p.clone()))
        .collect();
    let mods = &mods;
    let reexports = reexports(mods);
    let mut g = Graph::new();
    for (m, path) in mods {
        let code = code_of(&fs::read_to_string(path).expect("read a module"));
        let parent: Vec<String> = {
            let mut p: Vec<String> = m.split("::").map(str::to_string).collect();
            p.pop();
            p
        };
        let mut refs = paths_after(&code, "crate");
        for p in paths_after(&code, "super") {
            let mut full = parent.clone();
            full.extend(p);
            refs.push(full);
        }
        let edges = g.entry(m.clone()).or_default();
        for mut segs in refs {
            if let Some(target) = segs.first().and_then(|s| binding.get(s)) {
                segs[0].clone_from(target);
            }
            let Some(t) = resolve(&segs, mods, &reexports) else {
                continue;
            };
            let structural =
                t == *m || t.starts_with(&format!("{m}::")) || m.starts_with(&format!("{t}::"));
            if !structural {
                edges.insert(t);
            }
        }
    }
    g
}

/// Strongly connected components of two or more modules (Tarjan).
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct State<'g> {
        g: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on: BTreeSet<&'g str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        for w in &s.g[v] {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().expect("on the stack");
                s.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The modules in layer order (each after those it uses), when there is
/// no cycle: `(layer, module)`, layer 0 using no other module.
fn layers(g: &Graph) -> Vec<(usize, String)> {
    let mut layer: BTreeMap<&str, usize> = BTreeMap::new();
    while layer.len() < g.len() {
        let before = layer.len();
        for (m, uses) in g {
            if layer.contains_key(m.as_str()) {
                continue;
            }
            if uses.iter().all(|u| layer.contains_key(u.as_str())) {
                let l = uses
                    .iter()
                    .map(|u| layer[u.as_str()] + 1)
                    .max()
                    .unwrap_or(0);
                layer.insert(m, l);
            }
        }
        if layer.len() == before {
            break;
        }
    }
    let mut out: Vec<(usize, String)> =
        layer.into_iter().map(|(m, l)| (l, m.to_string())).collect();
    out.sort();
    out
}

/// Every binding of the crate's aliases to one of their targets.
fn bindings(aliases: &BTreeMap<String, Vec<String>>) -> Vec<BTreeMap<String, String>> {
    let mut out = vec![BTreeMap::new()];
    for (alias, targets) in aliases {
        out = out
            .into_iter()
            .flat_map(|b| {
                targets.iter().map(move |t| {
                    let mut b = b.clone();
                    b.insert(alias.clone(), t.clone());
                    b
                })
            })
            .collect();
    }
    out
}

#[test]
fn every_crate_keeps_its_modules_in_layers() {
    let mut found = Vec::new();
    for dir in crates() {
        let name = dir
            .file_name()
            .expect("a crate folder")
            .to_string_lossy()
            .into_owned();
        let src = dir.join("src");
        let mods = modules(&src);
        let aliases = aliases(&src, &mods);
        for binding in bindings(&aliases) {
            let g = graph(&mods, &aliases, &binding);
            let how: String = binding
                .iter()
                .map(|(a, t)| [" (", a, " = ", t, ")"].concat())
                .collect();
            let cs = cycles(&g);
            if cs.is_empty() {
                let order: Vec<String> = layers(&g)
                    .into_iter()
                    .map(|(l, m)| format!("{l}:{m}"))
                    .collect();
                println!("{name}{how}: {}", order.join(" "));
            }
            for c in cs {
                println!("{name}{how}: cycle of {}: {}", c.len(), c.join(" "));
                found.push(format!("{name}{how}: {}", c.join(" <-> ")));
            }
        }
    }
    println!("{} cycles", found.len());
    assert!(
        found.is_empty(),
        "module cycles (a lower module reaching back up):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_reader_finds_paths_groups_and_comments() {
    let code =
        code_of("use crate::a::{b, c::{d, e}}; // crate::f\n/* crate::g */ x = super::h::i;");
    assert_eq!(
        paths_after(&code, "crate"),
        [vec!["a", "b"], vec!["a", "c", "d"], vec!["a", "c", "e"]]
            .map(|v| v.into_iter().map(String::from).collect::<Vec<_>>())
    );
    assert_eq!(
        paths_after(&code, "super"),
        [vec!["h".to_string(), "i".to_string()]]
    );
    // `mycrate::x` is not `crate::x`.
    assert!(paths_after("mycrate::x", "crate").is_empty());
}

#[test]
fn a_cycle_is_found() {
    let mut g = Graph::new();
    g.insert("a".into(), ["b".to_string()].into());
    g.insert("b".into(), ["c".to_string()].into());
    g.insert("c".into(), ["a".to_string()].into());
    g.insert("d".into(), ["a".to_string()].into());
    assert_eq!(cycles(&g), [vec!["a", "b", "c"]]);
    g.get_mut("c").expect("c").clear();
    assert!(cycles(&g).is_empty());
    assert_eq!(
        layers(&g),
        [
            (0, "c".into()),
            (1, "b".into()),
            (2, "a".into()),
            (3, "d".into())
        ]
    );
}
