//! Documents (spec files, config files) in YAML, TOML or JSON, read into one tree whose
//! every node knows its line, and a serde `Deserializer` over that tree, so that every
//! error (a wrong type, an unknown field, a value the library rejects) names its line.

use std::fmt;
use std::path::Path;

use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};

/// The largest document read: a spec or config file is written by hand, and a bigger one
/// is a mistake or an attack, refused before it is parsed.
pub const MAX_DOCUMENT_BYTES: u64 = 1 << 20;
/// How deep maps and lists may nest.
pub const MAX_DEPTH: usize = 64;
/// How many values a document may hold once YAML aliases are expanded (an alias bomb of
/// 1 KiB expands to billions); 64 bytes of text count as one value.
pub const MAX_NODES: usize = 100_000;
/// The name of a newtype struct that takes any scalar as its text as written (`8080`,
/// `true`, `1.10`): for fields where a hand-written file means the text, such as env values
/// in a map. Every other string field takes strings only.
pub const SCALAR_TEXT: &str = "$doc::ScalarText";

/// Reads a document, refusing one over [`MAX_DOCUMENT_BYTES`] before reading it whole.
pub fn read(path: &Path) -> Result<String, String> {
    read_at_most(
        path,
        MAX_DOCUMENT_BYTES,
        "a spec or config file is written by hand",
    )
}

/// Reads a text file of at most `cap` bytes; a larger one (or one that grows, or a
/// device) is refused after `cap + 1` bytes, saying `why` the bound is what it is.
pub fn read_at_most(path: &Path, cap: u64, why: &str) -> Result<String, String> {
    use std::io::Read as _;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(cap + 1).read_to_string(&mut text))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if text.len() as u64 > cap {
        return Err(format!(
            "{}: larger than {} KiB; {why}",
            path.display(),
            cap >> 10
        ));
    }
    Ok(text)
}

/// One value of a document, with the line (1-based; 0 when unknown) it starts on.
#[derive(Debug, Clone)]
pub struct Node {
    pub line: usize,
    pub kind: Kind,
}

/// What a node is. Scalars keep their text as written: a field that takes a scalar's text
/// (see [`SCALAR_TEXT`]) gets `8080`, not `8080.0`; a string field takes strings only.
#[derive(Debug, Clone)]
pub enum Kind {
    Null,
    Bool(bool, String),
    Int(i64, String),
    Float(f64, String),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

impl Node {
    fn new(line: usize, kind: Kind) -> Node {
        Node { line, kind }
    }

    /// The text of a scalar (keys, strings, numbers as written).
    pub fn text(&self) -> Option<&str> {
        match &self.kind {
            Kind::Bool(_, t) | Kind::Int(_, t) | Kind::Float(_, t) | Kind::Str(t) => Some(t),
            Kind::Null | Kind::Seq(_) | Kind::Map(_) => None,
        }
    }

    fn describe(&self) -> &'static str {
        match self.kind {
            Kind::Null => "null",
            Kind::Bool(..) => "a boolean",
            Kind::Int(..) => "an integer",
            Kind::Float(..) => "a number",
            Kind::Str(_) => "a string",
            Kind::Seq(_) => "a list",
            Kind::Map(_) => "a map",
        }
    }
}

/// The formats, chosen by the file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Yaml,
    Toml,
    Json,
}

impl Format {
    pub fn of(path: &Path) -> Result<Format, String> {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("yaml" | "yml") => Ok(Format::Yaml),
            Some("toml") => Ok(Format::Toml),
            Some("json") => Ok(Format::Json),
            _ => Err(format!(
                "{}: unknown format: name it .yaml, .yml, .toml or .json",
                path.display()
            )),
        }
    }
}

/// A parse error: the message and, where known, the line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub line: Option<usize>,
    pub message: String,
}

