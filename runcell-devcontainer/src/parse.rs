//! Reading the text: JSON with comments and trailing commas, bounded in size and depth
//! before the parser runs, and positions in it for errors.

use jsonc_parser::ast::Value;
use jsonc_parser::common::Range;
use jsonc_parser::{CollectOptions, ParseOptions, parse_to_ast};
use runcell_core::{Error, Result, RunSpec};

use crate::context::Context;
use crate::mapper::Mapper;

/// The largest `devcontainer.json` read (they are a few kilobytes).
pub(crate) const MAX_FILE_BYTES: u64 = 4 << 20;

/// How deep objects and arrays may nest in a `devcontainer.json` (the parser recurses).
const MAX_DEPTH: usize = 64;

/// The deepest nesting of `{` and `[` outside strings and comments, found without
/// recursion, so that a hostile file cannot exhaust the parser's stack.
fn nesting(text: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut star = false;
                for c in chars.by_ref() {
                    if star && c == '/' {
                        break;
                    }
                    star = c == '*';
                }
            }
            '{' | '[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            '}' | ']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// Maps the text of a `devcontainer.json` to a spec, in `cx` (the file named in errors, the
/// workspace folder, the local environment). The [crate docs](crate) list
/// what each property becomes.
///
/// ```
/// use runcell_devcontainer::{Context, parse};
/// let folder = std::env::temp_dir().join("my-project");
/// # std::fs::create_dir_all(&folder).unwrap();
/// let cx = Context::new(folder.join(".devcontainer/devcontainer.json"), &folder);
/// let spec = parse(
///     r#"{
///         // comments and trailing commas are fine
///         "image": "python:3.12-slim",
///         "workspaceFolder": "/src",
///         "postCreateCommand": "pip install -r requirements.txt",
///     }"#,
///     &cx,
/// )?;
/// assert_eq!(spec.workspace.path, "/src");
/// assert_eq!(spec.post_create, [["sh", "-c", "pip install -r requirements.txt"]]);
/// # Ok::<(), runcell_core::Error>(())
/// ```
pub fn parse(text: &str, cx: &Context) -> Result<RunSpec> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(Error::invalid_spec(
            "devcontainer",
            format!("is more than the {MAX_FILE_BYTES} bytes read"),
        )
        .with("file", cx.file.display()));
    }
    if nesting(text) > MAX_DEPTH {
        return Err(Error::invalid_spec(
            "devcontainer",
            format!("nests objects and arrays deeper than {MAX_DEPTH}"),
        )
        .with("file", cx.file.display()));
    }
    // JSONC as editors read it: comments and trailing commas, nothing of JSON5.
    let options = ParseOptions {
        allow_comments: true,
        allow_trailing_commas: true,
        allow_loose_object_property_names: false,
        allow_missing_commas: false,
        allow_single_quoted_strings: false,
        allow_hexadecimal_numbers: false,
        allow_unary_plus_numbers: false,
        allow_bare_decimal_point_numbers: false,
        allow_non_finite_numbers: false,
        allow_extended_string_escapes: false,
    };
    let ast = parse_to_ast(text, &CollectOptions::default(), &options).map_err(|e| {
        Error::invalid_spec("devcontainer", format!("is not valid JSON: {}", e.kind()))
            .with("file", cx.file.display())
            .with("line", e.line_display())
            .with("column", e.column_display())
    })?;
    let root = match ast.value {
        Some(Value::Object(root)) => root,
        other => {
            let mapper = Mapper::new(cx, text)?;
            let range = other.as_ref().map_or(Range::new(0, 0), value_range);
            return Err(mapper.invalid("", range, "must be a JSON object"));
        }
    };
    Mapper::new(cx, text)?.map(&root)
}

pub(crate) fn value_range(value: &Value<'_>) -> Range {
    match value {
        Value::StringLit(v) => v.range,
        Value::NumberLit(v) => v.range,
        Value::BooleanLit(v) => v.range,
        Value::Object(v) => v.range,
        Value::Array(v) => v.range,
        Value::NullKeyword(v) => v.range,
    }
}

pub(crate) fn kind_of(value: &Value<'_>) -> &'static str {
    match value {
        Value::StringLit(_) => "a string",
        Value::NumberLit(_) => "a number",
        Value::BooleanLit(_) => "a boolean",
        Value::Object(_) => "an object",
        Value::Array(_) => "an array",
        Value::NullKeyword(_) => "null",
    }
}

/// 1-based line and column (in characters) of a byte offset.
pub(crate) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before
        .rsplit('\n')
        .next()
        .unwrap_or_default()
        .chars()
        .count()
        + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use runcell_core::ErrorKind;

    use crate::tests::{error_of, spec_of};

    #[test]
    fn hostile_files_fail_fast_without_exhausting_the_stack() {
        // 500 000 levels would overflow the parser's stack; refused before parsing.
        let deep = format!(
            "{{\"image\": \"x\", \"a\": {}1{}}}",
            "[".repeat(500_000),
            "]".repeat(500_000)
        );
        let e = error_of(&deep);
        assert_eq!(e.field(), Some("devcontainer"));
        assert!(e.to_string().contains("deeper than 64"), "{e}");
        // Brackets in strings and comments do not count.
        let spec = spec_of(&format!(
            "{{\"image\": \"x\", // {}\n \"containerEnv\": {{\"A\": \"{}\"}}}}",
            "[".repeat(100),
            "{".repeat(100)
        ));
        assert_eq!(spec.image, "x");
        // Larger than the bound: refused unread.
        let e = error_of(&format!(
            "{{\"image\": \"x\", \"x\": \"{}\"}}",
            "y".repeat(5 << 20)
        ));
        assert!(e.to_string().contains("bytes read"), "{e}");
    }

    #[test]
    fn syntax_errors_point_at_line_and_column() {
        let e = error_of("{\n  \"image\": \"busybox\",\n  \"name\" \"x\"\n}");
        assert_eq!(e.kind(), ErrorKind::InvalidSpec);
        assert_eq!(e.field(), Some("devcontainer"));
        assert_eq!(e.context_value("line"), Some("3"), "{e}");
        assert_eq!(e.context_value("column"), Some("10"), "{e}");
        assert!(e.to_string().contains("devcontainer.json"), "{e}");
        // JSONC, not JSON5: no single quotes, no bare keys, no hex.
        for text in [
            "{'image': 'x'}",
            "{image: \"x\"}",
            "{\"image\": \"x\", \"hostRequirements\": {\"cpus\": 0x2}}",
            "",
            "{\"image\": \"x\"} {}",
        ] {
            let e = error_of(text);
            assert_eq!(e.field(), Some("devcontainer"), "{text}: {e}");
            assert!(e.context_value("line").is_some(), "{text}: {e}");
        }
        let e = error_of("[\"image\"]");
        assert_eq!(e.field(), Some("devcontainer"), "{e}");
        assert!(e.message().contains("JSON object"), "{e}");
    }
}
