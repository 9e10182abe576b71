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
    let cycles = cycles_in(krate.modules.keys(), edges.keys().map(|(a, b)| (a, b)));
    Report { edges, cycles }
}

/// The cycles of a graph: its strongly connected components of more than one node, each
/// sorted, in order.
pub fn cycles_in<'a, T: Ord + Clone + 'a>(
    nodes: impl IntoIterator<Item = &'a T>,
    edges: impl IntoIterator<Item = (&'a T, &'a T)>,
) -> Vec<Vec<T>> {
    let mut graph: BTreeMap<&T, Vec<&T>> = nodes.into_iter().map(|k| (k, Vec::new())).collect();
    for (from, to) in edges {
        graph.entry(from).or_default().push(to);
    }
    let mut cycles: Vec<Vec<T>> = strongly_connected(&graph)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut c: Vec<T> = c.into_iter().cloned().collect();
            c.sort();
            c
        })
        .collect();
    cycles.sort();
    cycles
}

/// Tarjan's algorithm: the strongly connected components of `graph` (node -> successors).
fn strongly_connected<'a, T: Ord>(graph: &BTreeMap<&'a T, Vec<&'a T>>) -> Vec<Vec<&'a T>> {
    struct State<'a, 'g, T> {
        graph: &'g BTreeMap<&'a T, Vec<&'a T>>,
        index: BTreeMap<&'a T, usize>,
        low: BTreeMap<&'a T, usize>,
        stack: Vec<&'a T>,
        on_stack: BTreeSet<&'a T>,
        out: Vec<Vec<&'a T>>,
    }
    fn visit<'a, T: Ord>(s: &mut State<'a, '_, T>, v: &'a T) {
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
