//! Waiting for a running request: the `Prefer: wait=N` preference (RFC 7240) and the wait a
//! request gets from it and the layer's settings.

use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;

use crate::http::config::Config;

const PREFER: HeaderName = HeaderName::from_static("prefer");
const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");

/// How long a request whose key is in flight waits for the running one, and whether its
/// client asked for it (and so is told with `Preference-Applied`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Wait {
    pub(crate) wait: Duration,
    pub(crate) asked: bool,
}

impl Wait {
    /// The wait for a request with `headers`: its `Prefer: wait=N`, else the layer's default,
    /// capped by the layer's maximum; `None` for no wait (the maximum is zero, the default is
    /// zero and nothing valid was asked, or the client asked for `wait=0`). Reads no header
    /// when the maximum is zero (waiting off, the default).
    pub(crate) fn for_request(headers: &HeaderMap, config: &Config) -> Option<Self> {
        if config.max_wait.is_zero() {
            return None;
        }
        let asked = preferred_wait(headers);
        let wait = asked.unwrap_or(config.default_wait).min(config.max_wait);
        (!wait.is_zero()).then_some(Self {
            wait,
            asked: asked.is_some(),
        })
    }

    /// Tells a client that asked to wait that it did (RFC 7240 §3), with the wait it got in
    /// whole seconds (the maximum, if it asked for more).
    pub(crate) fn mark<B>(&self, response: &mut http::Response<B>) {
        if self.asked {
            let value = HeaderValue::from_str(&format!("wait={}", self.wait.as_secs()));
            if let Ok(value) = value {
                response.headers_mut().insert(PREFERENCE_APPLIED, value);
            }
        }
    }
}

/// The `wait` preference of RFC 7240 from every `Prefer` field of `headers`: the first `wait`
/// preference decides (RFC 7240 §2: a preference given twice counts once, the first time); its
/// value is whole seconds, bare or quoted. A value that is not a number (`wait=soon`,
/// `wait=-1`, `wait=`) makes it as if no wait were asked. Parameters (`; foo`) are ignored.
pub(crate) fn preferred_wait(headers: &HeaderMap) -> Option<Duration> {
    for field in headers.get_all(PREFER) {
        let Ok(field) = std::str::from_utf8(field.as_bytes()) else {
            continue;
        };
        for preference in split_outside_quotes(field, ',') {
            let name_value = split_outside_quotes(preference, ';').next().unwrap_or_default();
            let (name, value) = match name_value.split_once('=') {
                Some((name, value)) => (name, Some(value.trim())),
                None => (name_value, None),
            };
            if name.trim().eq_ignore_ascii_case("wait") {
                return value.and_then(seconds);
            }
        }
    }
    None
}

/// Whole seconds, bare or in double quotes; saturating for absurd values (the maximum caps
/// them anyway).
fn seconds(value: &str) -> Option<Duration> {
    let digits = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value);
    let is_number = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
    is_number.then(|| Duration::from_secs(digits.parse().unwrap_or(u64::MAX)))
}

/// `text` split at `separator`s outside double-quoted strings (with `\` escapes inside them).
fn split_outside_quotes(text: &str, separator: char) -> impl Iterator<Item = &str> {
    let mut rest = Some(text);
    std::iter::from_fn(move || {
        let text = rest?;
        let (mut quoted, mut escaped) = (false, false);
        for (at, c) in text.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if quoted => escaped = true,
                '"' => quoted = !quoted,
                c if c == separator && !quoted => {
                    rest = Some(&text[at + c.len_utf8()..]);
                    return Some(&text[..at]);
                }
                _ => {}
            }
        }
        rest = None;
        Some(text)
    })
}

