//! Checks of the addition task's data module (`zero_llama::data`):
//! tokenizer, chat template, the generated split, JSON loading, batches,
//! scoring and epoch order.

use std::collections::HashSet;
use std::path::PathBuf;

use llama::data::*;
use proptest::prelude::*;
use zero_llama as llama;

/// The records of `/work/shared/fixtures/math_sample.json` (the original
/// experiment's format), inline so the test needs no file outside the repo.
const MATH_SAMPLE: &str = r#"[
  {"instruction": "5=", "input": "", "output": "王大丫丫的回答是--->2 + 3"},
  {"instruction": "17=", "input": "", "output": "王大丫丫的回答是--->4 + 13"},
  {"instruction": "240=", "input": "", "output": "王大丫丫的回答是--->101 + 139"},
  {"instruction": "999=", "input": "", "output": "王大丫丫的回答是--->666 + 333"},
  {"instruction": "1234=", "input": "", "output": "王大丫丫的回答是--->98 + 1136"},
  {"instruction": "1700=", "input": "", "output": "王大丫丫的回答是--->148 + 1552"},
  {"instruction": "1798=", "input": "", "output": "王大丫丫的回答是--->1681 + 117"}
]"#;

/// A JSON file in the temp dir, removed on drop.
struct TempJson(PathBuf);

impl TempJson {
    fn new(name: &str, text: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "zero_llama_data_{}_{name}.json",
            std::process::id()
        ));
        std::fs::write(&path, text).unwrap();
        TempJson(path)
    }
}

