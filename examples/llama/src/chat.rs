//! SFT data in the usual layouts, as conversations.
//!
//! # Files
//!
//! A JSON list of records, or JSON Lines (one record per line, blank lines
//! skipped). Errors name the file and the record (`record i`, counting
//! from 0, in a list; `line n`, counting from 1, in JSON Lines).
//!
//! # Layouts
//!
//! Each record is one of (other keys are ignored):
//!
//! | layout | keys | conversation |
//! |---|---|---|
//! | messages | `messages`: a list of `{"role", "content"}`, roles `system`, `user`, `assistant` | as it is |
//! | Alpaca | `instruction`, `output`, optional `input` | user `instruction ++ input`, assistant `output` |
//! | prompt/response | `prompt`, and `response` or `completion` | user `prompt`, assistant the answer |
//!
//! Alpaca's `instruction` and `input` are joined as the addition task's
//! files always were (`"1807=" ++ ""`): the input follows the instruction
//! directly.
//!
//! # Training and evaluation
//!
//! Training learns every assistant turn ([`Example::turns`]): a
//! conversation with `k` assistant turns gives `k` (history, answer)
//! pairs, each a sample whose loss falls on its answer alone. Since a
//! causal model's predictions for a turn depend only on what precedes it,
//! this is the loss of the whole conversation with every non-assistant
//! token masked, spread over `k` rows. Evaluation and generation use the
//! conversation up to its last assistant turn as the prompt
//! ([`Example::prompt`]) and that turn as the reference
//! ([`Example::reference`]).

use std::path::Path;

use serde_json::{Map, Value};

use super::data::{self, Sample};
use super::hf::HfTokenizer;

/// Who speaks a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Instructions before the conversation.
    System,
    /// The user.
    User,
    /// The model: the turns training learns.
    Assistant,
}

impl Role {
    /// The role's name in a chat template (`"system"`, `"user"`,
    /// `"assistant"`).
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        match s {
            "system" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            _ => None,
        }
    }
}

/// One turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What is said.
    pub content: String,
}

impl Message {
    /// A turn of `role`.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
        }
    }
}