/// The fuzz target's check of `Prefer` fields (`fuzz/fuzz_targets/prefer.rs`, and
/// `tests/fuzz_corpora.rs` on every checked-in input): the first 16 bytes are the layer's
/// maximum and default wait (seconds, mod 1000), the rest the fields, one a line. Reading never
/// panics; a wait found stays the answer whatever field comes after; fields each of which ends
/// outside a quoted string read as their comma-joined single field (RFC 9110 §5.3); the wait a
/// request gets is never zero, never more than the maximum, and marked only when asked.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check(data: &[u8]) {
    let (Some(max), Some(default)) = (data.get(..8), data.get(8..16)) else {
        return;
    };
    let seconds = |b: &[u8]| Duration::from_secs(u64::from_be_bytes(b.try_into().unwrap_or_default()) % 1000);
    let fields: Vec<HeaderValue> = data[16..]
        .split(|b| *b == b'\n')
        .filter_map(|line| HeaderValue::from_bytes(line).ok())
        .collect();
    let headers = |fields: &[HeaderValue]| {
        let mut headers = HeaderMap::new();
        for field in fields {
            headers.append(PREFER, field.clone());
        }
        headers
    };
    let found = preferred_wait(&headers(&fields));
    for extra in &fields {
        let mut more = fields.clone();
        more.push(extra.clone());
        if found.is_some() {
            assert_eq!(preferred_wait(&headers(&more)), found);
        }
    }
    // Whether a field ends outside a quoted string, by a scan of its own.
    let closed = |field: &HeaderValue| {
        let (mut quoted, mut escaped) = (false, false);
        for &b in field.as_bytes() {
            match b {
                _ if escaped => escaped = false,
                b'\\' if quoted => escaped = true,
                b'"' => quoted = !quoted,
                _ => {}
            }
        }
        !quoted && std::str::from_utf8(field.as_bytes()).is_ok()
    };
    if fields.len() > 1 && fields.iter().all(closed) {
        let joined = fields
            .iter()
            .map(|f| f.as_bytes())
            .collect::<Vec<_>>()
            .join(&b", "[..]);
        let joined = HeaderValue::from_bytes(&joined).expect("fields joined are a field");
        assert_eq!(preferred_wait(&headers(&[joined])), found, "{fields:?}");
    }
    let config = Config {
        max_wait: seconds(max),
        default_wait: seconds(default),
        ..Config::default()
    };
    match Wait::for_request(&headers(&fields), &config) {
        None => assert!(config.max_wait.is_zero() || found.unwrap_or(config.default_wait).is_zero()),
        Some(wait) => {
            assert!(!wait.wait.is_zero() && wait.wait <= config.max_wait);
            assert_eq!(wait.asked, found.is_some());
            assert_eq!(
                wait.wait,
                found.unwrap_or(config.default_wait).min(config.max_wait)
            );
            let mut response = http::Response::new(());
            wait.mark(&mut response);
            assert_eq!(response.headers().contains_key(PREFERENCE_APPLIED), wait.asked);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(fields: &[&str]) -> Option<Duration> {
        let mut headers = HeaderMap::new();
        for field in fields {
            headers.append(PREFER, HeaderValue::from_str(field).unwrap());
        }
        preferred_wait(&headers)
    }

    /// What the property (`the_first_wait_decides_however_the_list_is_split`) does not draw:
    /// a comma inside another preference's quoted value, a number past `u64`, a name that
    /// starts with `wait`, values that are not a whole number of seconds. Its other rules
    /// (off by default, capped, `wait=0` opting out, marked only when asked) are
    /// tests/waiting.rs's, on every store.
    #[test]
    fn the_wait_preference_is_read_as_rfc_7240_writes_it() {
        let s = Duration::from_secs;
        assert_eq!(
            asked(&["foo=\"wait=9, x\", wait=2"]),
            Some(s(2)),
            "commas in quotes"
        );
        assert_eq!(asked(&["wait=99999999999999999999999"]), Some(s(u64::MAX)));
        assert_eq!(asked(&["waiting=3"]), None, "another preference");
        for bad in ["wait=", "wait=-1", "wait=1.5", "wait=\"2", "wait=2s"] {
            assert_eq!(asked(&[bad]), None, "{bad}");
        }
    }

    /// A wait spelt wrong is not asked for: the layer's default applies.
    #[test]
    fn a_wait_spelt_wrong_takes_the_default() {
        let mut headers = HeaderMap::new();
        headers.insert(PREFER, HeaderValue::from_static("wait=bad"));
        let config = Config {
            max_wait: Duration::from_secs(10),
            default_wait: Duration::from_secs(2),
            ..Config::default()
        };
        let wait = Wait::for_request(&headers, &config);
        let default = Wait {
            wait: Duration::from_secs(2),
            asked: false,
        };
        assert_eq!(wait, Some(default));
    }

    use proptest::prelude::*;

    /// A preference as RFC 7240 writes it, and the wait it asks for if it is `wait`: a name
    /// (`wait` in any case, or another), a value (a number, quoted or not, or a token, or
    /// none) and parameters, some with quoted commas and semicolons.
    fn preferences() -> impl Strategy<Value = (String, Option<Option<Duration>>)> {
        let name = prop_oneof!["[wW][aA][iI][tT]", "[a-z][a-z-]{0,8}"];
        let value = prop_oneof![
            (0u64..100_000).prop_map(|n| (format!("{n}"), Some(Duration::from_secs(n)))),
            (0u64..100_000).prop_map(|n| (format!("\"{n}\""), Some(Duration::from_secs(n)))),
            "[a-z-]{1,5}".prop_map(|t| (t, None)),
            "\"[a-z ,;=]{0,6}\"".prop_map(|t| (t, None)),
        ];
        let params = proptest::collection::vec("; ?[a-z]{1,4}(=\"[a-z ,;]{0,5}\"|=[a-z0-9]{1,3})?", 0..3);
        (name, proptest::option::of(value), params, " {0,2}", " {0,2}").prop_map(
            |(name, value, params, s1, s2)| {
                let is_wait = name.eq_ignore_ascii_case("wait");
                let (text, asked) = match value {
                    Some((text, asked)) => (format!("{name}{s1}={s2}{text}"), asked),
                    None => (name, None),
                };
                (format!("{text}{}", params.concat()), is_wait.then_some(asked))
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// The first `wait` preference decides, however the preferences are spread over
        /// fields: one field, one per preference, or any grouping (RFC 9110 §5.3: a list over
        /// several lines is the list joined with commas).
        #[test]
        fn the_first_wait_decides_however_the_list_is_split(
            list in proptest::collection::vec(preferences(), 0..6),
            splits in proptest::collection::vec(any::<bool>(), 6),
        ) {
            let expected = list.iter().find_map(|(_, wait)| *wait).flatten();
            let mut fields: Vec<String> = Vec::new();
            for (i, (text, _)) in list.iter().enumerate() {
                match fields.last_mut() {
                    Some(last) if !splits[i] => {
                        last.push_str(", ");
                        last.push_str(text);
                    }
                    _ => fields.push(text.clone()),
                }
            }
            let fields: Vec<&str> = fields.iter().map(String::as_str).collect();
            prop_assert_eq!(asked(&fields), expected, "{:?}", fields);
            let mut data = [0u8; 16];
            data[7] = 30;
            let mut data = data.to_vec();
            data.extend_from_slice(fields.join("\n").as_bytes());
            check(&data);
        }

        /// Any bytes: the fuzz check (no panic; a wait found stays found; the wait a request
        /// gets is within the layer's maximum, and marked only when asked).
        #[test]
        fn any_bytes_pass_the_fuzz_check(data in proptest::collection::vec(any::<u8>(), 0..120), text in "[ -~\n]{0,60}") {
            check(&data);
            let mut settings = data.get(..16).map(<[u8]>::to_vec).unwrap_or_else(|| vec![0; 16]);
            settings.extend_from_slice(text.as_bytes());
            check(&settings);
        }
    }
}
