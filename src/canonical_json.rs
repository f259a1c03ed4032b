//! JSON by its meaning rather than its bytes: the RFC 8785 (JSON Canonicalization Scheme)
//! form of a JSON text, and the members JSON Pointers (RFC 6901) choose, so that a fingerprint
//! ignores how a client serialised the same JSON.
//!
//! Written here rather than taken from a crate: the JCS crates on crates.io canonicalise a
//! `serde_json::Value`, which keeps the last of two members of one name (`{"a":1,"a":2}` would
//! read as `{"a":2}`, though a handler whose parser keeps the first sees `1`), or turn on
//! `serde_json`'s `arbitrary_precision`, which feature unification would impose on the whole
//! application. A small parser of our own refuses both and sees each number's text (below).

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;
use std::io::Write as _;
use std::str::FromStr;

/// The deepest nesting of arrays and objects canonicalised: a deeper body counts by its bytes
/// (the parser recurses, and a body of a million `[` must not overflow the stack).
const MAX_DEPTH: usize = 128;

/// A parsed JSON value, as JCS sees it: numbers are IEEE 754 doubles, and an object's members
/// are sorted by their names' UTF-16 code units (RFC 8785 §3.2.3), with no name twice.
/// Strings and names without escapes borrow from the text (most of them): no allocation each.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Json<'a> {
    Null,
    Bool(bool),
    Number(f64),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
    /// What a pointer of `except` took out of an array: kept in place so that the elements
    /// after it keep their indices. Written as a byte no JSON text holds outside a string.
    Excluded,
}

/// Why a body has no canonical form (and so counts by its bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotCanonical {
    /// Not a JSON text (RFC 8259), or not UTF-8.
    Syntax,
    /// An object names a member twice (I-JSON, RFC 7493 §2.3, forbids it: parsers disagree on
    /// which one counts).
    DuplicateMember,
    /// A number a double cannot hold as written: beyond its range, or with more precision than
    /// its shortest form (`0.1000000000000000001`, integers past 2^53). JCS would round it, and
    /// a handler that reads decimals exactly would then see two requests with one fingerprint.
    InexactNumber,
    /// Nested deeper than [`MAX_DEPTH`].
    TooDeep,
}

impl NotCanonical {
    /// A label for logs.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            NotCanonical::Syntax => "not a JSON text",
            NotCanonical::DuplicateMember => "a member named twice",
            NotCanonical::InexactNumber => "a number a double does not hold exactly",
            NotCanonical::TooDeep => "nested too deep",
        }
    }
}

/// Parses a JSON text (RFC 8259, UTF-8, no byte order mark) into the value JCS canonicalises;
/// refuses what I-JSON refuses and, with `exact_numbers`, numbers that a double does not hold
/// as written (JCS itself rounds them: the RFC's vectors need that off).
pub(crate) fn parse(text: &[u8], exact_numbers: bool) -> Result<Json<'_>, NotCanonical> {
    let text = std::str::from_utf8(text).map_err(|_| NotCanonical::Syntax)?;
    let mut parser = Parser {
        text: text.as_bytes(),
        str: text,
        at: 0,
        exact_numbers,
    };
    let value = parser.value(0)?;
    parser.whitespace();
    if parser.at != parser.text.len() {
        return Err(NotCanonical::Syntax);
    }
    Ok(value)
}

struct Parser<'a> {
    text: &'a [u8],
    /// The same text, whose slices between ASCII bytes are whole characters: sliced, not
    /// validated again.
    str: &'a str,
    at: usize,
    exact_numbers: bool,
}