impl Drop for TempJson {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The error of `load_json` on `text`, checked to name the file.
fn load_error(name: &str, text: &str) -> String {
    let file = TempJson::new(name, text);
    let err = load_json(&file.0).unwrap_err();
    assert!(err.contains(&file.0.display().to_string()), "{err}");
    err
}

#[test]
fn tokenizer_roundtrips_ascii_and_chinese() {
    for text in ["", "1807=", "王大丫丫的回答是--->1800 + 7", "héllo\n"] {
        let tokens = encode_text(text);
        assert_eq!(tokens.len(), text.len());
        assert!(tokens.iter().all(|&t| t < 256));
        assert_eq!(decode(&tokens), text);
    }
    assert_eq!(encode_text("王"), vec![0xE7, 0x8E, 0x8B]);
}

#[test]
fn decode_stops_at_eos_and_skips_specials() {
    let mut tokens = vec![BOS, USER];
    tokens.extend(encode_text("ab"));
    tokens.extend([ASSISTANT, PAD]);
    tokens.extend(encode_text("c"));
    tokens.extend([EOS, b'd' as u32]);
    assert_eq!(decode(&tokens), "abc");
    // Invalid UTF-8 (a cut character) decodes lossily instead of failing.
    assert_eq!(decode(&[0xE7, 0x8E]), "\u{FFFD}");
    assert_eq!(VOCAB, 261);
    assert_eq!([BOS, EOS, PAD, USER, ASSISTANT], [256, 257, 258, 259, 260]);
}

#[test]
fn template_layout_for_1807() {
    let sample = Sample::new("1807=", "", "王大丫丫的回答是--->1800 + 7");
    assert_eq!(sample.prompt, vec![256, 259, 49, 56, 48, 55, 61, 260]);
    assert_eq!(prompt_for(1807), sample.prompt);
    assert_eq!(sample.number, Some(1807));
    let answer: Vec<u32> = "王大丫丫的回答是--->1800 + 7"
        .bytes()
        .map(u32::from)
        .chain([EOS])
        .collect();
    assert_eq!(sample.answer, answer);
    assert_eq!(sample, Sample::addition(1807));
    assert_eq!(sample.prompt_text(), "1807=");

    // The input follows the instruction; the number comes from the instruction.
    let other = Sample::new("Add:", " 1+1", "2");
    assert_eq!(other.prompt_text(), "Add: 1+1");
    assert_eq!(other.number, None);
}

#[test]
fn prompt_numbers_are_canonical() {
    assert_eq!(parse_prompt("0="), Some(0));
    assert_eq!(parse_prompt("1807="), Some(1807));
    assert_eq!(parse_prompt("18446744073709551615="), Some(u64::MAX));
    for bad in [
        "",
        "=",
        "1807",
        "07=",
        "-1=",
        "+1=",
        "1 =",
        "18446744073709551616=",
    ] {
        assert_eq!(parse_prompt(bad), None, "{bad:?}");
    }
}

#[test]
fn split_cases() {
    assert_eq!(split(1807), (1800, 7));
    assert_eq!(split(5), (0, 5));
    assert_eq!(split(0), (0, 0));
    assert_eq!(split(10), (10, 0));
    assert_eq!(split(1997), (1990, 7));
    assert_eq!(answer_for(1807), "王大丫丫的回答是--->1800 + 7");
    assert_eq!(answer_for(5), "王大丫丫的回答是--->0 + 5");
}

#[test]
fn addition_task_holds_out_200_of_1998() {
    let task = addition_task(0);
    assert_eq!(task.train.len(), 1798);
    assert_eq!(task.eval.len(), 200);

    let train: HashSet<u64> = task.train.iter().map(|s| s.number.unwrap()).collect();
    let eval: HashSet<u64> = task.eval.iter().copied().collect();
    assert_eq!(train.len(), 1798, "training numbers repeat");
    assert_eq!(eval.len(), 200, "evaluation numbers repeat");
    assert!(train.is_disjoint(&eval));
    let all: HashSet<u64> = train.union(&eval).copied().collect();
    assert_eq!(all, (0..1998).collect());

    for sample in &task.train {
        let n = sample.number.unwrap();
        assert_eq!(sample.prompt, prompt_for(n));
        assert!(score(n, &decode(&sample.answer)), "{n}");
    }

    assert_eq!(addition_task(0), task, "not deterministic");
    assert_ne!(addition_task(1).eval, task.eval, "seed is ignored");
}

#[test]
fn make_batch_targets_predict_only_the_answer() {
    let a = Sample::new("5=", "", "xy");
    let b = Sample::new("12=", "", "z");
    let (x, y, z) = (b'x' as u32, b'y' as u32, b'z' as u32);
    let (d1, d2, eq) = (b'1' as u32, b'2' as u32, b'=' as u32);
    let five = b'5' as u32;
    assert_eq!(max_len([&a, &b]), 8);
    assert_eq!(max_len(&[a.clone(), b.clone()]), 8);
    assert_eq!(max_len(&Vec::<Sample>::new()), 0);

    let (tokens, targets) = make_batch(&[&a, &b], 9).unwrap();
    #[rustfmt::skip]
    let want_tokens = vec![
        BOS, USER, five, eq, ASSISTANT, x, y, EOS, PAD,
        BOS, USER, d1, d2, eq, ASSISTANT, z, EOS, PAD,
    ];
    #[rustfmt::skip]
    let want_targets = vec![
        -100, -100, -100, -100, x as i32, y as i32, EOS as i32, -100, -100,
        -100, -100, -100, -100, -100, z as i32, EOS as i32, -100, -100,
    ];
    assert_eq!(tokens, want_tokens);
    assert_eq!(targets, want_targets);

    // A row that fills `seq` exactly has no padding and an ignored last target.
    let (tokens, targets) = make_batch(&[&b], 8).unwrap();
    assert_eq!(tokens, &want_tokens[9..17]);
    assert_eq!(targets, &want_targets[9..17]);

    assert_eq!(make_batch(&[], 4).unwrap(), (vec![], vec![]));
}

#[test]
fn make_batch_rejects_a_sample_longer_than_seq() {
    let short = Sample::addition(5);
    let long = Sample::addition(1807);
    let err = make_batch(&[&short, &long], short.len()).unwrap_err();
    assert!(err.contains("\"1807=\""), "{err}");
    assert!(err.contains(&long.len().to_string()), "{err}");
    assert!(err.contains(&format!("seq {}", short.len())), "{err}");
}

#[test]
fn score_accepts_any_correct_split() {
    assert!(score(1807, "王大丫丫的回答是--->1800 + 7"));
    assert!(score(1807, "王大丫丫的回答是--->98 + 1709"));
    assert!(score(5, "王大丫丫的回答是--->0 + 5"));
    assert!(score(5, "王大丫丫的回答是--->5 + 0"));
    assert!(score(0, "王大丫丫的回答是--->0 + 0"));
    assert!(score(
        u64::MAX,
        "王大丫丫的回答是--->18446744073709551615 + 0"
    ));
}

#[test]
fn score_rejects_malformed_or_wrong_answers() {
    let cases = [
        ("wrong sum", "王大丫丫的回答是--->1800 + 8"),
        ("missing prefix", "1800 + 7"),
        ("altered prefix", "王大丫的回答是--->1800 + 7"),
        ("prefix after a space", " 王大丫丫的回答是--->1800 + 7"),
        ("leading zero", "王大丫丫的回答是--->1800 + 07"),
        ("leading zero on a", "王大丫丫的回答是--->01800 + 7"),
        ("extra space before +", "王大丫丫的回答是--->1800  + 7"),
        ("extra space after +", "王大丫丫的回答是--->1800 +  7"),
        ("no spaces", "王大丫丫的回答是--->1800+7"),
        ("trailing text", "王大丫丫的回答是--->1800 + 7 done"),
        ("trailing newline", "王大丫丫的回答是--->1800 + 7\n"),
        ("negative", "王大丫丫的回答是--->1808 + -1"),
        ("plus sign", "王大丫丫的回答是--->1800 + +7"),
        ("three terms", "王大丫丫的回答是--->1800 + 5 + 2"),
        ("one term", "王大丫丫的回答是--->1807"),
        ("empty term", "王大丫丫的回答是---> + 1807"),
        ("non-ASCII digit", "王大丫丫的回答是--->1800 + ７"),
        ("empty", ""),
        ("prefix only", ANSWER_PREFIX),
    ];
    for (what, text) in cases {
        assert!(!score(1807, text), "{what}: {text:?}");
    }
    assert!(!score(1, "王大丫丫的回答是--->99999999999999999999999 + 1"));
    assert!(!score(
        u64::MAX,
        "王大丫丫的回答是--->18446744073709551615 + 1"
    ));
    assert!(!score(0, "王大丫丫的回答是--->18446744073709551615 + 1"));
}

#[test]
fn load_json_reads_the_experiment_format() {
    let file = TempJson::new("math_sample", MATH_SAMPLE);
    let samples = load_json(&file.0).unwrap();
    assert_eq!(samples.len(), 7);
    assert_eq!(
        samples[0],
        Sample::new("5=", "", "王大丫丫的回答是--->2 + 3")
    );
    let numbers: Vec<u64> = samples.iter().map(|s| s.number.unwrap()).collect();
    assert_eq!(numbers, [5, 17, 240, 999, 1234, 1700, 1798]);
    for (s, &n) in samples.iter().zip(&numbers) {
        assert!(score(n, &decode(&s.answer)), "{n}");
    }
    assert_eq!(eval_numbers_from_json(&file.0).unwrap(), numbers);
}

#[test]
fn load_json_ignores_unknown_fields_and_keeps_free_form_output() {
    let text = r#"[{"instruction": "Hi", "input": " there", "output": "hello", "id": 3}]"#;
    let file = TempJson::new("free_form", text);
    let samples = load_json(&file.0).unwrap();
    assert_eq!(samples, vec![Sample::new("Hi", " there", "hello")]);
    let err = eval_numbers_from_json(&file.0).unwrap_err();
    assert!(err.contains("record 0") && err.contains("\"Hi\""), "{err}");
}

#[test]
fn load_json_errors_name_the_file_and_record() {
    let missing = std::env::temp_dir().join("zero_llama_data_no_such_file.json");
    let err = load_json(&missing).unwrap_err();
    assert!(err.contains(&missing.display().to_string()), "{err}");

    let err = load_error("bad_json", "[{\"instruction\": ");
    assert!(err.contains("not valid JSON"), "{err}");

    let err = load_error(
        "not_list",
        r#"{"instruction": "5=", "input": "", "output": "x"}"#,
    );
    assert!(err.contains("list"), "{err}");

    let err = load_error("empty", "[]");
    assert!(err.contains("empty"), "{err}");

    let text = r#"[{"instruction": "5=", "input": "", "output": "x"},
                   {"instruction": "6=", "input": ""}]"#;
    let err = load_error("missing_field", text);
    assert!(err.contains("record 1") && err.contains("output"), "{err}");

