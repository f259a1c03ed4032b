//! What makes two HTTP requests the same request: [`FingerprintPolicy`], and the fingerprint the
//! layer computes from it.

use std::borrow::Cow;

use http::header::{HeaderName, CONTENT_TYPE, HOST};
use http::request;

use crate::fingerprint::{Fingerprint, FingerprintBuilder};

/// Which parts of a request count in its fingerprint, so that a retry that differs only in
/// parts that do not count replays, and one that differs in a counted part is a mismatch.
///
/// The default counts the method, the authority (the URI's, else `Host`, normalised), the path
/// and query, the whole `Content-Type` and the body: the fingerprint of every request is then
/// exactly the one earlier releases computed, so their records still replay. Each builder
/// method changes one part:
///
/// ```
/// use http::HeaderName;
/// use tower_idempotency::{FingerprintPolicy, IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_fingerprint(
///     FingerprintPolicy::new()
///         .media_type_only()                                   // `charset` and other parameters ignored
///         .with_header(HeaderName::from_static("x-account-id")), // and this header counted too
/// );
/// # let _ = layer;
/// ```
///
/// Changing an endpoint's policy changes the fingerprint of requests that differ in the parts
/// changed: a retry across that deploy may then be answered as a mismatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FingerprintPolicy {
    pub(crate) content_type: ContentTypePart,
    pub(crate) headers: Vec<HeaderName>,
    pub(crate) body: bool,
}

/// How `Content-Type` counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum ContentTypePart {
    /// The header's bytes as sent (the default, as earlier releases).
    #[default]
    Full,
    /// The media type alone, lower-cased: `application/json; charset=utf-8` is `application/json`.
    MediaType,
    /// Not at all.
    Ignored,
}

impl Default for FingerprintPolicy {
    fn default() -> Self {
        Self {
            content_type: ContentTypePart::Full,
            headers: Vec::new(),
            body: true,
        }
    }
}

impl FingerprintPolicy {
    /// The default: method, authority, path and query, `Content-Type` as sent, and the body.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts only the media type of `Content-Type`, compared case-insensitively; its
    /// parameters (`charset`, `boundary`, ...) do not count.
    ///
    /// ```
    /// # use tower_idempotency::FingerprintPolicy;
    /// let policy = FingerprintPolicy::new().media_type_only();
    /// # let _ = policy;
    /// ```
    pub fn media_type_only(mut self) -> Self {
        self.content_type = ContentTypePart::MediaType;
        self
    }

    /// `Content-Type` does not count at all.
    ///
    /// ```
    /// # use tower_idempotency::FingerprintPolicy;
    /// let policy = FingerprintPolicy::new().without_content_type();
    /// # let _ = policy;
    /// ```
    pub fn without_content_type(mut self) -> Self {
        self.content_type = ContentTypePart::Ignored;
        self
    }

    /// Counts a request header too: its absence, and each of its values in order. Headers
    /// are counted in the order they were added; adding one twice counts it once.
    ///
    /// ```
    /// # use http::HeaderName;
    /// # use tower_idempotency::FingerprintPolicy;
    /// let policy = FingerprintPolicy::new().with_header(HeaderName::from_static("x-account-id"));
    /// # let _ = policy;
    /// ```
    pub fn with_header(mut self, name: HeaderName) -> Self {
        if !self.headers.contains(&name) {
            self.headers.push(name);
        }
        self
    }

    /// The body does not count (it is still read, up to the body limit, and handed on). For
    /// endpoints whose body varies between retries of one operation (a client-side timestamp,
    /// a signature), where the key alone names the operation.
    ///
    /// ```
    /// # use tower_idempotency::FingerprintPolicy;
    /// let policy = FingerprintPolicy::new().without_body();
    /// # let _ = policy;
    /// ```
    pub fn without_body(mut self) -> Self {
        self.body = false;
        self
    }