/// Parses a whole document.
pub fn parse(text: &str, format: Format) -> Result<Node, ParseError> {
    if text.len() as u64 > MAX_DOCUMENT_BYTES {
        return Err(ParseError {
            line: None,
            message: format!("larger than {} KiB", MAX_DOCUMENT_BYTES >> 10),
        });
    }
    let root = match format {
        Format::Yaml => parse_yaml(text)?,
        Format::Toml => parse_toml(text)?,
        Format::Json => {
            // serde_json for the syntax (its errors are precise), the YAML parser for the
            // lines of the nodes (JSON is YAML); a JSON text the YAML parser refuses still
            // loads, without lines.
            let value: serde_json::Value = serde_json::from_str(text).map_err(|e| ParseError {
                line: Some(e.line()),
                message: e.to_string(),
            })?;
            parse_yaml(text).unwrap_or_else(|_| from_json(&value))
        }
    };
    check_bounds(&root)?;
    Ok(root)
}

/// Refuses a tree deeper than [`MAX_DEPTH`] or larger than [`MAX_NODES`] (the YAML builder
/// stops at them while building; the other parsers are checked here), without recursion.
fn check_bounds(root: &Node) -> Result<(), ParseError> {
    let mut pending = vec![(root, 0usize)];
    let mut count = 0usize;
    while let Some((node, depth)) = pending.pop() {
        count += 1;
        let error = if depth > MAX_DEPTH {
            format!("maps and lists nest deeper than {MAX_DEPTH}")
        } else if count > MAX_NODES {
            format!("more than {MAX_NODES} values")
        } else {
            match &node.kind {
                Kind::Seq(items) => pending.extend(items.iter().map(|n| (n, depth + 1))),
                Kind::Map(entries) => pending.extend(
                    entries
                        .iter()
                        .flat_map(|(k, v)| [(k, depth + 1), (v, depth + 1)]),
                ),
                _ => {}
            }
            continue;
        };
        return Err(ParseError {
            line: (node.line > 0).then_some(node.line),
            message: error,
        });
    }
    Ok(())
}

fn from_json(v: &serde_json::Value) -> Node {
    use serde_json::Value;
    let kind = match v {
        Value::Null => Kind::Null,
        Value::Bool(b) => Kind::Bool(*b, b.to_string()),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Kind::Int(i, n.to_string()),
            None => Kind::Float(n.as_f64().unwrap_or(f64::NAN), n.to_string()),
        },
        Value::String(s) => Kind::Str(s.clone()),
        Value::Array(items) => Kind::Seq(items.iter().map(from_json).collect()),
        Value::Object(map) => Kind::Map(
            map.iter()
                .map(|(k, v)| (Node::new(0, Kind::Str(k.clone())), from_json(v)))
                .collect(),
        ),
    };
    Node::new(0, kind)
}

// ---------------------------------------------------------------------------------------
// YAML

fn parse_yaml(text: &str) -> Result<Node, ParseError> {
    use yaml_rust2::parser::Parser;
    let mut builder = YamlBuilder::default();
    Parser::new_from_str(text)
        .load(&mut builder, false)
        .map_err(|e| ParseError {
            line: Some(e.marker().line()),
            message: e.info().to_string(),
        })?;
    if let Some(message) = builder.error {
        return Err(ParseError {
            line: None,
            message,
        });
    }
    Ok(builder
        .root
        .unwrap_or_else(|| Node::new(1, Kind::Map(Vec::new()))))
}

#[derive(Default)]
struct YamlBuilder {
    /// Open maps and lists: the node, its anchor, a pending key, and how many values the
    /// node holds so far (itself included).
    stack: Vec<(Node, usize, Option<Node>, usize)>,
    /// Anchored values, with how many values each holds.
    anchors: std::collections::HashMap<usize, (Node, usize)>,
    root: Option<Node>,
    /// Values so far, aliases counted as expanded.
    nodes: usize,
    error: Option<String>,
}