impl<'a> Parser<'a> {
    fn whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.text.get(self.at) {
            self.at += 1;
        }
    }

    fn literal(&mut self, word: &[u8], value: Json<'a>) -> Result<Json<'a>, NotCanonical> {
        if self.text[self.at..].starts_with(word) {
            self.at += word.len();
            Ok(value)
        } else {
            Err(NotCanonical::Syntax)
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json<'a>, NotCanonical> {
        self.whitespace();
        match self.text.get(self.at) {
            Some(b'n') => self.literal(b"null", Json::Null),
            Some(b't') => self.literal(b"true", Json::Bool(true)),
            Some(b'f') => self.literal(b"false", Json::Bool(false)),
            Some(b'"') => self.string().map(Json::String),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b'[') => self
                .items(depth, b']', |parser| parser.value(depth + 1))
                .map(Json::Array),
            Some(b'{') => {
                let mut members = self.items(depth, b'}', |parser| {
                    parser.whitespace();
                    if parser.text.get(parser.at) != Some(&b'"') {
                        return Err(NotCanonical::Syntax);
                    }
                    let name = parser.string()?;
                    parser.whitespace();
                    if parser.text.get(parser.at) != Some(&b':') {
                        return Err(NotCanonical::Syntax);
                    }
                    parser.at += 1;
                    Ok((name, parser.value(depth + 1)?))
                })?;
                members.sort_by(|(a, _), (b, _)| utf16_order(a, b));
                if members.windows(2).any(|pair| pair[0].0 == pair[1].0) {
                    return Err(NotCanonical::DuplicateMember);
                }
                Ok(Json::Object(members))
            }
            _ => Err(NotCanonical::Syntax),
        }
    }

    /// An array's elements or an object's members, at its opening bracket (nested at `depth`):
    /// each read by `item`, separated by commas, up to `close`.
    fn items<T>(
        &mut self,
        depth: usize,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Result<T, NotCanonical>,
    ) -> Result<Vec<T>, NotCanonical> {
        if depth == MAX_DEPTH {
            return Err(NotCanonical::TooDeep);
        }
        self.at += 1;
        let mut items = Vec::new();
        self.whitespace();
        if self.text.get(self.at) == Some(&close) {
            self.at += 1;
            return Ok(items);
        }
        loop {
            items.push(item(self)?);
            self.whitespace();
            match self.text.get(self.at) {
                Some(b',') => self.at += 1,
                Some(&next) if next == close => {
                    self.at += 1;
                    return Ok(items);
                }
                _ => return Err(NotCanonical::Syntax),
            }
        }
    }

    /// A string, at its opening quote; the text is valid UTF-8 already. Borrowed when it has
    /// no escape, as most have.
    fn string(&mut self) -> Result<Cow<'a, str>, NotCanonical> {
        self.at += 1;
        let start = self.at;
        self.plain();
        if self.text.get(self.at) == Some(&b'"') {
            let plain = self.slice(start)?;
            self.at += 1;
            return Ok(Cow::Borrowed(plain));
        }
        let mut out = String::from(self.slice(start)?);
        loop {
            match self.text.get(self.at) {
                Some(b'"') => {
                    self.at += 1;
                    return Ok(Cow::Owned(out));
                }
                Some(b'\\') => {
                    self.at += 1;
                    let escaped = *self.text.get(self.at).ok_or(NotCanonical::Syntax)?;
                    self.at += 1;
                    match escaped {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let unit = self.hex4()?;
                            let code = match unit {
                                // A high surrogate must be followed by an escaped low one; a
                                // lone surrogate is no character (I-JSON §2.1).
                                0xD800..=0xDBFF => {
                                    if !self.text[self.at..].starts_with(b"\\u") {
                                        return Err(NotCanonical::Syntax);
                                    }
                                    self.at += 2;
                                    let low = self.hex4()?;
                                    if !(0xDC00..=0xDFFF).contains(&low) {
                                        return Err(NotCanonical::Syntax);
                                    }
                                    0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                                }
                                0xDC00..=0xDFFF => return Err(NotCanonical::Syntax),
                                unit => unit,
                            };
                            out.push(char::from_u32(code).ok_or(NotCanonical::Syntax)?);
                        }
                        _ => return Err(NotCanonical::Syntax),
                    }
                    let start = self.at;
                    self.plain();
                    out.push_str(self.slice(start)?);
                }
                // A control character unescaped, or the text ends inside the string.
                _ => return Err(NotCanonical::Syntax),
            }
        }
    }

    /// Moves past the characters a string holds as they are, up to a quote, a backslash or a
    /// control character (or the end).
    fn plain(&mut self) {
        let rest = &self.text[self.at..];
        self.at += rest
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
            .unwrap_or(rest.len());
    }

    /// The text from `start` to here: both ends sit on ASCII bytes (or the text's end), so the
    /// slice is whole characters and needs no validation again.
    fn slice(&self, start: usize) -> Result<&'a str, NotCanonical> {
        self.str.get(start..self.at).ok_or(NotCanonical::Syntax)
    }

    fn hex4(&mut self) -> Result<u32, NotCanonical> {
        let digits = self.text.get(self.at..self.at + 4).ok_or(NotCanonical::Syntax)?;
        let mut unit = 0;
        for &digit in digits {
            unit = unit * 16 + (digit as char).to_digit(16).ok_or(NotCanonical::Syntax)?;
        }
        self.at += 4;
        Ok(unit)
    }

    /// A number (RFC 8259 §6): `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, held as
    /// the double nearest to it, which must be its value exactly as written.
    fn number(&mut self) -> Result<Json<'a>, NotCanonical> {
        let start = self.at;
        let digits = |parser: &mut Self| {
            let from = parser.at;
            while parser.text.get(parser.at).is_some_and(u8::is_ascii_digit) {
                parser.at += 1;
            }
            parser.at - from
        };
        if self.text.get(self.at) == Some(&b'-') {
            self.at += 1;
        }
        match self.text.get(self.at) {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => {
                digits(self);
            }
            _ => return Err(NotCanonical::Syntax),
        }
        if self.text.get(self.at) == Some(&b'.') {
            self.at += 1;
            if digits(self) == 0 {
                return Err(NotCanonical::Syntax);
            }
        }
        if let Some(b'e' | b'E') = self.text.get(self.at) {
            self.at += 1;
            if let Some(b'+' | b'-') = self.text.get(self.at) {
                self.at += 1;
            }
            if digits(self) == 0 {
                return Err(NotCanonical::Syntax);
            }
        }
        // ASCII by construction.
        let written = self.slice(start)?;
        // Rust's parser rounds correctly (to the nearest double), as JCS requires.
        let number: f64 = written.parse().map_err(|_| NotCanonical::Syntax)?;
        if !number.is_finite() {
            return Err(NotCanonical::InexactNumber);
        }
        if self.exact_numbers && !surely_exact(written.as_bytes()) {
            let mut canonical = Vec::new();
            write_number(number, &mut canonical);
            if decimal(written.as_bytes()) != decimal(&canonical) {
                return Err(NotCanonical::InexactNumber);
            }
        }
        Ok(Json::Number(number))
    }
}