    let text = r#"[{"instruction": "5=", "input": "", "output": 5}]"#;
    let err = load_error("wrong_type", text);
    assert!(err.contains("record 0"), "{err}");

    let text = r#"[{"instruction": "5=", "input": "", "output": "x"},
                   {"instruction": "6=", "input": "", "output": "y"},
                   {"instruction": "7=", "input": "", "output": ""}]"#;
    let err = load_error("empty_output", text);
    assert!(
        err.contains("record 2") && err.contains("empty output"),
        "{err}"
    );

    let text = r#"[{"instruction": "", "input": "5=", "output": "x"}]"#;
    let err = load_error("empty_instruction", text);
    assert!(
        err.contains("record 0") && err.contains("empty instruction"),
        "{err}"
    );
}

#[test]
fn eval_numbers_require_number_prompts() {
    let text = r#"[{"instruction": "5=", "input": "", "output": "x"},
                   {"instruction": "05=", "input": "", "output": "x"}]"#;
    let file = TempJson::new("eval_leading_zero", text);
    let err = eval_numbers_from_json(&file.0).unwrap_err();
    assert!(err.contains(&file.0.display().to_string()), "{err}");
    assert!(err.contains("record 1") && err.contains("05="), "{err}");
}

#[test]
fn epoch_order_varies_by_epoch_and_seed() {
    let n = 1798;
    let first = epoch_order(n, 0, 7);
    assert_eq!(epoch_order(n, 0, 7), first, "not deterministic");
    assert_ne!(epoch_order(n, 1, 7), first, "same order in epoch 1");
    assert_ne!(epoch_order(n, 0, 8), first, "seed is ignored");
    assert_ne!(first, (0..n).collect::<Vec<_>>(), "not shuffled");
    assert!(epoch_order(0, 3, 7).is_empty());
    assert_eq!(epoch_order(1, 3, 7), [0]);
}