impl YamlBuilder {
    fn insert(&mut self, node: Node, size: usize) {
        let Some((parent, _, key, parent_size)) = self.stack.last_mut() else {
            self.root.get_or_insert(node);
            return;
        };
        *parent_size += size;
        match &mut parent.kind {
            Kind::Seq(items) => items.push(node),
            Kind::Map(entries) => match key.take() {
                None => *key = Some(node),
                Some(k) => entries.push((k, node)),
            },
            _ => {}
        }
    }

    fn anchor(&mut self, id: usize, node: &Node, size: usize) {
        if id != 0 {
            self.anchors.insert(id, (node.clone(), size));
        }
    }

    /// Counts `size` more values; false (with the error set) past [`MAX_NODES`].
    fn admit(&mut self, size: usize, line: usize) -> bool {
        self.nodes = self.nodes.saturating_add(size);
        if self.nodes > MAX_NODES {
            self.error.get_or_insert(format!(
                "line {line}: more than {MAX_NODES} values (with aliases expanded, 64 bytes of text counting as one)"
            ));
            return false;
        }
        true
    }
}

fn yaml_scalar(value: String, style: yaml_rust2::scanner::TScalarStyle, tagged: bool) -> Kind {
    use yaml_rust2::Yaml;
    use yaml_rust2::scanner::TScalarStyle;
    if style != TScalarStyle::Plain || tagged {
        return Kind::Str(value);
    }
    match Yaml::from_str(&value) {
        Yaml::Null => Kind::Null,
        Yaml::Boolean(b) => Kind::Bool(b, value),
        Yaml::Integer(i) => Kind::Int(i, value),
        Yaml::Real(r) => match r.parse::<f64>() {
            Ok(f) => Kind::Float(f, value),
            Err(_) => Kind::Str(value),
        },
        _ => Kind::Str(value),
    }
}

