//! The addition task: byte tokenizer, chat template, data sets, batches, scoring.
//!
//! # Task
//!
//! The prompt is a non-negative integer followed by `=` (`1807=`); a correct
//! answer is [`ANSWER_PREFIX`] followed by `a + b`, where `a` and `b` are
//! non-negative integers that sum to the prompt's number
//! (`王大丫丫的回答是--->1800 + 7`). Any such split is correct ([`score`]).
//!
//! # Tokenizer
//!
//! Byte level: a token is a UTF-8 byte (`0..=255`) or one of five specials,
//! [`BOS`], [`EOS`], [`PAD`], [`USER`], [`ASSISTANT`]; [`VOCAB`] = 261.
//!
//! # Chat template
//!
//! A record `{instruction, input, output}` becomes
//!
//! ```text
//!  prompt                                          answer
//! [BOS, USER, bytes(instruction ++ input)..., ASSISTANT] [bytes(output)..., EOS]
//! ```
//!
//! Training sees `prompt ++ answer`, right-padded with [`PAD`]; only answer
//! tokens (the final `EOS` included) are predicted ([`make_batch`]).
//! Generation feeds the prompt and decodes until `EOS` ([`decode`]).
//!
//! # Data
//!
//! [`addition_task`] builds the original experiment's split in-process: the
//! numbers `0..1998`, 200 of them held out for evaluation by a seeded shuffle.
//! [`load_json`] reads the experiment's JSON files (a list of
//! `{"instruction", "input", "output"}` records) or any other SFT data in that
//! format; [`eval_numbers_from_json`] reads such a file's prompts as
//! evaluation numbers.

use std::path::Path;

use serde::Deserialize;

use super::XorShift;

/// Beginning of a sequence.
pub const BOS: u32 = 256;
/// End of the answer: generation stops here.
pub const EOS: u32 = 257;
/// Right padding of a batch row; never predicted.
pub const PAD: u32 = 258;
/// Opens the user's turn (the prompt text).
pub const USER: u32 = 259;
/// Opens the assistant's turn (the answer text).
pub const ASSISTANT: u32 = 260;
/// Tokenizer size: 256 byte values and 5 specials.
pub const VOCAB: usize = 261;
/// Target of a position that is not predicted (prompt, padding), as in HF.
pub const IGNORE: i32 = -100;

/// Every answer of the addition task starts with this text.
pub const ANSWER_PREFIX: &str = "王大丫丫的回答是--->";

/// Numbers of the addition task: `0..NUMBERS`.
pub const NUMBERS: u64 = 1998;
/// Numbers held out from training for evaluation.
pub const HELD_OUT: usize = 200;

/// The UTF-8 bytes of `text`, one token each.
pub fn encode_text(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// The text of `tokens` up to the first [`EOS`]; other specials are skipped
/// and invalid UTF-8 is replaced (lossy), so any model output decodes.
pub fn decode(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .take_while(|&&t| t != EOS)
        .filter_map(|&t| u8::try_from(t).ok())
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// How token `id` reads in a listing (`--show-tokens`): a special as
/// `<bos>`, `<eos>`, `<pad>`, `<user>`, `<assistant>`, a printable ASCII
/// byte as itself, any other byte as `<0xNN>`.
pub fn piece(id: u32) -> String {
    match id {
        BOS => "<bos>".into(),
        EOS => "<eos>".into(),
        PAD => "<pad>".into(),
        USER => "<user>".into(),
        ASSISTANT => "<assistant>".into(),
        0x21..=0x7e => char::from(id as u8).to_string(),
        0..=0xff => format!("<0x{id:02X}>"),
        _ => format!("<{id}?>"),
    }
}

/// The prompt of the chat template: `[BOS, USER] ++ bytes(instruction ++
/// input) ++ [ASSISTANT]`.
pub fn encode_prompt(instruction: &str, input: &str) -> Vec<u32> {
    let mut tokens = vec![BOS, USER];
    tokens.extend(encode_text(instruction));
    tokens.extend(encode_text(input));
    tokens.push(ASSISTANT);
    tokens
}

/// The answer of the chat template: `bytes(output) ++ [EOS]`.
pub fn encode_answer(output: &str) -> Vec<u32> {
    let mut tokens = encode_text(output);
    tokens.push(EOS);
    tokens
}

/// The prompt asking for a split of `n`: the template applied to `"{n}="`.
pub fn prompt_for(n: u64) -> Vec<u32> {
    encode_prompt(&format!("{n}="), "")
}

/// The number of an addition prompt: `Some(n)` when `instruction` is exactly
/// `"{n}="` (decimal, no sign, no leading zeros, fits in `u64`).
pub fn parse_prompt(instruction: &str) -> Option<u64> {
    let digits = instruction.strip_suffix('=')?;
    parse_decimal(digits)
}

/// The training split of `n`: `(n - n % 10, n % 10)`, so `1807` becomes
/// `1800 + 7` and `5` becomes `0 + 5`.
///
/// Any split is correct, but this one is nearly a copy of the prompt (all
/// digits but the last, then a zero; then the last digit), so a small model
/// learns it in few steps, and since it is digit-wise rather than memorized
/// per number, it generalizes to the held-out numbers.
pub fn split(n: u64) -> (u64, u64) {
    (n - n % 10, n % 10)
}

/// The training answer for `n`: [`ANSWER_PREFIX`] and the [`split`].
pub fn answer_for(n: u64) -> String {
    let (a, b) = split(n);
    format!("{ANSWER_PREFIX}{a} + {b}")
}

/// One tokenized training example.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// `[BOS, USER, ..instruction ++ input.., ASSISTANT]`.
    pub prompt: Vec<u32>,
    /// `[..output.., EOS]`.
    pub answer: Vec<u32>,
    /// The prompt's number when the instruction is `<digits>=`.
    pub number: Option<u64>,
}

impl Sample {
    /// Applies the chat template to one record.
    pub fn new(instruction: &str, input: &str, output: &str) -> Self {
        Sample {
            prompt: encode_prompt(instruction, input),
            answer: encode_answer(output),
            number: parse_prompt(instruction),
        }
    }

    /// The addition example for `n` with the [`split`] answer.
    pub fn addition(n: u64) -> Self {
        Sample::new(&format!("{n}="), "", &answer_for(n))
    }

    /// Tokens of `prompt ++ answer`.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.answer.len()
    }

    /// Whether both prompt and answer are empty (never for a built sample).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The prompt's text (`instruction ++ input`), for messages.
    pub fn prompt_text(&self) -> String {
        decode(&self.prompt)
    }
}

