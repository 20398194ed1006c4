//! A Hugging Face tokenizer (`tokenizer.json`, through the `tokenizers`
//! crate) with the model's chat template (`tokenizer_config.json`'s
//! `chat_template`, or `chat_template.jinja`), rendered by `minijinja` as
//! `transformers`' `apply_chat_template` does (Jinja with `trim_blocks`
//! and `lstrip_blocks`, `raise_exception`, `strftime_now` (UTC), Python
//! string methods).
//!
//! # Samples
//!
//! A record `{instruction, input, output}` becomes one user turn
//! (`instruction ++ input`) and one assistant turn (`output`):
//!
//! - prompt: the template over the user turn with
//!   `add_generation_prompt = true`, tokenized without special tokens (the
//!   template writes them), as `apply_chat_template` does;
//! - answer: the tokens the template adds for the assistant turn (the
//!   rendering of both turns, tokenized the same way, past the prompt's
//!   tokens; or, where the two tokenizations differ at the seam, the
//!   rendering less the prompt's text, tokenized on its own), with the EOS
//!   token appended when the template does not write it.
//!
//! Any conversation ([`HfTokenizer::sample_messages`], the layouts of
//! [`crate::chat`]) works the same way: the prompt is the template over
//! the turns before an assistant turn with the generation prompt, the
//! answer what the template adds for that turn.
//!
//! Without a chat template the prompt is `instruction ++ input` tokenized
//! with the tokenizer's special tokens (a BOS where the tokenizer adds one)
//! and the answer is `output` followed by EOS.
//!
//! Loss falls on the answer only ([`crate::data::make_batch_with_pad`]);
//! generation stops at EOS.

use std::path::{Path, PathBuf};

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde_json::Value;

use super::super::chat::{Message, Role};
use super::super::data::{parse_prompt, Sample};

/// The files of a Hugging Face tokenizer that an export copies.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// A tokenizer with its chat template and special tokens.
pub struct HfTokenizer {
    tok: tokenizers::Tokenizer,
    template: Option<String>,
    bos: Option<String>,
    eos: String,
    eos_id: u32,
    pad_id: u32,
    dir: PathBuf,
}

