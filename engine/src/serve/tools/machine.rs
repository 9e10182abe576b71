//! mlx-lm's `TextStateMachine` (generate.py): decoded text is matched, character by
//! character, against each state's marker strings (an Aho-Corasick automaton per state);
//! a marker switches state and is cut out, and text that may still be the start of a
//! marker is held back until it is known not to be one.

use std::collections::HashMap;

/// Where generated text belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    Normal,
    Reasoning,
    Tool,
}

#[derive(Debug, Default)]
struct Node {
    next: HashMap<char, usize>,
    fail: usize,
    /// A marker ends here (or at a suffix): its length in chars and its edge index.
    hit: Option<(usize, usize)>,
}

/// One state's automaton over its markers, and where each marker leads.
#[derive(Debug)]
struct Trie {
    nodes: Vec<Node>,
    to: Vec<State>,
}

impl Trie {
    fn new(edges: &[(String, State)]) -> Self {
        let mut nodes = vec![Node::default()];
        for (idx, (marker, _)) in edges.iter().enumerate() {
            if marker.is_empty() {
                continue;
            }
            let mut at = 0;
            for c in marker.chars() {
                at = match nodes[at].next.get(&c) {
                    Some(&n) => n,
                    None => {
                        nodes.push(Node::default());
                        let n = nodes.len() - 1;
                        nodes[at].next.insert(c, n);
                        n
                    }
                };
            }
            nodes[at].hit = Some((marker.chars().count(), idx));
        }
        // Breadth first: failure links, and matches inherited from them.
        let mut queue: std::collections::VecDeque<usize> =
            nodes[0].next.values().copied().collect();
        while let Some(parent) = queue.pop_front() {
            let children: Vec<(char, usize)> =
                nodes[parent].next.iter().map(|(c, n)| (*c, *n)).collect();
            for (c, child) in children {
                queue.push_back(child);
                let mut fail = nodes[parent].fail;
                while !nodes[fail].next.contains_key(&c) && fail != 0 {
                    fail = nodes[fail].fail;
                }
                let target = nodes[fail]
                    .next
                    .get(&c)
                    .copied()
                    .filter(|&t| t != child)
                    .unwrap_or(0);
                nodes[child].fail = target;
                if nodes[child].hit.is_none() {
                    nodes[child].hit = nodes[target].hit;
                }
            }
        }
        Trie {
            nodes,
            to: edges.iter().map(|(_, s)| *s).collect(),
        }
    }
}

/// The transitions of every state.
#[derive(Debug)]
pub struct Machine {
    tries: HashMap<State, Trie>,
}

/// One request's place in the machine: state, automaton node, text held back.
#[derive(Debug, Clone)]
pub struct Cursor {
    pub state: State,
    node: usize,
    held: Vec<char>,
}

impl Machine {
    pub fn new(transitions: &[(State, Vec<(String, State)>)]) -> Self {
        let mut tries: HashMap<State, Trie> = transitions
            .iter()
            .map(|(s, edges)| (*s, Trie::new(edges)))
            .collect();
        for s in [State::Normal, State::Reasoning, State::Tool] {
            tries.entry(s).or_insert_with(|| Trie::new(&[]));
        }
        Machine { tries }
    }

    pub fn start(&self, state: State) -> Cursor {
        Cursor {
            state,
            node: 0,
            held: Vec::new(),
        }
    }

    /// `TextStateMachine.split`: one (state, text) segment per state passed, markers cut
    /// out, a possible marker start held back; the last segment is the current state's.
    pub fn split(&self, cur: &mut Cursor, text: &str) -> Vec<(State, String)> {
        let start = cur.held.len();
        let mut buf = std::mem::take(&mut cur.held);
        buf.extend(text.chars());
        let mut s = cur.state;
        let mut trie = &self.tries[&s];
        let mut n = cur.node;
        let mut segments = Vec::new();
        let (mut begin, mut consumed) = (0, 0);
        for i in start..buf.len() {
            let ch = buf[i];
            while !trie.nodes[n].next.contains_key(&ch) && n != 0 {
                n = trie.nodes[n].fail;
            }
            if let Some(&next) = trie.nodes[n].next.get(&ch) {
                n = next;
            }
            if let Some((len, idx)) = trie.nodes[n].hit {
                let end = (i + 1).saturating_sub(len).max(begin);
                segments.push((s, buf[begin..end].iter().collect()));
                begin = i + 1;
                consumed = i + 1;
                s = trie.to[idx];
                trie = &self.tries[&s];
                n = 0;
            } else if n == 0 {
                consumed = i + 1;
            }
        }
        segments.push((s, buf[begin..consumed].iter().collect()));
        cur.state = s;
        cur.node = n;
        cur.held = buf.split_off(consumed);
        segments
    }

    /// `TextStateMachine.flush`: the held text, released in the current state.
    pub fn flush(&self, cur: &mut Cursor) -> String {
        cur.node = 0;
        std::mem::take(&mut cur.held).into_iter().collect()
    }

    /// `TextStateMachine.discard`: the held text, dropped.
    pub fn discard(&self, cur: &mut Cursor) {
        cur.node = 0;
        cur.held.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen() -> Machine {
        let s = |x: &str| x.to_owned();
        Machine::new(&[
            (
                State::Normal,
                vec![
                    (s("<think>"), State::Reasoning),
                    (s("<tool_call>"), State::Tool),
                ],
            ),
            (
                State::Reasoning,
                vec![
                    (s("</think>"), State::Normal),
                    (s("<tool_call>"), State::Tool),
                ],
            ),
            (State::Tool, vec![(s("</tool_call>"), State::Normal)]),
        ])
    }

    /// Every segment of a run of pieces, joined per state change, and the held text.
    fn run(m: &Machine, pieces: &[&str]) -> (Vec<Vec<(State, String)>>, String) {
        let mut cur = m.start(State::Normal);
        let out = pieces.iter().map(|p| m.split(&mut cur, p)).collect();
        (out, cur.held.iter().collect())
    }

    #[test]
    fn markers_split_and_partial_markers_wait() {
        use State::*;
        let m = qwen();
        // Expected: mlx_lm.generate.TextStateMachine.split over the same pieces (0.32.2).
        let (segs, held) = run(
            &m,
            &[
                "<th",
                "ink>why",
                "</think>ok <",
                "tool_call>{}</tool_call>",
                "<t",
            ],
        );
        let want: Vec<Vec<(State, String)>> = vec![
            vec![(Normal, "".into())],
            vec![(Normal, "".into()), (Reasoning, "why".into())],
            vec![(Reasoning, "".into()), (Normal, "ok ".into())],
            vec![
                (Normal, "".into()),
                (Tool, "{}".into()),
                (Normal, "".into()),
            ],
            vec![(Normal, "".into())],
        ];
        assert_eq!(segs, want);
        assert_eq!(held, "<t");
        // A held prefix that fails is released, including a shorter marker start in it.
        let (segs, _) = run(&m, &["a<thin", "<think>b"]);
        assert_eq!(
            segs[1],
            vec![(Normal, "<thin".into()), (Reasoning, "b".into())]
        );
    }
}