/// The content of `history` when it is a single user turn; otherwise
/// `Err` with what it is instead ("3 turn(s) (system, user, assistant)"),
/// for the error of a template that renders one user turn only.
pub fn single_user_turn(history: &[Message]) -> Result<&str, String> {
    match history {
        [m] if m.role == Role::User => Ok(&m.content),
        _ => Err(format!(
            "{} turn(s) ({})",
            history.len(),
            history
                .iter()
                .map(|m| m.role.name())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// One record of a data file, as a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    /// The turns, in order.
    pub messages: Vec<Message>,
    /// Where it came from, for errors: `"FILE: record i"` or `"FILE: line n"`.
    pub origin: String,
}

impl Example {
    /// Every assistant turn with the turns before it: what training learns.
    pub fn turns(&self) -> Vec<(&[Message], &str)> {
        self.messages
            .iter()
            .enumerate()
            .filter(|(_, m)| m.role == Role::Assistant)
            .map(|(i, m)| (&self.messages[..i], m.content.as_str()))
            .collect()
    }

    /// The conversation before its last turn when that is an assistant's,
    /// else the whole conversation: the prompt of generation and evaluation.
    pub fn prompt(&self) -> &[Message] {
        match self.messages.last() {
            Some(m) if m.role == Role::Assistant => &self.messages[..self.messages.len() - 1],
            _ => &self.messages,
        }
    }

    /// The last assistant turn when the conversation ends with one: the
    /// reference answer of evaluation.
    pub fn reference(&self) -> Option<&str> {
        self.messages
            .last()
            .filter(|m| m.role == Role::Assistant)
            .map(|m| m.content.as_str())
    }

    /// The single user turn's text when the prompt is exactly one user
    /// turn (the addition task's `N=` prompts).
    pub fn single_user_text(&self) -> Option<&str> {
        match self.prompt() {
            [m] if m.role == Role::User => Some(m.content.as_str()),
            _ => None,
        }
    }
}

/// What a file's records must hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Training or evaluation data: every record ends with an assistant
    /// turn (its answer).
    Answers,
    /// Prompts for generation: the answer may be missing (`{"prompt"}`
    /// alone, `{"instruction"}` alone, or messages ending with a user turn).
    Prompts,
}

/// Reads a data file ([`parse_examples`]); errors name the file.
pub fn load_examples(path: &Path, need: Need) -> Result<Vec<Example>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    parse_examples(&text, &path.display().to_string(), need)
}

/// The records of `text` (a JSON list, or JSON Lines), named `file` in
/// errors. An empty file or list is an error.
pub fn parse_examples(text: &str, file: &str, need: Need) -> Result<Vec<Example>, String> {
    let records: Vec<(String, Value)> = match serde_json::from_str::<Value>(text) {
        Ok(Value::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(i, v)| (format!("{file}: record {i}"), v))
            .collect(),
        Ok(v @ Value::Object(_)) => vec![(format!("{file}: line 1"), v)],
        Ok(_) => {
            return Err(format!(
                "{file}: expected a JSON list of records or JSON Lines (one record per line)"
            ))
        }
        Err(whole) => {
            let mut out = Vec::new();
            for (n, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let v = serde_json::from_str(line).map_err(|e| {
                    format!(
                        "{file}: line {}: not valid JSON ({e}); the file is neither a JSON \
                         list ({whole}) nor JSON Lines",
                        n + 1
                    )
                })?;
                out.push((format!("{file}: line {}", n + 1), v));
            }
            out
        }
    };
    if records.is_empty() {
        return Err(format!("{file}: no records"));
    }
    records
        .into_iter()
        .map(|(origin, v)| {
            let messages = conversation(&v, need).map_err(|e| format!("{origin}: {e}"))?;
            Ok(Example { messages, origin })
        })
        .collect()
}

/// The layouts, for errors.
const LAYOUTS: &str = "`messages` (a list of {role, content}), `instruction`/`input`/`output` \
                       (Alpaca) or `prompt` with `response` or `completion`";

/// One record's conversation.
fn conversation(v: &Value, need: Need) -> Result<Vec<Message>, String> {
    let Value::Object(o) = v else {
        return Err(format!("expected a JSON object ({LAYOUTS}), found {v}"));
    };
    let messages = if let Some(m) = o.get("messages") {
        messages(m)?
    } else if o.contains_key("instruction") {
        let instruction = string(o, "instruction")?;
        let input = match o.get("input") {
            None | Some(Value::Null) => String::new(),
            Some(_) => string(o, "input")?,
        };
        let mut m = vec![Message::new(Role::User, format!("{instruction}{input}"))];
        if need == Need::Answers || o.contains_key("output") {
            m.push(Message::new(Role::Assistant, string(o, "output")?));
        }
        m
    } else if o.contains_key("prompt") {
        let mut m = vec![Message::new(Role::User, string(o, "prompt")?)];
        match ["response", "completion"].map(|k| o.contains_key(k)) {
            [true, true] => {
                return Err("both `response` and `completion`: which is the answer?".into())
            }
            [true, false] => m.push(Message::new(Role::Assistant, string(o, "response")?)),
            [false, true] => m.push(Message::new(Role::Assistant, string(o, "completion")?)),
            [false, false] if need == Need::Answers => {
                return Err("`prompt` without `response` or `completion`".into())
            }
            [false, false] => {}
        }
        m
    } else {
        let keys: Vec<&str> = o.keys().map(String::as_str).collect();
        return Err(format!("unknown layout: keys {keys:?}; expected {LAYOUTS}"));
    };
    check(&messages, need)?;
    Ok(messages)
}

/// A non-empty string under `key`.
fn string(o: &Map<String, Value>, key: &str) -> Result<String, String> {
    match o.get(key) {
        Some(Value::String(s)) if !s.is_empty() || key == "input" => Ok(s.clone()),
        Some(Value::String(_)) => Err(format!("`{key}` is empty")),
        Some(v) => Err(format!("`{key}`: expected a string, found {v}")),
        None => Err(format!("no `{key}`")),
    }
}

/// A `messages` list.
fn messages(v: &Value) -> Result<Vec<Message>, String> {
    let Value::Array(items) = v else {
        return Err(format!("`messages`: expected a list, found {v}"));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let at = |e: String| format!("`messages`[{i}]: {e}");
            let Value::Object(o) = m else {
                return Err(at(format!("expected {{role, content}}, found {m}")));
            };
            let role = match o.get("role") {
                Some(Value::String(r)) => Role::parse(r).ok_or_else(|| {
                    at(format!(
                        "role {r:?}: expected \"system\", \"user\" or \"assistant\""
                    ))
                })?,
                Some(r) => return Err(at(format!("`role`: expected a string, found {r}"))),
                None => return Err(at("no `role`".into())),
            };
            let content = match o.get("content") {
                Some(Value::String(c)) => c.clone(),
                Some(c) => return Err(at(format!("`content`: expected a string, found {c}"))),
                None => return Err(at("no `content`".into())),
            };
            Ok(Message { role, content })
        })
        .collect()
}

/// A conversation has a user turn, and (training data) ends with a
/// non-empty assistant turn.
fn check(m: &[Message], need: Need) -> Result<(), String> {
    if !m.iter().any(|m| m.role == Role::User) {
        return Err("the conversation has no user turn".into());
    }
    if need == Need::Answers {
        match m.last() {
            Some(last) if last.role == Role::Assistant && !last.content.is_empty() => {}
            Some(last) if last.role == Role::Assistant => {
                return Err("the last assistant turn is empty".into())
            }
            _ => return Err("the conversation does not end with an assistant turn".into()),
        }
    }
    Ok(())
}

