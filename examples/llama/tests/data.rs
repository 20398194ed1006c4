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
