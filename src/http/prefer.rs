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
                Some((name, value)) => (name.trim(), Some(value.trim())),
                None => (name_value.trim(), None),
            };
            if !name.eq_ignore_ascii_case("wait") {
                continue;
            }
            return value.and_then(seconds);
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
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let secs = digits.parse::<u64>().unwrap_or(u64::MAX);
    Some(Duration::from_secs(secs))
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

    #[test]
    fn the_wait_preference_is_read_as_rfc_7240_writes_it() {
        let s = Duration::from_secs;
        assert_eq!(asked(&["wait=10"]), Some(s(10)));
        assert_eq!(asked(&["WAIT = 7"]), Some(s(7)), "case and spaces around =");
        assert_eq!(asked(&["wait=\"3\""]), Some(s(3)), "quoted");
        assert_eq!(asked(&["respond-async, wait=100"]), Some(s(100)));
        assert_eq!(asked(&["return=minimal", "wait=4"]), Some(s(4)), "a second field");
        assert_eq!(
            asked(&["wait=5; foo=\"a,b\", bar"]),
            Some(s(5)),
            "parameters ignored"
        );
        assert_eq!(
            asked(&["foo=\"wait=9, x\", wait=2"]),
            Some(s(2)),
            "commas in quotes"
        );
        assert_eq!(asked(&["wait=1", "wait=9"]), Some(s(1)), "the first one counts");
        assert_eq!(asked(&["wait=0"]), Some(s(0)));
        assert_eq!(asked(&["wait=99999999999999999999999"]), Some(s(u64::MAX)));
        assert_eq!(asked(&[]), None);
        assert_eq!(asked(&["respond-async"]), None);
        assert_eq!(asked(&["waiting=3"]), None, "another preference");
        for bad in [
            "wait",
            "wait=",
            "wait=soon",
            "wait=-1",
            "wait=1.5",
            "wait=\"2",
            "wait=2s",
        ] {
            assert_eq!(asked(&[bad]), None, "{bad}");
        }
        assert_eq!(
            asked(&["wait=soon", "wait=3"]),
            None,
            "the first one counts, even bad"
        );
    }

    #[test]
    fn the_wait_is_capped_by_the_maximum_and_defaults_apply_only_when_nothing_valid_is_asked() {
        let s = Duration::from_secs;
        let headers = |field: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(PREFER, HeaderValue::from_str(field).unwrap());
            headers
        };
        let off = Config::default();
        assert_eq!(
            Wait::for_request(&headers("wait=5"), &off),
            None,
            "off by default"
        );
        let on = Config {
            max_wait: s(10),
            ..Config::default()
        };
        let wait = |field, config: &Config| Wait::for_request(&headers(field), config);
        assert_eq!(
            wait("wait=5", &on),
            Some(Wait {
                wait: s(5),
                asked: true
            })
        );
        assert_eq!(
            wait("wait=60", &on),
            Some(Wait {
                wait: s(10),
                asked: true
            }),
            "capped"
        );
        assert_eq!(wait("wait=0", &on), None);
        assert_eq!(wait("wait=soon", &on), None, "no default");
        let by_default = Config {
            max_wait: s(10),
            default_wait: s(2),
            ..Config::default()
        };
        assert_eq!(
            wait("x=1", &by_default),
            Some(Wait {
                wait: s(2),
                asked: false
            })
        );
        assert_eq!(
            wait("wait=bad", &by_default),
            Some(Wait {
                wait: s(2),
                asked: false
            })
        );
        assert_eq!(wait("wait=0", &by_default), None, "the client asked not to wait");
        let mut response = http::Response::new(());
        Wait {
            wait: s(10),
            asked: true,
        }
        .mark(&mut response);
        assert_eq!(response.headers()[PREFERENCE_APPLIED], "wait=10");
        let mut response = http::Response::new(());
        Wait {
            wait: s(2),
            asked: false,
        }
        .mark(&mut response);
        assert!(response.headers().get(PREFERENCE_APPLIED).is_none());
    }
}