impl yaml_rust2::parser::MarkedEventReceiver for YamlBuilder {
    fn on_event(&mut self, ev: yaml_rust2::parser::Event, mark: yaml_rust2::scanner::Marker) {
        use yaml_rust2::parser::Event;
        if self.error.is_some() {
            // Past a bound: the rest of the document is not built.
            return;
        }
        let line = mark.line();
        match ev {
            Event::MappingStart(anchor, _) | Event::SequenceStart(anchor, _) => {
                if self.stack.len() >= MAX_DEPTH {
                    self.error.get_or_insert(format!(
                        "line {line}: maps and lists nest deeper than {MAX_DEPTH}"
                    ));
                    return;
                }
                if !self.admit(1, line) {
                    return;
                }
                let kind = match ev {
                    Event::MappingStart(..) => Kind::Map(Vec::new()),
                    _ => Kind::Seq(Vec::new()),
                };
                self.stack.push((Node::new(line, kind), anchor, None, 1));
            }
            Event::MappingEnd | Event::SequenceEnd => {
                if let Some((node, anchor, _, size)) = self.stack.pop() {
                    // An anchor keeps a copy: counted like the values it copies.
                    if anchor != 0 && !self.admit(size, line) {
                        return;
                    }
                    self.anchor(anchor, &node, size);
                    self.insert(node, size);
                }
            }
            Event::Scalar(value, style, anchor, tag) => {
                // A long text counts as many values (one per 64 bytes): an alias copies
                // its bytes, so 100 000 aliases of one 512 KiB text must not pass.
                let size = 1 + value.len() / 64;
                if !self.admit(size, line) {
                    return;
                }
                let node = Node::new(line, yaml_scalar(value, style, tag.is_some()));
                self.anchor(anchor, &node, size);
                self.insert(node, size);
            }
            Event::Alias(id) => match self.anchors.get(&id).map(|(_, size)| *size) {
                Some(size) => {
                    // Counted before it is copied: an alias bomb stops here.
                    if !self.admit(size, line) {
                        return;
                    }
                    let node = Node {
                        line,
                        ..self.anchors[&id].0.clone()
                    };
                    self.insert(node, size);
                }
                None => {
                    self.error
                        .get_or_insert(format!("line {line}: unknown alias"));
                }
            },
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------
// TOML

fn parse_toml(text: &str) -> Result<Node, ParseError> {
    use toml::de::DeTable;
    let line_at = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
    let table = DeTable::parse(text).map_err(|e| ParseError {
        line: e.span().map(|s| line_at(s.start)),
        message: e.message().to_string(),
    })?;
    let span = table.span();
    Ok(toml_table(table.get_ref(), line_at(span.start), &line_at))
}

fn toml_table(
    table: &toml::de::DeTable<'_>,
    line: usize,
    line_at: &dyn Fn(usize) -> usize,
) -> Node {
    let entries = table
        .iter()
        .map(|(k, v)| {
            let key = Node::new(line_at(k.span().start), Kind::Str(k.get_ref().to_string()));
            (key, toml_value(v, line_at))
        })
        .collect();
    Node::new(line, Kind::Map(entries))
}

fn toml_value(
    value: &toml::Spanned<toml::de::DeValue<'_>>,
    line_at: &dyn Fn(usize) -> usize,
) -> Node {
    use toml::de::DeValue;
    let line = line_at(value.span().start);
    let kind = match value.get_ref() {
        DeValue::String(s) => Kind::Str(s.to_string()),
        DeValue::Integer(i) => {
            let digits = i.as_str().replace('_', "");
            match i64::from_str_radix(&digits, i.radix()) {
                Ok(n) => Kind::Int(n, n.to_string()),
                Err(_) => Kind::Str(i.as_str().to_string()),
            }
        }
        DeValue::Float(f) => match f.as_str().replace('_', "").parse::<f64>() {
            Ok(x) => Kind::Float(x, f.as_str().to_string()),
            Err(_) => Kind::Str(f.as_str().to_string()),
        },
        DeValue::Boolean(b) => Kind::Bool(*b, b.to_string()),
        DeValue::Datetime(d) => Kind::Str(d.to_string()),
        DeValue::Array(items) => Kind::Seq(items.iter().map(|v| toml_value(v, line_at)).collect()),
        DeValue::Table(t) => return toml_table(t, line, line_at),
    };
    Node::new(line, kind)
}

// ---------------------------------------------------------------------------------------
// Deserializing from a node

/// A deserialization error: the message, the line of the innermost node at fault and
/// the path to it (`resources.cpus`, `env[1]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeError {
    pub message: String,
    pub line: Option<usize>,
    path: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

impl DeError {
    fn at(mut self, line: usize) -> Self {
        if self.line.is_none() && line > 0 {
            self.line = Some(line);
        }
        self
    }

    fn within(mut self, segment: Segment) -> Self {
        self.path.insert(0, segment);
        self
    }

    /// The path to the value at fault, as the library names fields (`resources.cpus`).
    pub fn path(&self) -> String {
        let mut out = String::new();
        for s in &self.path {
            match s {
                Segment::Key(k) if out.is_empty() => out.push_str(k),
                Segment::Key(k) => {
                    out.push('.');
                    out.push_str(k);
                }
                Segment::Index(i) => out.push_str(&format!("[{i}]")),
            }
        }
        out
    }
}

impl fmt::Display for DeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DeError {}

impl de::Error for DeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        DeError {
            message: msg.to_string(),
            line: None,
            path: Vec::new(),
        }
    }
}

impl<'de> IntoDeserializer<'de, DeError> for &'de Node {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

/// Deserializes `T` from a node, every error with its line and path.
pub fn from_node<'de, T: de::Deserialize<'de>>(node: &'de Node) -> Result<T, DeError> {
    T::deserialize(node).map_err(|e| e.at(node.line))
}

struct Seq<'a> {
    items: std::slice::Iter<'a, Node>,
    index: usize,
}