/// The addition data set: training samples and held-out evaluation numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Task {
    /// [`Sample::addition`] for every number not held out, ascending.
    pub train: Vec<Sample>,
    /// The held-out numbers, ascending.
    pub eval: Vec<u64>,
}

/// The original experiment's data, generated: of the numbers `0..1998`,
/// [`HELD_OUT`] (200) are chosen by a shuffle seeded with `seed` for
/// evaluation and the other 1798 are training samples.
pub fn addition_task(seed: u64) -> Task {
    let mut numbers: Vec<u64> = (0..NUMBERS).collect();
    shuffle(&mut numbers, &mut XorShift::new(mix(seed, 0)));
    let mut eval = numbers.split_off(numbers.len() - HELD_OUT);
    eval.sort_unstable();
    numbers.sort_unstable();
    Task {
        train: numbers.into_iter().map(Sample::addition).collect(),
        eval,
    }
}

/// One record of the JSON format; unknown fields are ignored.
#[derive(Clone, Debug, Deserialize)]
pub struct Record {
    /// The prompt (`"1807="`).
    pub instruction: String,
    /// Appended to the instruction (often empty).
    pub input: String,
    /// The answer.
    pub output: String,
}

/// Reads a JSON list of `{"instruction", "input", "output"}` records (all
/// three strings) and applies the chat template.
///
/// The output is free-form (other SFT data loads too), but instruction and
/// output must be non-empty, and the list must not be empty. Errors name the
/// file and, for a bad record, its index and what is wrong.
pub fn load_json(path: &Path) -> Result<Vec<Sample>, String> {
    Ok(load_records(path)?
        .iter()
        .map(|r| Sample::new(&r.instruction, &r.input, &r.output))
        .collect())
}

/// The records of [`load_json`], checked as it checks them (non-empty
/// instruction and output), for a tokenizer other than the byte one.
pub fn load_records(path: &Path) -> Result<Vec<Record>, String> {
    let records = read_records(path)?;
    for (i, r) in records.iter().enumerate() {
        if r.instruction.is_empty() {
            return Err(format!("{}: record {i}: empty instruction", path.display()));
        }
        if r.output.is_empty() {
            return Err(format!("{}: record {i}: empty output", path.display()));
        }
    }
    Ok(records)
}

/// The numbers of the instructions of a file in [`load_json`]'s format, as
/// evaluation prompts. Each instruction must be `"{n}="` ([`parse_prompt`])
/// with an empty input; errors name the file and the record's index.
pub fn eval_numbers_from_json(path: &Path) -> Result<Vec<u64>, String> {
    let records = read_records(path)?;
    records
        .iter()
        .enumerate()
        .map(|(i, r)| match parse_prompt(&r.instruction) {
            Some(n) if r.input.is_empty() => Ok(n),
            Some(_) => Err(format!(
                "{}: record {i}: an evaluation prompt has an empty input, found {:?}",
                path.display(),
                r.input
            )),
            None => Err(format!(
                "{}: record {i}: instruction {:?} is not `<number>=`",
                path.display(),
                r.instruction
            )),
        })
        .collect()
}

