//! Modules import one way (DESIGN.md: "no module imports one that imports
//! it back"): no import cycle among the modules of `src/`, and none that
//! runs through `zero-comm/src/nccl/`.
//!
//! The check reads the sources, not the compiler. Every path that starts
//! with `crate`, `super`, `self` or a module the file declares (in `use`
//! lines and in code alike) is resolved to the file that defines what it
//! names, following re-exports (`pub use error::Error` in `lib.rs` sends
//! `crate::Error` to `error.rs`); comments, string literals and
//! `#[cfg(test)]` modules are left out, and `mod x;` alone is no import.
//!
//! ```text
//!  files ─▶ strip comments/strings/tests ─▶ tokens ─▶ paths (use groups expanded)
//!        ─▶ resolve (re-exports followed) ─▶ graph of files ─▶ strongly
//!           connected components: any with two or more files is a cycle
//! ```
//!
//! A cycle fails with the files in it and, for each import among them, the
//! file and line that makes it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// A module, as the path of segments below the crate root (`[]` is the root).
type ModPath = Vec<String>;

/// An import of one module by another, with where it was seen.
#[derive(Clone)]
struct Witness {
    file: String,
    line: usize,
    path: String,
}

/// Which module a file defines: `lib.rs` the root, `a/mod.rs` and `a.rs`
/// the module `a`, `a/b.rs` the module `a::b`.
fn module_of(rel: &Path) -> ModPath {
    let mut segs: ModPath = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let last = segs.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "lib" && stem != "mod" && stem != "main" {
        segs.push(stem.to_string());
    }
    segs
}