/// A special token of `tokenizer_config.json`: a string or an
/// `AddedToken` object with `content`.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl HfTokenizer {
    /// Loads `dir/tokenizer.json` and `dir/tokenizer_config.json` (and
    /// `dir/chat_template.jinja` when there). `eos_fallback` (the model
    /// config's `eos_token_id`) is used when `tokenizer_config.json` names
    /// no `eos_token`. Errors name the file and key.
    pub fn load(dir: &Path, eos_fallback: Option<u32>) -> Result<Self, String> {
        let tj = dir.join("tokenizer.json");
        if !tj.is_file() {
            return Err(format!(
                "{}: missing: the model directory needs its tokenizer.json",
                tj.display()
            ));
        }
        let tok = tokenizers::Tokenizer::from_file(&tj)
            .map_err(|e| format!("{}: cannot load the tokenizer: {e}", tj.display()))?;
        let tc = dir.join("tokenizer_config.json");
        let cfg: Value = if tc.is_file() {
            let text = std::fs::read_to_string(&tc)
                .map_err(|e| format!("{}: cannot read: {e}", tc.display()))?;
            serde_json::from_str(&text)
                .map_err(|e| format!("{}: not valid JSON: {e}", tc.display()))?
        } else {
            Value::Null
        };
        let jinja = dir.join("chat_template.jinja");
        let template = if jinja.is_file() {
            Some(
                std::fs::read_to_string(&jinja)
                    .map_err(|e| format!("{}: cannot read: {e}", jinja.display()))?,
            )
        } else {
            match cfg.get("chat_template") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: the one called `default`.
                Some(Value::Array(list)) => Some(
                    list.iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                        .and_then(|t| t.get("template")?.as_str())
                        .ok_or_else(|| {
                            format!(
                                "{}: `chat_template`: a list without a `default` template",
                                tc.display()
                            )
                        })?
                        .to_string(),
                ),
                Some(v) => {
                    return Err(format!(
                        "{}: `chat_template`: expected a string, found {v}",
                        tc.display()
                    ))
                }
            }
        };
        let id_of = |key: &str, text: &str| {
            tok.token_to_id(text).ok_or_else(|| {
                format!(
                    "{}: `{key}` {text:?} is not a token of {}",
                    tc.display(),
                    tj.display()
                )
            })
        };
        let eos = match cfg.get("eos_token").and_then(token_text) {
            Some(t) => t,
            None => {
                let id = eos_fallback.ok_or_else(|| {
                    format!(
                        "{}: no `eos_token`, and config.json has no `eos_token_id`: \
                         generation would not know where to stop",
                        tc.display()
                    )
                })?;
                tok.id_to_token(id).ok_or_else(|| {
                    format!(
                        "config.json: `eos_token_id` {id} is not a token of {}",
                        tj.display()
                    )
                })?
            }
        };
        let eos_id = id_of("eos_token", &eos)?;
        let bos = cfg.get("bos_token").and_then(token_text);
        let pad_id = match cfg.get("pad_token").and_then(token_text) {
            Some(p) => id_of("pad_token", &p)?,
            None => eos_id,
        };
        let t = HfTokenizer {
            tok,
            template,
            bos,
            eos,
            eos_id,
            pad_id,
            dir: dir.to_path_buf(),
        };
        // Render once now, so that a template that cannot render fails
        // before training.
        if t.template.is_some() {
            t.render("1=", None)?;
        }
        Ok(t)
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tok.get_vocab_size(true)
    }

    /// The EOS token: generation stops here.
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// The padding token (`pad_token`, else EOS); padding is never predicted.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// Whether the tokenizer has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The largest token id the tokenizer can produce.
    pub fn max_id(&self) -> u32 {
        self.tok
            .get_vocab(true)
            .values()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// Token ids of `text`; `special`: add the tokenizer's special tokens.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        self.tok
            .encode(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("{}: cannot tokenize {text:?}: {e}", self.dir.display()))
    }

    /// The text of `ids` up to the first EOS, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let end = ids
            .iter()
            .position(|&t| t == self.eos_id)
            .unwrap_or(ids.len());
        self.tok.decode(&ids[..end], true).unwrap_or_default()
    }

    /// The chat template over a user turn `user` and, when given, an
    /// assistant turn; `add_generation_prompt` when there is none.
    pub fn render(&self, user: &str, assistant: Option<&str>) -> Result<String, String> {
        let mut messages = vec![Message::new(Role::User, user)];
        if let Some(a) = assistant {
            messages.push(Message::new(Role::Assistant, a));
        }
        self.render_messages(&messages, assistant.is_none())
    }

    /// The chat template over `messages` (any roles, any number of turns),
    /// with `add_generation_prompt` as given.
    pub fn render_messages(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let template = self
            .template
            .as_deref()
            .ok_or_else(|| format!("{}: no chat template", self.dir.display()))?;
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| format!("chat template syntax: {e}"))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function(
            "strftime_now",
            |fmt: String| -> Result<String, JinjaError> {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                strftime_utc(&fmt, now).map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e))
            },
        );
        let fail = |e: JinjaError| {
            format!(
                "{}: chat template: {e:#}",
                self.dir.join("tokenizer_config.json").display()
            )
        };
        env.add_template("chat", template).map_err(fail)?;
        let messages: Vec<_> = messages
            .iter()
            .map(|m| context! { role => m.role.name(), content => m.content.as_str() })
            .collect();
        env.get_template("chat")
            .map_err(fail)?
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos.clone().unwrap_or_default(),
                eos_token => self.eos.clone(),
            })
            .map_err(fail)
    }

    /// The prompt of `instruction ++ input` (see the module's doc).
    pub fn prompt(&self, instruction: &str, input: &str) -> Result<Vec<u32>, String> {
        self.prompt_messages(&[Message::new(Role::User, format!("{instruction}{input}"))])
    }

    /// The prompt of a conversation `history`: the template with the
    /// generation prompt. Without a template, only a single user turn has
    /// a prompt (its text with the tokenizer's special tokens).
    pub fn prompt_messages(&self, history: &[Message]) -> Result<Vec<u32>, String> {
        match &self.template {
            Some(_) => self.encode(&self.render_messages(history, true)?, false),
            None => self.encode(self.untemplated(history)?, true),
        }
    }

    /// The one user turn of `history`, for a tokenizer without a template.
    fn untemplated<'m>(&self, history: &'m [Message]) -> Result<&'m str, String> {
        crate::chat::single_user_turn(history).map_err(|found| {
            format!(
                "{}: the tokenizer has no chat template: only a single user turn can be \
                 rendered, not {found}",
                self.dir.display()
            )
        })
    }

    /// One training sample (see the module's doc).
    pub fn sample(&self, instruction: &str, input: &str, output: &str) -> Result<Sample, String> {
        let user = Message::new(Role::User, format!("{instruction}{input}"));
        let mut s = self.sample_messages(std::slice::from_ref(&user), output)?;
        s.number = parse_prompt(instruction);
        Ok(s)
    }

    /// The sample of assistant turn `output` after the conversation
    /// `history`: the prompt is [`HfTokenizer::prompt_messages`], the
    /// answer the tokens the template adds for the turn (see the module's
    /// doc); `number` is the addition prompt's when `history` is one user
    /// turn `N=`.
    pub fn sample_messages(&self, history: &[Message], output: &str) -> Result<Sample, String> {
        let number = match history {
            [m] if m.role == Role::User => parse_prompt(&m.content),
            _ => None,
        };
        let (prompt, mut answer) = match &self.template {
            Some(_) => {
                let p = self.render_messages(history, true)?;
                let mut conversation = history.to_vec();
                conversation.push(Message::new(Role::Assistant, output));
                let full = self.render_messages(&conversation, false)?;
                let rest = full.strip_prefix(p.as_str()).ok_or_else(|| {
                    format!(
                        "{}: the chat template renders a conversation that does not \
                         start with its own generation prompt ({p:?} vs {full:?})",
                        self.dir.display()
                    )
                })?;
                // The tokens of the whole conversation past the prompt's,
                // when they extend them (as a trainer that tokenizes the
                // conversation once sees them); else the rest on its own.
                let prompt = self.encode(&p, false)?;
                let all = self.encode(&full, false)?;
                let answer = match all.strip_prefix(prompt.as_slice()) {
                    Some(a) => a.to_vec(),
                    None => self.encode(rest, false)?,
                };
                (prompt, answer)
            }
            None => (
                self.encode(self.untemplated(history)?, true)?,
                self.encode(output, false)?,
            ),
        };
        if !answer.contains(&self.eos_id) {
            answer.push(self.eos_id);
        }
        Ok(Sample {
            prompt,
            answer,
            number,
        })
    }

    /// The token's text as the vocabulary spells it (`Ġthe`,
    /// `<|im_end|>`), for `--show-tokens`; `<id?>` for an unknown id.
    pub fn piece(&self, id: u32) -> String {
        self.tok
            .id_to_token(id)
            .unwrap_or_else(|| format!("<{id}?>"))
    }
}