/// Whether a number as written is surely held exactly by the double nearest to it, without
/// writing that double out: 15 significant digits at most (a double holds any such decimal, as
/// C's `DBL_DIG` says) and an exponent far from the double's range. Most numbers in a body.
fn surely_exact(written: &[u8]) -> bool {
    let mantissa_end = written
        .iter()
        .position(|b| matches!(b, b'e' | b'E'))
        .unwrap_or(written.len());
    let significant = written[..mantissa_end]
        .iter()
        .filter(|b| b.is_ascii_digit())
        .skip_while(|b| **b == b'0')
        .count();
    let exponent_digits = written[mantissa_end..]
        .iter()
        .filter(|b| b.is_ascii_digit())
        .count();
    // |exponent| < 100 and a mantissa of 40 characters at most: the value is between 10^-140
    // and 10^140, far inside the doubles' normal range (no underflow to 0, no overflow).
    significant <= 15 && exponent_digits <= 2 && mantissa_end <= 40
}

/// A number's decimal value, from its JSON spelling: (negative, significant digits without
/// leading or trailing zeros, the power of ten of the last one). Zero is `(false, [], 0)`, so
/// `-0`, `0.0` and `0e5` are one value. Exponents saturate: no double's spelling comes near.
fn decimal(written: &[u8]) -> (bool, Vec<u8>, i64) {
    let (negative, rest) = match written.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, written),
    };
    let (mantissa, exponent) = match rest.iter().position(|b| matches!(b, b'e' | b'E')) {
        Some(e) => (&rest[..e], &rest[e + 1..]),
        None => (rest, &b""[..]),
    };
    let (exp_negative, exp_digits) = match exponent.split_first() {
        Some((b'-', digits)) => (true, digits),
        Some((b'+', digits)) => (false, digits),
        _ => (false, exponent),
    };
    let mut power = exp_digits.iter().fold(0i64, |acc, d| {
        acc.saturating_mul(10).saturating_add(i64::from(d - b'0'))
    });
    if exp_negative {
        power = -power;
    }
    let (int, frac) = match mantissa.iter().position(|b| *b == b'.') {
        Some(dot) => (&mantissa[..dot], &mantissa[dot + 1..]),
        None => (mantissa, &b""[..]),
    };
    power = power.saturating_sub(frac.len() as i64);
    let mut digits: Vec<u8> = int
        .iter()
        .chain(frac)
        .copied()
        .skip_while(|d| *d == b'0')
        .collect();
    while digits.last() == Some(&b'0') {
        digits.pop();
        power = power.saturating_add(1);
    }
    if digits.is_empty() {
        return (false, digits, 0);
    }
    (negative, digits, power)
}