/// Blanks comments, string and char literals (keeping newlines).
fn strip(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && (i == 0 || !ident(b[i - 1]) || b[i - 1] == 'b')
            && {
                let mut j = i + 1;
                while b.get(j) == Some(&'#') {
                    j += 1;
                }
                b.get(j) == Some(&'"')
            }
        {
            let mut j = i + 1;
            let mut hashes = 0;
            while b[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            while j < b.len() {
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                blank(&mut out, b[j]);
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                if i < b.len() {
                    blank(&mut out, b[i]);
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if next == Some('\\') {
                // Past the quote, the backslash and the escaped character.
                i += 3;
                while i < b.len() && b[i] != '\'' {
                    i += 1;
                }
                i += 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Colons,
    Open,
    Close,
    Comma,
    Semi,
    Star,
    Hash,
    Other(char),
}

/// Tokens with their line numbers.
fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let b: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < b.len() {
        let c = b[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphabetic() || c == '_' {
            let s = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push((Tok::Ident(b[s..i].iter().collect()), line));
        } else if c.is_ascii_digit() {
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_' || b[i] == '.') {
                i += 1;
            }
            out.push((Tok::Other('0'), line));
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push((Tok::Colons, line));
            i += 2;
        } else {
            out.push((
                match c {
                    '{' => Tok::Open,
                    '}' => Tok::Close,
                    ',' => Tok::Comma,
                    ';' => Tok::Semi,
                    '*' => Tok::Star,
                    '#' => Tok::Hash,
                    c => Tok::Other(c),
                },
                line,
            ));
            i += 1;
        }
    }
    out
}

/// Drops `#[cfg(test)]` items: the attribute and the item after it (up to
/// its `;`, or its braced body).
fn drop_test_items(toks: Vec<(Tok, usize)>) -> Vec<(Tok, usize)> {
    let is = |t: &[(Tok, usize)], i: usize, want: &[Tok]| {
        want.iter()
            .enumerate()
            .all(|(k, w)| t.get(i + k).map(|x| &x.0) == Some(w))
    };
    let id = |s: &str| Tok::Ident(s.into());
    let cfg_test = [
        Tok::Hash,
        Tok::Other('['),
        id("cfg"),
        Tok::Other('('),
        id("test"),
        Tok::Other(')'),
        Tok::Other(']'),
    ];
    let mut out = Vec::with_capacity(toks.len());
    let mut i = 0;
    while i < toks.len() {
        if !is(&toks, i, &cfg_test) {
            out.push(toks[i].clone());
            i += 1;
            continue;
        }
        i += cfg_test.len();
        while i < toks.len() && toks[i].0 != Tok::Semi && toks[i].0 != Tok::Open {
            i += 1;
        }
        if i < toks.len() && toks[i].0 == Tok::Open {
            let mut depth = 0;
            while i < toks.len() {
                match toks[i].0 {
                    Tok::Open => depth += 1,
                    Tok::Close => depth -= 1,
                    _ => {}
                }
                i += 1;
                if depth == 0 {
                    break;
                }
            }
        } else {
            i += 1;
        }
    }
    out
}

/// A path as written, relative to the module it appears in.
#[derive(Debug, Clone)]
struct RawPath {
    segs: Vec<String>,
    /// The name it is imported as (`use a::b as c;` → `c`), for `use`.
    alias: Option<String>,
    line: usize,
    /// Written in a `pub`/`pub(..)` `use`: a re-export, not an import.
    reexport: bool,
    /// Written in a `use` item.
    used: bool,
    /// The inline module (`mod m { .. }`) it appears in, below the file's.
    inline: ModPath,
}

/// What a file declares and mentions.
#[derive(Default)]
struct Parsed {
    /// Modules declared with `mod x;` or `mod x { .. }` (by inline scope).
    declared: BTreeSet<ModPath>,
    paths: Vec<RawPath>,
}

/// Expands the tree of a `use` item starting at `toks[i]` (after `use`),
/// appending every leaf path; returns the index after it.
fn use_tree(
    toks: &[(Tok, usize)],
    mut i: usize,
    prefix: &[String],
    leaf: &mut dyn FnMut(Vec<String>, Option<String>, usize),
) -> usize {
    let mut segs = prefix.to_vec();
    loop {
        match toks.get(i).map(|t| &t.0) {
            Some(Tok::Ident(s)) => {
                let line = toks[i].1;
                segs.push(s.clone());
                i += 1;
                match toks.get(i).map(|t| &t.0) {
                    Some(Tok::Colons) => i += 1,
                    Some(Tok::Ident(a)) if a == "as" => {
                        let alias = match toks.get(i + 1).map(|t| &t.0) {
                            Some(Tok::Ident(n)) => Some(n.clone()),
                            _ => None,
                        };
                        leaf(segs, alias, line);
                        return i + 2;
                    }
                    _ => {
                        leaf(segs, None, line);
                        return i;
                    }
                }
            }
            Some(Tok::Star) => {
                leaf(segs, Some("*".into()), toks[i].1);
                return i + 1;
            }
            Some(Tok::Open) => {
                i += 1;
                loop {
                    match toks.get(i).map(|t| &t.0) {
                        Some(Tok::Close) => return i + 1,
                        Some(Tok::Comma) => i += 1,
                        None => return i,
                        _ => i = use_tree(toks, i, &segs, leaf),
                    }
                }
            }
            _ => return i,
        }
    }
}

fn parse(code: &str) -> Parsed {
    let toks = drop_test_items(tokens(code));
    let mut p = Parsed::default();
    // Inline modules open now, with the brace depth at which each ends.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let here =
        |inline: &[(String, usize)]| -> ModPath { inline.iter().map(|(m, _)| m.clone()).collect() };
    while i < toks.len() {
        let prev = if i > 0 { Some(&toks[i - 1].0) } else { None };
        match &toks[i].0 {
            Tok::Open => depth += 1,
            Tok::Close => {
                depth -= 1;
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(k) if k == "mod" => {
                if let Some((Tok::Ident(name), _)) = toks.get(i + 1) {
                    let mut m = here(&inline);
                    m.push(name.clone());
                    p.declared.insert(m);
                    if toks.get(i + 2).map(|t| &t.0) == Some(&Tok::Open) {
                        inline.push((name.clone(), depth));
                        depth += 1;
                        i += 3;
                        continue;
                    }
                }
            }
            Tok::Ident(k) if k == "use" && prev != Some(&Tok::Colons) => {
                // `pub use`, `pub(crate) use`: a re-export.
                let pub_at =
                    |k: usize| i >= k && matches!(&toks[i - k].0, Tok::Ident(s) if s == "pub");
                let reexport = pub_at(1) || (pub_at(4) && toks[i - 3].0 == Tok::Other('('));
                let scope = here(&inline);
                let mut found = Vec::new();
                let mut leaf = |segs: Vec<String>, alias: Option<String>, line: usize| {
                    found.push(RawPath {
                        segs,
                        alias,
                        line,
                        reexport,
                        used: true,
                        inline: scope.clone(),
                    })
                };
                i = use_tree(&toks, i + 1, &[], &mut leaf);
                p.paths.extend(found);
                continue;
            }
            // The start of a path in code: `a::b::c`.
            Tok::Ident(first)
                if prev != Some(&Tok::Colons)
                    && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Colons) =>
            {
                let line = toks[i].1;
                let mut segs = vec![first.clone()];
                let mut j = i + 1;
                while toks.get(j).map(|t| &t.0) == Some(&Tok::Colons) {
                    match toks.get(j + 1).map(|t| &t.0) {
                        Some(Tok::Ident(s)) => {
                            segs.push(s.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                p.paths.push(RawPath {
                    segs,
                    alias: None,
                    line,
                    reexport: false,
                    used: false,
                    inline: here(&inline),
                });
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    p
}

/// A crate's files (their paths relative to `src/`, for messages),
/// parsed, and the import graph between them.
struct Crate {
    files: BTreeMap<ModPath, (String, Parsed)>,
}

impl Crate {
    /// Reads every `.rs` file under `src` (except `bin/`, which holds
    /// separate crates).
    fn read(src: &Path) -> Crate {
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            let mut entries: Vec<_> = std::fs::read_dir(dir)
                .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
                .map(|e| e.expect("a directory entry").path())
                .collect();
            entries.sort();
            for p in entries {
                if p.is_dir() {
                    walk(&p, out);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    out.push(p);
                }
            }
        }
        let mut paths = Vec::new();
        walk(src, &mut paths);
        let files = paths
            .into_iter()
            .filter_map(|p| {
                let rel = p.strip_prefix(src).expect("under src").to_path_buf();
                if rel.starts_with("bin") {
                    return None;
                }
                let text = std::fs::read_to_string(&p)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
                Some((rel.to_string_lossy().into_owned(), text))
            })
            .collect::<Vec<_>>();
        Crate::from_sources(&files)
    }

    /// From `(path relative to src, text)` pairs.
    fn from_sources(sources: &[(String, String)]) -> Crate {
        let files = sources
            .iter()
            .map(|(name, text)| {
                let parsed = parse(&strip(text));
                (module_of(Path::new(name)), (name.clone(), parsed))
            })
            .collect();
        Crate { files }
    }

    /// The file module that `abs` (a module or an item path) lands in,
    /// following `use`s of the module that holds the last segment.
    fn resolve(&self, abs: &[String], hops: usize) -> Option<ModPath> {
        if hops > 16 {
            return None;
        }
        // The longest prefix that is a file module.
        let k = (0..=abs.len())
            .rev()
            .find(|&k| self.files.contains_key(&abs[..k]))?;
        let module = abs[..k].to_vec();
        let rest = &abs[k..];
        let Some(name) = rest.first() else {
            return Some(module);
        };
        // A name the module imports or re-exports (at its top level).
        let (_, parsed) = &self.files[&module];
        for p in parsed
            .paths
            .iter()
            .filter(|p| p.used && p.inline.is_empty())
        {
            let as_name = p.alias.as_ref().or(p.segs.last());
            if as_name == Some(name) && p.alias.as_deref() != Some("*") {
                let target = absolute(&module, &[], &p.segs, &parsed.declared)?;
                let mut full = target;
                full.extend(rest[1..].iter().cloned());
                if full == abs {
                    return Some(module);
                }
                return self.resolve(&full, hops + 1);
            }
        }
        // Defined there (an item or an inline module).
        Some(module)
    }

    /// Every import between two files: `(from, to) → first witness`.
    fn edges(&self, node: &dyn Fn(&ModPath) -> ModPath) -> BTreeMap<(ModPath, ModPath), Witness> {
        let mut out = BTreeMap::new();
        for (module, (file, parsed)) in &self.files {
            for p in parsed.paths.iter().filter(|p| !p.reexport) {
                let Some(abs) = absolute(module, &p.inline, &p.segs, &parsed.declared) else {
                    continue;
                };
                let Some(to) = self.resolve(&abs, 0) else {
                    continue;
                };
                let (a, b) = (node(module), node(&to));
                if a != b {
                    out.entry((a, b)).or_insert_with(|| Witness {
                        file: file.clone(),
                        line: p.line,
                        path: p.segs.join("::"),
                    });
                }
            }
        }
        out
    }
}

/// The absolute form of `segs`, written in file module `module` inside its
/// inline module `inline`; `None` for paths into other crates or locals.
fn absolute(
    module: &[String],
    inline: &[String],
    segs: &[String],
    declared: &BTreeSet<ModPath>,
) -> Option<Vec<String>> {
    let mut cur: ModPath = module.iter().chain(inline).cloned().collect();
    let mut rest = segs;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            cur.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                cur.pop()?;
                rest = &rest[1..];
            }
        }
        Some(first) => {
            // A module declared here (`mod x;` or `mod x { .. }`).
            let mut m = inline.to_vec();
            m.push(first.to_string());
            if !declared.contains(&m) {
                return None;
            }
        }
        None => return None,
    }
    cur.extend(rest.iter().cloned());
    Some(cur)
}

/// Strongly connected components with two or more nodes (Tarjan).
fn cycles(edges: &BTreeMap<(ModPath, ModPath), Witness>) -> Vec<Vec<ModPath>> {
    let mut nodes: BTreeSet<ModPath> = BTreeSet::new();
    let mut adj: HashMap<ModPath, Vec<ModPath>> = HashMap::new();
    for (a, b) in edges.keys() {
        nodes.insert(a.clone());
        nodes.insert(b.clone());
        adj.entry(a.clone()).or_default().push(b.clone());
    }
    struct T<'a> {
        adj: &'a HashMap<ModPath, Vec<ModPath>>,
        index: HashMap<ModPath, usize>,
        low: HashMap<ModPath, usize>,
        stack: Vec<ModPath>,
        on: BTreeSet<ModPath>,
        next: usize,
        out: Vec<Vec<ModPath>>,
    }
    fn visit(t: &mut T<'_>, v: &ModPath) {
        t.index.insert(v.clone(), t.next);
        t.low.insert(v.clone(), t.next);
        t.next += 1;
        t.stack.push(v.clone());
        t.on.insert(v.clone());
        for w in t.adj.get(v).cloned().unwrap_or_default() {
            if !t.index.contains_key(&w) {
                visit(t, &w);
                let l = t.low[v].min(t.low[&w]);
                t.low.insert(v.clone(), l);
            } else if t.on.contains(&w) {
                let l = t.low[v].min(t.index[&w]);
                t.low.insert(v.clone(), l);
            }
        }
        if t.low[v] == t.index[v] {
            let mut scc = Vec::new();
            loop {
                let w = t.stack.pop().expect("v is on the stack");
                t.on.remove(&w);
                let done = &w == v;
                scc.push(w);
                if done {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                t.out.push(scc);
            }
        }
    }
    let mut t = T {
        adj: &adj,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in &nodes {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// The cycles among `edges` that `relevant` says concern us, described.
fn describe(
    edges: &BTreeMap<(ModPath, ModPath), Witness>,
    relevant: &dyn Fn(&ModPath) -> bool,
) -> Vec<String> {
    let name = |m: &ModPath| {
        if m.is_empty() {
            "crate".to_string()
        } else {
            m.join("::")
        }
    };
    cycles(edges)
        .into_iter()
        .filter(|scc| scc.iter().any(relevant))
        .map(|scc| {
            let inside: Vec<String> = edges
                .iter()
                .filter(|((a, b), _)| scc.contains(a) && scc.contains(b))
                .map(|((a, b), w)| {
                    format!(
                        "  {} -> {} ({}:{}: {})",
                        name(a),
                        name(b),
                        w.file,
                        w.line,
                        w.path
                    )
                })
                .collect();
            format!(
                "cycle among {}:\n{}",
                scc.iter().map(name).collect::<Vec<_>>().join(", "),
                inside.join("\n")
            )
        })
        .collect()
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The facade's modules (`src/`): no cycles, each file checked on its
/// own. In the engine that means the coordinator (`engine/mod.rs`) is the
/// only file that names `Engine`'s fields: the builder hands it what it
/// built, the optimizer-step tiers (`step/`) and the state reads
/// (`state.rs`, used by `checkpoint.rs` and `export.rs`) borrow its parts
/// through a context struct, and no component imports the coordinator.
#[test]
fn src_modules_import_one_way() {
    let krate = Crate::read(&root().join("src"));
    let edges = krate.edges(&|m: &ModPath| m.clone());
    let found = describe(&edges, &|_| true);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// zero-comm's NCCL backend (`zero-comm/src/nccl/`): no cycle runs through
/// any of its files.
#[test]
fn nccl_modules_import_one_way() {
    let krate = Crate::read(&root().join("zero-comm/src"));
    assert!(
        krate
            .files
            .contains_key(&vec!["nccl".to_string(), "batch".to_string()]),
        "the NCCL backend's files were not found"
    );
    let edges = krate.edges(&|m: &ModPath| m.clone());
    let found = describe(&edges, &|m: &ModPath| {
        m.first().map(String::as_str) == Some("nccl")
    });
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The checker finds cycles through `super::`, `crate::`, use groups,
/// re-exports and declared modules, and ignores comments, strings and
/// test modules.
#[test]
fn the_checker_sees_cycles_and_nothing_else() {
    let src = |files: &[(&str, &str)]| {
        Crate::from_sources(
            &files
                .iter()
                .map(|(n, t)| (n.to_string(), t.to_string()))
                .collect::<Vec<_>>(),
        )
    };
    let all = |k: &Crate| describe(&k.edges(&|m: &ModPath| m.clone()), &|_| true);
    let lib = "mod a; mod b; mod c; pub use b::Thing;";
    // a -> b through a re-export at the root; b -> a through super::{..}.
    let k = src(&[
        ("lib.rs", lib),
        ("a.rs", "use crate::Thing; pub struct A;"),
        ("b.rs", "use super::{a::A, c}; pub struct Thing;"),
        ("c.rs", "pub fn f() {}"),
    ]);
    let found = all(&k);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("cycle among a, b:"), "{}", found[0]);
    assert!(
        found[0].contains("a -> b (a.rs:1: crate::Thing)"),
        "{}",
        found[0]
    );
    assert!(
        found[0].contains("b -> a (b.rs:1: super::a::A)"),
        "{}",
        found[0]
    );

    // A path in code (not a use), three modules round.
    let k = src(&[
        ("lib.rs", lib),
        ("a.rs", "fn f() { crate::b::g(); }"),
        ("b.rs", "pub fn g() { let _ = super::c::h(); }"),
        ("c.rs", "pub fn h() { crate::a::f2(); } pub fn f2() {}"),
    ]);
    assert!(all(&k)[0].starts_with("cycle among a, b, c:"));

    // A child module of a directory module, and its parent.
    let k = src(&[
        ("lib.rs", "mod m;"),
        ("m/mod.rs", "mod x; mod y; use x::X; pub struct M;"),
        ("m/x.rs", "pub struct X; fn f(_: super::y::Y) {}"),
        ("m/y.rs", "pub struct Y;"),
    ]);
    assert!(all(&k).is_empty(), "{:?}", all(&k));
    let k = src(&[
        ("lib.rs", "mod m;"),
        ("m/mod.rs", "mod x; use x::X; pub struct M;"),
        ("m/x.rs", "pub struct X(super::M);"),
    ]);
    assert!(
        all(&k)[0].starts_with("cycle among m, m::x:"),
        "{:?}",
        all(&k)
    );

    // Comments, strings, test modules and other crates are no imports.
    let k = src(&[
        ("lib.rs", lib),
        (
            "a.rs",
            "// use crate::b::Thing;\n/* crate::b::x */ const S: &str = \"crate::b::Thing\";\n\
             const R: &str = r#\"super::b\"#; fn f<'a>(x: &'a str) -> char { 'b' }\n\
             const E: char = '\\''; use std::fmt; use zero_core::b; fn g() { crate::c::f(); }",
        ),
        ("b.rs", "use crate::a::S; pub struct Thing;"),
        (
            "c.rs",
            "pub fn f() {}\n#[cfg(test)]\nmod tests { use crate::a::S; use super::*; }",
        ),
    ]);
    assert!(all(&k).is_empty(), "{:?}", all(&k));
}
