//! The grammar engine's limits, set explicitly: a request's grammar must not hold a
//! request thread for long nor take much memory, whatever a client sends. llguidance
//! counts its work in "fuel" and items and refuses a grammar (or a step) over a limit;
//! those refusals, and a grammar text over [`MAX_GRAMMAR_BYTES`], are a 400 with the
//! reason (the CLI says the same).
//!
//! The values (llguidance 1.9.1's own defaults where they are already tight, its speed
//! figures in brackets): a grammar of at most 500 000 symbols ("a few megabytes of JSON";
//! the FHIR schema is ~200k), 1M fuel to build the lexer (~20 ms), 200k lexer fuel and
//! 50k Earley items per token mask (~15 ms and ~3 ms: the worst step's time), 2 000 items
//! per row; lexer states cut to 50 000 (from 250 000; each is 1–2 kB, so ~100 MB at
//! worst); errors without the parser state and grammar (not echoed to a client).

use llguidance::api::ParserLimits;

use super::Grammar;

/// The largest grammar text accepted, in bytes (a schema as compact JSON): the server's
/// default body limit.
pub const MAX_GRAMMAR_BYTES: usize = 4 << 20;

/// The parser limits every grammar is compiled under.
pub const LIMITS: ParserLimits = ParserLimits {
    max_items_in_row: 2_000,
    initial_lexer_fuel: 1_000_000,
    step_lexer_fuel: 200_000,
    step_max_items: 50_000,
    max_lexer_states: 50_000,
    max_grammar_size: 500_000,
    precompute_large_lexemes: true,
    verbose_errors: false,
};

/// The limits a server sets (`engine serve --grammar-*`); the others stay [`LIMITS`]'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    /// Lexer fuel to compile a grammar (`initial_lexer_fuel`): its compile time.
    pub compile_fuel: u64,
    /// Lexer fuel per token mask (`step_lexer_fuel`).
    pub step_fuel: u64,
    /// Earley items per token mask (`step_max_items`): with the fuel, a step's time.
    pub step_items: usize,
}

impl Default for Work {
    fn default() -> Self {
        Work {
            compile_fuel: LIMITS.initial_lexer_fuel,
            step_fuel: LIMITS.step_lexer_fuel,
            step_items: LIMITS.step_max_items,
        }
    }
}

static WORK: std::sync::OnceLock<Work> = std::sync::OnceLock::new();

/// Sets the process's grammar work limits, before any grammar is compiled (a server's
/// startup); false when they were set (or used) already with other values.
pub fn set_work(work: Work) -> bool {
    *WORK.get_or_init(|| work) == work
}

/// The limits grammars are compiled under: [`LIMITS`] with the process's `Work`.
pub(super) fn current() -> ParserLimits {
    let mut w = *WORK.get_or_init(Work::default);
    // Planted: the server's --grammar-* flags are ignored (caught by
    // engine/tests/it/constrained_fuzz.rs).
    if crate::plant::is(crate::plant::Defect::GrammarLimitsIgnored) {
        w = Work::default();
    }
    ParserLimits {
        initial_lexer_fuel: w.compile_fuel,
        step_lexer_fuel: w.step_fuel,
        step_max_items: w.step_items,
        ..LIMITS
    }
}

/// Refuses a grammar text over [`MAX_GRAMMAR_BYTES`] before it is compiled.
pub(super) fn check_size(grammar: &Grammar) -> Result<(), String> {
    let size = grammar.size();
    if size > MAX_GRAMMAR_BYTES {
        return Err(format!(
            "the grammar is {size} bytes; at most {MAX_GRAMMAR_BYTES} are accepted"
        ));
    }
    if let Grammar::Lark(text) = grammar {
        let rules = text.lines().filter(|l| defines_rule(l)).count();
        if rules > MAX_LARK_RULES {
            return Err(format!(
                "the grammar defines {rules} rules; at most {MAX_LARK_RULES} are accepted \
                 (llguidance compiles rule references recursively: 30 000 chained rules \
                 overflow a thread's stack)"
            ));
        }
    }
    Ok(())
}

/// The most rules a Lark grammar may define (measured: 30 000 chained rules overflow a
/// 2 MiB thread stack in llguidance's compiler, so do 2 000 in a debug build; 500 compile there).
pub const MAX_LARK_RULES: usize = 500;

/// Whether a Lark line starts a rule or token definition (`name:`, `name[lazy]:`, `?name:`).
fn defines_rule(line: &str) -> bool {
    let t = line.trim_start().trim_start_matches(['?', '!']);
    let name_end = t
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(t.len());
    if name_end == 0 {
        return false;
    }
    let rest = t[name_end..].trim_start();
    let rest = match rest.strip_prefix('[') {
        Some(r) => r
            .split_once(']')
            .map_or("", |(_, after)| after.trim_start()),
        None => rest,
    };
    rest.starts_with(':')
}

/// The longest error text passed on (llguidance's can quote a grammar).
const MAX_MESSAGE: usize = 600;

/// Whether llguidance's error `e` is one of its limits.
pub(super) fn is_limit(e: &str) -> bool {
    let e = e.to_lowercase();
    let marks = [
        "too big",
        "limit",
        "fuel",
        "max is",
        "max_items",
        "states",
        "too many",
    ];
    marks.iter().any(|k| e.contains(k))
}

/// llguidance's error `e`, said as a limit where it is one, and cut to a readable length.
pub(super) fn explain(e: &str) -> String {
    // llguidance ends some errors with a marker of its non-verbose mode.
    let e = e.trim_end().trim_end_matches("<non-verbose/>").trim_end();
    let mut text = if is_limit(e) {
        format!("the grammar is over this engine's grammar limits ({e})")
    } else {
        e.to_owned()
    };
    if text.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}