/// The records of a JSON file, with errors that name it.
fn read_records(path: &Path) -> Result<Vec<Record>, String> {
    let file = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{file}: cannot read: {e}"))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{file}: not valid JSON: {e}"))?;
    let serde_json::Value::Array(items) = value else {
        return Err(format!(
            "{file}: expected a JSON list of {{instruction, input, output}} records"
        ));
    };
    if items.is_empty() {
        return Err(format!("{file}: the list of records is empty"));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            serde_json::from_value(item).map_err(|e| format!("{file}: record {i}: {e}"))
        })
        .collect()
}

/// The longest `prompt ++ answer`, in tokens: the smallest `seq` that
/// [`make_batch`] accepts for these samples (0 for none).
pub fn max_len<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> usize {
    samples.into_iter().map(Sample::len).max().unwrap_or(0)
}

/// Tokens and next-token targets, both `[samples.len() * seq]` row-major.
///
/// Row `i` is `prompt ++ answer` of `samples[i]`, right-padded with [`PAD`].
/// `targets[t] = tokens[t + 1]` when token `t + 1` is an answer token (the
/// final `EOS` included), else [`IGNORE`]: the prompt and the padding are not
/// learned. For `[BOS, USER, '5', '=', ASSISTANT] ++ ['x', EOS]`, seq 8:
///
/// ```text
/// tokens : BOS  USER '5'  '='  ASST 'x'  EOS  PAD
/// targets: -100 -100 -100 -100 'x'  EOS  -100 -100
/// ```
///
/// A sample longer than `seq` is an error naming its prompt and lengths.
pub fn make_batch(samples: &[&Sample], seq: usize) -> Result<(Vec<u32>, Vec<i32>), String> {
    make_batch_with_pad(samples, seq, PAD)
}

/// [`make_batch`] with padding token `pad` (a Hugging Face tokenizer's).
pub fn make_batch_with_pad(
    samples: &[&Sample],
    seq: usize,
    pad: u32,
) -> Result<(Vec<u32>, Vec<i32>), String> {
    let mut tokens = Vec::with_capacity(samples.len() * seq);
    let mut targets = Vec::with_capacity(samples.len() * seq);
    for sample in samples {
        let (p, len) = (sample.prompt.len(), sample.len());
        if len > seq {
            return Err(format!(
                "sample {:?} is {len} tokens (prompt {p} + answer {}), longer than seq {seq}",
                sample.prompt_text(),
                sample.answer.len()
            ));
        }
        let row = tokens.len();
        tokens.extend_from_slice(&sample.prompt);
        tokens.extend_from_slice(&sample.answer);
        tokens.resize(row + seq, pad);
        targets.extend((0..seq).map(|t| {
            if (p..len).contains(&(t + 1)) {
                tokens[row + t + 1] as i32
            } else {
                IGNORE
            }
        }));
    }
    Ok((tokens, targets))
}

/// Whether `text` answers the prompt `"{n}="` correctly: exactly
/// [`ANSWER_PREFIX`], then `"{a} + {b}"` with `a + b == n`.
///
/// `a` and `b` are plain decimals: ASCII digits, no sign, no leading zeros
/// (but `0` itself), one space either side of `+`, nothing after `b`. A number
/// or sum beyond `u64` is simply wrong.
pub fn score(n: u64, text: &str) -> bool {
    let Some(sum) = text.strip_prefix(ANSWER_PREFIX) else {
        return false;
    };
    let Some((a, b)) = sum.split_once(" + ") else {
        return false;
    };
    match (parse_decimal(a), parse_decimal(b)) {
        (Some(a), Some(b)) => a.checked_add(b) == Some(n),
        _ => false,
    }
}

/// A canonical decimal: non-empty ASCII digits, no leading zero unless the
/// number is 0, within `u64`.
fn parse_decimal(s: &str) -> Option<u64> {
    let canonical =
        !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    if canonical {
        s.parse().ok()
    } else {
        None
    }
}

/// The order of `0..n` in epoch `epoch`: a permutation that depends only on
/// `(n, epoch, seed)`, so every rank given the same seed agrees, and that
/// changes from epoch to epoch.
pub fn epoch_order(n: usize, epoch: u64, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    // Stream 0 is the held-out choice of `addition_task`; epochs are 1.. .
    shuffle(
        &mut order,
        &mut XorShift::new(mix(seed, epoch.wrapping_add(1))),
    );
    order
}

/// Fisher-Yates.
fn shuffle<T>(items: &mut [T], rng: &mut XorShift) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

/// An RNG seed for stream `stream` of `seed`: the splitmix64 finalizer of
/// their combination, so nearby seeds and streams give unrelated sequences.
fn mix(seed: u64, stream: u64) -> u64 {
    let mut z = seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