/// A double as ECMAScript's `Number.prototype.toString` writes it (RFC 8785 §3.2.2.3): the
/// shortest digits that read back as the same double (Rust's `{:e}` gives those), placed as
/// ECMA-262 §6.1.6.1.20 says.
fn write_number(number: f64, out: &mut Vec<u8>) {
    if number == 0.0 {
        out.push(b'0');
        return;
    }
    if number < 0.0 {
        out.push(b'-');
    }
    // An integer below 2^53 is written as its digits (ECMA-262: no exponent under 10^21), and a
    // double next to it is at least 1 away, so no shorter digits read back as it.
    const EXACT_INTEGERS: f64 = 9_007_199_254_740_992.0;
    if number.abs() < EXACT_INTEGERS && number.fract() == 0.0 {
        write_integer(number.abs() as u64, out);
        return;
    }
    // The shortest digits, written on the stack: `{:e}` of a double is at most 24 bytes
    // (`d.` 16 more digits, `e-324`).
    let mut buffer = [0u8; 32];
    let mut cursor = &mut buffer[..];
    let written = match write!(cursor, "{:e}", number.abs()) {
        Ok(()) => 32 - cursor.len(),
        Err(_) => 0,
    };
    let shortest = &buffer[..written];
    let (mantissa, exponent) = match shortest.iter().position(|b| *b == b'e') {
        Some(e) => (&shortest[..e], &shortest[e + 1..]),
        None => (shortest, &b"0"[..]),
    };
    let mut digits = [0u8; 24];
    let mut k = 0;
    for &b in mantissa.iter().filter(|b| **b != b'.') {
        if let Some(slot) = digits.get_mut(k) {
            *slot = b;
            k += 1;
        }
    }
    let digits = &mut digits[..k];
    let exponent = std::str::from_utf8(exponent)
        .ok()
        .and_then(|e| e.parse::<i64>().ok())
        .unwrap_or(0);
    round_half_to_even(number.abs(), digits, exponent);
    let k = digits.len() as i64;
    // The value is 0.d1 d2 ... dk × 10^n.
    let n = exponent + 1;
    if k <= n && n <= 21 {
        out.extend_from_slice(digits);
        out.extend(std::iter::repeat_n(b'0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        out.extend_from_slice(&digits[..n as usize]);
        out.push(b'.');
        out.extend_from_slice(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.extend_from_slice(b"0.");
        out.extend(std::iter::repeat_n(b'0', (-n) as usize));
        out.extend_from_slice(digits);
    } else {
        out.push(digits[0]);
        if k > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        out.push(b'e');
        out.push(if n - 1 < 0 { b'-' } else { b'+' });
        write_integer((n - 1).unsigned_abs(), out);
    }
}

/// `n` in decimal digits, formatted straight into `out`: no `String` between.
fn write_integer(n: u64, out: &mut Vec<u8>) {
    // Writing to a `Vec` cannot fail.
    let _ = write!(out, "{n}");
}

/// ECMA-262 §6.1.6.1.20 step 5: of two shortest spellings equally near the double, the even
/// one. Rust's shortest formatting rounds such a tie up (`1424953923781206.25` is written
/// `…206.3`, RFC 8785 Appendix B wants `…206.2`). `digits` are Rust's, the first at
/// 10^`exponent`; a tie is the double's exact expansion (which Rust prints in full given the
/// precision: a double has at most 767 significant digits) ending in a 5 right after them.
fn round_half_to_even(number: f64, digits: &mut [u8], exponent: i64) {
    let k = digits.len();
    // Both candidates read back as the double only where doubles are at least 10^(exponent -
    // k + 1) apart, that is (their relative spacing being 2^-52) where the digits are 16 or
    // more: below that there is no tie to break.
    if k < 16 {
        return;
    }
    // Cheap first: the digit after them, rounded, is a 5 for every tie (and a tenth of the rest).
    let next = format!("{:.*e}", k, number);
    if next.bytes().filter(|b| *b != b'.').nth(k) != Some(b'5') {
        return;
    }
    let exact = format!("{:.800e}", number);
    let Some((exact_mantissa, exact_exponent)) = exact.split_once('e') else {
        return;
    };
    if exact_exponent.parse::<i64>().ok() != Some(exponent) {
        return;
    }
    let exact_digits: Vec<u8> = exact_mantissa.bytes().filter(|b| *b != b'.').collect();
    let tie = exact_digits.get(k) == Some(&b'5') && exact_digits[k + 1..].iter().all(|d| *d == b'0');
    if !tie {
        return;
    }
    // The two candidates: the exact digits cut after k (`down`), and one more in the last
    // place. Rust gave one of them; the even one is kept if it reads back as the double.
    let down = &exact_digits[..k];
    let last = down[k - 1] - b'0';
    if last % 2 == 0 {
        if *digits != *down {
            let mut candidate = down.to_vec();
            if parses_as(&candidate, exponent, number) {
                digits.swap_with_slice(&mut candidate);
            }
        }
    } else if *digits == *down && last < 9 {
        let mut candidate = down.to_vec();
        candidate[k - 1] += 1;
        if parses_as(&candidate, exponent, number) {
            digits.swap_with_slice(&mut candidate);
        }
    }
}

/// Whether `d1.d2…dk × 10^exponent` reads back as `number`.
fn parses_as(digits: &[u8], exponent: i64, number: f64) -> bool {
    let (first, rest) = digits.split_at(1);
    let text = format!(
        "{}.{}e{exponent}",
        String::from_utf8_lossy(first),
        String::from_utf8_lossy(rest)
    );
    text.parse::<f64>() == Ok(number)
}

/// RFC 8785 §3.2.3: member names sort by their UTF-16 code units, which differs from UTF-8's
/// (code point) order only between U+E000..U+FFFF and the characters past U+FFFF.
fn utf16_order(a: &str, b: &str) -> Ordering {
    if a.is_ascii() && b.is_ascii() {
        return a.as_bytes().cmp(b.as_bytes());
    }
    a.encode_utf16().cmp(b.encode_utf16())
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let mut bytes = s.as_bytes();
    // Runs of bytes written as they are, copied whole: most strings are one run.
    while let Some(special) = bytes.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20) {
        out.extend_from_slice(&bytes[..special]);
        let b = bytes[special];
        bytes = &bytes[special + 1..];
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x09 => out.extend_from_slice(b"\\t"),
            0x0A => out.extend_from_slice(b"\\n"),
            0x0C => out.extend_from_slice(b"\\f"),
            0x0D => out.extend_from_slice(b"\\r"),
            0x00..=0x1F => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xF)]);
            }
            _ => out.push(b),
        }
    }
    out.extend_from_slice(bytes);
    out.push(b'"');
}