proptest! {
    #[test]
    fn epoch_order_is_a_permutation(n in 0usize..300, epoch: u64, seed: u64) {
        let mut order = epoch_order(n, epoch, seed);
        order.sort_unstable();
        prop_assert_eq!(order, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn split_answers_score(n: u64) {
        let (a, b) = split(n);
        prop_assert_eq!(a + b, n);
        prop_assert!(b < 10 && a % 10 == 0);
        prop_assert!(score(n, &answer_for(n)));
    }

    #[test]
    fn score_matches_the_sum(a in 0u64..1 << 40, b in 0u64..1 << 40, n in 0u64..1 << 41) {
        let text = format!("{ANSWER_PREFIX}{a} + {b}");
        prop_assert_eq!(score(n, &text), a + b == n);
        prop_assert!(score(a + b, &text));
    }

    #[test]
    fn tokenizer_roundtrips_any_text(text in any::<String>()) {
        prop_assert_eq!(decode(&encode_text(&text)), text);
    }
}

mod chat_data {
    use super::TempJson;
    use zero_llama::chat::{
        eval_of, exact_match, load_examples, parse_examples, samples, split_indices, ByteTemplate,
        Eval, Message, Need, Role, Template,
    };
    use zero_llama::data::{piece, Sample, ASSISTANT, EOS};

    /// The three layouts, as a JSON list and as JSON Lines, read alike.
    #[test]
    fn layouts_become_conversations() {
        let records = [
            r#"{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}, {"role": "assistant", "content": "A2"}]}"#,
            r#"{"instruction": "Say", "input": " no", "output": "no"}"#,
            r#"{"instruction": "5=", "output": "x", "id": 7}"#,
            r#"{"prompt": "P", "response": "R"}"#,
            r#"{"prompt": "P", "completion": "C"}"#,
        ];
        let list = format!("[{}]", records.join(",\n"));
        let lines = format!("{}\n\n", records.join("\n"));
        let a = parse_examples(&list, "f.json", Need::Answers).unwrap();
        let b = parse_examples(&lines, "f.jsonl", Need::Answers).unwrap();
        assert_eq!(a.len(), 5);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.messages, y.messages);
        }
        assert_eq!(a[1].origin, "f.json: record 1");
        assert_eq!(b[1].origin, "f.jsonl: line 2");
        let m = |r: Role, c: &str| Message::new(r, c);
        assert_eq!(a[0].messages.len(), 5);
        assert_eq!(a[0].turns().len(), 2, "every assistant turn is learned");
        assert_eq!(
            a[0].turns()[1].0.len(),
            4,
            "the second turn sees the history"
        );
        assert_eq!(a[0].reference(), Some("A2"));
        assert_eq!(
            a[1].messages,
            vec![m(Role::User, "Say no"), m(Role::Assistant, "no")],
            "the input follows the instruction"
        );
        assert_eq!(a[2].single_user_text(), Some("5="), "input is optional");
        assert_eq!(a[3].messages[1], m(Role::Assistant, "R"));
        assert_eq!(a[4].messages[1], m(Role::Assistant, "C"));
    }

    /// A record in no known layout, or with a bad field, is an error that
    /// names the file, the record (index in a list, line in JSON Lines)
    /// and, for an unknown layout, the keys found.
    #[test]
    fn bad_records_are_named() {
        let err = |text: &str| parse_examples(text, "d.json", Need::Answers).unwrap_err();
        let e = err(r#"[{"prompt": "a", "response": "b"}, {"question": "x", "answer": "y"}]"#);
        assert!(
            e.contains("d.json: record 1") && e.contains(r#"["answer", "question"]"#),
            "{e}"
        );
        let e = err("{\"prompt\": \"a\", \"response\": \"b\"}\n{\"q\": 1}\n");
        assert!(
            e.contains("d.json: line 2") && e.contains("unknown layout"),
            "{e}"
        );
        let e = err("{\"prompt\": \"a\", \"response\": \"b\"}\nnot json\n");
        assert!(e.contains("line 2") && e.contains("not valid JSON"), "{e}");
        for (text, what) in [
            (r#"[{"prompt": "a"}]"#, "without `response`"),
            (
                r#"[{"prompt": "a", "response": "b", "completion": "c"}]"#,
                "both",
            ),
            (
                r#"[{"instruction": "a", "output": ""}]"#,
                "`output` is empty",
            ),
            (
                r#"[{"instruction": "a", "output": 5}]"#,
                "`output`: expected a string",
            ),
            (
                r#"[{"messages": [{"role": "bot", "content": "x"}]}]"#,
                "role \"bot\"",
            ),
            (
                r#"[{"messages": [{"role": "user", "content": "x"}]}]"#,
                "does not end with an assistant",
            ),
            (
                r#"[{"messages": [{"role": "assistant", "content": "x"}]}]"#,
                "no user turn",
            ),
            ("[]", "no records"),
            ("5", "expected a JSON list"),
        ] {
            let e = err(text);
            assert!(e.contains(what) && e.starts_with("d.json"), "{text}: {e}");
        }
        // Prompts may lack answers.
        let p = parse_examples(
            "{\"prompt\": \"a\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"b\"}]}",
            "p.jsonl",
            Need::Prompts,
        )
        .unwrap();
        assert_eq!(p[0].reference(), None);
        assert_eq!(p[1].prompt().len(), 1);
        let file = TempJson::new("chat_missing", "");
        let e = load_examples(&file.0, Need::Answers).unwrap_err();
        assert!(e.contains(&file.0.display().to_string()), "{e}");
    }

    /// The byte template gives the addition task's samples for single
    /// turns, and refuses what it cannot render, saying what to use.
    #[test]
    fn byte_template_samples() {
        let ex = parse_examples(
            r#"[{"instruction": "17=", "input": "", "output": "a"}, {"prompt": "hi", "response": "yo"}]"#,
            "f",
            Need::Answers,
        )
        .unwrap();
        let s = samples(&ByteTemplate, &ex).unwrap();
        assert_eq!(
            s,
            vec![Sample::new("17=", "", "a"), Sample::new("hi", "", "yo")]
        );
        assert_eq!(s[0].number, Some(17));
        let p = ByteTemplate.prompt(ex[1].prompt()).unwrap();
        assert_eq!(p, s[1].prompt);
        assert_eq!(*p.last().unwrap(), ASSISTANT);
        let multi = parse_examples(
            r#"[{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]}]"#,
            "m.json",
            Need::Answers,
        )
        .unwrap();
        let e = samples(&ByteTemplate, &multi).unwrap_err();
        assert!(
            e.contains("m.json: record 0") && e.contains("--model-dir"),
            "{e}"
        );
    }

    /// The held-out choice depends only on (n, fraction, seed), is disjoint
    /// from training, and keeps at least one record on each side.
    #[test]
    fn split_is_seeded_and_disjoint() {
        let (t, v) = split_indices(100, 0.1, 3);
        assert_eq!((t.len(), v.len()), (90, 10));
        assert!(v.iter().all(|i| !t.contains(i)));
        assert_eq!(split_indices(100, 0.1, 3), (t.clone(), v.clone()));
        assert_ne!(split_indices(100, 0.1, 4).1, v);
        assert_eq!(split_indices(5, 0.01, 0).1.len(), 1, "at least one");
        assert_eq!(split_indices(2, 0.99, 0).0.len(), 1, "never all");
        assert_eq!(split_indices(10, 0.0, 0), ((0..10).collect(), vec![]));
        assert_eq!(
            split_indices(1, 0.5, 0),
            (vec![0], vec![]),
            "nothing to hold out"
        );
    }

    /// Held-out `N=` prompts are the addition task (scored by the sum);
    /// anything else is exact match against the reference.
    #[test]
    fn eval_is_addition_or_exact_match() {
        let add = parse_examples(
            r#"[{"instruction": "5=", "output": "x"}, {"prompt": "17=", "response": "y"}]"#,
            "f",
            Need::Answers,
        )
        .unwrap();
        assert_eq!(
            eval_of(&ByteTemplate, &add).unwrap(),
            Eval::Numbers(vec![5, 17])
        );
        let other = parse_examples(
            r#"[{"instruction": "5=", "output": "x"}, {"prompt": "Capital of France?", "response": " Paris "}]"#,
            "f",
            Need::Answers,
        )
        .unwrap();
        let Eval::Exact(refs) = eval_of(&ByteTemplate, &other).unwrap() else {
            panic!("exact match expected");
        };
        assert_eq!(refs[1].answer, " Paris ");
        assert_eq!(refs[1].shown, "Capital of France?");
        assert_eq!(refs[1].answer_tokens, " Paris ".len() + 1, "with EOS");
        assert_eq!(
            refs[1].prompt,
            ByteTemplate.prompt(other[1].prompt()).unwrap()
        );
        assert_eq!(eval_of(&ByteTemplate, &[]).unwrap(), Eval::None);
        assert!(exact_match("Paris\n", " Paris "));
        assert!(!exact_match("paris", "Paris"));
        assert!(!exact_match("Paris.", "Paris"));
    }

    #[test]
    fn byte_pieces_are_readable() {
        assert_eq!(piece(u32::from(b'a')), "a");
        assert_eq!(piece(u32::from(b' ')), "<0x20>");
        assert_eq!(piece(0xE7), "<0xE7>");
        assert_eq!(piece(EOS), "<eos>");
        assert_eq!(piece(9999), "<9999?>");
    }
}