    /// The fingerprint of a request with this policy. The default policy's parts are exactly
    /// those of earlier releases, in the same order; the options only change a part's bytes
    /// (`Content-Type`, body) or add parts after them (headers).
    pub(crate) fn fingerprint(&self, parts: &request::Parts, body: &[u8]) -> Fingerprint {
        let authority = match parts.uri.authority() {
            Some(authority) => authority.as_str().as_bytes(),
            None => parts.headers.get(HOST).map_or(&[][..], |v| v.as_bytes()),
        };
        let authority = normalized_authority(authority);
        let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let content_type = parts.headers.get(CONTENT_TYPE).map_or(&[][..], |v| v.as_bytes());
        let mut fingerprint = FingerprintBuilder::default();
        fingerprint.part(parts.method.as_str().as_bytes());
        fingerprint.part(&authority);
        fingerprint.part(path_and_query.as_bytes());
        match self.content_type {
            ContentTypePart::Full => fingerprint.part(content_type),
            ContentTypePart::MediaType => fingerprint.part(&media_type(content_type)),
            ContentTypePart::Ignored => fingerprint.part(&[]),
        }
        fingerprint.part(if self.body { body } else { &[] });
        for name in &self.headers {
            // The count of values first, so that values of one header can never read as the
            // name or values of the next.
            let values = parts.headers.get_all(name);
            fingerprint.part(name.as_str().as_bytes());
            fingerprint.part(&(values.iter().count() as u64).to_be_bytes());
            for value in values {
                fingerprint.part(value.as_bytes());
            }
        }
        fingerprint.finish()
    }
}

/// The media type of a `Content-Type` value: before any `;`, trimmed, lower-cased (RFC 9110
/// §8.3.1: type and subtype are case-insensitive).
fn media_type(value: &[u8]) -> Cow<'_, [u8]> {
    let end = value.iter().position(|&b| b == b';').unwrap_or(value.len());
    let media = value[..end].trim_ascii();
    if media.iter().any(u8::is_ascii_uppercase) {
        Cow::Owned(media.to_ascii_lowercase())
    } else {
        Cow::Borrowed(media)
    }
}

/// `host[:port]` as DNS and HTTP treat it: host names are case-insensitive, `example.com.` is
/// `example.com`, and `:80` and `:443` are the default ports (the layer cannot tell the scheme, and
/// a server answers one of them per name). Borrows when there is nothing to change, as for nearly
/// every request.
pub(crate) fn normalized_authority(raw: &[u8]) -> Cow<'_, [u8]> {
    // Split off the port: after the last `:`, unless that `:` is inside an IPv6 literal.
    let (host, port) = match raw.iter().rposition(|&b| b == b':') {
        Some(colon) if !raw[colon..].contains(&b']') && raw[colon + 1..].iter().all(u8::is_ascii_digit) => {
            (&raw[..colon], Some(&raw[colon + 1..]))
        }
        _ => (raw, None),
    };
    let port = port.filter(|port| *port != b"80" && *port != b"443");
    let host = host.strip_suffix(b".").unwrap_or(host);
    let unchanged = host.len() + port.map_or(0, |p| p.len() + 1) == raw.len();
    if unchanged && !host.iter().any(u8::is_ascii_uppercase) {
        return Cow::Borrowed(raw);
    }
    let mut normalized = host.to_ascii_lowercase();
    if let Some(port) = port {
        normalized.push(b':');
        normalized.extend_from_slice(port);
    }
    Cow::Owned(normalized)
}