impl<'a> Json<'a> {
    /// The RFC 8785 canonical form (for [`Json::Excluded`], a NUL byte, which no JSON text
    /// holds outside a string, where it is escaped).
    pub(crate) fn write_canonical(&self, out: &mut Vec<u8>) {
        match self {
            Json::Null => out.extend_from_slice(b"null"),
            Json::Bool(true) => out.extend_from_slice(b"true"),
            Json::Bool(false) => out.extend_from_slice(b"false"),
            Json::Number(n) => write_number(*n, out),
            Json::String(s) => write_string(s, out),
            Json::Array(elements) => write_list(out, b"[]", elements, Json::write_canonical),
            Json::Object(members) => write_list(out, b"{}", members, |(name, value), out| {
                write_string(name, out);
                out.push(b':');
                value.write_canonical(out);
            }),
            Json::Excluded => out.push(0),
        }
    }

    /// The value `pointer` refers to, if there is one.
    pub(crate) fn get(&self, pointer: &JsonPointer) -> Option<&Json<'a>> {
        pointer
            .tokens
            .iter()
            .try_fold(self, |value, token| value.child(token))
    }

    fn child(&self, token: &str) -> Option<&Json<'a>> {
        match self {
            Json::Object(members) => members
                .binary_search_by(|(name, _)| utf16_order(name, token))
                .ok()
                .map(|i| &members[i].1),
            Json::Array(elements) => array_index(token).and_then(|i| elements.get(i)),
            _ => None,
        }
    }

    fn child_mut(&mut self, token: &str) -> Option<&mut Json<'a>> {
        match self {
            Json::Object(members) => members
                .binary_search_by(|(name, _)| utf16_order(name, token))
                .ok()
                .map(|i| &mut members[i].1),
            Json::Array(elements) => array_index(token).and_then(|i| elements.get_mut(i)),
            _ => None,
        }
    }

    /// Takes out the value `pointer` refers to, if there is one: an object's member is removed,
    /// an array's element becomes [`Json::Excluded`], the whole document too.
    pub(crate) fn exclude(&mut self, pointer: &JsonPointer) {
        let Some((last, parents)) = pointer.tokens.split_last() else {
            *self = Json::Excluded;
            return;
        };
        match parents
            .iter()
            .try_fold(self, |value, token| value.child_mut(token))
        {
            // Names are unique: a parsed object holds none twice.
            Some(Json::Object(members)) => members.retain(|(name, _)| name != last),
            Some(parent) => {
                if let Some(element) = parent.child_mut(last) {
                    *element = Json::Excluded;
                }
            }
            None => {}
        }
    }
}

/// `items` between the two `brackets`, separated by commas, each written by `write`.
fn write_list<T>(out: &mut Vec<u8>, brackets: &[u8; 2], items: &[T], write: impl Fn(&T, &mut Vec<u8>)) {
    out.push(brackets[0]);
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write(item, out);
    }
    out.push(brackets[1]);
}

/// RFC 6901 §4: an array index is `0` or digits without a leading zero (`-`, the element past
/// the end, refers to nothing that exists).
fn array_index(token: &str) -> Option<usize> {
    let well_formed = token == "0"
        || (!token.starts_with('0') && !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit()));
    well_formed.then(|| token.parse().ok()).flatten()
}

/// A JSON Pointer (RFC 6901): the place of one value in a JSON document, as `/`-separated
/// member names or array indices, with `~1` for a `/` and `~0` for a `~` in a name. The empty
/// pointer is the whole document.
///
/// ```
/// use tower_idempotency::JsonPointer;
///
/// let amount: JsonPointer = "/payment/amount".parse()?;
/// let odd = JsonPointer::parse("/a~1b/m~0n")?; // the member "m~n" of the member "a/b"
/// assert_eq!(odd.to_string(), "/a~1b/m~0n");
/// assert!(JsonPointer::parse("amount").is_err()); // must start with `/`
/// # let _ = amount;
/// # Ok::<(), tower_idempotency::InvalidJsonPointer>(())
/// ```
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JsonPointer {
    /// The reference tokens, unescaped.
    tokens: Vec<String>,
}

/// A string that is not a JSON Pointer: it neither is empty nor starts with `/`, or has a `~`
/// followed by something other than `0` or `1`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{pointer:?} is not a JSON Pointer (RFC 6901): {why}")]
pub struct InvalidJsonPointer {
    pointer: String,
    why: &'static str,
}

impl JsonPointer {
    /// The reference tokens, unescaped.
    pub(crate) fn tokens(&self) -> &[String] {
        &self.tokens
    }

