//! Import cycles between modules. Every reference from module A to module B is lifted to
//! the two sibling modules under their lowest common ancestor (`serve::emit` naming
//! `serve::worker::Event` is the edge `emit -> worker`); a module naming its own ancestor
//! or descendant is no edge. A strongly connected component of more than one module is a
//! cycle.

use std::collections::{BTreeMap, BTreeSet};

use crate::tree::{Crate, ModPath, Site};

/// Sibling edges, each with the places that make it.
pub type Edges = BTreeMap<(ModPath, ModPath), BTreeSet<Site>>;

pub struct Report {
    pub edges: Edges,
    /// Each cycle's modules, sorted.
    pub cycles: Vec<Vec<ModPath>>,
}

pub fn check(krate: &Crate) -> Report {
    let mut edges = Edges::new();
    for (path, module) in &krate.modules {
        for reference in &module.references {
            let Some(named) = krate.resolve(path, &reference.segments) else {
                continue;
            };
            let target = krate.module_of(&named);
            let common = path.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common == path.len() || common == target.len() {
                continue;
            }
            let edge = (path[..=common].to_vec(), target[..=common].to_vec());
            edges
                .entry(edge)
                .or_default()
                .insert(reference.site.clone());
        }
    }
    let mut graph: BTreeMap<&ModPath, Vec<&ModPath>> =
        krate.modules.keys().map(|k| (k, Vec::new())).collect();
    for (from, to) in edges.keys() {
        graph.entry(from).or_default().push(to);
    }
    let mut cycles: Vec<Vec<ModPath>> = strongly_connected(&graph)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut c: Vec<ModPath> = c.into_iter().cloned().collect();
            c.sort();
            c
        })
        .collect();
    cycles.sort();
    Report { edges, cycles }
}

/// Tarjan's algorithm.
fn strongly_connected<'a>(
    graph: &BTreeMap<&'a ModPath, Vec<&'a ModPath>>,
) -> Vec<Vec<&'a ModPath>> {
    struct State<'a, 'g> {
        graph: &'g BTreeMap<&'a ModPath, Vec<&'a ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on_stack: BTreeSet<&'a ModPath>,
        out: Vec<Vec<&'a ModPath>>,
    }
    fn visit<'a>(s: &mut State<'a, '_>, v: &'a ModPath) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for &w in s.graph.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(component);
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}