impl<'de> SeqAccess<'de> for Seq<'de> {
    type Error = DeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, DeError> {
        let Some(node) = self.items.next() else {
            return Ok(None);
        };
        let index = self.index;
        self.index += 1;
        seed.deserialize(node)
            .map(Some)
            .map_err(|e| e.at(node.line).within(Segment::Index(index)))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.items.len())
    }
}

struct Map<'a> {
    entries: std::slice::Iter<'a, (Node, Node)>,
    value: Option<&'a (Node, Node)>,
}

impl<'de> MapAccess<'de> for Map<'de> {
    type Error = DeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, DeError> {
        let Some(entry) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some(entry);
        seed.deserialize(&entry.0)
            .map(Some)
            .map_err(|e| e.at(entry.0.line))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, DeError> {
        let (key, value) = self.value.take().expect("a value follows its key");
        let name = key.text().unwrap_or("?").to_string();
        seed.deserialize(value)
            .map_err(|e| e.at(value.line).within(Segment::Key(name)))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

impl<'de> de::Deserializer<'de> for &'de Node {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        let r = match &self.kind {
            Kind::Null => visitor.visit_unit(),
            Kind::Bool(b, _) => visitor.visit_bool(*b),
            Kind::Int(i, _) => visitor.visit_i64(*i),
            Kind::Float(f, _) => visitor.visit_f64(*f),
            Kind::Str(s) => visitor.visit_str(s),
            Kind::Seq(items) => visitor.visit_seq(Seq {
                items: items.iter(),
                index: 0,
            }),
            Kind::Map(entries) => visitor.visit_map(Map {
                entries: entries.iter(),
                value: None,
            }),
        };
        r.map_err(|e| e.at(self.line))
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.kind {
            Kind::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
        .map_err(|e| e.at(self.line))
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        // A string field takes a string: `image = 5` is not the image "5".
        match &self.kind {
            Kind::Str(t) => visitor.visit_str(t).map_err(|e: DeError| e.at(self.line)),
            _ => Err(<DeError as de::Error>::custom(format!(
                "expected a string, found {}",
                self.describe()
            ))
            .at(self.line)),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        match &self.kind {
            Kind::Str(s) => visitor
                .visit_enum(s.as_str().into_deserializer())
                .map_err(|e: DeError| e.at(self.line)),
            _ => Err(<DeError as de::Error>::custom(format!(
                "expected one of {}, found {}",
                variants.join(", "),
                self.describe()
            ))
            .at(self.line)),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, DeError> {
        if name == SCALAR_TEXT
            && let Some(text) = self.text()
        {
            let text: de::value::StrDeserializer<'_, DeError> = text.into_deserializer();
            return visitor
                .visit_newtype_struct(text)
                .map_err(|e| e.at(self.line));
        }
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_unit()
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char bytes byte_buf unit
        unit_struct seq tuple tuple_struct map struct
    }
}

// ---------------------------------------------------------------------------------------
// Finding a field's line

/// The line of the value a field path names (`resources.cpus`, `env[1].name`,
/// `labels["app"]`, `post_create[0][1]`): the deepest node of the path the document has.
pub fn line_of(root: &Node, field: &str) -> Option<usize> {
    let mut node = root;
    let mut line = None;
    for segment in parse_path(field) {
        let next = match (&segment, &node.kind) {
            (Segment::Key(k), Kind::Map(entries)) => entries
                .iter()
                .find(|(key, _)| key.text() == Some(k))
                .map(|(key, value)| (key.line, value)),
            (Segment::Index(i), Kind::Map(entries)) => {
                entries.get(*i).map(|(key, value)| (key.line, value))
            }
            (Segment::Index(i), Kind::Seq(items)) => items.get(*i).map(|n| (n.line, n)),
            // An env entry written as a pair: [name, value].
            (Segment::Key(k), Kind::Seq(items)) if k == "name" => {
                items.first().map(|n| (n.line, n))
            }
            (Segment::Key(k), Kind::Seq(items)) if k == "value" => {
                items.get(1).map(|n| (n.line, n))
            }
            _ => None,
        };
        match next {
            Some((l, n)) => {
                if l > 0 {
                    line = Some(l);
                }
                node = n;
            }
            None => break,
        }
    }
    line
}

/// Splits `a.b[1]["k"]` into its segments.
fn parse_path(field: &str) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut rest = field;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            rest = r;
        } else if let Some(r) = rest.strip_prefix("[\"") {
            // A JSON-quoted key: find the closing quote that is not escaped.
            let mut end = None;
            let mut escaped = false;
            for (i, c) in r.char_indices() {
                match c {
                    '\\' if !escaped => escaped = true,
                    '"' if !escaped => {
                        end = Some(i);
                        break;
                    }
                    _ => escaped = false,
                }
            }
            let Some(end) = end else { break };
            let key = serde_json::from_str::<String>(&format!("\"{}\"", &r[..end]))
                .unwrap_or_else(|_| r[..end].to_string());
            out.push(Segment::Key(key));
            rest = r[end + 1..].strip_prefix(']').unwrap_or(&r[end + 1..]);
        } else if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']').unwrap_or(r.len());
            match r[..end].parse() {
                Ok(i) => out.push(Segment::Index(i)),
                Err(_) => break,
            }
            rest = r.get(end + 1..).unwrap_or("");
        } else {
            let end = rest.find(['.', '[']).unwrap_or(rest.len());
            out.push(Segment::Key(rest[..end].to_string()));
            rest = &rest[end..];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_into_segments() {
        use Segment::*;
        assert_eq!(
            parse_path("env[1].name"),
            vec![Key("env".into()), Index(1), Key("name".into())]
        );
        assert_eq!(
            parse_path("labels[\"a b\"]"),
            vec![Key("labels".into()), Key("a b".into())]
        );
        assert_eq!(
            parse_path("post_create[0][1]"),
            vec![Key("post_create".into()), Index(0), Index(1)]
        );
        assert_eq!(
            parse_path("resources.cpus"),
            vec![Key("resources".into()), Key("cpus".into())]
        );
    }

    #[test]
    fn every_format_gives_lines() {
        let yaml = "image: x\nresources:\n  cpus: 0\nenv:\n  A: 1\n  B: 2\n";
        let toml = "image = \"x\"\n\n[resources]\ncpus = 0\n\n[env]\nA = \"1\"\nB = \"2\"\n";
        let json = "{\n  \"image\": \"x\",\n  \"resources\": {\n    \"cpus\": 0\n  },\n  \"env\": [[\"A\", \"1\"],\n    [\"B\", \"2\"]]\n}\n";
        for (text, format, cpus, env1) in [
            (yaml, Format::Yaml, 3, 6),
            (toml, Format::Toml, 4, 8),
            (json, Format::Json, 4, 7),
        ] {
            let root = parse(text, format).unwrap();
            assert_eq!(line_of(&root, "resources.cpus"), Some(cpus), "{format:?}");
            assert_eq!(line_of(&root, "env[1].name"), Some(env1), "{format:?}");
            assert_eq!(
                line_of(&root, "image"),
                Some(if format == Format::Toml {
                    1
                } else {
                    1 + usize::from(format == Format::Json)
                }),
                "{format:?}"
            );
        }
    }

    #[test]
    fn syntax_errors_have_lines() {
        let e = parse("a: 1\nb: [\n", Format::Yaml).unwrap_err();
        assert!(e.line.is_some(), "{e:?}");
        let e = parse("a = 1\nb = \n", Format::Toml).unwrap_err();
        assert_eq!(e.line, Some(2), "{e:?}");
        let e = parse("{\n\"a\": 1,\n}", Format::Json).unwrap_err();
        assert_eq!(e.line, Some(3), "{e:?}");
    }
}
