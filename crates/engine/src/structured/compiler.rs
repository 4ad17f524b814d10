//! Compiling constraints into grammars, once per distinct constraint. The token environment and
//! llguidance's parser factory are built on first use (about a second for a 152k vocabulary),
//! and compiled grammars are kept in a small most-recently-used cache, since agent frameworks
//! send the same schema with every call. The cache is bounded by the bytes its grammars' lexers
//! hold, not only by their count: a 30-byte regex such as `(ab){300}{300}` builds a lexer of
//! 180,000 states (over 100 MB), and 64 of those would be gigabytes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::earley::Parser;
use llguidance::{Matcher, ParserFactory};

use super::compile_queue::{CompileQueue, CompileStats, CompileTicket};
use super::{bounds, schema, tok_env, Constraint};
use crate::tokenizer::Tokenizer;

/// Compiled grammars kept for reuse.
pub const CACHE_ENTRIES: usize = 64;

/// Most bytes the cached grammars' lexers may hold together (llguidance's estimate, about half
/// the RSS measured; it grows as generation explores new lexer states); past it the least
/// recently used go.
pub const CACHE_BYTES: usize = 64 << 20;

/// Most bytes (llguidance's estimate) a grammar's lexer may hold once compiled and walked for
/// its first tokens. The tests' JSON schemas, tool grammars and 4,096-way choices hold 30–250 kB;
/// `(ab){300}{300}` forces its 180,000 characters at once, one lexer state each: 56 MB by the
/// estimate, 110–145 MB of RSS measured, cached for reuse. Forced bytes are not held to
/// llguidance's state limit (it applies while masks are computed), so the size is checked here.
const MAX_LEXER_BYTES: usize = 16 << 20;

/// Most lexer states a grammar may build while masks are computed (llguidance's default is
/// 250,000, ~80 MB by its estimate of ~310 bytes a state): the same order as [`MAX_LEXER_BYTES`].
const MAX_LEXER_STATES: usize = 50_000;

/// Most grammar symbols one constraint may compile to (llguidance's default is 500,000, a few
/// megabytes of schema; a request body is far smaller, so a bigger grammar is an attack).
const MAX_GRAMMAR_SIZE: usize = 200_000;

/// Tokens a new grammar is walked for before it is accepted (see [`dry_run`]).
const DRY_RUN_TOKENS: usize = 4;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The constraint itself is wrong: a bad schema, an unsupported keyword, a malformed regex
    /// or grammar, or one too large to compile within the limits.
    #[error("{0}")]
    Invalid(String),
    /// This model cannot take constraints at all (its vocabulary or EOS ids do not fit).
    #[error("structured output is unavailable for this model: {0}")]
    Unavailable(String),
}

/// A compiled constraint, shared by every sample that uses it; each starts its own walk.
#[derive(Clone)]
pub struct CompiledGrammar {
    key: Arc<str>,
    proto: Arc<Matcher>,
    /// The vocabulary's whitespace-only tokens as a bitset (see [`GrammarState`]'s reasoning gate).
    pub(crate) whitespace: Arc<Vec<u32>>,
}

impl CompiledGrammar {
    /// A fresh matcher at the start of the grammar. It shares the prototype's lexer cache (a
    /// mutex inside llguidance), so a lexer state one sample built serves every other: measured
    /// at 16 sequences, deep copies (each building its own) were no faster on two cores.
    pub(crate) fn start(&self) -> Matcher {
        self.proto.as_ref().clone()
    }
}

impl PartialEq for CompiledGrammar {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown: String = self.key.chars().take(60).collect();
        write!(f, "CompiledGrammar({shown:?})")
    }
}

/// What every grammar of a model shares, built on first use.
struct Vocabulary {
    factory: ParserFactory,
    whitespace: Arc<Vec<u32>>,
}

/// A cached grammar and a handle on its lexer, to weigh it.
struct CacheEntry {
    key: Arc<str>,
    grammar: CompiledGrammar,
    /// A clone of the grammar's parser: it shares the lexer every walk of the grammar grows.
    lexer: Parser,
    /// The bytes it held when last weighed (at insertion and at each hit).
    bytes: usize,
}