    /// Parses a pointer written as RFC 6901 §3 says: empty (the whole document), or each
    /// reference token after a `/`.
    pub fn parse(pointer: &str) -> Result<Self, InvalidJsonPointer> {
        let invalid = |why| InvalidJsonPointer {
            pointer: pointer.to_owned(),
            why,
        };
        if pointer.is_empty() {
            return Ok(Self { tokens: Vec::new() });
        }
        let Some(rest) = pointer.strip_prefix('/') else {
            return Err(invalid("it must be empty or start with `/`"));
        };
        let tokens = rest
            .split('/')
            .map(|token| {
                let mut unescaped = String::with_capacity(token.len());
                let mut chars = token.chars();
                while let Some(c) = chars.next() {
                    match c {
                        '~' => match chars.next() {
                            Some('0') => unescaped.push('~'),
                            Some('1') => unescaped.push('/'),
                            _ => return Err(invalid("`~` must be followed by `0` or `1`")),
                        },
                        c => unescaped.push(c),
                    }
                }
                Ok(unescaped)
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { tokens })
    }
}

impl FromStr for JsonPointer {
    type Err = InvalidJsonPointer;

    fn from_str(pointer: &str) -> Result<Self, Self::Err> {
        Self::parse(pointer)
    }
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for token in &self.tokens {
            write!(f, "/{}", token.replace('~', "~0").replace('/', "~1"))?;
        }
        Ok(())
    }
}

impl fmt::Debug for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonPointer({:?})", self.to_string())
    }
}

#[cfg(feature = "policy")]
impl<'de> serde::Deserialize<'de> for JsonPointer {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// The RFC 8785 canonical form of a JSON text (numbers rounded to doubles, as the RFC says),
/// or why it has none: the RFC's own test vectors run through this.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn canonicalize(text: &[u8]) -> Result<Vec<u8>, NotCanonical> {
    let mut out = Vec::new();
    parse(text, false)?.write_canonical(&mut out);
    Ok(out)
}