/// Splits `n` records into (training, validation) indices: `fraction` of
/// them (rounded, at least 1 when `fraction > 0`, never all; none of fewer
/// than 2 records) held out, chosen by a shuffle seeded with `seed`; both
/// lists ascending.
pub fn split_indices(n: usize, fraction: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let held = if fraction > 0.0 && n >= 2 {
        ((fraction * n as f64).round() as usize).clamp(1, n.saturating_sub(1))
    } else {
        0
    };
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = super::XorShift::new(seed ^ 0x5EED_5A11_D00D_F00D);
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let mut val = order.split_off(n - held);
    val.sort_unstable();
    order.sort_unstable();
    (order, val)
}

/// Whether `generated` answers `reference` exactly: equal once both are
/// trimmed of leading and trailing whitespace.
pub fn exact_match(generated: &str, reference: &str) -> bool {
    generated.trim() == reference.trim()
}

/// A chat template over token ids: the byte tokenizer's ([`ByteTemplate`])
/// or a model's ([`HfTokenizer`]).
pub trait Template {
    /// The tokens of `history` with the generation prompt: what generation
    /// continues.
    fn prompt(&self, history: &[Message]) -> Result<Vec<u32>, String>;
    /// The training sample of assistant turn `answer` after `history`.
    fn sample(&self, history: &[Message], answer: &str) -> Result<Sample, String>;
}

/// The byte tokenizer's template ([`crate::data`]): one user turn and one
/// assistant turn; anything else (a system turn, several turns) is an
/// error that says to use a model with a chat template.
pub struct ByteTemplate;

impl ByteTemplate {
    fn user(history: &[Message]) -> Result<&str, String> {
        single_user_turn(history).map_err(|found| {
            format!(
                "the built-in byte tokenizer's template has one user turn then the answer, \
                 not {found}: use a model with a chat template (--model-dir)"
            )
        })
    }
}

impl Template for ByteTemplate {
    fn prompt(&self, history: &[Message]) -> Result<Vec<u32>, String> {
        Ok(data::encode_prompt(Self::user(history)?, ""))
    }
    fn sample(&self, history: &[Message], answer: &str) -> Result<Sample, String> {
        Ok(Sample::new(Self::user(history)?, "", answer))
    }
}

impl Template for HfTokenizer {
    fn prompt(&self, history: &[Message]) -> Result<Vec<u32>, String> {
        self.prompt_messages(history)
    }
    fn sample(&self, history: &[Message], answer: &str) -> Result<Sample, String> {
        self.sample_messages(history, answer)
    }
}

/// The training samples of `examples`: one per assistant turn
/// ([`Example::turns`]); errors name the record.
pub fn samples(t: &dyn Template, examples: &[Example]) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    for e in examples {
        for (history, answer) in e.turns() {
            out.push(
                t.sample(history, answer)
                    .map_err(|err| format!("{}: {err}", e.origin))?,
            );
        }
    }
    Ok(out)
}

/// One held-out record of an exact-match evaluation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    /// The prompt's tokens (the conversation before the answer, with the
    /// generation prompt).
    pub prompt: Vec<u32>,
    /// The answer's text.
    pub answer: String,
    /// The answer's tokens (with the end of the turn): how many tokens
    /// generation needs to write it.
    pub answer_tokens: usize,
    /// The last user turn, to show.
    pub shown: String,
}

/// How answers are judged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Eval {
    /// No held-out records: no accuracy.
    None,
    /// The addition task: prompts `N=`, any correct split scores
    /// ([`crate::data::score`]).
    Numbers(Vec<u64>),
    /// Any other task: the greedy answer must equal the reference
    /// ([`exact_match`]).
    Exact(Vec<Reference>),
}

/// The evaluation of held-out `examples`: the addition task's when every
/// prompt is a single user turn `N=` ([`crate::data::parse_prompt`]), else
/// exact match against each record's last assistant turn.
pub fn eval_of(t: &dyn Template, examples: &[Example]) -> Result<Eval, String> {
    if examples.is_empty() {
        return Ok(Eval::None);
    }
    let numbers: Option<Vec<u64>> = examples
        .iter()
        .map(|e| e.single_user_text().and_then(data::parse_prompt))
        .collect();
    if let Some(n) = numbers {
        return Ok(Eval::Numbers(n));
    }
    examples
        .iter()
        .map(|e| {
            let fail = |err: String| format!("{}: {err}", e.origin);
            let answer = e
                .reference()
                .ok_or_else(|| fail("no assistant answer to compare with".into()))?;
            let sample = t.sample(e.prompt(), answer).map_err(fail)?;
            let shown = e
                .prompt()
                .iter()
                .rev()
                .find(|m| m.role == Role::User)
                .map_or(String::new(), |m| m.content.clone());
            Ok(Reference {
                prompt: sample.prompt,
                answer: answer.to_string(),
                answer_tokens: sample.answer.len(),
                shown,
            })
        })
        .collect::<Result<_, _>>()
        .map(Eval::Exact)
}