impl CacheEntry {
    fn new(key: Arc<str>, grammar: CompiledGrammar, lexer: Parser) -> Self {
        let mut e = Self { key, grammar, lexer, bytes: 0 };
        e.weigh();
        e
    }

    /// Re-read the lexer's size (it takes the lexer's lock, which a walk holds for a mask).
    fn weigh(&mut self) {
        self.bytes = self.lexer.lexer_stats().num_bytes + self.key.len();
    }
}

/// Turns [`Constraint`]s into [`CompiledGrammar`]s for one model's vocabulary.
pub struct GrammarCompiler {
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    eos: Vec<u32>,
    max_grammar_size: usize,
    cache_bytes: usize,
    factory: OnceLock<Result<Vocabulary, String>>,
    cache: Mutex<VecDeque<CacheEntry>>,
    queue: Arc<CompileQueue>,
}

impl Drop for GrammarCompiler {
    fn drop(&mut self) {
        self.queue.close();
    }
}

impl GrammarCompiler {
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos: Vec<u32>) -> Self {
        Self {
            tokenizer,
            vocab_size,
            eos,
            max_grammar_size: MAX_GRAMMAR_SIZE,
            cache_bytes: CACHE_BYTES,
            factory: OnceLock::new(),
            cache: Mutex::new(VecDeque::new()),
            queue: Arc::new(CompileQueue::new()),
        }
    }

    /// How many compiles may run at once on the compile threads (set before the first
    /// [`submit`](Self::submit); see [`super::compile_queue`]).
    pub fn set_compile_threads(&self, n: usize) {
        self.queue.set_threads(n);
    }

    /// What the compile threads have done so far.
    pub fn compile_stats(&self) -> CompileStats {
        self.queue.stats()
    }

    /// Compile `c` on the compile threads (a cached grammar answers at once). Drop the ticket to
    /// withdraw a compile no one waits for any more.
    pub fn submit(self: &Arc<Self>, c: Constraint) -> CompileTicket {
        match self.cached(&c.key()) {
            Some(g) => CompileTicket::ready(Ok(g)),
            None => self.queue.submit(self, c),
        }
    }

    /// Build the token environment now rather than on the first constrained request.
    pub fn warm_up(&self) -> Result<(), GrammarError> {
        self.factory().map(|_| ())
    }

    fn factory(&self) -> Result<&Vocabulary, GrammarError> {
        let f = self.factory.get_or_init(|| {
            let env = tok_env::build(&self.tokenizer, self.vocab_size, &self.eos)?;
            let whitespace = Arc::new(tok_env::whitespace_tokens(&env));
            let mut f = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            f.quiet();
            f.limits_mut().max_grammar_size = self.max_grammar_size;
            f.limits_mut().max_lexer_states = MAX_LEXER_STATES;
            // Errors go to clients: the cause, not the parser's state dump.
            f.limits_mut().verbose_errors = false;
            Ok(Vocabulary { factory: f, whitespace })
        });
        f.as_ref().map_err(|e| GrammarError::Unavailable(e.clone()))
    }

    /// The compiled grammar of `c`, from the cache or compiled now (bounded by llguidance's
    /// fuel and size limits, so a hostile schema fails instead of running on), on the calling
    /// thread: its stack must hold what [`bounds::MAX_LEVELS`] allows (the compile threads' do;
    /// serve requests through [`submit`](Self::submit)).
    pub fn compile(&self, c: &Constraint) -> Result<CompiledGrammar, GrammarError> {
        let key: Arc<str> = c.key().into();
        if let Some(g) = self.cached(&key) {
            return Ok(g);
        }
        let levels = c.levels();
        if levels > bounds::MAX_LEVELS {
            return Err(GrammarError::Invalid(format!(
                "the {} nests too deeply: its rules, references and groups could chain {levels} levels \
                 deep; at most {} are allowed",
                c.kind(),
                bounds::MAX_LEVELS
            )));
        }
        let run = c.optional_run();
        if run > schema::MAX_OPTIONAL_RUN {
            return Err(GrammarError::Invalid(format!(
                "an object of the {} has {run} optional properties in a row; at most {} are allowed \
                 (mark some `required`, or split the object)",
                c.kind(),
                schema::MAX_OPTIONAL_RUN
            )));
        }
        let Vocabulary { factory, whitespace } = self.factory()?;
        let invalid = |e: &str| GrammarError::Invalid(first_lines(e));
        let parser = factory.create_parser(c.grammar()).map_err(|e| invalid(&e.to_string()))?;
        let lexer = parser.parser.clone();
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(&e));
        }
        // A grammar that can neither produce a token nor end would stall its sample.
        let mask = matcher.compute_mask().map_err(|e| invalid(&e.to_string()))?;
        if mask.is_zero() {
            return Err(GrammarError::Invalid("the grammar matches nothing".into()));
        }
        dry_run(&matcher)?;
        let built = lexer.lexer_stats();
        if built.num_bytes > MAX_LEXER_BYTES {
            return Err(GrammarError::Invalid(format!(
                "the {} needs a lexer of {} states ({} MB) for its first tokens; at most {} MB are allowed \
                 (a long literal or a nested repeat such as (ab){{300}}{{300}} builds one state per character)",
                c.kind(),
                built.num_states,
                built.num_bytes >> 20,
                MAX_LEXER_BYTES >> 20
            )));
        }
        let g = CompiledGrammar { key: key.clone(), proto: Arc::new(matcher), whitespace: whitespace.clone() };
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.retain(|e| e.key != key);
        cache.push_front(CacheEntry::new(key, g.clone(), lexer));
        evict(&mut cache, self.cache_bytes);
        Ok(g)
    }

    fn cached(&self, key: &str) -> Option<CompiledGrammar> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let i = cache.iter().position(|e| &*e.key == key)?;
        let mut entry = cache.remove(i)?;
        let g = entry.grammar.clone();
        // Its lexer may have grown since it was weighed.
        entry.weigh();
        cache.push_front(entry);
        evict(&mut cache, self.cache_bytes);
        Some(g)
    }

    /// What the cache holds: (grammars, bytes their lexers held when last weighed).
    #[cfg(test)]
    pub(crate) fn cache_usage(&self) -> (usize, usize) {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        (cache.len(), cache.iter().map(|e| e.bytes).sum())
    }
}