/// The fuzz target's check of the fingerprint's normalisation (`fuzz/fuzz_targets/fingerprint.rs`,
/// and `tests/fuzz_corpora.rs` on every checked-in input): the first line is an authority (or
/// `Host`), the second a `Content-Type`, the third a request target. Normalising never panics,
/// ignores ASCII case, only takes away (a trailing dot, a default port) and, for a host with
/// no empty label and one port at most, is the same done twice; a media type is the same with
/// parameters added; a request's fingerprint ignores the case of its authority and `Host`.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check(data: &[u8]) {
    let mut lines = data.splitn(3, |b| *b == b'\n');
    let authority = lines.next().unwrap_or_default();
    let content_type = lines.next().unwrap_or_default();
    let target = lines.next().unwrap_or_default();

    let normalized = normalized_authority(authority);
    assert_eq!(*normalized, normalized.to_ascii_lowercase());
    assert_eq!(normalized, normalized_authority(&authority.to_ascii_uppercase()));
    let lower = authority.to_ascii_lowercase();
    let mut rest = lower.iter();
    assert!(
        normalized.iter().all(|b| rest.any(|c| c == b)),
        "{normalized:?} is not {authority:?} with parts taken away"
    );
    // `host[:digits]`, the host a name with no empty label or an IPv6 literal: the `http`
    // crate takes more (`a.:.`), whose dot and colon normalisation may read differently twice.
    let host_end = match authority.first() {
        Some(b'[') => authority.iter().position(|b| *b == b']').map(|end| end + 1),
        _ => Some(
            authority
                .iter()
                .position(|b| *b == b':')
                .unwrap_or(authority.len()),
        ),
    };
    let well_formed = host_end.is_some_and(|end| {
        let (host, port) = authority.split_at(end);
        !host.is_empty()
            && !host.starts_with(b".")
            && !host.windows(2).any(|w| w == b"..")
            && port.first().is_none_or(|colon| *colon == b':')
            && port.iter().skip(1).all(u8::is_ascii_digit)
    });
    if well_formed {
        assert_eq!(normalized_authority(&normalized), normalized, "{authority:?}");
    }

    let media = media_type(content_type);
    assert_eq!(media_type(&media), media);
    if !content_type.contains(&b';') {
        assert_eq!(media_type(&[content_type, b"; charset=utf-8"].concat()), media);
    }

    let (Ok(target), Ok(host)) = (
        http::Uri::try_from(target),
        http::HeaderValue::from_bytes(authority),
    ) else {
        return;
    };
    let request = |target: http::Uri, host: http::HeaderValue| {
        let mut request = http::Request::new(());
        *request.uri_mut() = target;
        request.headers_mut().insert(HOST, host);
        request.into_parts().0
    };
    let shouted = |uri: &http::Uri| {
        let mut parts = uri.clone().into_parts();
        parts.authority = parts
            .authority
            .and_then(|a| a.as_str().to_ascii_uppercase().parse().ok());
        http::Uri::from_parts(parts).ok()
    };
    let policy = FingerprintPolicy::new();
    let fingerprint = policy.fingerprint(&request(target.clone(), host.clone()), b"");
    let loud_host = http::HeaderValue::from_bytes(&authority.to_ascii_uppercase()).expect("still a value");
    if let Some(loud_target) = shouted(&target) {
        assert_eq!(
            fingerprint,
            policy.fingerprint(&request(loud_target, loud_host), b"")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(request: Request<()>) -> request::Parts {
        request.into_parts().0
    }

    fn hex(fingerprint: &Fingerprint) -> String {
        crate::key::hex(fingerprint.as_bytes())
    }

    /// The default fingerprint is the one earlier releases computed and stored: the same five
    /// parts in the same order, and the same digest (pinned here, computed independently as
    /// SHA-256 over each part's big-endian u64 length and bytes).
    #[test]
    fn the_default_fingerprint_is_byte_identical_to_earlier_releases() {
        let request = parts(
            Request::post("/payments?x=1")
                .header("host", "API.Example.com.:443")
                .header("content-type", "application/json; charset=utf-8")
                .body(())
                .unwrap(),
        );
        let body = br#"{"amount":42}"#;
        let computed = FingerprintPolicy::new().fingerprint(&request, body);
        let earlier = Fingerprint::new([
            b"POST".as_slice(),
            b"api.example.com",
            b"/payments?x=1",
            b"application/json; charset=utf-8",
            body,
        ]);
        assert_eq!(computed, earlier);
        assert_eq!(
            hex(&computed),
            "660ec80aa86dca72934ec43e43b50a07c61b0beec69275483b1a179574efecec",
            "the digest of the default fingerprint changed: records of earlier releases would mismatch"
        );
    }

    #[test]
    fn media_type_only_ignores_parameters_and_case() {
        assert_eq!(
            &*media_type(b"Application/JSON; charset=utf-8"),
            b"application/json"
        );
        assert_eq!(&*media_type(b" text/plain ;q=1"), b"text/plain");
        assert!(matches!(media_type(b"application/json"), Cow::Borrowed(_)));
        let policy = FingerprintPolicy::new().media_type_only();
        let with = |ct: &str| {
            let request = parts(Request::post("/p").header("content-type", ct).body(()).unwrap());
            policy.fingerprint(&request, b"{}")
        };
        assert_eq!(with("application/json"), with("application/JSON; charset=utf-8"));
        assert_ne!(with("application/json"), with("text/plain"));
    }

    #[test]
    fn header_values_never_read_as_the_next_header() {
        let policy = FingerprintPolicy::new()
            .with_header(HeaderName::from_static("x-a"))
            .with_header(HeaderName::from_static("x-b"));
        let a = parts(Request::post("/p").header("x-a", "x-b").body(()).unwrap());
        let b = parts(Request::post("/p").header("x-b", "x-b").body(()).unwrap());
        assert_ne!(policy.fingerprint(&a, b""), policy.fingerprint(&b, b""));
        let empty = parts(Request::post("/p").header("x-a", "").body(()).unwrap());
        let absent = parts(Request::post("/p").body(()).unwrap());
        assert_ne!(policy.fingerprint(&empty, b""), policy.fingerprint(&absent, b""));
    }

    #[test]
    fn authorities_that_name_the_same_host_normalise_alike() {
        let norm = |raw: &str| String::from_utf8(normalized_authority(raw.as_bytes()).into_owned()).unwrap();
        for same in [
            "API.Example.com",
            "api.example.com.",
            "api.example.com:443",
            "Api.Example.Com.:80",
        ] {
            assert_eq!(norm(same), "api.example.com", "{same}");
        }
        assert_eq!(norm("api.example.com:8080"), "api.example.com:8080");
        assert_eq!(norm("API.example.com.:8443"), "api.example.com:8443");
        assert_eq!(norm("[::1]:443"), "[::1]");
        assert_eq!(norm("[::1]"), "[::1]");
        assert_eq!(norm("[2001:DB8::1]:8080"), "[2001:db8::1]:8080");
        assert_eq!(norm(""), "");
        assert!(matches!(
            normalized_authority(b"api.example.com:8080"),
            Cow::Borrowed(_)
        ));
    }

    use proptest::prelude::*;

    /// A host name (labels of letters in any case, digits and `-`, maybe a trailing dot), or
    /// an IPv6 literal; and a port: none, 80, 443 or another.
    fn authorities() -> impl Strategy<Value = (String, Option<u16>)> {
        let host = prop_oneof![
            ("[a-cA-C0-9-]{1,3}(\\.[a-cA-C0-9-]{1,3}){0,2}", any::<bool>()).prop_map(|(h, dot)| if dot {
                format!("{h}.")
            } else {
                h
            }),
            "\\[(::1|2001:[dD][bB]8::[0-9a-fA-F]{1,2})\\]",
        ];
        let port = proptest::option::of(prop_oneof![Just(80u16), Just(443), Just(8080), 1u16..3]);
        (host, port)
    }

    fn written((host, port): &(String, Option<u16>)) -> String {
        match port {
            Some(port) => format!("{host}:{port}"),
            None => host.clone(),
        }
    }

    /// What DNS and HTTP take the authority for: the host lower-cased without its trailing
    /// dot, and the port, the defaults 80 and 443 being none (the layer cannot tell the scheme).
    fn named((host, port): &(String, Option<u16>)) -> (String, Option<u16>) {
        let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        (host, port.filter(|p| *p != 80 && *p != 443))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Two authorities normalise alike exactly when they name the same host and port: no
        /// two hosts share records (unscoped keys of `a.example` never replay for
        /// `b.example`), and no spelling of one host makes a retry a mismatch. Normalised twice
        /// is normalised once.
        #[test]
        fn authorities_normalise_alike_exactly_when_they_name_the_same_host(a in authorities(), b in authorities()) {
            let (x, y) = (written(&a), written(&b));
            let nx = normalized_authority(x.as_bytes()).into_owned();
            let ny = normalized_authority(y.as_bytes()).into_owned();
            prop_assert_eq!(nx == ny, named(&a) == named(&b), "{} {}", x, y);
            prop_assert_eq!(&*normalized_authority(&nx), &nx[..]);
            check(format!("{x}\n\n/").as_bytes());
        }

        /// The media type is the type and subtype, lower-cased, whatever the parameters and
        /// spaces; and `Content-Type` as sent counts in full by default.
        #[test]
        fn media_types_ignore_parameters_and_case(
            media in "[a-zA-Z]{1,5}/[a-zA-Z+.-]{1,8}",
            params in "( ?; ?[a-z]{1,6}=[A-Za-z0-9-]{1,6}){0,2}",
            space in " {0,2}",
        ) {
            let value = format!("{space}{media}{space}{params}");
            let lower = media.to_ascii_lowercase();
            prop_assert_eq!(&*media_type(value.as_bytes()), lower.as_bytes());
            let policy = FingerprintPolicy::new().media_type_only();
            let with = |ct: &str| {
                let request = parts(Request::post("/p").header("content-type", ct).body(()).unwrap());
                (policy.fingerprint(&request, b""), FingerprintPolicy::new().fingerprint(&request, b""))
            };
            let (loose, full) = with(&value);
            prop_assert_eq!(loose, with(&media.to_ascii_lowercase()).0);
            prop_assert_eq!(full == with(&media).1, value == media);
        }

        /// A request's fingerprint is the same in absolute form and in origin form with `Host`,
        /// whatever the case of the authority; a different method, path, query or body is
        /// another fingerprint.
        #[test]
        fn requests_naming_the_same_target_share_a_fingerprint(
            a in authorities(),
            path in "(/[a-z0-9%._~-]{0,6}){1,3}(\\?[a-z0-9=&]{0,8})?",
            other in "(/[a-z0-9%._~-]{0,6}){1,3}(\\?[a-z0-9=&]{0,8})?",
            body in proptest::collection::vec(any::<u8>(), 0..20),
        ) {
            let authority = written(&a);
            let policy = FingerprintPolicy::new();
            let absolute = parts(Request::post(format!("http://{}{path}", authority.to_ascii_uppercase())).body(()).unwrap());
            let origin = parts(Request::post(path.as_str()).header("host", authority.as_str()).body(()).unwrap());
            prop_assert_eq!(policy.fingerprint(&absolute, &body), policy.fingerprint(&origin, &body));
            let put = parts(Request::put(path.as_str()).header("host", authority.as_str()).body(()).unwrap());
            prop_assert_ne!(policy.fingerprint(&put, &body), policy.fingerprint(&origin, &body));
            let moved = parts(Request::post(other.as_str()).header("host", authority.as_str()).body(()).unwrap());
            prop_assert_eq!(policy.fingerprint(&moved, &body) == policy.fingerprint(&origin, &body), other == path);
            prop_assert_ne!(policy.fingerprint(&origin, &[&body[..], b"x"].concat()), policy.fingerprint(&origin, &body));
            check(format!("{authority}\napplication/json\nhttp://{authority}{path}").as_bytes());
        }

        /// Any bytes: the fuzz check.
        #[test]
        fn any_bytes_pass_the_fuzz_check(data in proptest::collection::vec(any::<u8>(), 0..80), text in "[ -~]{0,20}(\n[ -~]{0,20}){0,2}") {
            check(&data);
            check(text.as_bytes());
        }
    }
}