/// The fuzz target's check (`fuzz/fuzz_targets/json_fingerprint.rs`, and `tests/fuzz_corpora.rs`
/// on every checked-in input): parsing any bytes never panics; a canonical form is its own
/// canonical form, reads back as the same value, and is refused by neither parser; a value
/// with a member left out or chosen is a value too.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check(data: &[u8]) {
    for exact in [false, true] {
        let Ok(value) = parse(data, exact) else {
            continue;
        };
        let mut canonical = Vec::new();
        value.write_canonical(&mut canonical);
        assert_eq!(parse(&canonical, exact).as_ref(), Ok(&value), "{canonical:?}");
        assert_eq!(canonicalize(&canonical).as_deref(), Ok(&canonical[..]));
        if exact {
            assert_eq!(parse(data, false).as_ref(), Ok(&value));
        }
        // Every member's pointer finds it; leaving it out leaves the rest.
        if let Json::Object(members) = &value {
            for (name, member) in members {
                let pointer = JsonPointer {
                    tokens: vec![name.to_string()],
                };
                assert_eq!(value.get(&pointer), Some(member));
                assert_eq!(JsonPointer::parse(&pointer.to_string()).as_ref(), Ok(&pointer));
                let mut without = value.clone();
                without.exclude(&pointer);
                assert_eq!(without.get(&pointer), None);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn canonical(text: &str) -> String {
        String::from_utf8(canonicalize(text.as_bytes()).expect("canonical")).expect("UTF-8")
    }

    fn number(n: f64) -> String {
        let mut out = Vec::new();
        write_number(n, &mut out);
        String::from_utf8(out).expect("ASCII")
    }

    /// RFC 8785 Appendix B: IEEE 754 doubles and their JSON form (NaN and Infinity, which
    /// JSON cannot write, are refused by the parser).
    #[test]
    fn numbers_are_written_as_rfc_8785_appendix_b_says() {
        let vectors: [(u64, &str); 25] = [
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
            (0x3ff0000000000000, "1"),
        ];
        for (bits, json) in vectors {
            let double = f64::from_bits(bits);
            assert_eq!(number(double), json, "{bits:016x}");
            // And the text reads back as the double, and is its own canonical form.
            assert_eq!(
                json.parse::<f64>().map(f64::to_bits),
                Ok(bits & !(u64::from(double == 0.0) << 63))
            );
            assert_eq!(canonical(json), json);
        }
        for not_json in [
            "NaN",
            "Infinity",
            "-Infinity",
            "1e400",
            "01",
            "1.",
            ".5",
            "+1",
            "0x10",
        ] {
            assert!(canonicalize(not_json.as_bytes()).is_err(), "{not_json}");
        }
    }

    /// RFC 8785 §3.2.2 and §3.2.3's examples: the whole transformation, and the sorting of
    /// names by UTF-16 code units.
    #[test]
    fn the_rfc_8785_examples_canonicalise_as_printed() {
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50,
                      2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        assert_eq!(
            canonical(input),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
        let input = r#"{
          "\u20ac": "Euro Sign",
          "\r": "Carriage Return",
          "\ufb33": "Hebrew Letter Dalet With Dagesh",
          "1": "One",
          "\ud83d\ude00": "Emoji: Grinning Face",
          "\u0080": "Control",
          "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        assert_eq!(
            canonical(input),
            "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
             \"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\
             \"\u{1f600}\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
        );
    }

    #[test]
    fn what_i_json_refuses_has_no_canonical_form() {
        let refused = |text: &str| parse(text.as_bytes(), true).err();
        assert_eq!(refused(r#"{"a":1,"a":2}"#), Some(NotCanonical::DuplicateMember));
        assert_eq!(
            refused(r#"{"a":1,"\u0061":1}"#),
            Some(NotCanonical::DuplicateMember)
        );
        assert_eq!(refused(r#"["\ud800"]"#), Some(NotCanonical::Syntax));
        assert_eq!(refused(r#"["\udc00\ud800"]"#), Some(NotCanonical::Syntax));
        assert_eq!(refused("\u{feff}{}"), Some(NotCanonical::Syntax));
        assert_eq!(refused("{\"a\":\"\n\"}"), Some(NotCanonical::Syntax));
        assert_eq!(refused("{} {}"), Some(NotCanonical::Syntax));
        assert_eq!(refused(""), Some(NotCanonical::Syntax));
        assert!(parse(b"[\"\xff\"]", true).is_err());
        assert_eq!(refused(&"[".repeat(200)), Some(NotCanonical::TooDeep));
        assert!(refused(&format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH))).is_none());
        // Numbers a double does not hold as written: refused only where exactness is asked.
        for inexact in [
            "0.10000000000000000001",
            "9007199254740993",
            "333333333.33333329",
            "1e-400",
            "1e-999",
            &format!("0.{}1", "0".repeat(400)),
        ] {
            assert_eq!(refused(inexact), Some(NotCanonical::InexactNumber), "{inexact}");
            assert!(parse(inexact.as_bytes(), false).is_ok());
        }
        for exact in [
            "0.1",
            "1.50",
            "15e-1",
            "-0",
            "0.0e7",
            "9007199254740992",
            "1E30",
            "100e-2",
        ] {
            assert_eq!(refused(exact), None, "{exact}");
        }
    }

    #[test]
    fn pointers_follow_rfc_6901() {
        let doc = parse(
            br#"{"foo":["bar","baz"],"":0,"a/b":1,"c%d":2,"e^f":3,"g|h":4,"i\\j":5,"k\"l":6," ":7,"m~n":8}"#,
            true,
        )
        .expect("the RFC's example");
        let at = |p: &str| {
            doc.get(&JsonPointer::parse(p).expect("pointer")).map(|v| {
                let mut out = Vec::new();
                v.write_canonical(&mut out);
                String::from_utf8(out).expect("UTF-8")
            })
        };
        assert_eq!(at("/foo").as_deref(), Some(r#"["bar","baz"]"#));
        assert_eq!(at("/foo/0").as_deref(), Some(r#""bar""#));
        for (pointer, value) in [
            ("/", "0"),
            ("/a~1b", "1"),
            ("/c%d", "2"),
            ("/e^f", "3"),
            ("/g|h", "4"),
            ("/i\\j", "5"),
            ("/k\"l", "6"),
            ("/ ", "7"),
            ("/m~0n", "8"),
        ] {
            assert_eq!(at(pointer).as_deref(), Some(value), "{pointer}");
        }
        assert!(at("").is_some());
        for absent in ["/foo/2", "/foo/-", "/foo/01", "/foo/bar", "/nope", "/m~0n/x"] {
            assert_eq!(at(absent), None, "{absent}");
        }
        for invalid in ["foo", "/a~2", "/a~"] {
            assert!(JsonPointer::parse(invalid).is_err(), "{invalid}");
        }
        assert_eq!(
            JsonPointer::parse("/a~1b/m~0n").map(|p| p.to_string()).as_deref(),
            Ok("/a~1b/m~0n")
        );
    }

    #[test]
    fn excluded_members_are_gone_and_excluded_elements_keep_their_place() {
        let mut doc = parse(br#"{"a":[1,2,3],"b":{"c":1,"d":2}}"#, true).expect("JSON");
        for pointer in ["/a/1", "/b/c", "/nope/x", "/a/9"] {
            doc.exclude(&JsonPointer::parse(pointer).expect("pointer"));
        }
        let mut out = Vec::new();
        doc.write_canonical(&mut out);
        assert_eq!(out, b"{\"a\":[1,\0,3],\"b\":{\"d\":2}}");
    }

    use proptest::prelude::*;

    /// A JSON value of a few levels, with names that sort differently in UTF-16 and UTF-8.
    pub(crate) fn values() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            (-(1i64 << 53) + 1..(1i64 << 53)).prop_map(serde_json::Value::from),
            (-100_000i64..100_000, 0u32..4)
                .prop_map(|(n, places)| { serde_json::Value::from(n as f64 / 10f64.powi(places as i32)) }),
            "[a-c\u{e9}\u{20ac}\u{fb33}\u{1f600}\"\\\\\n/]{0,4}".prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
                proptest::collection::btree_map("[ab\u{e000}\u{1f600}]{0,2}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// `value` written another way, as `seed` picks: members in another order, whitespace,
    /// characters escaped, numbers spelt with exponents and zeros.
    pub(crate) fn respelt(value: &serde_json::Value, seed: &mut u64) -> String {
        let mut next = || {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (*seed >> 33) as usize
        };
        fn go(value: &serde_json::Value, next: &mut dyn FnMut() -> usize, out: &mut String) {
            const SPACE: [&str; 4] = ["", " ", "\n\t", "\r\n  "];
            out.push_str(SPACE[next() % 4]);
            match value {
                serde_json::Value::Number(n) => {
                    let double = n.as_f64().expect("finite");
                    let mut plain = Vec::new();
                    write_number(double, &mut plain);
                    let plain = String::from_utf8(plain).expect("ASCII");
                    match next() % 3 {
                        0 => out.push_str(&plain),
                        1 if !plain.contains(['e', '.']) && double != 0.0 => {
                            out.push_str(&format!("{plain}0e-1"))
                        }
                        _ => out.push_str(&format!("{double:e}").replace('e', "E")),
                    }
                }
                serde_json::Value::String(s) => {
                    out.push('"');
                    for c in s.chars() {
                        match c {
                            '"' => out.push_str("\\\""),
                            '\\' => out.push_str("\\\\"),
                            '\n' => out.push_str("\\n"),
                            '/' if next() % 2 == 0 => out.push_str("\\/"),
                            c if next() % 3 == 0 => {
                                let mut units = [0u16; 2];
                                for unit in c.encode_utf16(&mut units) {
                                    out.push_str(&format!("\\u{unit:04X}"));
                                }
                            }
                            c => out.push(c),
                        }
                    }
                    out.push('"');
                }
                serde_json::Value::Array(elements) => {
                    out.push('[');
                    for (i, element) in elements.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        go(element, next, out);
                    }
                    out.push_str(SPACE[next() % 4]);
                    out.push(']');
                }
                serde_json::Value::Object(members) => {
                    let mut members: Vec<_> = members.iter().collect();
                    for i in (1..members.len()).rev() {
                        members.swap(i, next() % (i + 1));
                    }
                    out.push('{');
                    for (i, (name, member)) in members.into_iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        go(&serde_json::Value::String(name.clone()), next, out);
                        out.push_str(SPACE[next() % 4]);
                        out.push(':');
                        go(member, next, out);
                    }
                    out.push_str(SPACE[next() % 4]);
                    out.push('}');
                }
                other => out.push_str(&other.to_string()),
            }
            out.push_str(SPACE[next() % 4]);
        }
        let mut out = String::new();
        go(value, &mut next, &mut out);
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any double is written as the shortest text that reads back as it, and that text is
        /// exact: a fingerprint never refuses a number JCS itself wrote.
        #[test]
        fn every_double_round_trips(bits in any::<u64>()) {
            let double = f64::from_bits(bits);
            prop_assume!(double.is_finite());
            let text = number(double);
            prop_assert_eq!(text.parse::<f64>().map(|d| d == double), Ok(true));
            prop_assert!(parse(text.as_bytes(), true).is_ok(), "{}", text);
            check(text.as_bytes());
        }

        /// However a value is written, its canonical form is the same, and is what serde_json
        /// reads as that value.
        #[test]
        fn every_spelling_of_a_value_has_one_canonical_form(value in values(), a in any::<u64>(), b in any::<u64>()) {
            let (mut a, mut b) = (a, b);
            let (one, other) = (respelt(&value, &mut a), respelt(&value, &mut b));
            let canonical_one = canonicalize(one.as_bytes());
            prop_assert!(canonical_one.is_ok(), "{}", one);
            prop_assert_eq!(&canonical_one, &canonicalize(other.as_bytes()), "{} / {}", one, other);
            prop_assert!(parse(one.as_bytes(), true).is_ok(), "{}", one);
            let serde_spelling = serde_json::to_vec(&value).expect("a value");
            prop_assert_eq!(&canonical_one, &canonicalize(&serde_spelling));
            let canonical_one = canonical_one.unwrap_or_default();
            let reread: serde_json::Value = serde_json::from_slice(&canonical_one).expect("canonical JSON is JSON");
            prop_assert_eq!(canonicalize(&serde_json::to_vec(&reread).expect("a value")), Ok(canonical_one));
            check(one.as_bytes());
        }

        /// Any bytes: the fuzz check.
        #[test]
        fn any_bytes_pass_the_fuzz_check(data in proptest::collection::vec(any::<u8>(), 0..64), text in "[\\[\\]{}\",:0-9a-z\\\\ .eE+-]{0,40}") {
            check(&data);
            check(text.as_bytes());
        }
    }
}