/// Drop the least recently used grammars past the count or the byte budget (a grammar too big
/// for the budget alone is not kept; the requests using it still hold it).
fn evict(cache: &mut VecDeque<CacheEntry>, budget: usize) {
    cache.truncate(CACHE_ENTRIES);
    let mut bytes: usize = cache.iter().map(|e| e.bytes).sum();
    while bytes > budget {
        match cache.pop_back() {
            Some(e) => bytes -= e.bytes,
            None => break,
        }
    }
}

/// Walk a copy of a new grammar for a few tokens, always taking the lowest allowed id (the short
/// byte-level tokens, which keep the most alternatives alive). llguidance checks some limits only
/// once tokens arrive: an Earley row of more than 2,000 items (a rule of 20,000 alternatives), a
/// lexer that grows past its budget (`a{1000}{1000}`). Found here, they are the client's 400;
/// found while generating, they were a 500 in the middle of a request.
fn dry_run(matcher: &Matcher) -> Result<(), GrammarError> {
    let mut m = matcher.deep_clone();
    let eos = m.tok_env().map(|env| env.tok_trie().eos_tokens().to_vec()).unwrap_or_default();
    for _ in 0..DRY_RUN_TOKENS {
        if m.is_stopped() {
            break;
        }
        let mask = m.compute_mask().map_err(|e| GrammarError::Invalid(first_lines(&e.to_string())))?;
        let allowed = mask
            .as_slice()
            .iter()
            .enumerate()
            .flat_map(|(w, &bits)| (0..32u32).filter(move |b| bits >> b & 1 == 1).map(move |b| w as u32 * 32 + b));
        let Some(token) = allowed.into_iter().find(|t| !eos.contains(t)) else { break };
        m.consume_token(token).map_err(|e| GrammarError::Invalid(first_lines(&e.to_string())))?;
    }
    Ok(())
}