/// `strftime` of `secs` since the Unix epoch, UTC, for the directives chat
/// templates use (`strftime_now("%d %b %Y")` in Llama 3.2's): `%d %e %m
/// %y %Y %b %B %a %A %H %M %S %j %%`; any other is an error naming it.
pub fn strftime_utc(fmt: &str, secs: u64) -> Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs / 86_400;
    let tod = secs % 86_400;
    // Days to a civil date (Howard Hinnant's algorithm), days >= 0.
    let z = days as i64 + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = DAYS[(days % 7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let d = chars.next().ok_or("strftime_now: a lone `%` at the end")?;
        let piece = match d {
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'm' => format!("{month:02}"),
            'y' => format!("{:02}", year % 100),
            'Y' => year.to_string(),
            'b' => month_name[..3].to_string(),
            'B' => month_name.to_string(),
            'a' => weekday[..3].to_string(),
            'A' => weekday.to_string(),
            'H' => format!("{:02}", tod / 3600),
            'M' => format!("{:02}", tod / 60 % 60),
            'S' => format!("{:02}", tod % 60),
            'j' => format!("{yday:03}"),
            '%' => "%".to_string(),
            other => return Err(format!("strftime_now: `%{other}` is not supported")),
        };
        out.push_str(&piece);
    }
    Ok(out)
}