/// llguidance's messages can quote a whole grammar; a client needs the first lines. A limit it
/// enforces by assertion arrives as a caught panic with a backtrace: the assertion is enough.
fn first_lines(msg: &str) -> String {
    if let Some(rest) = msg.strip_prefix("panic: ") {
        let what = rest.lines().next().unwrap_or(rest);
        return format!("the grammar is too large for the compiler ({what})");
    }
    let lines: Vec<&str> = msg.lines().take(4).collect();
    let mut s = lines.join("\n");
    if s.len() > 600 {
        let cut = (0..=600).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::OnceLock;

    use serde_json::json;

    use super::*;
    use crate::structured::bounds::tests::{ref_chain, rule_chain};
    use crate::structured::GrammarState;

    /// Qwen's padded vocabulary and its two EOS ids.
    pub const VOCAB: usize = 151_936;
    pub const EOS: [u32; 2] = [151_645, 151_643];

    /// One compiler for every test here: building the token trie takes a second.
    pub fn compiler() -> &'static GrammarCompiler {
        static C: OnceLock<GrammarCompiler> = OnceLock::new();
        C.get_or_init(|| {
            let tok = Arc::new(Tokenizer::builtin_qwen().unwrap());
            GrammarCompiler::new(tok, VOCAB, EOS.to_vec())
        })
    }

    fn tok() -> &'static Tokenizer {
        &compiler().tokenizer
    }

    fn allowed(words: &[u32], id: u32) -> bool {
        words.get(id as usize / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
    }

    /// Feed `text`'s tokens, checking each against the mask first; returns whether all passed.
    fn walk(g: &mut GrammarState, text: &str) -> bool {
        let mut words = Vec::new();
        for t in tok().encode(text, false).unwrap() {
            if g.is_active() && (g.mask(&EOS, &mut words).is_err() || !allowed(&words, t)) {
                return false;
            }
            if g.advance(t, &EOS).is_err() {
                return false;
            }
        }
        true
    }

    #[test]
    fn bad_constraints_are_errors_that_say_why() {
        let c = compiler();
        let err = |k: Constraint| match c.compile(&k) {
            Err(GrammarError::Invalid(m)) => m,
            Err(other) => panic!("{} failed otherwise: {other}", k.key().chars().take(80).collect::<String>()),
            Ok(_) => panic!("{} compiled", k.key().chars().take(80).collect::<String>()),
        };
        assert!(err(Constraint::JsonSchema(json!({"type": "strin"}))).contains("strin"));
        assert!(err(Constraint::JsonSchema(json!({"$dynamicRef": "#m"}))).contains("$dynamicRef"));
        assert!(err(Constraint::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})))
            .contains("nsatisfiable"));
        assert!(err(Constraint::Regex("a(b".into())).contains("regex"));
        assert!(err(Constraint::Lark("start: foo".into())).contains("foo"));
        // More grammar symbols than the limit (lowered here: the real one takes a big grammar).
        let mut small = GrammarCompiler::new(c.tokenizer.clone(), VOCAB, EOS.to_vec());
        small.max_grammar_size = 100;
        let many: Vec<String> = (0..200).map(|i| format!("\"c{i}\"")).collect();
        match small.compile(&Constraint::Lark(format!("start: {}", many.join(" | ")))) {
            Err(GrammarError::Invalid(m)) => assert!(m.contains("too big"), "{m}"),
            other => panic!("{:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn deep_chains_are_refused_before_they_can_recurse() {
        // The test thread's stack is 2 MiB, where these chains aborted the process at depth
        // ~800: refused by the bound, they never reach the compiler.
        let c = compiler();
        for k in [Constraint::Lark(rule_chain(10_000)), Constraint::JsonSchema(ref_chain(10_000))] {
            match c.compile(&k) {
                Err(GrammarError::Invalid(m)) => assert!(m.contains("nests too deeply"), "{m}"),
                other => panic!("{:?}", other.map(|_| ())),
            }
        }
        // Chains within the bound compile, on a stack like the compile threads'.
        let ok = std::thread::Builder::new()
            .stack_size(super::super::compile_queue::STACK_BYTES)
            .spawn(|| {
                compiler().compile(&Constraint::Lark(rule_chain(900)))?;
                compiler().compile(&Constraint::JsonSchema(ref_chain(2_000)))
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(ok.is_ok(), "{:?}", ok.map(|_| ()));
    }

    #[test]
    fn limits_llguidance_checks_only_at_the_first_tokens_are_found_at_compile() {
        let c = compiler();
        let invalid = |k: Constraint| match c.compile(&k) {
            Err(GrammarError::Invalid(m)) => m,
            other => panic!("{:?}", other.map(|_| ())),
        };
        // These passed the compile and failed at the first generated token (a 500).
        assert!(invalid(Constraint::Regex("a{1000}{1000}".into())).contains("lexer"));
        let alts: Vec<String> = (0..20_000).map(|i| format!("\"w{i}\"")).collect();
        assert!(invalid(Constraint::Lark(format!("start: {}", alts.join(" | ")))).contains("items"));
        // 8,000 optional properties compiled for 6.7 s before failing at the first property; past
        // the run llguidance can walk, they are refused before compiling.
        let props: serde_json::Map<String, serde_json::Value> =
            (0..8000).map(|i| (format!("p{i}"), json!({"type": "integer"}))).collect();
        assert!(invalid(Constraint::JsonSchema(json!({"properties": props}))).contains("optional properties"));
        // A choice list up to the API's limit is one terminal, not 4,096 Earley items.
        let choices: Vec<String> = (0..4096).map(|i| format!("option number {i}")).collect();
        let g = c.compile(&Constraint::Choice(choices)).unwrap();
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(walk(&mut s, "option number 4095"));
        assert!(s.is_finished());
        let g = c.compile(&Constraint::Choice(vec!["".into(), "a".into(), "ab".into()])).unwrap();
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(walk(&mut s, "ab") && s.is_finished());
    }

    #[test]
    fn tool_schemas_keep_their_definitions() {
        // What Pydantic (and openai.pydantic_function_tool) emit for a nested model.
        let parameters = json!({
            "type": "object",
            "properties": {"owner": {"$ref": "#/$defs/Person"}, "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}}},
            "required": ["owner", "tags"],
            "$defs": {
                "Person": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                "Tag": {"type": "string", "enum": ["a", "b"]}
            }
        });
        let tools = vec![
            crate::structured::ToolSchema { name: "save".into(), parameters },
            crate::structured::ToolSchema { name: "other".into(), parameters: ref_chain(3) },
        ];
        let g = compiler().compile(&Constraint::ToolCalls { tools, parallel: false, optional: false }).unwrap();
        let call = "<tool_call>\n{\"name\": \"save\", \"arguments\": {\"owner\": {\"name\": \"Ada\"}, \"tags\": [\"a\"]}}\n</tool_call>";
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(walk(&mut s, call));
        assert!(s.is_finished());
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(!walk(&mut s, "<tool_call>\n{\"name\": \"save\", \"arguments\": {\"owner\": {\"name\": 1"));
        // Objects that list properties are closed: no extra key in the nested model.
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(!walk(
            &mut s,
            "<tool_call>\n{\"name\": \"save\", \"arguments\": {\"owner\": {\"name\": \"Ada\", \"age\""
        ));
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(walk(&mut s, "<tool_call>\n{\"name\": \"other\", \"arguments\": \"text\"}\n</tool_call>"));
    }

    #[test]
    fn extra_keys_are_refused_unless_the_schema_allows_them() {
        let c = compiler();
        let closed = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let g = c.compile(&Constraint::JsonSchema(closed)).unwrap();
        assert!(!walk(&mut GrammarState::new(&g, None).unwrap(), "{\"a\": 1, \"b\""));
        assert!(walk(&mut GrammarState::new(&g, None).unwrap(), "{\"a\": 1}"));
        let open = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": true});
        let g = c.compile(&Constraint::JsonSchema(open)).unwrap();
        assert!(walk(&mut GrammarState::new(&g, None).unwrap(), "{\"a\": 1, \"b\": 2}"));
    }

    #[test]
    fn queued_compiles_run_at_most_threads_at_once_and_not_for_nobody() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(queued_compiles());
    }

    async fn queued_compiles() {
        let tok = Arc::new(Tokenizer::builtin_qwen().unwrap());
        let c = Arc::new(GrammarCompiler::new(tok, VOCAB, EOS.to_vec()));
        c.set_compile_threads(1);
        c.warm_up().unwrap();
        // Slow enough (a few hundred ms) that the next ones are still queued behind it.
        let slow = |i: usize| {
            let names: Vec<String> = (0..30).map(|q| format!("q{q}")).collect();
            let inner = json!({"type": "object", "properties": names.iter().map(|q| (q.clone(), json!({"type": "string", "maxLength": 50}))).collect::<serde_json::Map<_, _>>(), "required": names});
            let names: Vec<String> = (0..300).map(|p| format!("p{i}_{p}")).collect();
            let props: serde_json::Map<_, _> = names.iter().map(|p| (p.clone(), inner.clone())).collect();
            Constraint::JsonSchema(json!({"type": "object", "properties": props, "required": names}))
        };
        let first = c.submit(slow(0));
        let abandoned: Vec<_> = (1..4).map(|i| c.submit(slow(i))).collect();
        drop(abandoned);
        let last = c.submit(Constraint::Regex("[0-9]+".into()));
        first.wait().await.unwrap();
        last.wait().await.unwrap();
        let n = c.compile_stats();
        assert_eq!((n.started, n.skipped), (2, 3), "the abandoned compiles never started");
        assert_eq!((n.threads, n.running, n.queued), (1, 0, 0));
        // A cached grammar does not queue.
        let again = c.submit(Constraint::Regex("[0-9]+".into()));
        again.wait().await.unwrap();
        assert_eq!(c.compile_stats().started, 2);
    }

    #[test]
    fn lexers_are_bounded_per_grammar_and_in_the_cache() {
        let c = compiler();
        // A 14-byte regex whose lexer is 180,000 states (over 100 MB) is refused.
        match c.compile(&Constraint::Regex("(ab){300}{300}".into())) {
            Err(GrammarError::Invalid(m)) => assert!(m.contains("needs a lexer of") && m.contains("states"), "{m}"),
            other => panic!("{:?}", other.map(|_| ())),
        }
        // The cache keeps what fits its byte budget, most recent first: here two of these.
        let mut small = GrammarCompiler::new(c.tokenizer.clone(), VOCAB, EOS.to_vec());
        let regex = |i: usize| Constraint::Regex(format!("(ab){{40}}{{20}}c{i}"));
        small.compile(&regex(0)).unwrap();
        let (_, one) = small.cache_usage();
        assert!(one > 100_000, "a 2,400-state lexer weighs {one} bytes");
        small.cache_bytes = one * 5 / 2;
        for i in 1..6 {
            small.compile(&regex(i)).unwrap();
        }
        let (n, bytes) = small.cache_usage();
        assert_eq!(n, 2, "{bytes} bytes held, {one} each");
        assert!(bytes <= small.cache_bytes);
        assert!(small.cached(&regex(5).key()).is_some() && small.cached(&regex(4).key()).is_some());
        assert!(small.cached(&regex(3).key()).is_none());
    }

    #[test]
    fn a_schema_is_compiled_once() {
        let c = compiler();
        let k = Constraint::JsonSchema(json!({"type": "object", "properties": {"cached": {"type": "boolean"}}}));
        let a = c.compile(&k).unwrap();
        let n = c.cache_usage().0;
        let b = c.compile(&k).unwrap();
        assert_eq!(a, b);
        assert_eq!(c.cache_usage().0, n, "a second compile is a cache hit");
    }

    #[test]
    fn masks_follow_the_grammar_and_allow_stop_ids_only_where_it_may_end() {
        let c = compiler();
        let schema =
            json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]});
        let g = c.compile(&Constraint::JsonSchema(schema)).unwrap();
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(walk(&mut s, "{\"answer\": \"no\"}"));
        assert!(s.is_finished(), "nothing may follow a complete object");
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(!walk(&mut s, "{\"answer\": \"maybe\"}"));
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(!walk(&mut s, "{\"answer\":\"no\"}"), "the layout is Python's: a space after the colon");

        // A regex that may end or go on: the stop ids come and go with it, and ignore_eos (no
        // stop ids) never lets the grammar's own EOS through.
        let g = c.compile(&Constraint::Regex("[a-z]+".into())).unwrap();
        let mut s = GrammarState::new(&g, None).unwrap();
        let mut words = Vec::new();
        s.mask(&EOS, &mut words).unwrap();
        assert!(!allowed(&words, EOS[0]), "nothing written yet");
        assert!(walk(&mut s, "abc"));
        s.mask(&[7], &mut words).unwrap();
        assert!(allowed(&words, 7) && !allowed(&words, EOS[0]) && !allowed(&words, EOS[1]));
        s.mask(&[], &mut words).unwrap();
        assert!(!allowed(&words, EOS[0]) && !allowed(&words, EOS[1]));
        assert!(!allowed(&words, VOCAB as u32 - 1), "padding rows are never allowed");

        let g = c.compile(&Constraint::Choice(vec!["red".into(), "green \"light\"".into()])).unwrap();
        let mut s = GrammarState::new(&g, None).unwrap();
        assert!(walk(&mut s, "green \"light\""));
        assert!(s.is_finished());
    }

    #[test]
    fn the_grammar_waits_for_the_end_of_the_reasoning() {
        let g = compiler().compile(&Constraint::Choice(vec!["yes".into(), "no".into()])).unwrap();
        let mut s = GrammarState::new(&g, Some("</think>")).unwrap();
        assert!(!s.is_active());
        // Free text, split so that the marker spans tokens.
        assert!(walk(&mut s, "Let me think: maybe </"));
        assert!(!s.is_active());
        assert!(walk(&mut s, "think>"));
        assert!(s.is_active(), "the marker has ended the reasoning");
        assert!(walk(&mut s, "\n\n"), "blank lines may follow the reasoning");
        assert!(!walk(&mut s.clone_for_test(), "maybe"));
        assert!(walk(&mut s, "yes"));
        assert!(s.is_finished());
    }

    #[test]
    fn tool_calls_name_a_tool_and_follow_its_schema() {
        let tools = vec![
            crate::structured::ToolSchema {
                name: "get_weather".into(),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
            },
            crate::structured::ToolSchema {
                name: "now".into(),
                parameters: json!({"type": "object", "properties": {}}),
            },
        ];
        let one = compiler()
            .compile(&Constraint::ToolCalls { tools: tools.clone(), parallel: false, optional: false })
            .unwrap();
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let mut s = GrammarState::new(&one, None).unwrap();
        assert!(walk(&mut s, call));
        assert!(s.is_finished(), "one call when calls are not parallel");
        let mut s = GrammarState::new(&one, None).unwrap();
        assert!(!walk(&mut s, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Paris\"}}"));
        let mut s = GrammarState::new(&one, None).unwrap();
        assert!(!walk(&mut s, "<tool_call>\n{\"name\": \"delete_everything\""));
        let many = compiler()
            .compile(&Constraint::ToolCalls { tools: tools.clone(), parallel: true, optional: false })
            .unwrap();
        let mut s = GrammarState::new(&many, None).unwrap();
        let two = format!("{call}\n<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}\n</tool_call>");
        assert!(walk(&mut s, &two));
        assert!(!s.is_finished(), "parallel calls may go on");

        // Optional calls (tool_choice auto, strict tools): text, then a call held to its schema.
        let auto = compiler().compile(&Constraint::ToolCalls { tools, parallel: false, optional: true }).unwrap();
        let mut s = GrammarState::new(&auto, None).unwrap();
        assert!(walk(&mut s, "Just an answer, no call."));
        let mut s = GrammarState::new(&auto, None).unwrap();
        assert!(walk(&mut s, &format!("Let me check.\n{call}")));
        assert!(s.is_finished());
        let mut s = GrammarState::new(&auto, None).unwrap();
        assert!(!walk(&mut s, "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\""));
    }
}
